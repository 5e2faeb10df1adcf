"""Devices and dtypes: prepared and converted models are ordinary nn.Modules.

The same battery for every kind of model: ``.to(torch.float64)`` and back,
``.half()`` then ``.float()``, ``.cpu()``, the ``meta`` device, a ``state_dict``
round trip, integer (``uint8``) inputs, ``torch.autocast``; on CUDA when
present: QAT training steps, VALIDATION on CUDA equal to the integer model on
CPU bit for bit, autocast in float16.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxq
from fxq.calibration import calibrate
from fxq.fake_quantize import fake_quantize_ste
from fxq.qat import QATModule
from fxq.qconfig import default_qat_8bit_fake_quant_qconfig
from tests.helpers import ResidualNet, recalibrate_bn, run_in_fresh_process

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

LABELS = torch.tensor([1, 2, 3, 4])


def _data() -> torch.Tensor:
    return torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))


def _prepared(x: torch.Tensor) -> nn.Module:
    """A calibrated QAT ResidualNet (BatchNorm statistics set from ``x``, so
    training steps see in-range activations)."""
    float_model = recalibrate_bn(ResidualNet(), [x])
    prepared = fxq.prepare_qat_fx(float_model, {"": default_qat_8bit_fake_quant_qconfig})
    return calibrate(prepared, [x], show_progress=False)


@pytest.fixture
def calibrated(bayes):
    x = _data()
    return _prepared(x), x


def _validation(model: nn.Module, *args: torch.Tensor) -> torch.Tensor:
    fxq.set_fake_quantize(model, "validation")
    model.eval()
    with torch.no_grad():
        return model(*args)


def _fake_quant_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every buffer of every fake quant (scales and observer statistics)."""
    return {
        f"{name}.{b}": t.detach().clone()
        for name, fq in model.named_modules()
        if isinstance(fq, fxq.FakeQuantize)
        for b, t in fq.named_buffers()
    }


def _assert_same_buffers(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = _fake_quant_buffers(model)
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert after[key].dtype == value.dtype, key
        assert torch.equal(after[key].cpu(), value.cpu()), key


def _train_steps(model: nn.Module, x: torch.Tensor, steps: int = 2, **autocast) -> list[float]:
    """QAT training steps; returns the losses and checks that every weight got a gradient."""
    fxq.set_fake_quantize(model, "qat")
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast(**autocast) if autocast else torch.enable_grad():
            out = model(x)
            loss = F.cross_entropy(out.float(), LABELS.to(x.device))
        loss.backward()
        for name, p in model.named_parameters():
            if name.endswith("weight"):
                assert p.grad is not None and bool(torch.isfinite(p.grad).all()), name
                assert float(p.grad.abs().sum()) > 0, f"no gradient reached {name}"
        opt.step()
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses)))
    return losses


# -- float64 ---------------------------------------------------------------------------------
def test_prepared_model_to_float64_and_back(calibrated):
    qat, x = calibrated
    before = _fake_quant_buffers(qat)
    expected = _validation(copy.deepcopy(qat), x)
    integer = fxq.convert_fx(qat)

    qat64 = copy.deepcopy(qat).to(torch.float64)
    assert {p.dtype for p in qat64.parameters()} == {torch.float64}
    _assert_same_buffers(qat64, before)  # scales and statistics stay float32
    out = _validation(qat64, x.double())
    # VALIDATION runs the integer model: float64 parameters change nothing here
    assert torch.equal(out, fxq.convert_fx(qat64)(x.double()))
    assert torch.equal(out, integer(x.double()))
    assert torch.equal(out.float(), expected)

    back = qat64.to(torch.float32)  # float32 -> float64 -> float32 is exact
    _assert_same_buffers(back, before)
    for (name, p), q in zip(back.named_parameters(), qat.parameters()):
        assert p.dtype is torch.float32 and torch.equal(p, q), name
    assert torch.equal(_validation(back, x), expected)


def test_qat_training_in_float64(calibrated):
    qat, x = calibrated
    qat64 = copy.deepcopy(qat).double()
    _train_steps(qat64, x.double())
    assert {b.dtype for n, b in qat64.named_buffers() if n.endswith(".scale")} == {torch.float32}
    assert torch.equal(_validation(qat64, x.double()), fxq.convert_fx(qat64)(x.double()))


# -- float16 / bfloat16 ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prepared_model_in_16_bit_floats_keeps_float32_scales(calibrated, dtype):
    qat, x = calibrated
    before = _fake_quant_buffers(qat)
    low = copy.deepcopy(qat).to(dtype)
    _assert_same_buffers(low, before)
    xl = x.to(dtype)
    out = _validation(low, xl)
    # the integer model of the 16-bit QAT model, on the same input values
    assert torch.equal(out, fxq.convert_fx(low)(xl.float()))
    # training steps run in the 16-bit dtype
    fxq.set_fake_quantize(low, "qat")
    low.train()
    y = low(xl)
    assert y.dtype is dtype and bool(torch.isfinite(y).all())
    y.float().square().mean().backward()
    assert low.fc.weight.grad.dtype is dtype


def test_prepared_model_half_then_float(calibrated):
    qat, x = calibrated
    before = _fake_quant_buffers(qat)
    model = copy.deepcopy(qat).half().float()
    _assert_same_buffers(model, before)  # nothing of the calibration was rounded to half
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert torch.equal(_validation(model, x), fxq.convert_fx(model)(x))


# -- cpu, meta, state_dict -------------------------------------------------------------------
def test_cpu_is_a_no_op_on_a_cpu_model(calibrated):
    qat, x = calibrated
    expected = _validation(copy.deepcopy(qat), x)
    assert qat.cpu() is qat
    assert torch.equal(_validation(qat, x), expected)


def test_meta_device_and_materialisation(calibrated):
    qat, x = calibrated
    expected = _validation(copy.deepcopy(qat), x)
    meta = copy.deepcopy(qat).to("meta")
    assert {t.device.type for t in [*meta.parameters(), *meta.buffers()]} == {"meta"}
    repr(meta)  # printing needs no values
    for state in ("qat", "calibration"):  # shapes flow through the fake quants
        fxq.set_fake_quantize(meta, state)
        out = meta(x.to("meta"))
        assert out.device.type == "meta" and out.shape == (4, 10)
    meta.to_empty(device="cpu")
    meta.load_state_dict(qat.state_dict())
    assert torch.equal(_validation(meta, x), expected)


def test_a_model_built_on_meta_prepares_on_meta(bayes):
    with torch.device("meta"):
        float_model = ResidualNet()
    prepared = fxq.prepare_qat_fx(float_model, {"": default_qat_8bit_fake_quant_qconfig})
    devices = {t.device.type for t in [*prepared.parameters(), *prepared.buffers()]}
    assert devices == {"meta"}


def test_state_dict_round_trip(calibrated):
    qat, x = calibrated
    expected = _validation(copy.deepcopy(qat), x)
    buffer = io.BytesIO()
    torch.save(qat.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    fresh = fxq.prepare_qat_fx(ResidualNet(), {"": default_qat_8bit_fake_quant_qconfig})
    fresh.load_state_dict(state)
    assert torch.equal(_validation(fresh, x), expected)


def test_state_dict_loads_in_a_fresh_process(calibrated, tmp_path):
    qat, x = calibrated
    expected = _validation(copy.deepcopy(qat), x)
    torch.save(qat.state_dict(), tmp_path / "qat.pt")
    torch.save(x, tmp_path / "x.pt")
    run_in_fresh_process(
        f"""
        import torch, fxq
        from fxq.qconfig import default_qat_8bit_fake_quant_qconfig
        from tests.helpers import ResidualNet
        fxq.set_march("bayes")
        qat = fxq.prepare_qat_fx(ResidualNet(), {{"": default_qat_8bit_fake_quant_qconfig}})
        qat.load_state_dict(torch.load({str(tmp_path / "qat.pt")!r}, weights_only=True))
        fxq.set_fake_quantize(qat, "validation")
        with torch.no_grad():
            out = qat.eval()(torch.load({str(tmp_path / "x.pt")!r}, weights_only=True))
        torch.save(out, {str(tmp_path / "out.pt")!r})
        """
    )
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True), expected)


# -- converted models ------------------------------------------------------------------------
def test_converted_model_changes_dtype_and_stays_exact(calibrated):
    qat, x = calibrated
    fxq.set_fake_quantize(qat, "validation")
    integer = fxq.convert_fx(qat)
    with torch.no_grad():
        expected = integer(x)
        assert torch.equal(copy.deepcopy(integer).to(torch.float64)(x), expected)
        assert torch.equal(copy.deepcopy(integer).double().float()(x), expected)
        assert torch.equal(copy.deepcopy(integer).cpu()(x), expected)
        # integer parameters, scales, multipliers and shifts keep their dtypes
        assert torch.equal(copy.deepcopy(integer).half()(x), expected)
        assert torch.equal(copy.deepcopy(integer).to(torch.bfloat16)(x), expected)
        assert torch.equal(copy.deepcopy(integer).half().float()(x), expected)


# -- integer inputs --------------------------------------------------------------------------
class _Frames(nn.Module):
    """A camera-frame model: uint8 pixels into a quantize stub, then a conv."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = fxq.QuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.dequant = fxq.DeQuantStub()

    def forward(self, x):
        return self.dequant(F.relu(self.conv(self.quant(x))))


def test_uint8_inputs_are_quantized_with_the_exact_scale(bayes):
    frames = torch.randint(0, 256, (2, 3, 6, 6), dtype=torch.uint8)
    prepared = fxq.prepare_qat_fx(_Frames(), {"": default_qat_8bit_fake_quant_qconfig})
    a, b = prepared, copy.deepcopy(prepared)
    for state in ("calibration", "qat"):  # the same statistics and scales from either dtype
        fxq.set_fake_quantize(a, state)
        fxq.set_fake_quantize(b, state)
        with torch.no_grad():
            assert torch.equal(a(frames), b(frames.float()))
    assert a.quant.activation_post_process.scale.item() == pytest.approx(int(frames.max()) / 127)
    _assert_same_buffers(a, _fake_quant_buffers(b))
    out = _validation(a, frames)
    assert torch.equal(out, _validation(b, frames.float()))
    integer = fxq.convert_fx(a)
    assert torch.equal(out, integer(frames.float()))
    assert torch.equal(out, integer(frames))  # the integer model takes the frames as they are


# -- autocast --------------------------------------------------------------------------------
def test_qat_training_under_cpu_autocast(calibrated):
    qat, x = calibrated
    seen = []

    def record(module, inputs, output):
        seen.append((inputs[0].dtype, output.dtype, output.detach().clone(), inputs[0].detach()))

    fq = qat.fc.activation_post_process  # a linear without BatchNorm: its output is bfloat16
    handle = fq.register_forward_hook(record)
    _train_steps(qat, x, device_type="cpu", dtype=torch.bfloat16)
    handle.remove()
    # inside autocast the linear's output is bfloat16; the fake quant divides in float32 by the
    # float32 scale and gives back bfloat16
    in_dtype, out_dtype, out, inp = seen[-1]
    assert in_dtype is torch.bfloat16 and out_dtype is torch.bfloat16
    float32 = fake_quantize_ste(inp.float(), fq.scale, fq.dtype, fq.rounding, exact=False)
    assert torch.equal(out, float32.to(torch.bfloat16))
    assert fq.scale.dtype is torch.float32
    # VALIDATION under autocast is still the integer model
    fxq.set_fake_quantize(qat, "validation")
    qat.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = qat(x)
    assert torch.equal(out, fxq.convert_fx(qat)(x))


# -- the integer twin follows the module ----------------------------------------------------
def test_integer_twin_is_rebuilt_after_a_dtype_or_device_change(calibrated):
    qat, x = calibrated
    _validation(qat, x)
    conv = qat.conv1
    assert isinstance(conv, QATModule)
    twin = conv.integer_twin()
    assert conv.integer_twin() is twin  # cached
    qat.to(torch.float64)
    assert conv.integer_twin() is not twin
    qat.to(torch.float32)
    assert torch.equal(_validation(qat, x), fxq.convert_fx(qat)(x))


# -- CUDA ------------------------------------------------------------------------------------
@cuda
def test_qat_training_steps_on_cuda(calibrated):
    qat, x = calibrated
    model = copy.deepcopy(qat).cuda()
    devices = {t.device.type for t in [*model.parameters(), *model.buffers()]}
    assert devices == {"cuda"}
    _train_steps(model, x.cuda(), steps=3)
    assert {b.dtype for n, b in model.named_buffers() if n.endswith(".scale")} == {torch.float32}


@cuda
def test_validation_on_cuda_equals_the_integer_model_on_cpu(calibrated):
    qat, x = calibrated
    _train_steps(qat, x)  # QAT on CPU first, so the twin was built on CPU once
    cpu_out = _validation(qat, x)
    integer = fxq.convert_fx(qat)
    on_cuda = copy.deepcopy(qat).cuda()
    cuda_out = _validation(on_cuda, x.cuda())
    assert cuda_out.device.type == "cuda"
    assert torch.equal(cuda_out.cpu(), integer(x))
    assert torch.equal(cuda_out.cpu(), cpu_out)
    # moving a model whose twin is cached rebuilds the twin on the new device
    qat.cuda()
    assert torch.equal(_validation(qat, x.cuda()).cpu(), cpu_out)
    assert all(t.device.type == "cuda" for t in qat.conv1.integer_twin().buffers())
    # and the integer model itself runs on CUDA with the same result
    assert torch.equal(copy.deepcopy(integer).cuda()(x.cuda()).cpu(), cpu_out)


@cuda
def test_qat_training_under_cuda_float16_autocast(calibrated):
    qat, x = calibrated
    model = copy.deepcopy(qat).cuda()
    _train_steps(model, x.cuda(), device_type="cuda", dtype=torch.float16)
    fxq.set_fake_quantize(model, "validation")
    model.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        out = model(x.cuda())
    assert torch.equal(out.cpu(), fxq.convert_fx(model).cpu()(x))
