"""QAT modules: float ops with fake quantization, one file per op family."""

from fxq.qat.activation import Clamp, LookupTableOp
from fxq.qat.attention import MultiheadAttention, ScaledDotProductAttention
from fxq.qat.base import FunctionalQAT, QATModule, freeze_bn_stats, update_bn_stats
from fxq.qat.batchnorm import BatchNorm
from fxq.qat.division import Div
from fxq.qat.elementwise import Add, Cat, Maximum, Minimum, Mul, Sub
from fxq.qat.interpolate import Interpolate
from fxq.qat.matmul import MatMul
from fxq.qat.normalization import GroupNorm, LayerNorm
from fxq.qat.pooling import AdaptiveAvgPool, AvgPool, Mean, Sum
from fxq.qat.softmax import Softmax
from fxq.qat.stubs import QuantStub
from fxq.qat.weighted import (
    Conv1d,
    Conv2d,
    Conv3d,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
    Linear,
    WeightedQAT,
)

__all__ = [
    "QATModule",
    "FunctionalQAT",
    "WeightedQAT",
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
    "Linear",
    "BatchNorm",
    "QuantStub",
    "Add",
    "Sub",
    "Mul",
    "Cat",
    "Div",
    "Maximum",
    "Minimum",
    "MatMul",
    "AvgPool",
    "AdaptiveAvgPool",
    "Mean",
    "Sum",
    "Clamp",
    "LookupTableOp",
    "Interpolate",
    "LayerNorm",
    "GroupNorm",
    "Softmax",
    "ScaledDotProductAttention",
    "MultiheadAttention",
    "freeze_bn_stats",
    "update_bn_stats",
]
