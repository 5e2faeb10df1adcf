"""Every debug tool measures a fake-quant model in VALIDATION and never changes it.

``fxq.calibration.calibrate`` and ``ptq`` leave the model in CALIBRATION state (where
it computes in float and its observers record what they see); a QAT model is in QAT
state (its observers move the scales). The tools run such a model in VALIDATION, the
arithmetic the converted model runs, and give each module its state back: the results
equal those of a copy the user put in VALIDATION, and the state dict is unchanged.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import fxq
from fxq.debug import (
    QuantAnalysis,
    compare_qat_quantized,
    featuremap_similarity,
    get_raw_features,
    sensitivity,
)
from fxq.fake_quantize import FakeQuantState
from fxq.qconfig import default_calib_8bit_fake_quant_qconfig
from tests.debug.models import batches, float_chain


def _states(model: torch.nn.Module) -> dict[str, FakeQuantState]:
    return {n: m.state for n, m in model.named_modules() if hasattr(m, "set_fake_quant_state")}


def _same_state_dict(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _same_rows(a: list[dict], b: list[dict]) -> bool:
    """Equal rows (NaN equal to NaN, tensors compared exactly)."""

    def same(x, y):
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and torch.equal(x, y)
        if isinstance(x, float) and math.isnan(x):
            return isinstance(y, float) and math.isnan(y)
        return x == y

    return len(a) == len(b) and all(
        r.keys() == s.keys() and all(same(r[k], s[k]) for k in r) for r, s in zip(a, b)
    )


@pytest.fixture(params=["calibration", "qat"])
def models(bayes, request):
    """(float model, the model in the state under test, a VALIDATION copy, debug input)."""
    data = batches()
    model = float_chain(data)
    prepared = fxq.prepare_qat_fx(model, {"": default_calib_8bit_fake_quant_qconfig})
    fxq.calibration.calibrate(prepared, data)
    assert set(_states(prepared).values()) == {FakeQuantState.CALIBRATION}
    if request.param == "qat":
        fxq.set_fake_quantize(prepared, "qat")
        prepared.train()
    validation = fxq.set_fake_quantize(copy.deepcopy(prepared), "validation")
    # far outside the calibration range: an observer that saw it would widen its scale
    return model, prepared, validation, data[0] * 10


@pytest.fixture
def unchanged(models):
    """Asserts after the test that the model under test kept its numbers, states and mode."""
    _, prepared, _, _ = models
    state_dict = copy.deepcopy(prepared.state_dict())
    states = _states(prepared)
    training = [(m, m.training) for m in prepared.modules()]
    yield
    assert _same_state_dict(prepared.state_dict(), state_dict)
    assert _states(prepared) == states
    assert all(m.training == t for m, t in training)


def test_featuremap_similarity(models, unchanged):
    model, prepared, validation, x = models
    rows = featuremap_similarity(model, prepared, x, similarity_func="sqnr")
    assert _same_rows(rows, featuremap_similarity(model, validation, x, similarity_func="sqnr"))
    assert all(r["sqnr"] < 40 for r in rows)  # the quantized arithmetic, not float vs float
    # as the reference side too
    assert _same_rows(
        featuremap_similarity(prepared, model, x), featuremap_similarity(validation, model, x)
    )


@pytest.mark.parametrize("float_values", [False, True])
def test_get_raw_features(models, unchanged, float_values):
    _, prepared, validation, x = models
    got = get_raw_features(prepared, x, float_values=float_values)
    assert _same_rows(got, get_raw_features(validation, x, float_values=float_values))


@pytest.mark.parametrize("mode", ["quantize_one", "float_one"])
def test_sensitivity(models, unchanged, mode):
    model, prepared, validation, x = models
    rows = sensitivity(model, prepared, x, mode=mode)
    expected = sensitivity(model, validation, x, mode=mode)
    for r in rows + expected:
        r.pop("seconds", None)  # the time a row took (where timed)
    assert _same_rows(rows, expected)


def test_quant_analysis(models, unchanged, tmp_path):
    model, prepared, validation, x = models
    batches_ = [x, x[:2] * 0.5]
    found = QuantAnalysis(model, prepared, tmp_path / "a").auto_find_bad_case(batches_)
    expected = QuantAnalysis(model, validation, tmp_path / "b").auto_find_bad_case(batches_)
    assert _same_rows(found, expected)
    assert all(r["metric"] < 40 for r in found)
    analysis = QuantAnalysis(model, prepared, tmp_path / "c")
    analysis.set_bad_case(x)
    reference = QuantAnalysis(model, validation, tmp_path / "d")
    reference.set_bad_case(x)
    assert _same_rows(analysis.compare_per_layer(), reference.compare_per_layer())


def test_compare_qat_quantized(models, unchanged):
    _, prepared, validation, x = models
    integer = fxq.convert_fx(validation)
    rows = compare_qat_quantized(prepared, integer, x, show=False)
    assert _same_rows(rows, compare_qat_quantized(validation, integer, x, show=False))
    assert rows and all(r["exact"] == 1.0 for r in rows)


def test_a_model_that_never_saw_data_is_refused_and_left_as_it_was(bayes):
    data = batches()
    model = float_chain(data)
    fresh = fxq.prepare_qat_fx(model, {"": default_calib_8bit_fake_quant_qconfig})
    state_dict = copy.deepcopy(fresh.state_dict())
    states = _states(fresh)
    with pytest.raises(RuntimeError, match="has never observed data"):
        featuremap_similarity(model, fresh, data[0])
    assert _same_state_dict(fresh.state_dict(), state_dict)
    assert _states(fresh) == states


def test_compare_qat_quantized_refuses_models_in_the_wrong_roles(bayes):
    data = batches()
    model = float_chain(data)
    prepared = fxq.prepare_qat_fx(model, {"": default_calib_8bit_fake_quant_qconfig})
    fxq.calibration.calibrate(prepared, data)
    integer = fxq.convert_fx(prepared)
    with pytest.raises(TypeError, match="qat_model must be the calibrated or QAT model"):
        compare_qat_quantized(model, integer, data[0], show=False)
    with pytest.raises(TypeError, match="qat_model is a converted"):
        compare_qat_quantized(integer, integer, data[0], show=False)
    with pytest.raises(TypeError, match="quantized_model must be the model fxq.convert_fx made"):
        compare_qat_quantized(prepared, prepared, data[0], show=False)
