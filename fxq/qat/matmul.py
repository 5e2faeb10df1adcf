"""Matrix products of two activations (``@``, ``torch.matmul``, ``torch.bmm``)."""

from __future__ import annotations

from fxq.qat.base import FunctionalQAT

__all__ = ["MatMul"]


class MatMul(FunctionalQAT):
    """``a @ b`` with an int32 accumulator and one requantization."""
