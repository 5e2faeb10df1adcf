"""Cross-layer equalization of depthwise inputs (``fxq.calibration.equalization``)."""

import copy

import pytest
import torch
from torch import nn

import fxq
from fxq.calibration import bias_correction, calibrate, ptq
from fxq.calibration.equalization import depthwise_pairs, equalize_depthwise
from fxq.fake_quantize import bypass
from fxq.qconfig import default_calib_8bit_fake_quant_qconfig as calib_q8
from tests.helpers import sqnr


class Block(nn.Module):
    """conv-bn-relu6 -> depthwise conv-bn-relu6 -> conv: an inverted residual without the add,
    whose expansion channels have ranges three decades apart."""

    def __init__(self, activation: type[nn.Module] = nn.ReLU6) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.expand = nn.Conv2d(3, 16, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.act1 = activation()
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.act2 = nn.ReLU6()
        self.project = nn.Conv2d(16, 8, 1)
        with torch.no_grad():
            for m in (self.expand, self.dw, self.project):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.5)
            self.bn1.weight.copy_(torch.logspace(-3, 0, 16))  # channel ranges 1e-3 .. 1
            self.bn1.bias.copy_(torch.logspace(-3, 0, 16) * 0.5)
            # the depthwise conv undoes the spread, so every channel matters downstream
            self.dw.weight.div_(torch.logspace(-3, 0, 16).reshape(16, 1, 1, 1))
            self.bn2.running_var.fill_(1e4)

    def forward(self, x):
        x = self.act1(self.bn1(self.expand(x)))
        x = self.act2(self.bn2(self.dw(x)))
        return self.project(x)


def _data(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(4, 3, 12, 12, generator=g) for _ in range(n)]


def _integer_sqnr(prepared, x, ref) -> float:
    fxq.set_fake_quantize(prepared, "validation")
    with torch.no_grad():
        out = fxq.convert_fx(prepared)(x)
        assert torch.equal(out, prepared(x))
    return sqnr(ref, out)


def test_equalization_keeps_the_float_function_and_levels_the_channels(bayes):
    model = Block().eval()
    data = _data(3, 0)
    prepared = fxq.prepare_qat_fx(model, {"": calib_q8})
    assert depthwise_pairs(prepared) == [("expand", "dw")]
    report = equalize_depthwise(prepared, data)
    assert [(r.producer, r.consumer) for r in report] == [("expand", "dw")]
    # gains: the largest channel keeps 1, the smallest (1000x smaller) is capped at 32
    assert report[0].min_gain == 1.0 and report[0].max_gain == 32.0 and report[0].capped > 0
    x = torch.cat(data)
    with torch.no_grad():
        before = model.act1(model.bn1(model.expand(x))).abs().amax(dim=(0, 2, 3))
    with torch.no_grad(), bypass(prepared):
        assert torch.allclose(prepared(x), model(x), rtol=1e-4, atol=1e-5)
        peaks = []
        handle = prepared.get_submodule("expand").register_forward_hook(
            lambda m, i, out: peaks.append(out.abs().amax(dim=(0, 2, 3)))
        )
        prepared(x)
        handle.remove()
    # each channel reaches the common range, or is 32x larger where that is not enough
    expected = torch.minimum(before * 32, before.max().expand(16))
    assert torch.allclose(peaks[0], expected, rtol=1e-4)


def test_equalization_gains_accuracy_on_the_integer_model(bayes):
    model = Block().eval()
    x = torch.cat(_data(2, 1))
    with torch.no_grad():
        ref = model(x)
    results = {}
    for eq in (False, True):
        prepared = fxq.prepare_qat_fx(model, {"": calib_q8})
        ptq(prepared, _data(3, 0), equalize=eq, bias_correction=False, show_progress=False)
        results[eq] = _integer_sqnr(prepared, x, ref)
    assert results[True] > results[False] + 6.0, results  # measured: 21.3 -> 43.5 dB


class TwoUsers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.expand = nn.Conv2d(3, 8, 1)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.other = nn.Conv2d(8, 8, 1)
        self.hsw = nn.Conv2d(3, 8, 1)
        self.act = nn.Hardswish()
        self.dw2 = nn.Conv2d(8, 8, 3, padding=1, groups=8)

    def forward(self, x):
        y = self.expand(x)
        z = self.act(self.hsw(x))  # not positively homogeneous: cannot be scaled
        return self.dw(y) + self.other(y) + self.dw2(z)


def test_only_safe_pairs_are_scaled(bayes):
    prepared = fxq.prepare_qat_fx(TwoUsers().eval(), {"": calib_q8})
    assert depthwise_pairs(prepared) == []
    assert equalize_depthwise(prepared, _data(1, 0)) == []
    with pytest.raises(ValueError, match="max_gain must be >= 1"):
        equalize_depthwise(prepared, _data(1, 0), max_gain=0.5)


def test_bias_correction_can_leave_depthwise_layers_alone(bayes):
    model = Block().eval()
    prepared = calibrate(fxq.prepare_qat_fx(model, {"": calib_q8}), _data(2, 0))
    rows = bias_correction(prepared, _data(2, 0), mode="fast", skip_depthwise=True)
    assert [r["layer"] for r in rows] == ["expand", "project"]
    rows = bias_correction(prepared, _data(2, 0), mode="fast")
    assert [r["layer"] for r in rows] == ["expand", "dw", "project"]


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_fast_bias_correction_on_sequences_of_different_lengths(bayes):
    """Padded text batches differ in length: the mean input is then taken per feature (the
    last axis of a linear layer's input), over samples and positions."""
    g = torch.Generator().manual_seed(0)
    batches = [torch.rand(3, n, 8, generator=g) for n in (5, 7)]
    prepared = calibrate(fxq.prepare_qat_fx(Tokens().eval(), {"": calib_q8}), batches)
    same = copy.deepcopy(prepared)
    rows = bias_correction(prepared, batches, mode="fast")
    # the same per-sample position means, as batches of one position
    bias_correction(same, [b.mean(1, keepdim=True) for b in batches], mode="fast")
    assert [r["layer"] for r in rows] == ["fc1", "fc2"] and rows[0]["shift"] > 0
    assert torch.allclose(prepared.fc1.bias, same.fc1.bias, atol=1e-6)


class _CalledTwice(nn.Module):
    """A conv-bn-relu6 called at two places, each output feeding its own depthwise conv: the
    call-site copies share one weight and BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        block = Block()
        self.p = nn.Sequential(block.expand, block.bn1, nn.ReLU6())
        self.d1 = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.d2 = nn.Conv2d(16, 16, 3, padding=1, groups=16)

    def forward(self, x):
        return self.d1(self.p(x)) + self.d2(self.p(x * 0.5))


def test_a_producer_called_twice_is_not_equalized(bayes):
    """Scaling one call site's shared BatchNorm would scale the other's output too: such
    pairs are left alone, and the float function stays the same."""
    model = _CalledTwice().eval()
    prepared = fxq.prepare_qat_fx(model, {"": calib_q8})
    x = torch.cat(_data(2, 1))
    assert depthwise_pairs(prepared) == []
    ptq(prepared, _data(2, 0), iters=0, bias_correction=False, show_progress=False)
    with torch.no_grad(), bypass(prepared):
        assert torch.allclose(prepared(x), model(x), atol=1e-5)


def test_channel_ranges_are_the_same_in_either_layout():
    """The per-sample, per-channel ranges recorded for the equalization read a channels_last
    output (``ptq``'s layout on CPU) in place and equal the default layout's."""
    from fxq.calibration.equalization import _ChannelRanges

    out = torch.randn(4, 6, 5, 3, generator=torch.Generator().manual_seed(1))
    plain, fast = _ChannelRanges(), _ChannelRanges()
    plain.add(out)
    fast.add(out.contiguous(memory_format=torch.channels_last))
    assert torch.equal(torch.cat(plain.mins), torch.cat(fast.mins))
    assert torch.equal(torch.cat(plain.maxs), torch.cat(fast.maxs))
    assert torch.cat(fast.maxs).shape == (4, 6)
    assert torch.equal(fast.peak(), out.abs().amax((0, 2, 3)))
    sliced = out.contiguous(memory_format=torch.channels_last)[:, :, ::2]  # not dense
    odd, expected = _ChannelRanges(), _ChannelRanges()
    odd.add(sliced)
    expected.add(sliced.contiguous())
    assert torch.equal(torch.cat(odd.maxs), torch.cat(expected.maxs))
