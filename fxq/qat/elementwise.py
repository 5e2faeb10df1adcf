"""Elementwise ops and concatenation: add, sub, mul, cat.

Each output gets its own fake quant. In the integer model the inputs are
rescaled to the output scale with fixed-point multipliers (see
``docs/arithmetic.md``).
"""

from __future__ import annotations

from fxq.qat.base import FunctionalQAT

__all__ = ["Add", "Sub", "Mul", "Cat", "Stack", "Maximum", "Minimum"]


class Add(FunctionalQAT):
    """``input + other`` (``+``, ``+=``, ``torch.add``, ``Tensor.add``); ``other`` may be a scalar."""


class Sub(FunctionalQAT):
    """``input - other``; ``other`` may be a scalar."""


class Mul(FunctionalQAT):
    """``input * other``; ``other`` may be a scalar."""


class Cat(FunctionalQAT):
    """``torch.cat(tensors, dim)``; every input is requantized to the output scale."""


class Stack(FunctionalQAT):
    """``torch.stack(tensors, dim)``; every input is requantized to the output scale."""


class Maximum(FunctionalQAT):
    """``torch.maximum(a, b)``; both inputs are requantized to the output scale."""


class Minimum(FunctionalQAT):
    """``torch.minimum(a, b)``; both inputs are requantized to the output scale."""
