"""QAT module -> integer module, as the op registry says (``fxq.registry``)."""

from __future__ import annotations

from torch import nn

from fxq.quantized.base import QuantizedModule, Standalone
from fxq.registry import integer_class_for

__all__ = ["to_quantized"]


def to_quantized(module: nn.Module) -> QuantizedModule:
    """The integer twin of a QAT module, from its current parameters and scales.

    Raises:
        KeyError: for a QAT module type that no registry row converts.
    """
    cls = integer_class_for(type(module))
    quantized = cls.from_qat(module)
    if getattr(module, "standalone", False):
        quants = list(module.input_quant)
        quantized = Standalone(quantized, [q.scale for q in quants], [q.dtype for q in quants])
    return quantized
