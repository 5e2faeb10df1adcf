"""Empirical bias correction: a known mean shift is removed, and failures leave the model."""

import copy

import pytest
import torch
from torch import nn

import fxq
from fxq.calibration import bias_correction, calibrate
from fxq.qconfig import default_calib_8bit_fake_quant_qconfig as calib_q8
from tests.helpers import sqnr


class Shifted(nn.Module):
    """Positive inputs into a linear layer whose weights all round down by 0.45 LSB."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 16)
        self.head = nn.Linear(16, 4)
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            steps = torch.randint(0, 100, (16, 64), generator=g).float() + 0.45
            steps[:, 0] = 127  # each row's max: the weight scale is exactly 1/127
            self.fc.weight.copy_(steps / 127)  # every other weight rounds down by 0.45 LSB

    def forward(self, x):
        return self.head(torch.relu(self.fc(x)))


def _data(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(32, 64, generator=g) for _ in range(n)]


def test_bias_correction_removes_a_known_mean_shift(bayes):
    model = Shifted().eval()
    x = torch.cat(_data(2, 1))
    with torch.no_grad():
        ref = model(x)
        ref_fc = model.fc(x)

    def quantized(correct: bool):
        prepared = calibrate(fxq.prepare_qat_fx(model, {"": calib_q8}), _data(4, 0))
        rows = bias_correction(prepared, _data(4, 0)) if correct else []
        fxq.set_fake_quantize(prepared, fxq.FakeQuantState.VALIDATION)
        with torch.no_grad():
            out = fxq.convert_fx(prepared)(x)
            fc = prepared.fc
            w = fc.weight_fake_quant(fc.folded_weight())
            fc_mean = fc.float_op_forward(x, w, fc.folded_bias()).mean(0)
        return out, rows, (fc_mean - ref_fc.mean(0)).abs().max()

    before, _, gap_before = quantized(False)
    after, rows, gap_after = quantized(True)
    assert [r["layer"] for r in rows] == ["fc", "head"]
    assert rows[0]["shift"] > 0.05  # the rounding made a shift of about 0.45 * 64 * 0.5 / 127
    assert gap_after < gap_before / 5  # the fc's mean output now matches the float layer's
    assert sqnr(ref, after) > sqnr(ref, before) + 1.0


def test_bias_correction_needs_data_and_a_calibrated_model(bayes):
    prepared = fxq.prepare_qat_fx(Shifted(), {"": calib_q8})
    with pytest.raises(ValueError, match="yielded no batch"):
        bias_correction(prepared, [])
    with pytest.raises(RuntimeError, match="needs a calibrated model"):
        bias_correction(prepared, _data(1, 0))


def test_a_failure_part_way_restores_the_model(bayes):
    prepared = calibrate(fxq.prepare_qat_fx(Shifted(), {"": calib_q8}), _data(2, 0))
    before = {k: v.clone() for k, v in prepared.state_dict().items()}
    calls, corrected = [], []

    def fail_on_fc(module, inputs):
        calls.append(1)
        # call 1 finds the layer order, 2-3 run the float copy's fc (it has the hook too)
        # on the way to head, 4 the model's fc, after fc was corrected
        if len(calls) > 3:
            corrected.append(not torch.equal(module.bias, before["fc.bias"]))
            raise KeyboardInterrupt

    prepared.fc.register_forward_pre_hook(fail_on_fc)
    with pytest.raises(KeyboardInterrupt):
        bias_correction(prepared, _data(2, 0))
    assert corrected == [True]  # the failure came part-way
    after = prepared.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert prepared.fc.state is fxq.FakeQuantState.CALIBRATION


class _ConvChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.b1 = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.c3 = nn.Conv2d(8, 8, 1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = torch.relu(self.b1(self.c1(x)))
        x = torch.relu(self.c2(x)) + x
        return self.fc(self.c3(x).mean((2, 3)))


def test_sequential_mode_runs_the_model_once_and_equals_the_layer_by_layer_runs(bayes, request):
    """On a GraphModule the sequential correction reads every layer's inputs from one run of
    the model and one of its float copy (not a partial run per layer: MobileNetV2 206 s ->
    9 s), with the same corrections as re-running up to each layer."""
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 3, 10, 10, generator=g) for _ in range(3)]
    streamed = calibrate(fxq.prepare_qat_fx(_ConvChain().eval(), {"": calib_q8}), batches)
    hooked = copy.deepcopy(streamed)
    calls = []
    streamed.c1.register_forward_hook(lambda *a: calls.append(1))
    rows = bias_correction(streamed, batches, mode="sequential")
    # one call per batch from each stream (the float reference is a copy of the model, hook
    # included); the layer order is the graph's (no run)
    assert len(calls) == 2 * len(batches)
    request.getfixturevalue("layer_by_layer")
    calls.clear()
    hooked.c1.register_forward_hook(lambda *a: calls.append(1))
    rows_hooked = bias_correction(hooked, batches, mode="sequential")
    # both models re-run up to each layer and stop before it: c1 runs for c2, c3 and fc
    assert len(calls) == 2 * 3 * len(batches)
    assert [r["layer"] for r in rows] == ["c1", "c2", "c3", "fc"]
    assert [r["layer"] for r in rows_hooked] == [r["layer"] for r in rows]
    assert all(r["shift"] > 0 for r in rows)
    after, expected = streamed.state_dict(), hooked.state_dict()
    assert after.keys() == expected.keys()
    assert all(torch.equal(after[k], expected[k]) for k in expected)
