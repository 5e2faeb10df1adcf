"""Every module that ``@fx_wrap()`` code calls is quantized (standalone) and converted,
whatever the shape of the wrapper, or the float-op warning lists it.

Shapes: a method on the root (with and without ``example_inputs``), a root
method calling a child whose other parts were traced, a method on a child, a
wrapped class and a wrapped method two levels deep, a wrapped class holding an
``nn.Sequential`` and a torchvision ``Conv2dNormActivation``.
"""

import warnings

import pytest
import torch
from torch import nn

import fxq
from fxq.fx.prepare import FloatOpWarning
from fxq.qat.base import QATModule
from fxq.quantized.base import QuantizedModule
from tests.helpers import calibrate

q8 = fxq.qconfig.default_qat_8bit_fake_quant_qconfig


def _conv_block() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())


class Head(nn.Module):
    """Traced part (``backbone``) and an opaque part (``decode`` with its own layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Conv2d(3, 4, 1)
        self.refine = _conv_block()
        self.score = nn.Linear(4, 2)

    def decode(self, f):
        f = self.refine(f)
        if f.mean() > 100:  # data-dependent: must not be traced
            f = f * 0
        return self.score(f.mean((2, 3)))

    @fxq.fx_wrap()
    def wrapped_decode(self, f):
        return self.decode(f)


class RootMethod(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Head()

    def forward(self, x):
        return self.post(self.inner.backbone(x))

    @fxq.fx_wrap()
    def post(self, f):
        return self.inner.decode(f)  # a child whose other part (backbone) was traced


class ChildMethod(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Head()

    def forward(self, x):
        return self.inner.wrapped_decode(self.inner.backbone(x))


class Middle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = Head()

    def forward(self, x):
        return self.head.wrapped_decode(self.head.backbone(x))


class TwoLevelsMethod(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stage = nn.ModuleDict({"middle": Middle()})

    def forward(self, x):
        return self.stage["middle"](x)


@fxq.fx_wrap()
class OpaqueBlock(nn.Module):
    """A wrapped class holding a Sequential and a torchvision block."""

    def __init__(self) -> None:
        super().__init__()
        from torchvision.ops.misc import Conv2dNormActivation

        self.seq = _conv_block()
        self.tv = Conv2dNormActivation(4, 4, 3)
        self.fc = nn.Linear(4, 2)

    def forward(self, f):
        for _ in range(int(f.shape[0] > 0)):  # opaque Python
            f = self.tv(self.seq(f))
        return self.fc(f.mean((2, 3)))


class TwoLevelsClass(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.outer = nn.Sequential(nn.Identity(), nn.Sequential(OpaqueBlock()))

    def forward(self, x):
        return self.outer(self.conv(x))


MODELS = {
    "root_method": RootMethod,
    "child_method": ChildMethod,
    "two_levels_method": TwoLevelsMethod,
    "two_levels_class": TwoLevelsClass,
}


def _float_layers(model: nn.Module) -> list[str]:
    """Float conv / linear / BN layers outside fxq's modules (a QAT BN holds its float BN)."""
    kinds = (nn.Conv2d, nn.Linear, nn.BatchNorm2d)
    found = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, (QATModule, QuantizedModule)):
                continue
            if type(child) in kinds:
                found.append(path)
            visit(child, path)

    visit(model, "")
    return found


@pytest.mark.parametrize("with_example", [False, True], ids=["plain", "example_inputs"])
@pytest.mark.parametrize("name", list(MODELS))
def test_every_called_module_is_quantized_and_converted(bayes, name, with_example):
    model = MODELS[name]().eval()
    x = torch.randn(2, 3, 8, 8)
    example = (x,) if with_example else None
    with warnings.catch_warnings():
        warnings.simplefilter("error", FloatOpWarning)
        prepared = fxq.prepare_qat_fx(model, {"": q8}, example_inputs=example)
    assert _float_layers(prepared) == []  # every conv, linear and BN became a QAT module
    calibrate(prepared, [x, torch.randn(2, 3, 8, 8)])
    fxq.set_fake_quantize(prepared, fxq.FakeQuantState.VALIDATION)
    with torch.no_grad():
        expected = prepared(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "stays float" warning
            converted = fxq.convert_fx(prepared)
        got = converted(x)
        ref = model(x)
    assert _float_layers(converted) == []
    assert not any(isinstance(m, QATModule) for m in converted.modules())
    assert sum(isinstance(m, QuantizedModule) for m in converted.modules()) >= 4
    assert torch.equal(expected, got)
    assert (got - ref).abs().max() < 0.2 * ref.abs().max() + 0.05


def test_modules_that_stay_float_in_opaque_code_are_listed(bayes):
    class WithNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)
            self.norm = nn.RNNCell(4, 4)  # weights and no integer implementation: float

        def forward(self, x):
            return self.post(self.conv(x))

        @fxq.fx_wrap()
        def post(self, f):
            return self.norm(f.mean((2, 3)))

    with pytest.warns(FloatOpWarning, match=r"norm \(torch.nn.modules.rnn.RNNCell"):
        fxq.prepare_qat_fx(WithNorm(), {"": q8})


def test_unused_modules_are_left_alone_without_opaque_code(bayes):
    class WithUnusedHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)
            self.aux = _conv_block()  # never called (an auxiliary head in eval)

        def forward(self, x):
            return self.conv(x)

    x = torch.randn(1, 3, 4, 4)
    prepared = calibrate(fxq.prepare_qat_fx(WithUnusedHead(), {"": q8}), [x])
    assert type(prepared.conv) is fxq.qat.Conv2d
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "never ran during calibration" warning
        fxq.convert_fx(prepared)
