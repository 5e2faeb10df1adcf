"""Division (``docs/arithmetic.md``, section 17): the float op during QAT, an exact integer
division (or a multiplication, for a constant divisor) in the integer twin."""

from __future__ import annotations

from fxq.qat.base import FunctionalQAT

__all__ = ["Div"]


class Div(FunctionalQAT):
    """``a / b``, ``a / c``, ``c / b`` (``/``, ``/=``, ``torch.div``, ``Tensor.div``, ``true_divide``)."""
