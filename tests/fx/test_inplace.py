"""In-place ops keep their meaning after prepare and convert (fxq computes quantized ops out
of place, so the readers of a value written in place are rewired to the writing node)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxq
from fxq.fx.inplace import InplaceViewError
from tests.helpers import sqnr


def _run(model: nn.Module, *inputs: torch.Tensor):
    qat = fxq.prepare_qat_fx(
        model, {"": fxq.qconfig.default_qat_8bit_fake_quant_qconfig}, example_inputs=inputs
    )
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    with torch.no_grad():
        qat(*inputs)
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
    with torch.no_grad():
        validation = qat(*inputs)
        integer = fxq.convert_fx(qat)(*inputs)
    return validation, integer


class InplaceChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, x, y):
        a = self.conv(x)
        a.sub_(self.conv(y))  # a method whose result is thrown away
        a.mul_(0.5)
        a.relu_()
        a.clamp_(max=1.0)
        b = self.conv(y)
        b += a  # an augmented assignment
        return b


class InplaceModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        a = self.conv(x)
        b = self.relu(a)  # writes into a, which is read again below
        return a + b


@pytest.mark.parametrize("model_cls", [InplaceChain, InplaceModule])
def test_inplace_ops_keep_their_meaning(bayes, model_cls):
    torch.manual_seed(0)
    model = model_cls().eval()
    inputs = [torch.randn(2, 3, 6, 6) for _ in range(2 if model_cls is InplaceChain else 1)]
    with torch.no_grad():
        reference = model(*[t.clone() for t in inputs])
    validation, integer = _run(model, *inputs)
    assert torch.equal(validation, integer)
    # before the rewiring, the prepared model dropped the sub_ / mul_ / clamp_ writes: 0 dB
    assert sqnr(reference, validation) > 25.0


def test_write_through_a_view_of_a_value_read_later_is_refused(bayes):
    class ViewWrite(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)

        def forward(self, x):
            a = self.conv(x)
            a[:, :2].mul_(2.0)
            return a

    with pytest.raises(InplaceViewError, match=r"mul_.*view of conv.*out of place"):
        fxq.prepare_qat_fx(
            ViewWrite().eval(), {"": fxq.qconfig.default_qat_8bit_fake_quant_qconfig}
        )


def test_float_inplace_op_through_a_view_is_refused_too(bayes):
    """A float op gets a dequantized copy of a quantized value: its write would be lost."""

    class FloatViewWrite(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)

        def forward(self, x):
            a = self.conv(x)
            a[:, :2].cumsum_(dim=2)
            return a

    with pytest.raises(InplaceViewError, match=r"cumsum_.*torch\.cat"):
        fxq.prepare_qat_fx(
            FloatViewWrite().eval(), {"": fxq.qconfig.default_qat_8bit_fake_quant_qconfig}
        )


def test_float_inplace_op_keeps_its_meaning(bayes):
    class FloatWrite(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)

        def forward(self, x):
            a = self.conv(x)
            a.cumsum_(dim=2)  # float op on a quantized value: runs on a dequantized copy
            return a

    torch.manual_seed(0)
    model = FloatWrite().eval()
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        reference = model(x)
    with pytest.warns(fxq.FloatOpWarning):
        validation, integer = _run(model, x)
    assert torch.equal(validation, integer)
    assert sqnr(reference, validation) > 25.0
