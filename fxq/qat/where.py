"""``torch.where(condition, input, other)`` with an integer twin (``fxq.quantized.where``)."""

from __future__ import annotations

from fxq.qat.base import FunctionalQAT

__all__ = ["Where"]


class Where(FunctionalQAT):
    """``torch.where(condition, input, other)``: ``condition`` a bool tensor (never quantized),
    ``input`` / ``other`` quantized tensors or Python numbers, the output its own fake quant."""

    #: ``(position, keyword)`` of the arguments prepare does not quantize
    unquantized_args = ((0, "condition"),)
