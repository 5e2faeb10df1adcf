"""Runtime input scales: an integer module fed a QTensor at another scale than it was
converted for computes exactly what a model converted for that scale computes.

Each case builds the same float model twice, with quantize stubs fixed at ``s1`` and at
``s2``, calibrates both on the same data (calibration does not round, so every other
scale comes out the same) and converts both. The ``s1`` model's stubs are then set to
``s2`` (``quant.scale.fill_``), so the op under test receives a QTensor at ``s2``: its
output must equal the ``s2`` model's bit for bit, and it must warn once, naming the layer
and both scales.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxq
from fxq.qconfig import default_calib_8bit_fake_quant_qconfig as q8
from fxq.qconfig import default_calib_8bit_weight_16bit_act_fake_quant_qconfig as q16
from fxq.qconfig import default_calib_out_8bit_fake_quant_qconfig as qout
from fxq.quantized import activation, batchnorm, elementwise, interpolate, matmul, pooling, weighted

S1, S2 = 0.02, 0.0123


class _Net(nn.Module):
    """Quantize stubs ``q0`` (and ``q1``) at ``scale``, then ``body(ops, *quantized)``."""

    def __init__(self, body: Callable, ops: dict[str, nn.Module], inputs: int, scale: float):
        super().__init__()
        self.q0 = fxq.QuantStub(scale=scale)
        self.q1 = fxq.QuantStub(scale=scale)
        self.ops = nn.ModuleDict(ops)
        self.body = body
        self.inputs = inputs
        self.dequant = fxq.DeQuantStub()

    def forward(self, x, y):
        xs = [self.q0(x), self.q1(y)][: self.inputs]
        return self.dequant(self.body(self.ops, *xs))


def _ops(**modules: nn.Module) -> Callable[[], dict[str, nn.Module]]:
    return lambda: modules


# name: (ops factory, body, number of quantized inputs, input shape, integer class, qconfig)
CASES = {
    "conv2d_bn_relu": (
        _ops(conv=nn.Conv2d(3, 4, 3, padding=1), bn=nn.BatchNorm2d(4)),
        lambda m, x: F.relu(m["bn"](m["conv"](x))),
        1,
        (2, 3, 6, 6),
        weighted.Conv2d,
        q8,
    ),
    "conv2d_relu6": (
        _ops(conv=nn.Conv2d(3, 4, 3, padding=1), act=nn.ReLU6()),
        lambda m, x: m["act"](m["conv"](x)),
        1,
        (2, 3, 6, 6),
        weighted.Conv2d,
        q8,
    ),
    "conv2d_int16": (
        _ops(conv=nn.Conv2d(3, 4, 3, padding=1)),
        lambda m, x: m["conv"](x),
        1,
        (2, 3, 6, 6),
        weighted.Conv2d,
        q16,
    ),
    "conv2d_high_precision_out": (
        _ops(conv=nn.Conv2d(3, 4, 3, padding=1)),
        lambda m, x: m["conv"](x),
        1,
        (2, 3, 6, 6),
        weighted.Conv2d,
        {"": q8, "module_name": {"ops.conv": qout}},
    ),
    "conv1d": (
        _ops(conv=nn.Conv1d(3, 4, 3)),
        lambda m, x: m["conv"](x),
        1,
        (2, 3, 7),
        weighted.Conv1d,
        q8,
    ),
    "conv3d": (
        _ops(conv=nn.Conv3d(3, 2, 2)),
        lambda m, x: m["conv"](x),
        1,
        (1, 3, 3, 4, 4),
        weighted.Conv3d,
        q8,
    ),
    "conv_transpose2d": (
        _ops(conv=nn.ConvTranspose2d(3, 4, 2, stride=2)),
        lambda m, x: m["conv"](x),
        1,
        (2, 3, 4, 4),
        weighted.ConvTranspose2d,
        q8,
    ),
    "linear": (
        _ops(fc=nn.Linear(5, 3)),
        lambda m, x: m["fc"](x),
        1,
        (4, 5),
        weighted.Linear,
        q8,
    ),
    "conv_add_relu": (
        _ops(conv=nn.Conv2d(3, 3, 3, padding=1)),
        lambda m, x, r: F.relu(m["conv"](x) + r),
        2,
        (2, 3, 6, 6),
        weighted.Conv2d,
        q8,
    ),
    "batchnorm": (
        _ops(bn=nn.BatchNorm2d(3)),
        lambda m, x: m["bn"](x),
        1,
        (2, 3, 4, 4),
        batchnorm.BatchNorm,
        q8,
    ),
    "sigmoid_int8": (
        _ops(act=nn.Sigmoid()),
        lambda m, x: m["act"](x),
        1,
        (2, 3, 4, 4),
        activation.LookupTable,
        q8,
    ),
    "gelu_int16": (
        _ops(act=nn.GELU()),
        lambda m, x: m["act"](x),
        1,
        (2, 3, 4, 4),
        activation.LookupTable,
        q16,
    ),
    "leaky_relu_functional": (
        _ops(),
        lambda m, x: F.leaky_relu(x, 0.2),
        1,
        (2, 3, 4, 4),
        activation.PReLU,
        q8,
    ),
    "relu6": (
        _ops(act=nn.ReLU6()),
        lambda m, x: m["act"](x),
        1,
        (2, 3, 4, 4),
        activation.Clamp,
        q8,
    ),
    "clamp": (
        _ops(),
        lambda m, x: torch.clamp(x, -0.5, 0.7),
        1,
        (2, 3, 4, 4),
        activation.Clamp,
        q8,
    ),
    "avg_pool2d": (
        _ops(pool=nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False)),
        lambda m, x: m["pool"](x),
        1,
        (2, 3, 7, 7),
        pooling.AvgPool,
        q8,
    ),
    "adaptive_avg_pool2d": (
        _ops(pool=nn.AdaptiveAvgPool2d((2, 3))),
        lambda m, x: m["pool"](x),
        1,
        (2, 3, 5, 7),
        pooling.AdaptiveAvgPool,
        q8,
    ),
    "mean": (
        _ops(),
        lambda m, x: x.mean((2, 3)),
        1,
        (2, 3, 4, 5),
        pooling.Mean,
        q8,
    ),
    "sum": (
        _ops(),
        lambda m, x: x.sum(-1),
        1,
        (2, 3, 4, 5),
        pooling.Sum,
        q8,
    ),
    "bilinear": (
        _ops(),
        lambda m, x: F.interpolate(x, scale_factor=2.0, mode="bilinear", align_corners=False),
        1,
        (2, 3, 3, 4),
        interpolate.Interpolate,
        q8,
    ),
    "add": (
        _ops(),
        lambda m, x, y: x + y,
        2,
        (2, 3, 4, 4),
        elementwise.Add,
        q8,
    ),
    "add_scalar": (
        _ops(),
        lambda m, x: x + 0.3,
        1,
        (2, 3, 4, 4),
        elementwise.Add,
        q8,
    ),
    "sub": (
        _ops(),
        lambda m, x, y: x - y,
        2,
        (2, 3, 4, 4),
        elementwise.Sub,
        q8,
    ),
    "mul": (
        _ops(),
        lambda m, x, y: x * y,
        2,
        (2, 3, 4, 4),
        elementwise.Mul,
        q8,
    ),
    "mul_scalar": (
        _ops(),
        lambda m, x: x * -0.7,
        1,
        (2, 3, 4, 4),
        elementwise.Mul,
        q8,
    ),
    "cat": (
        _ops(),
        lambda m, x, y: torch.cat([x, y], 1),
        2,
        (2, 3, 4, 4),
        elementwise.Cat,
        q8,
    ),
    "matmul": (
        _ops(),
        lambda m, x, y: torch.matmul(x, y.transpose(-1, -2)),
        2,
        (2, 3, 4, 4),
        matmul.MatMul,
        q8,
    ),
}


def _converted(case: str, scales: tuple[float, float], data) -> nn.Module:
    """The case's model with stubs q0, q1 fixed at ``scales``, calibrated on ``data``, converted."""
    ops, body, inputs, _, _, qconfig = CASES[case]
    torch.manual_seed(1)  # the same float weights and statistics for every scale
    net = _Net(body, copy.deepcopy(ops()), inputs, scales[0])
    net.q1 = fxq.QuantStub(scale=scales[1])
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):  # statistics far from the identity
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.3, 0.3)
    qconfig_dict = qconfig if isinstance(qconfig, dict) else {"": qconfig}
    qat = fxq.prepare_qat_fx(net, qconfig_dict)
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    with torch.no_grad():
        for batch in data:
            qat.eval()(*batch)
    return fxq.convert_fx(qat)


def _data(case: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = CASES[case][3]
    return [(torch.randn(shape), torch.randn(shape)) for _ in range(2)]


def _rescaled_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "was converted for input" in str(w.message)]


_NEW_SCALES = {"all": (S2, S2), "first": (S2, S1), "second": (S1, S2)}


@pytest.mark.parametrize(
    "case, which",
    [(c, "all") for c in sorted(CASES)]
    + [(c, w) for c in sorted(CASES) if CASES[c][2] == 2 for w in ("first", "second")],
)
def test_a_new_input_scale_computes_what_convert_gives_for_it(bayes, case, which):
    """``which``: the scale of all inputs changes, or only that of the first or second."""
    cls = CASES[case][4]
    data = _data(case)
    edited = _converted(case, (S1, S1), data)
    new_scales = _NEW_SCALES[which]
    index = 1 if which == "second" else 0
    reference = _converted(case, new_scales, data)
    layers = [m for m in edited.modules() if type(m) is cls]
    assert len(layers) == 1 and layers[0].name, f"no single {cls.__name__} in {edited}"
    edited.q0.scale.fill_(new_scales[0])
    edited.q1.scale.fill_(new_scales[1])
    x, y = torch.randn(CASES[case][3]), torch.randn(CASES[case][3])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            for _ in range(2):  # the second call uses the parameters cached for s2
                assert torch.equal(edited(x, y), reference(x, y))
    assert _rescaled_warnings(caught) == [  # once, naming the layer and both scales
        f"fxq: {cls.__name__} {layers[0].name!r} was converted for input {index} scale {S1:.8g} but "
        f"receives scale {S2:.8g}; it computes what a model converted for input scale {S2:.8g} "
        "computes (multipliers, shifts and int32 bias derived again, cached per scale). If that "
        "is not intended, the op before it must output the scale it was converted for"
    ]
