"""The float -> QAT table: what each graph node is, and what replaces it.

Every node falls in one ``Kind``:

* ``WEIGHTED``: a module with weights, swapped for its fxq.qat twin.
* ``COMPUTE``: makes a new value (``+``, ``cat``, pooling, LUT ops...); its
  QAT module owns the output fake quant.
* ``PASSTHROUGH``: keeps its input's integer grid and scale (ReLU, max
  pooling, reshapes, slicing, dropout...); no fake quant, no module.
* ``QUANT_STUB`` / ``DEQUANT_STUB``: the user's boundaries.
* ``FLOAT``: no quantized implementation; runs in float, with quantize /
  dequantize inserted at its borders.
* ``NONTENSOR``: sizes, shapes and other Python values.

Supporting a new op is adding a row here (and its integer twin in
``fxq.quantized``), not editing prepare.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Node

from fxq import stubs
from fxq.fused import Fused
from fxq.qat import activation, batchnorm, elementwise, interpolate, matmul, pooling, weighted
from fxq.qat.stubs import QuantStub

__all__ = [
    "Kind",
    "OpRule",
    "rule_for",
    "qat_class_for_weighted",
    "functional_target",
    "NONTENSOR_METHODS",
]


class Kind(str, enum.Enum):
    WEIGHTED = "weighted"
    COMPUTE = "compute"
    PASSTHROUGH = "passthrough"
    QUANT_STUB = "quant_stub"
    DEQUANT_STUB = "dequant_stub"
    FLOAT = "float"
    NONTENSOR = "nontensor"


@dataclass(frozen=True)
class OpRule:
    """How to treat one op.

    Attributes:
        kind: see ``Kind``.
        qat_class: the fxq.qat class for WEIGHTED / COMPUTE ops.
        refine: optional ``(node, module) -> OpRule`` that looks at the call's
            arguments (e.g. an interpolation mode) and returns the final rule.
    """

    kind: Kind
    qat_class: type | None = None
    refine: Callable[[Node, nn.Module | None], OpRule] | None = None

    def resolve(self, node: Node, module: nn.Module | None) -> OpRule:
        return self.refine(node, module) if self.refine is not None else self


PASS = OpRule(Kind.PASSTHROUGH)
FLOAT = OpRule(Kind.FLOAT)
NONTENSOR = OpRule(Kind.NONTENSOR)


def _compute(cls: type) -> OpRule:
    return OpRule(Kind.COMPUTE, cls)


LUT = _compute(activation.LookupTableOp)
CLAMP = _compute(activation.Clamp)


def _arg(node: Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


# -- refinements -----------------------------------------------------------------
_INTERP_MODES = ("bilinear", "linear")
_NEAREST_MODES = ("nearest", "nearest-exact")


def _interpolate_rule(mode) -> OpRule:
    if mode in _NEAREST_MODES:
        return PASS
    if mode in _INTERP_MODES:
        return _compute(interpolate.Interpolate)
    return FLOAT


def _refine_interpolate(node: Node, module: nn.Module | None) -> OpRule:
    if module is not None:
        return _interpolate_rule(getattr(module, "mode", "nearest"))
    return _interpolate_rule(_arg(node, 3, "mode", "nearest"))


def _refine_pad(node: Node, module: nn.Module | None) -> OpRule:
    mode = _arg(node, 2, "mode", "constant")
    value = _arg(node, 3, "value", None)
    if mode == "constant" and value not in (None, 0, 0.0):
        return FLOAT
    return PASS


def _refine_clamp(node: Node, module: nn.Module | None) -> OpRule:
    bounds = [_arg(node, 1, "min"), _arg(node, 2, "max")]
    if any(isinstance(b, Node) for b in bounds):
        return FLOAT  # tensor bounds have no fixed integer meaning
    return CLAMP


def _refine_getattr(node: Node, module: nn.Module | None) -> OpRule:
    return NONTENSOR


def _refine_conv_module(node: Node, module: nn.Module | None) -> OpRule:
    return OpRule(Kind.WEIGHTED, qat_class_for_weighted(module))


# -- module rules -------------------------------------------------------------
_WEIGHTED_CLASSES: dict[type, type] = {
    nn.Conv1d: weighted.Conv1d,
    nn.Conv2d: weighted.Conv2d,
    nn.Conv3d: weighted.Conv3d,
    nn.ConvTranspose1d: weighted.ConvTranspose1d,
    nn.ConvTranspose2d: weighted.ConvTranspose2d,
    nn.ConvTranspose3d: weighted.ConvTranspose3d,
    nn.Linear: weighted.Linear,
    nn.BatchNorm1d: batchnorm.BatchNorm,
    nn.BatchNorm2d: batchnorm.BatchNorm,
    nn.BatchNorm3d: batchnorm.BatchNorm,
}


def qat_class_for_weighted(module: nn.Module) -> type:
    """The fxq.qat class for a float weighted module or a ``Fused`` chain."""
    op = module.op if isinstance(module, Fused) else module
    for float_cls, qat_cls in _WEIGHTED_CLASSES.items():
        if type(op) is float_cls:
            return qat_cls
    raise KeyError(type(op))


MODULE_RULES: dict[type, OpRule] = {
    **{cls: OpRule(Kind.WEIGHTED, qat) for cls, qat in _WEIGHTED_CLASSES.items()},
    Fused: OpRule(Kind.WEIGHTED, refine=_refine_conv_module),
    stubs.QuantStub: OpRule(Kind.QUANT_STUB, QuantStub),
    stubs.DeQuantStub: OpRule(Kind.DEQUANT_STUB),
    torch.ao.quantization.QuantStub: OpRule(Kind.QUANT_STUB, QuantStub),
    torch.ao.quantization.DeQuantStub: OpRule(Kind.DEQUANT_STUB),
    nn.AvgPool1d: _compute(pooling.AvgPool),
    nn.AvgPool2d: _compute(pooling.AvgPool),
    nn.AvgPool3d: _compute(pooling.AvgPool),
    nn.AdaptiveAvgPool1d: _compute(pooling.AdaptiveAvgPool),
    nn.AdaptiveAvgPool2d: _compute(pooling.AdaptiveAvgPool),
    nn.AdaptiveAvgPool3d: _compute(pooling.AdaptiveAvgPool),
    nn.ReLU6: CLAMP,
    nn.Hardtanh: CLAMP,
    nn.Sigmoid: LUT,
    nn.Tanh: LUT,
    nn.Hardsigmoid: LUT,
    nn.Hardswish: LUT,
    nn.SiLU: LUT,
    nn.GELU: LUT,
    nn.LeakyReLU: LUT,
    nn.ELU: LUT,
    nn.Softplus: LUT,
    nn.Mish: LUT,
    nn.Upsample: OpRule(Kind.COMPUTE, refine=_refine_interpolate),
    nn.UpsamplingBilinear2d: _compute(interpolate.Interpolate),
    nn.UpsamplingNearest2d: PASS,
    nn.ReLU: PASS,
    nn.MaxPool1d: PASS,
    nn.MaxPool2d: PASS,
    nn.MaxPool3d: PASS,
    nn.AdaptiveMaxPool1d: PASS,
    nn.AdaptiveMaxPool2d: PASS,
    nn.AdaptiveMaxPool3d: PASS,
    nn.Flatten: PASS,
    nn.Unflatten: PASS,
    nn.Identity: PASS,
    nn.Dropout: PASS,
    nn.Dropout1d: PASS,
    nn.Dropout2d: PASS,
    nn.Dropout3d: PASS,
    nn.AlphaDropout: PASS,
    nn.ZeroPad1d: PASS,
    nn.ZeroPad2d: PASS,
    nn.ZeroPad3d: PASS,
    nn.ReflectionPad1d: PASS,
    nn.ReflectionPad2d: PASS,
    nn.ReplicationPad1d: PASS,
    nn.ReplicationPad2d: PASS,
    nn.PixelShuffle: PASS,
    nn.PixelUnshuffle: PASS,
    nn.ChannelShuffle: PASS,
}
try:  # torchvision is optional
    from torchvision.ops import StochasticDepth

    MODULE_RULES[StochasticDepth] = PASS  # identity in eval; a random mask in training
except Exception:  # pragma: no cover
    pass

# -- function rules ---------------------------------------------------------------
FUNCTION_RULES: dict[Callable, OpRule] = {
    operator.add: _compute(elementwise.Add),
    operator.iadd: _compute(elementwise.Add),
    torch.add: _compute(elementwise.Add),
    operator.sub: _compute(elementwise.Sub),
    operator.isub: _compute(elementwise.Sub),
    torch.sub: _compute(elementwise.Sub),
    operator.mul: _compute(elementwise.Mul),
    operator.imul: _compute(elementwise.Mul),
    torch.mul: _compute(elementwise.Mul),
    operator.matmul: _compute(matmul.MatMul),
    torch.matmul: _compute(matmul.MatMul),
    torch.bmm: _compute(matmul.MatMul),
    torch.cat: _compute(elementwise.Cat),
    torch.concat: _compute(elementwise.Cat),
    F.avg_pool1d: _compute(pooling.AvgPool),
    F.avg_pool2d: _compute(pooling.AvgPool),
    F.avg_pool3d: _compute(pooling.AvgPool),
    F.adaptive_avg_pool1d: _compute(pooling.AdaptiveAvgPool),
    F.adaptive_avg_pool2d: _compute(pooling.AdaptiveAvgPool),
    F.adaptive_avg_pool3d: _compute(pooling.AdaptiveAvgPool),
    torch.mean: _compute(pooling.Mean),
    torch.sum: _compute(pooling.Sum),
    F.relu6: CLAMP,
    F.hardtanh: CLAMP,
    torch.clamp: OpRule(Kind.COMPUTE, refine=_refine_clamp),
    torch.clip: OpRule(Kind.COMPUTE, refine=_refine_clamp),
    torch.sigmoid: LUT,
    F.sigmoid: LUT,
    torch.tanh: LUT,
    F.tanh: LUT,
    F.hardsigmoid: LUT,
    F.hardswish: LUT,
    F.silu: LUT,
    F.gelu: LUT,
    torch.exp: LUT,
    F.leaky_relu: LUT,
    F.elu: LUT,
    F.softplus: LUT,
    F.mish: LUT,
    F.interpolate: OpRule(Kind.COMPUTE, refine=_refine_interpolate),
    F.pad: OpRule(Kind.PASSTHROUGH, refine=_refine_pad),
    F.relu: PASS,
    torch.relu: PASS,
    F.max_pool1d: PASS,
    F.max_pool2d: PASS,
    F.max_pool3d: PASS,
    F.adaptive_max_pool1d: PASS,
    F.adaptive_max_pool2d: PASS,
    F.adaptive_max_pool3d: PASS,
    F.dropout: PASS,
    F.dropout1d: PASS,
    F.dropout2d: PASS,
    F.dropout3d: PASS,
    F.pixel_shuffle: PASS,
    F.pixel_unshuffle: PASS,
    torch.flatten: PASS,
    torch.reshape: PASS,
    torch.permute: PASS,
    torch.transpose: PASS,
    torch.squeeze: PASS,
    torch.unsqueeze: PASS,
    torch.chunk: PASS,
    torch.split: PASS,
    torch.unbind: PASS,
    torch.narrow: PASS,
    torch.flip: PASS,
    torch.roll: PASS,
    torch.t: PASS,
    torch.channel_shuffle: PASS,
    operator.getitem: PASS,
    getattr: OpRule(Kind.NONTENSOR, refine=_refine_getattr),
    len: NONTENSOR,
}
try:  # torchvision's fx-wrapped stochastic depth
    from torchvision.ops import stochastic_depth

    FUNCTION_RULES[stochastic_depth] = PASS
except Exception:  # pragma: no cover
    pass

# -- method rules (call_method targets) --------------------------------------
#: tensor methods that return Python values (sizes, flags), not tensors
NONTENSOR_METHODS = frozenset(
    {
        "size",
        "dim",
        "numel",
        "nelement",
        "element_size",
        "is_contiguous",
        "get_device",
        "tolist",
        "item",
        "__len__",
    }
)
METHOD_RULES: dict[str, OpRule] = {
    "add": _compute(elementwise.Add),
    "add_": _compute(elementwise.Add),
    "sub": _compute(elementwise.Sub),
    "sub_": _compute(elementwise.Sub),
    "mul": _compute(elementwise.Mul),
    "mul_": _compute(elementwise.Mul),
    "matmul": _compute(matmul.MatMul),
    "bmm": _compute(matmul.MatMul),
    "mean": _compute(pooling.Mean),
    "sum": _compute(pooling.Sum),
    "sigmoid": LUT,
    "sigmoid_": LUT,
    "tanh": LUT,
    "tanh_": LUT,
    "exp": LUT,
    "clamp": OpRule(Kind.COMPUTE, refine=_refine_clamp),
    "clamp_": OpRule(Kind.COMPUTE, refine=_refine_clamp),
    "clip": OpRule(Kind.COMPUTE, refine=_refine_clamp),
    **{
        name: PASS
        for name in (
            "relu",
            "relu_",
            "view",
            "view_as",
            "reshape",
            "reshape_as",
            "flatten",
            "permute",
            "transpose",
            "contiguous",
            "squeeze",
            "unsqueeze",
            "chunk",
            "split",
            "unbind",
            "expand",
            "expand_as",
            "repeat",
            "t",
            "narrow",
            "flip",
            "roll",
            "clone",
            "detach",
            "__getitem__",
        )
    },
    **dict.fromkeys(NONTENSOR_METHODS, NONTENSOR),
}


def functional_target(node: Node) -> Callable:
    """The function a COMPUTE call_function / call_method node computes."""
    if node.op == "call_function":
        return node.target
    name = (
        node.target.rstrip("_")
        if node.target.endswith("_") and not node.target.startswith("__")
        else node.target
    )
    fn = getattr(torch, name, None)
    if fn is None:
        return getattr(torch.Tensor, node.target)
    return fn


def rule_for(node: Node, modules: dict[str, nn.Module]) -> tuple[OpRule, nn.Module | None]:
    """The resolved rule of ``node`` and its module (for call_module nodes)."""
    module = None
    if node.op == "call_module":
        module = modules[node.target]
        rule = MODULE_RULES.get(type(module), FLOAT)
    elif node.op == "call_function":
        try:
            rule = FUNCTION_RULES.get(node.target, FLOAT)
        except TypeError:
            rule = FLOAT
    elif node.op == "call_method":
        rule = METHOD_RULES.get(node.target, FLOAT)
    else:
        rule = FLOAT
    return rule.resolve(node, module), module
