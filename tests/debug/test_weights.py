"""compare_weights: per-channel weight error, the worst layer and channel named."""

from __future__ import annotations

import pytest
import torch

import fxq
from fxq.debug import compare_weights
from tests.debug.models import SharedConvNet, batches, calibrated, float_chain
from tests.debug.test_similarity import parse_html


def test_an_outlier_weight_names_its_layer_and_channel(bayes, tmp_path):
    data = batches()
    model = float_chain(data)
    with torch.no_grad():
        model.convs[2].weight[5, 0, 1, 1] = 40.0  # channel 5's other weights round to zero
    prepared = calibrated(model, data)
    rows = compare_weights(model, prepared, out_dir=tmp_path)
    assert [r["layer"] for r in rows][0] == "convs.2"
    assert rows[0]["worst_channels"].startswith("5:")
    # measured: 36.6 dB for channel 5, every other channel of every layer above 45 dB
    assert rows[0]["min_channel_sqnr"] < min(r["min_channel_sqnr"] for r in rows[1:]) - 6
    # calibrated weights are the float weights rounded: at most half a step off
    assert all(r["max_lsb"] <= 0.5 + 1e-4 for r in rows)
    assert {r["layer"] for r in rows} == {"convs.0", "convs.1", "convs.2", "convs.3", "fc"}
    # the integer model holds the same integers
    integer = fxq.convert_fx(prepared)
    same = {r["layer"]: r["sqnr"] for r in compare_weights(model, integer)}
    for r in rows:
        assert same[r["layer"]] == pytest.approx(r["sqnr"], abs=1e-3)
    page = parse_html(tmp_path / "weight_comparison.html")
    assert page.svgs == 1 and len(page.rows["weights"]) == 5
    assert "convs.2" in (tmp_path / "weight_comparison.txt").read_text().splitlines()[2]


def test_trained_weights_are_compared_with_where_they_started(bayes):
    data = batches()
    model = float_chain(data)
    prepared = calibrated(model, data)
    with torch.no_grad():
        prepared.get_submodule("convs.1").weight.mul_(1.1)
    rows = {r["layer"]: r for r in compare_weights(model, prepared)}
    assert rows["convs.1"]["sqnr"] < 25 < rows["convs.0"]["sqnr"]


def test_a_shared_conv_has_one_row(bayes):
    data = batches()
    model = SharedConvNet().eval()
    rows = compare_weights(model, calibrated(model, data))
    assert sorted(r["layer"] for r in rows) == ["conv", "stem"]


def test_a_float_second_model_is_refused(bayes):
    model = SharedConvNet()
    with pytest.raises(TypeError, match="prepare_qat_fx"):
        compare_weights(model, model)


@pytest.fixture
def pair(bayes):
    data = batches()
    model = SharedConvNet().eval()
    return model, calibrated(model, data)


def _files(directory):
    return sorted(p.name for p in directory.iterdir())


def test_every_documented_argument_form_gives_the_same_rows(pair, tmp_path):
    model, prepared = pair
    expected = compare_weights(model, prepared, similarity_func="cosine")
    assert [r["similarity"] for r in expected] == [r["cosine"] for r in expected]
    forms = {
        "fxq keywords": ((), {"out_dir": tmp_path / "a", "similarity_func": "cosine"}),
        "fxq positional": ((tmp_path / "b", False, 3), {"similarity_func": "Cosine"}),
        "vendor keywords": (
            (),
            {
                "similarity_func": "Cosine",
                "with_tensorboard": False,
                "tensorboard_dir": None,
                "out_dir": tmp_path / "c",
            },
        ),
        "vendor, out_dir by keyword": (("Cosine",), {"out_dir": tmp_path / "d"}),
        "vendor positional": (("Cosine", False, None, str(tmp_path / "e")), {}),
        "vendor, fxq keywords": (("COSINE",), {"out_dir": tmp_path / "f", "worst_channels": 3}),
    }
    for name, (args, kwargs) in forms.items():
        assert compare_weights(model, prepared, *args, **kwargs) == expected, name
    for d in "abcdef":
        assert _files(tmp_path / d) == ["weight_comparison.html", "weight_comparison.txt"]
    assert compare_weights(model, prepared, "Cosine") == expected  # nothing written
    custom = compare_weights(model, prepared, lambda ref, test: 7.0)
    assert [r["similarity"] for r in custom] == [7.0, 7.0]


def test_arguments_that_fit_neither_order_are_refused(pair, tmp_path):
    model, prepared = pair
    refused = [
        (("Cosine", False, None, tmp_path, 1), {}, TypeError, "too many positional"),
        ((tmp_path, False, 3, 4), {}, TypeError, "too many positional"),
        (("Cosine",), {"similarity_func": "mse"}, TypeError, "multiple values for argument"),
        ((tmp_path,), {"out_dir": tmp_path}, TypeError, "multiple values for argument 'out_dir'"),
        ((), {"tensorboard": True}, TypeError, "unexpected keyword argument 'tensorboard'"),
        ((5,), {}, TypeError, "out_dir must be a path"),
        ((tmp_path, "yes"), {}, TypeError, "show must be True or False"),
        ((tmp_path, False, 2.5), {}, TypeError, "worst_channels must be an int"),
        ((), {"worst_channels": 0}, ValueError, "worst_channels must be at least 1"),
        ((), {"similarity_func": 3}, TypeError, "similarity_func must be a name"),
        (("KL",), {}, ValueError, "unknown similarity 'KL'"),  # the vendor's, not fxq's
    ]
    for args, kwargs, error, message in refused:
        with pytest.raises(error, match=message):
            compare_weights(model, prepared, *args, **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_weights_whose_scale_is_not_set_yet_are_refused(bayes):
    model = SharedConvNet().eval()
    fresh = fxq.prepare_qat_fx(model, {"": fxq.qconfig.default_calib_8bit_fake_quant_qconfig})
    with pytest.raises(
        ValueError, match=r"3 layer\(s\) \('stem', 'conv', 'conv_call1'\) has no scale"
    ):
        compare_weights(model, fresh)
