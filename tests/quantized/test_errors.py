"""Errors and warnings of the integer modules: each names the layer, says what was
wrong and what to do."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxq
from fxq.qconfig import default_calib_8bit_fake_quant_qconfig as q8
from fxq.qconfig import default_calib_8bit_weight_16bit_act_fake_quant_qconfig as q16
from fxq.qtensor import QTensor
from fxq.quantized import functional as qf
from tests.helpers import SeedNet, calibrate, recalibrate_bn

_DIVERGED = (
    "which cannot be quantized. The training diverged (or the checkpoint is damaged): load a "
    "good checkpoint, or train again with a lower learning rate; or keep this layer in float "
    "with a qconfig of None"
)


class _ConvBnAndBn(nn.Module):
    """conv+bn+relu (fused) and a standalone BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = fxq.QuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.bn_alone = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        y = self.bn_alone(F.relu(self.bn(self.conv(self.quant(x)))))
        return self.fc(y.mean((2, 3)))


@pytest.fixture
def calibrated(bayes):
    torch.manual_seed(0)
    model = _ConvBnAndBn()
    data = [torch.randn(4, 3, 6, 6)]
    recalibrate_bn(model, data)
    return calibrate(fxq.prepare_qat_fx(model, {"": q8}), data)


def _poison(qat: nn.Module, where: str) -> None:
    with torch.no_grad():
        if where == "weight":
            qat.conv.weight[1, 0, 0, 0] = float("nan")
        elif where == "bias":
            qat.conv.bias[2] = float("inf")
        elif where == "running_var":
            qat.conv.bn.running_var[0] = float("nan")
        elif where == "standalone running_mean":
            qat.bn_alone.bn.running_mean[3] = float("-inf")
        elif where == "linear weight":
            qat.fc.weight[:] = float("nan")


@pytest.mark.parametrize(
    "where, message",
    [
        ("weight", "Conv2d 'conv': its weight has 1 NaN/Inf value(s) of 108, "),
        ("bias", "Conv2d 'conv': its bias has 1 NaN/Inf value(s) of 4, "),
        ("running_var", "Conv2d 'conv': its BatchNorm running_var has 1 NaN/Inf value(s) of 4, "),
        (
            "standalone running_mean",
            "BatchNorm 'bn_alone': its BatchNorm running_mean has 1 NaN/Inf value(s) of 4, ",
        ),
        ("linear weight", "Linear 'fc': its weight has 8 NaN/Inf value(s) of 8, "),
    ],
)
def test_nan_or_inf_parameters_are_refused_at_convert_and_validation(calibrated, where, message):
    _poison(calibrated, where)
    expected = "^" + re.escape(message + _DIVERGED) + "$"
    with pytest.raises(ValueError, match=expected):
        fxq.convert_fx(calibrated)
    fxq.set_fake_quantize(calibrated, fxq.FakeQuantState.VALIDATION)
    with pytest.raises(ValueError, match=expected), torch.no_grad():
        calibrated(torch.randn(2, 3, 6, 6))


def test_multiplier_range_error_names_the_layer_and_its_scales(calibrated):
    calibrated.conv.activation_post_process.scale.fill_(1e-12)
    s_x = calibrated.quant.activation_post_process.scale.item()
    with pytest.raises(qf.MultiplierRangeError) as info:
        fxq.convert_fx(calibrated)
    text = str(info.value)
    assert text.startswith("Conv2d 'conv': requantization factor ")
    assert "exceeds what march bayes can represent (32767 * 2**-0)" in text
    assert (
        f"(input scale {s_x:.6g}, weight scale 0.00" in text
        and " (4 channels), output scale 1e-12)" in text
    )
    assert text.endswith(
        "Calibrate this layer with data that reaches its real output range (or fix the scale of "
        "its output), check the model for NaN/Inf scales, or keep the layer in float with a "
        "qconfig of None"
    )


def test_multiplier_range_error_of_a_functional_op_names_it(bayes):
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant = fxq.QuantStub()

        def forward(self, x):
            return torch.sigmoid(x) * x

    qat = calibrate(fxq.prepare_qat_fx(Net(), {"": q8}), [torch.randn(4, 8)])
    mul = next(m for m in qat.modules() if type(m).__name__ == "Mul")
    mul.activation_post_process.scale.fill_(1e-12)
    with pytest.raises(qf.MultiplierRangeError, match=rf"^Mul '{mul.name}': requantization"):
        fxq.convert_fx(qat)(torch.randn(2, 8))


def test_int32_saturation_warning_describes_the_actual_operands(bayes):
    """An int8 conv saturates through its bias (tiny input scale): the warning says so."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant = fxq.QuantStub(scale=2.0**-20)
            self.conv = nn.Conv2d(3, 2, 1)

        def forward(self, x):
            return self.conv(self.quant(x))

    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        net.conv.bias.fill_(5000.0)
    converted = fxq.convert_fx(
        calibrate(fxq.prepare_qat_fx(net, {"": q8}), [torch.randn(2, 3, 4, 4) * 1e-4])
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        converted(torch.randn(2, 3, 4, 4) * 1e-4)
    messages = [str(w.message) for w in caught if "saturated" in str(w.message)]
    assert len(messages) == 1
    text = messages[0]
    assert text.startswith(
        "fxq: the int32 accumulator of Conv2d 'conv' saturated on 32 of 64 elements, so its "
        "results are clipped; it sums qint8 inputs times int8 weights (|X| * sum|W| up to "
    )
    assert text.endswith(
        "plus an int32 bias of up to 2,147,483,647 (2^31.0) (the float bias divided by input "
        "scale 9.53674e-07 times the weight scale); 32 bits hold 2^31. The bias is what "
        "overflows: the input scale is too small for it (calibrate the input on its real range, "
        "or fix a larger input scale), or keep the layer in float with a qconfig of None"
    )
    assert "int16" not in text


def test_int32_saturation_warning_of_an_int16_matmul(bayes):
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant = fxq.QuantStub()

        def forward(self, x):
            return torch.matmul(x, x.transpose(-1, -2))

    qat = calibrate(fxq.prepare_qat_fx(Net(), {"": q16}), [torch.ones(1, 4, 64)])
    with pytest.warns(RuntimeWarning) as caught:
        fxq.convert_fx(qat)(torch.ones(1, 4, 64))
    (text,) = [str(w.message) for w in caught if "saturated" in str(w.message)]
    assert text == (
        "fxq: the int32 accumulator of MatMul 'matmul' saturated on 16 of 16 elements, so its "
        "results are clipped; it sums 64 products of a qint16 and a qint16 operand (up to "
        "68,719,476,736 = 2^36 in magnitude; 32 bits hold 2^31). Use int8 for one operand (its "
        "producer's qconfig), or keep the op in float with a qconfig of None"
    )


def test_inputs_the_modules_cannot_take(bayes):
    torch.manual_seed(0)
    converted = fxq.convert_fx(
        calibrate(fxq.prepare_qat_fx(SeedNet(), {"": q8}), [torch.randn(2, 3, 6, 6)])
    )
    conv = converted.conv
    x = torch.randint(-5, 5, (1, 3, 6, 6), dtype=torch.int16)
    with pytest.raises(
        TypeError,
        match=r"^Conv2d 'conv': input 0 is qint16, but the module was converted for qint8 inputs "
        r"\(its accumulation plan depends on the width\). If you edited the graph, the op before "
        r"this one must output qint8 \(or narrower\)$",
    ):
        conv(QTensor(x, torch.tensor([0.1]), fxq.qint16))
    per_channel = QTensor(x.to(torch.int8), torch.tensor([0.1, 0.2, 0.3]), fxq.qint8, axis=1)
    with pytest.raises(
        ValueError,
        match=r"^Conv2d 'conv': input 0 has per-channel scales \(axis 1\); integer ops take one "
        r"scale per activation tensor. Requantize it per tensor first$",
    ):
        conv(per_channel)
    with pytest.raises(TypeError, match=r"^Conv2d 'conv' expects a QTensor as input 0, got Tensor"):
        conv(torch.randn(1, 3, 6, 6))


def test_an_edited_scale_warns_once_and_recovers_the_converted_parameters(bayes):
    torch.manual_seed(0)
    data = [torch.randn(2, 3, 6, 6)]
    converted = fxq.convert_fx(calibrate(fxq.prepare_qat_fx(SeedNet(), {"": q8}), data))
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        before = converted(x)
    original = converted.quant.scale.clone()
    edited = copy.deepcopy(converted)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            for factor in (1.5, 2.0, 1.5):
                edited.quant.scale.copy_(original * factor)
                edited(x)
            edited.quant.scale.copy_(original)
            after = edited(x)
    assert torch.equal(before, after)  # back at the converted scale: the buffers themselves
    assert len([w for w in caught if "was converted for input" in str(w.message)]) == 1
    assert len(edited.conv.__dict__["_derived"]) == 2  # one entry per scale seen
