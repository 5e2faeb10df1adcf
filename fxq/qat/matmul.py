"""Matrix products of two activations (``@``, ``torch.matmul``, ``torch.bmm``, and
``torch.einsum`` equations that are a batched matrix product)."""

from __future__ import annotations

from fxq.qat.base import FunctionalQAT

__all__ = ["MatMul", "Einsum"]


class MatMul(FunctionalQAT):
    """``a @ b`` with an int32 accumulator and one requantization."""


class Einsum(FunctionalQAT):
    """``torch.einsum(eq, a, b)`` for an equation that is a batched matmul
    (``fxq.registry.einsum_as_matmul``; the registry keeps other equations in float);
    its integer twin is transposes and ``MatMul``."""
