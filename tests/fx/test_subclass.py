"""Subclasses of registry layers that keep the base's ``forward`` are the base op.

``class MyConv(nn.Conv2d): pass`` used to be traced through into ``F.conv2d``,
which stays float and is never fused; now it is ``nn.Conv2d`` for tracing,
fusion, QAT and convert.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxq
from fxq import registry
from fxq.fx.prepare import FloatOpWarning
from tests.helpers import calibrate, recalibrate_bn

q8 = fxq.qconfig.default_qat_8bit_fake_quant_qconfig


class MyConv(nn.Conv2d):
    pass


class MyBN(nn.BatchNorm2d):
    """Adds a helper method, keeps the forward."""

    def describe(self) -> str:
        return f"bn({self.num_features})"


class MyLinear(nn.Linear):
    def __init__(self, n: int) -> None:
        super().__init__(n, n)


class ScaledConv(nn.Conv2d):
    """Overrides forward: computes something else, so it is not a Conv2d."""

    def forward(self, x):
        return super().forward(x) * 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = MyConv(3, 8, 3, padding=1)
        self.bn = MyBN(8)
        self.relu = nn.ReLU()
        self.conv2 = MyConv(8, 8, 1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = MyLinear(8)

    def forward(self, x):
        x = self.relu(self.bn(self.conv(x)))
        x = F.relu(self.conv2(x))
        return self.fc(self.pool(x).flatten(1))


def test_registry_class_follows_the_forward():
    assert registry.registry_class(MyConv) is nn.Conv2d
    assert registry.registry_class(MyBN) is nn.BatchNorm2d
    assert registry.row_for_module(MyLinear).name == "linear"
    assert registry.registry_class(ScaledConv) is None
    assert registry.row_for_module(ScaledConv).kind is registry.Kind.FLOAT
    assert registry.registry_class(nn.ReLU6) is nn.ReLU6  # its own row, not Hardtanh's


def test_subclasses_are_leaves_fused_and_converted_bit_exact(bayes):
    model = Net()
    data = [torch.randn(2, 3, 8, 8) for _ in range(3)]
    recalibrate_bn(model, data)
    gm = fxq.symbolic_trace(model)
    assert not any(n.target in (F.conv2d, F.batch_norm, F.linear) for n in gm.graph.nodes)
    fused = fxq.fuse_fx(model)
    assert fused.conv.pattern == "conv_bn_relu" and fused.conv2.pattern == "conv_relu"
    with warnings.catch_warnings():
        warnings.simplefilter("error", FloatOpWarning)  # nothing stays float
        prepared = fxq.prepare_qat_fx(model, {"": q8})
    assert type(prepared.conv).__name__ == "Conv2d" and prepared.conv.bn is not None
    assert type(prepared.fc) is fxq.qat.Linear
    calibrate(prepared, data)
    x = torch.randn(2, 3, 8, 8)
    fxq.set_fake_quantize(prepared, fxq.FakeQuantState.VALIDATION)
    with torch.no_grad():
        expected = prepared(x)
        converted = fxq.convert_fx(prepared)
        got = converted(x)
        ref = model(x)
    assert torch.equal(expected, got)
    assert torch.allclose(got, ref, atol=0.1 * ref.abs().max().item())


def test_a_subclass_with_its_own_forward_is_traced_through(bayes):
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = ScaledConv(3, 4, 1)

        def forward(self, x):
            return self.conv(x)

    gm = fxq.symbolic_trace(M())
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert F.conv2d in targets


def test_module_type_qconfig_of_the_base_covers_the_subclass(bayes):
    prepared = fxq.prepare_qat_fx(Net(), {"": q8, "module_type": {nn.Linear: None}})
    assert type(prepared.fc) is MyLinear  # float on purpose
    assert type(prepared.conv2).__name__ == "Conv2d"


def test_torchvision_r3d_18_has_no_float_conv():
    tv = pytest.importorskip("torchvision")
    from torchvision.models.video.resnet import Conv3DSimple

    fxq.set_march("bayes")
    assert registry.registry_class(Conv3DSimple) is nn.Conv3d
    model = tv.models.video.r3d_18(num_classes=4).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepared = fxq.prepare_qat_fx(model, {"": q8})
    assert not [w for w in caught if issubclass(w.category, FloatOpWarning)]
    assert not any(
        n.target in (F.conv3d, F.batch_norm) for n in prepared.graph.nodes if n.op != "output"
    )
    x = torch.randn(1, 3, 4, 16, 16)
    calibrate(prepared, [x])
    fxq.set_fake_quantize(prepared, fxq.FakeQuantState.VALIDATION)
    with torch.no_grad():
        expected = prepared(x)
        got = fxq.convert_fx(prepared)(x)
    assert torch.equal(expected, got)
