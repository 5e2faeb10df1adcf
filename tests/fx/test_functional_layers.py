"""Layers that override ``forward`` with functional conv / linear / batch_norm on their own
parameters (timm's ``BatchNormAct2d`` and ``Linear``) are quantized and fused."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxq
from fxq.fx.functional_layers import modularize_functional_layers
from fxq.fx.prepare import FloatOpWarning
from tests.helpers import calibrate, recalibrate_bn

q8 = fxq.qconfig.default_qat_8bit_fake_quant_qconfig


class StridedConv(nn.Conv2d):
    """Overrides forward: pads, then calls F.conv2d on its own weight."""

    def forward(self, x):
        return F.conv2d(F.pad(x, (1, 1, 1, 1)), self.weight, self.bias, self.stride)


class BNReLU(nn.BatchNorm2d):
    def forward(self, x):
        x = F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias,
            self.training, 0.1 if self.momentum is None else self.momentum, self.eps,
        )  # fmt: skip
        return F.relu(x)


class Head(nn.Linear):
    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = StridedConv(3, 8, 3, padding=0)
        self.bn = BNReLU(8)
        self.fc = Head(8, 4)

    def forward(self, x):
        return self.fc(self.bn(self.conv(x)).mean((2, 3)))


def _check_converts(model: nn.Module, x: torch.Tensor) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("error", FloatOpWarning)  # no functional layer stays float
        prepared = fxq.prepare_qat_fx(model, {"": q8})
    calibrate(prepared, [x])
    fxq.set_fake_quantize(prepared, fxq.FakeQuantState.VALIDATION)
    with torch.no_grad():
        expected = prepared(x)
        got = fxq.convert_fx(prepared)(x)
        ref = model(x)
    assert torch.equal(expected, got)
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()
    return prepared


def test_functional_layers_become_modules_and_fuse(bayes):
    model = Net()
    x = torch.randn(4, 3, 8, 8)
    recalibrate_bn(model, [x])
    fused = fxq.fuse_fx(model)
    assert not any(n.target in (F.conv2d, F.batch_norm, F.linear) for n in fused.graph.nodes), (
        fused.graph
    )
    assert fused.conv.conv2d.pattern == "conv_bn_relu"  # F.conv2d + F.batch_norm + F.relu
    assert type(fused.fc.linear) is nn.Linear and torch.equal(
        fused.fc.linear.weight, model.fc.weight
    )
    assert not hasattr(fused.fc, "weight")  # the new module holds it (once)
    prepared = _check_converts(model, x)
    assert type(prepared.conv.conv2d).__name__ == "Conv2d" and prepared.conv.conv2d.bn is not None
    names = set(prepared.state_dict())
    assert "fc.weight" not in names and "fc.linear.weight" in names  # held once


def test_a_computed_weight_stays_functional():
    class Standardized(nn.Conv2d):
        def forward(self, x):
            w = (self.weight - self.weight.mean()) / self.weight.std()
            return F.conv2d(x, w, self.bias)

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = Standardized(3, 4, 1)

        def forward(self, x):
            return self.conv(x)

    gm = fxq.symbolic_trace(M())
    assert modularize_functional_layers(gm) == []
    assert any(n.target is F.conv2d for n in gm.graph.nodes)


def test_timm_batchnormact_and_linear(bayes):
    layers = pytest.importorskip("timm.layers")

    class TimmNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
            self.bn = layers.BatchNormAct2d(8, act_layer=nn.ReLU)
            self.fc = layers.Linear(8, 4)

        def forward(self, x):
            return self.fc(self.bn(self.conv(x)).mean((2, 3)))

    x = torch.randn(4, 3, 8, 8)
    model = recalibrate_bn(TimmNet(), [x])
    prepared = _check_converts(model, x)
    assert prepared.conv.bn is not None and prepared.conv.activation == "relu"  # conv+bn+relu

    # traced in training mode: the BatchNorm counts its batches once and keeps training
    model.train()
    qat = fxq.prepare_qat_fx(model, {"": q8})
    bn = qat.conv.bn
    before = int(bn.num_batches_tracked)
    qat(x)
    assert int(bn.num_batches_tracked) == before + 1
    assert sum(k.endswith("num_batches_tracked") for k in qat.state_dict()) == 1  # held once
