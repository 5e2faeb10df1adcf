"""Converted models under dtype conversions and device moves, and inputs of every kind:
half-precision and integer frames, unbatched images. Each gives the exact integers."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxq
from fxq.qconfig import default_calib_8bit_fake_quant_qconfig as q8
from fxq.qtensor import QTensor
from fxq.quantized import functional as qf
from fxq.quantized import pooling, weighted
from tests.helpers import ResidualNet, calibrate, recalibrate_bn
from tests.zoo import Zoo


def _converted(model: nn.Module, data: list[torch.Tensor], qconfig=q8) -> nn.Module:
    return fxq.convert_fx(calibrate(fxq.prepare_qat_fx(model, {"": qconfig}), data))


@pytest.fixture(scope="module")
def zoo_int8():
    """Every integer op, converted once for the dtype tests (bayes, int8)."""
    fxq.set_march("bayes")
    torch.manual_seed(0)
    model = Zoo()
    data = [torch.randn(2, 3, 16, 16) for _ in range(2)]
    recalibrate_bn(model, data)
    return _converted(model, data)


def _run(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return model(x)


# -- dtype conversions of the converted model ----------------------------------------------------
@pytest.mark.parametrize(
    "convert",
    [
        lambda m: m.half(),
        lambda m: m.to(torch.bfloat16),
        lambda m: m.double(),
        lambda m: m.to("cpu", torch.float16),
        lambda m: m.half().float(),
        lambda m: m.to(torch.bfloat16).to(torch.float32),
        lambda m: m.double().float(),
    ],
    ids=["half", "bfloat16", "double", "cpu+half", "half-back", "bfloat16-back", "double-back"],
)
def test_dtype_conversions_keep_every_integer_result(bayes, zoo_int8, convert):
    x = torch.randn(2, 3, 16, 16)
    expected = _run(zoo_int8, x)
    moved = convert(copy.deepcopy(zoo_int8))
    got = _run(moved, x)
    for e, g in zip(expected, got):
        assert torch.equal(e, g)
    before = {k: v.dtype for k, v in zoo_int8.state_dict().items()}
    assert {k: v.dtype for k, v in moved.state_dict().items()} == before


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_quantize_like_the_same_values_in_float32(bayes, zoo_int8, dtype):
    x = torch.randn(2, 3, 16, 16).to(dtype)  # values every float dtype holds exactly
    for e, g in zip(_run(zoo_int8, x.float()), _run(copy.deepcopy(zoo_int8).to(dtype), x)):
        assert torch.equal(e, g)


def test_meta_device_keeps_dtypes_and_shapes(bayes, zoo_int8):
    meta = copy.deepcopy(zoo_int8).to("meta").half()
    for (k, v), (_, w) in zip(zoo_int8.state_dict().items(), meta.state_dict().items()):
        assert w.device.type == "meta" and w.dtype == v.dtype and w.shape == v.shape, k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_half_model_equals_the_cpu_model(bayes, zoo_int8):
    x = torch.randn(2, 3, 16, 16)
    expected = _run(zoo_int8, x)
    got = _run(copy.deepcopy(zoo_int8).cuda().half(), x.cuda())
    for e, g in zip(expected, got):
        assert g.device.type == "cuda" and torch.equal(e, g.cpu())
    back = _run(copy.deepcopy(zoo_int8).cuda().half().cpu().float(), x)
    for e, g in zip(expected, back):
        assert torch.equal(e, g)


def test_rescaled_parameters_follow_device_moves(bayes):
    """Parameters derived for a new input scale are cached per device: a move clears them."""
    torch.manual_seed(0)
    converted = _converted(ResidualNet(), [torch.randn(4, 3, 8, 8)])
    converted.x_quant.scale.mul_(2)
    x = torch.randn(2, 3, 8, 8)
    with pytest.warns(RuntimeWarning, match="Conv2d 'stem' was converted for input 0 scale"):
        expected = _run(converted, x)
    assert converted.stem.__dict__["_derived"]
    moved = copy.deepcopy(converted).to("meta")
    assert "_derived" not in moved.stem.__dict__
    assert torch.equal(_run(copy.deepcopy(converted).double().float(), x), expected)


# -- integer and half inputs to quantize ----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
def test_integer_inputs_quantize_with_the_exact_scale(bayes, dtype):
    """A uint8 camera frame quantizes like the same values in float (the scale is not cast)."""
    torch.manual_seed(0)
    frames = [torch.randint(0, 256, (4, 3, 8, 8)).float() for _ in range(2)]
    converted = _converted(ResidualNet(), frames)
    scale = converted.x_quant.scale.item()
    assert 1.0 < scale < 3.0  # about 255 / 127: an integer dtype would truncate it to 2
    x = torch.randint(0, 256, (2, 3, 8, 8))
    assert torch.equal(_run(converted, x.to(dtype)), _run(converted, x.float()))
    q = QTensor.quantize(x.to(dtype), converted.x_quant.scale, fxq.qint8, converted.stem.rounding)
    expected = qf.quantize(x.float(), converted.x_quant.scale, fxq.qint8, converted.stem.rounding)
    assert torch.equal(q.int_repr(), expected)
    assert torch.equal(
        q.int_repr(), torch.floor(x.double() / scale + 0.5).clamp(max=127).to(torch.int8)
    )


def test_quantize_divides_exactly_for_every_input_dtype():
    s = torch.tensor([0.1])
    values = torch.tensor([0.0, 1.0, 3.0, 5.0, 7.0, 250.0, -120.0])
    expected = qf.quantize(values, s, fxq.qint16, qf.Rounding.HALF_UP)
    assert expected.tolist() == [0, 10, 30, 50, 70, 2500, -1200]
    for dtype in (torch.float16, torch.bfloat16, torch.int16, torch.int32):
        v = values.to(dtype)
        assert torch.equal(qf.quantize(v, s, fxq.qint16, qf.Rounding.HALF_UP), expected), dtype
    assert qf.division_dtype(torch.uint8) is torch.float32
    assert qf.division_dtype(torch.float16) is torch.float32
    assert qf.division_dtype(torch.int32) is torch.float64
    assert qf.division_dtype(torch.float64) is torch.float64


# -- unbatched inputs --------------------------------------------------------------------------
class _Unbatched(nn.Module):
    """conv+bn+relu, conv+add, a transposed conv, average and adaptive pooling, then linear."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = fxq.QuantStub()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1, padding_mode="reflect")
        self.up = nn.ConvTranspose2d(6, 4, 2, stride=2)
        self.pool = nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False)
        self.apool = nn.AdaptiveAvgPool2d((2, 3))
        self.fc = nn.Linear(3, 5)
        self.dequant = fxq.DeQuantStub()

    def forward(self, x):
        x = self.quant(x)
        y = F.relu(self.bn(self.conv(x)))
        y = self.conv2(y) + y
        z = self.apool(self.pool(self.up(y)))
        return self.dequant(self.fc(z)), self.dequant(F.avg_pool2d(y, 2))


def test_unbatched_images_give_the_batched_results(bayes):
    torch.manual_seed(0)
    model = _Unbatched()
    data = [torch.randn(4, 3, 8, 8) for _ in range(2)]
    recalibrate_bn(model, data)
    converted = _converted(model, data)
    kinds = {type(m) for m in converted.modules()}
    assert {weighted.Conv2d, weighted.ConvTranspose2d, pooling.AvgPool} <= kinds
    assert pooling.AdaptiveAvgPool in kinds and weighted.Linear in kinds
    x = torch.randn(2, 3, 8, 8)
    batched = _run(converted, x)
    for i in range(2):
        single = _run(converted, x[i])
        for b, s in zip(batched, single):
            assert s.shape == b.shape[1:] and torch.equal(s, b[i])


def test_unbatched_conv1d_and_linear_vectors(bayes):
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant = fxq.QuantStub()
            self.conv = nn.Conv1d(3, 5, 3)
            self.pool = nn.AvgPool1d(2)
            self.fc = nn.Linear(5, 4)

        def forward(self, x):
            y = self.pool(F.relu(self.conv(self.quant(x))))
            return self.fc(y.transpose(-1, -2))

    torch.manual_seed(0)
    converted = _converted(Net(), [torch.randn(4, 3, 9)])
    x = torch.randn(2, 3, 9)
    batched = _run(converted, x)
    for i in range(2):
        assert torch.equal(_run(converted, x[i]), batched[i])
