"""QAT training's fake quantization on the CPU in one C pass (``native.fake_quantize``)
equals the five torch passes of ``fxq.quantized.functional.fake_quantize`` bit for bit."""

from __future__ import annotations

import pytest
import torch

import fxq
from fxq.march.spec import Rounding
from fxq.qconfig import default_qat_8bit_fake_quant_qconfig
from fxq.quantized import functional as qf
from fxq.quantized import native
from tests.helpers import ResidualNet

SPECIAL = [0.0, -0.0, 1e-45, -1e-38, 0.5, -0.5, 1.5, -2.5, 0.49999997, 126.5, 127.49998]
SPECIAL += [127.5, -128.5, -128.49998, 1e30, -1e30, float("inf"), float("-inf"), float("nan")]


def _torch_path(monkeypatch, *args, **kwargs):
    with monkeypatch.context() as m:
        m.setattr(native, "fake_quantize", lambda *a, **k: None)
        return qf.fake_quantize(*args, **kwargs)


def _inputs(shape, ch_axis, spread: float = 3.0):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * spread
    flat = x.view(-1)
    flat[: len(SPECIAL)] = torch.tensor(SPECIAL)  # scale 1 in channel 0 (below)
    channels = 1 if ch_axis is None else shape[ch_axis]
    scale = torch.rand(channels, generator=g) * 0.05 + 0.01
    scale[0] = 1.0
    return x, scale


@pytest.mark.parametrize(
    ("shape", "ch_axis"),
    [((4, 8, 5, 7), None), ((40000,), None), ((16, 3, 3, 3), 0), ((4, 8, 5, 7), 1), ((6, 9), -1)],
)
@pytest.mark.parametrize(("qmin", "qmax"), [(-128, 127), (0, 255), (-32768, 32767)])
@pytest.mark.parametrize("with_mask", [True, False])
def test_the_native_pass_equals_the_torch_passes(
    monkeypatch, shape, ch_axis, qmin, qmax, with_mask
):
    assert native.available()  # CI has a C compiler: the kernel really runs here
    x, scale = _inputs(shape, ch_axis)
    if ch_axis is not None and ch_axis % len(shape) != 0:
        x.view(-1)[: len(SPECIAL)] = torch.randn(len(SPECIAL))  # keep the specials in scale 1
    args = (x, scale, qmin, qmax, Rounding.HALF_UP, ch_axis, False, with_mask)
    expected, expected_mask = _torch_path(monkeypatch, *args)
    got = native.fake_quantize(x, scale, ch_axis, qmin, qmax, with_mask)
    assert got is not None
    out, mask = got
    assert torch.equal(out.isnan(), expected.isnan())
    same = out.view(torch.int32) == expected.view(torch.int32)  # bits, -0.0 included
    assert bool((same | expected.isnan()).all())
    if with_mask:
        assert mask.dtype is torch.bool and torch.equal(mask, expected_mask)
    else:
        assert mask is None


def test_in_place_writes_into_the_input(monkeypatch):
    x, scale = _inputs((3, 4, 50), None)
    expected, _ = _torch_path(
        monkeypatch, x.clone(), scale, -128, 127, Rounding.HALF_UP, None, False, False
    )
    out, _ = qf.fake_quantize(
        x, scale, -128, 127, Rounding.HALF_UP, None, False, False, inplace=True
    )
    assert out.data_ptr() == x.data_ptr()
    assert torch.allclose(out, expected, rtol=0, atol=0, equal_nan=True)


def test_the_largest_float_below_one_half_keeps_training_rounding():
    """``floor(x * r + 0.5)`` with two roundings (no FMA): 0.49999997 + 0.5 rounds to 1 in
    float32, as torch's two ops do; a fused multiply-add would give 0."""
    x = torch.tensor([0.49999997, 0.5, -0.49999997])
    out, _ = native.fake_quantize(x, torch.ones(1), None, -128, 127, False)
    assert out.tolist() == [1.0, 1.0, 0.0]


def test_other_inputs_take_the_torch_path():
    scale = torch.ones(1)
    assert (
        native.fake_quantize(torch.ones(4, dtype=torch.float64), scale, None, -8, 7, True) is None
    )
    assert native.fake_quantize(torch.ones(4, 4).t()[:, :2], scale, None, -8, 7, True) is None
    assert native.fake_quantize(torch.ones(0), scale, None, -8, 7, True) is None


def test_a_qat_step_with_the_kernel_equals_the_torch_step(monkeypatch):
    """A residual CNN's QAT step: outputs and every gradient bit for bit."""

    def step(use_native: bool):
        fxq.set_march("bayes")
        torch.manual_seed(0)
        model = fxq.prepare_qat_fx(ResidualNet(), {"": default_qat_8bit_fake_quant_qconfig}).train()
        fxq.set_fake_quantize(model, fxq.FakeQuantState.QAT)
        x = torch.randn(8, 3, 12, 12, generator=torch.Generator().manual_seed(1))
        with monkeypatch.context() as m:
            if not use_native:
                m.setattr(native, "fake_quantize", lambda *a, **k: None)
            calls = []
            if use_native:
                real = native.fake_quantize
                m.setattr(native, "fake_quantize", lambda *a, **k: calls.append(1) or real(*a, **k))
            y = model(x)
            y.square().sum().backward()
        return y, {n: p.grad for n, p in model.named_parameters()}, len(calls)

    y_native, grads_native, calls = step(True)
    y_torch, grads_torch, _ = step(False)
    assert calls >= 4  # the input's and the activations' fake quants at least
    assert torch.equal(y_native, y_torch)
    for name, grad in grads_torch.items():
        assert torch.equal(grads_native[name], grad), name
