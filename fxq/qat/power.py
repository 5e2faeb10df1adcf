"""``x ** n`` with an integer twin for ``n`` = 2 and 3 (``fxq.quantized.power``)."""

from __future__ import annotations

from fxq.qat.base import FunctionalQAT

__all__ = ["Pow"]


class Pow(FunctionalQAT):
    """``torch.pow(x, n)`` / ``x ** n`` / ``x.pow(n)`` / ``torch.square(x)`` with ``n`` 2 or 3;
    the float power during QAT, exact integer products once converted."""
