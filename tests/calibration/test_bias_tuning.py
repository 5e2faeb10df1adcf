"""Bias tuning (``tune_biases``, ``ptq(tune_biases=True)``) and learned rounding with float
activations (``weight_reconstruction(float_activations=True)``), on the first blocks of the
pretrained MobileNetV2."""

import copy

import pytest
import torch

import fxq
from fxq.calibration import ptq, tune_biases, weight_reconstruction
from fxq.calibration.bias_tuning import tuned_biases
from fxq.calibration.ptq import activation_quants
from fxq.fake_quantize import FakeQuantize
from fxq.qconfig import default_calib_8bit_fake_quant_qconfig as calib_q8
from tests.calibration.test_ptq import _integer_sqnr


def _learned(model, calib, **options):
    return ptq(
        fxq.prepare_qat_fx(model, {"": calib_q8}),
        calib,
        "best",
        float_activations=True,
        show_progress=False,
        **options,
    )


def test_tuning_moves_only_the_biases_and_raises_held_out_sqnr(bayes, pretrained):
    model, calib, held, ref = pretrained
    prepared = _learned(model, calib)
    before_state = copy.deepcopy(prepared.state_dict())
    start = _integer_sqnr(prepared, held, ref)
    first = tuned_biases(prepared)[0]
    own = torch.ones_like(first)
    first.grad = own  # a gradient of the caller's own survives the tuning
    result = tune_biases(prepared, calib, model, show_progress=False)
    assert first.grad is own
    first.grad = None
    assert result["after"] < result["before"]
    biases = {id(p) for p in tuned_biases(prepared)}
    names = {n for n, p in prepared.named_parameters() if id(p) in biases}
    assert names and all(n.endswith(("bn.bias", ".bias")) for n in names)
    after_state = prepared.state_dict()
    changed = {k for k, v in after_state.items() if not torch.equal(v, before_state[k])}
    assert changed and changed <= names  # weights, scales and observers untouched
    assert all(p.grad is None for p in prepared.parameters())
    # measured: 26.31 -> 27.79 dB on the held-out crops
    assert _integer_sqnr(prepared, held, ref) > start + 0.5


def test_ptq_tunes_from_the_outputs_recorded_while_calibrating(bayes, pretrained):
    model, calib, held, ref = pretrained
    plain = _integer_sqnr(_learned(model, calib), held, ref)
    tuned = _integer_sqnr(_learned(model, calib, tune_biases=True), held, ref)
    assert tuned > plain + 0.5  # measured: 26.31 -> 27.79 dB
    # without learned rounding too: the default's ranges and fast bias correction, and the
    # observers alone
    for method, options in (("default", {"iters": 0}), ("calibrate", {})):

        def score(method=method, **extra):
            prepared = fxq.prepare_qat_fx(model, {"": calib_q8})
            ptq(prepared, calib, method, show_progress=False, **extra)
            return _integer_sqnr(prepared, held, ref)

        assert score(tune_biases=True, **options) > score(**options), method


def test_a_tuning_that_does_not_help_is_undone(bayes, pretrained):
    model, calib, _, _ = pretrained
    prepared = _learned(model, calib)
    state = copy.deepcopy(prepared.state_dict())
    result = tune_biases(prepared, calib, model, lr=1.0, show_progress=False)  # far too large
    assert result["after"] == result["before"]
    assert all(torch.equal(v, state[k]) for k, v in prepared.state_dict().items())


def test_tuning_failing_part_way_leaves_the_model_as_it_was(bayes, pretrained):
    model, calib, _, _ = pretrained
    prepared = _learned(model, calib)
    state = copy.deepcopy(prepared.state_dict())
    flags = {n: p.requires_grad for n, p in prepared.named_parameters()}
    calls = []

    def failing(batch):
        calls.append(1)
        if len(calls) == 6:  # after some steps
            raise KeyboardInterrupt
        return (batch,)

    with pytest.raises(KeyboardInterrupt):
        tune_biases(prepared, calib, model, input_fn=failing, show_progress=False)
    assert all(torch.equal(v, state[k]) for k, v in prepared.state_dict().items())
    assert {n: p.requires_grad for n, p in prepared.named_parameters()} == flags


def test_tuning_refuses_bad_arguments(bayes, pretrained):
    model, calib, _, _ = pretrained
    prepared = fxq.prepare_qat_fx(model, {"": calib_q8})
    with pytest.raises(RuntimeError, match="never observed|not calibrated|calibrat"):
        tune_biases(prepared, calib, model)
    ptq(prepared, calib, iters=0, show_progress=False)
    with pytest.raises(ValueError, match="pass the float model"):
        tune_biases(prepared, calib)
    with pytest.raises(ValueError, match="epochs must be >= 1 and lr > 0"):
        tune_biases(prepared, calib, model, epochs=0)
    with pytest.raises(ValueError, match="no batch"):
        tune_biases(prepared, [], model)
    other = copy.deepcopy(model)
    other[3] = torch.nn.Linear(32, 10)
    with pytest.raises(
        ValueError, match="gives 80 output values on a batch where the model gives 128"
    ):
        tune_biases(prepared, calib, other)


def test_ptq_tune_biases_takes_a_number_of_epochs(bayes, pretrained, monkeypatch):
    """``tune_biases=True``: the default epochs; an int: that many (0: none); else an error
    before anything runs."""
    import fxq.calibration.bias_tuning as bias_tuning

    model, calib, _, _ = pretrained
    asked = []
    monkeypatch.setattr(bias_tuning, "tune_biases", lambda *a, epochs, **k: asked.append(epochs))
    for value in (True, 8, 1, 0, False):
        ptq(fxq.prepare_qat_fx(model, {"": calib_q8}), calib, "calibrate", tune_biases=value)
    assert asked == [bias_tuning.DEFAULT_EPOCHS, 8, 1]
    prepared = fxq.prepare_qat_fx(model, {"": calib_q8})
    before = copy.deepcopy(prepared.state_dict())
    for bad in (-1, 2.5, "yes"):
        with pytest.raises(ValueError, match="tune_biases must be True, False or a number"):
            ptq(prepared, calib, "calibrate", tune_biases=bad)
    after = prepared.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_float_activations_learn_the_same_rounding_whatever_the_activation_scales(
    bayes, pretrained
):
    """With the activations float while learning, the learned rounding depends on the weights
    and the float model, not on the activations' grids: two models whose activation scales
    differ learn almost the same weights (the biases are still rounded on the input scale),
    ten times closer than when they learn with their activations quantized."""
    model, calib, _, _ = pretrained
    a = ptq(fxq.prepare_qat_fx(model, {"": calib_q8}), calib, iters=0, show_progress=False)
    b = copy.deepcopy(a)
    with torch.no_grad():
        for fq in activation_quants(b):
            fq.scale.mul_(1.5)
    opts = {"iters": 20, "block_depth": "auto", "show": False, "show_progress": False}

    def weights(m):
        return [p.detach().clone() for n, p in m.named_parameters() if n.endswith("weight")]

    fa, fb = copy.deepcopy(a), copy.deepcopy(b)
    weight_reconstruction(fa, calib, float_activations=True, **opts)
    weight_reconstruction(fb, calib, float_activations=True, **opts)
    floats = _differing(weights(fa), weights(fb))
    assert _differing(weights(fa), weights(a)) > 0.5  # it learned (measured: 94 % moved)
    weight_reconstruction(a, calib, **opts)
    weight_reconstruction(b, calib, **opts)
    quantized = _differing(weights(a), weights(b))
    assert floats < 0.01 and quantized > 4 * floats  # measured: 0.57 % and 5.7 %
    # the fake quants are back in service afterwards, and the learning leaves no gradient
    assert all(p.grad is None for p in fa.parameters())
    assert not any(
        fq.__dict__.get("bypassed") for fq in fa.modules() if isinstance(fq, FakeQuantize)
    )


def _differing(xs, ys) -> float:
    """The share of the weights' elements that differ between two lists of tensors."""
    return sum(int((x != y).sum()) for x, y in zip(xs, ys)) / sum(x.numel() for x in xs)
