"""The QAT -> quantized table: which integer module replaces each fxq.qat module."""

from __future__ import annotations

from torch import nn

from fxq import qat
from fxq.quantized import (
    activation,
    batchnorm,
    elementwise,
    interpolate,
    matmul,
    pooling,
    stubs,
    weighted,
)
from fxq.quantized.base import QuantizedModule, Standalone

__all__ = ["QUANTIZED_CLASSES", "to_quantized"]

QUANTIZED_CLASSES: dict[type, type[QuantizedModule]] = {
    qat.Conv1d: weighted.Conv1d,
    qat.Conv2d: weighted.Conv2d,
    qat.Conv3d: weighted.Conv3d,
    qat.ConvTranspose1d: weighted.ConvTranspose1d,
    qat.ConvTranspose2d: weighted.ConvTranspose2d,
    qat.ConvTranspose3d: weighted.ConvTranspose3d,
    qat.Linear: weighted.Linear,
    qat.BatchNorm: batchnorm.BatchNorm,
    qat.QuantStub: stubs.Quantize,
    qat.Add: elementwise.Add,
    qat.Sub: elementwise.Sub,
    qat.Mul: elementwise.Mul,
    qat.Cat: elementwise.Cat,
    qat.MatMul: matmul.MatMul,
    qat.AvgPool: pooling.AvgPool,
    qat.AdaptiveAvgPool: pooling.AdaptiveAvgPool,
    qat.Mean: pooling.Mean,
    qat.Sum: pooling.Sum,
    qat.Clamp: activation.Clamp,
    qat.LookupTableOp: activation.LookupTable,
    qat.Interpolate: interpolate.Interpolate,
}


def to_quantized(module: nn.Module) -> QuantizedModule:
    """The integer twin of a QAT module, from its current parameters and scales.

    Raises:
        KeyError: for a QAT module type without an integer twin.
    """
    try:
        cls = QUANTIZED_CLASSES[type(module)]
    except KeyError:
        raise KeyError(f"no integer module for {type(module).__name__}") from None
    quantized = cls.from_qat(module)
    if getattr(module, "standalone", False):
        quants = list(module.input_quant)
        quantized = Standalone(quantized, [q.scale for q in quants], [q.dtype for q in quants])
    return quantized
