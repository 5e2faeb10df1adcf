"""get_raw_features + profile_featuremap: statistics, clipping, underflow, NaN, files."""

from __future__ import annotations

import torch
from torch import nn

import fxq
from fxq.debug import get_raw_features, profile_featuremap
from tests.debug.models import batches, calibrated, clip_output, float_chain
from tests.debug.test_similarity import parse_html


def test_a_clipped_activation_shows_in_the_statistics(bayes, tmp_path):
    data = batches()
    model = float_chain(data)
    prepared = calibrated(model, data)
    clip_output(prepared, "convs.1", factor=0.25)
    features = get_raw_features(prepared, data[0], float_values=True)
    rows = profile_featuremap(features, out_dir=tmp_path)
    outputs = {r["layer"]: r for r in rows if r["attr"] == "output"}
    assert outputs["convs_1"]["clipped"] > 0.01
    for name in ("convs_0", "convs_2", "convs_3", "fc"):  # calibrated on these very inputs
        assert outputs[name]["clipped"] == 0.0
    # the consumer's input is the clipped tensor, with the producer's scale
    conv2_in = next(r for r in rows if r["layer"] == "convs_2" and r["attr"] == "input0")
    assert conv2_in["scale"] == outputs["convs_1"]["scale"]
    assert conv2_in["clipped"] == outputs["convs_1"]["clipped"]
    # the float values are untouched by the recording: statistics agree with a float run
    x = data[0]
    with torch.no_grad():
        stem = torch.relu(model.bns[0](model.convs[0](x)))
    assert abs(outputs["convs_0"]["max"] - float(stem.max())) < 1e-5
    assert outputs["convs_0"]["scale"] == float(
        prepared.get_submodule("convs.0").activation_post_process.scale
    )
    assert outputs["convs_0"]["dtype"] == "qint8"
    text = (tmp_path / "statistic.txt").read_text()
    assert "sorted by range" in text
    page = parse_html(tmp_path / "statistic.html")
    assert len(page.rows["statistic"]) == len(rows) == len(page.rows["sorted"])
    assert page.svgs == len(outputs)


def test_selection_nan_and_underflow(bayes):
    data = batches()
    model = float_chain(data)
    x = data[0].clone()
    x[0, 0, 0, 0] = float("nan")
    features = get_raw_features(model, x, prefixes="convs_0")
    assert {f["layer"] for f in features} == {"convs_0"}
    rows = profile_featuremap(features)
    assert rows[-1]["nan"] > 0 and rows[-1]["scale"] is None and rows[-1]["clipped"] is None
    prepared = calibrated(model, data)
    only_linear = get_raw_features(prepared, data[0], types=[fxq.qat.Linear])
    assert {f["layer"] for f in only_linear} == {"fc"}
    by_name = get_raw_features(prepared, data[0], types=["Linear"])
    assert [f["attr"] for f in by_name] == [f["attr"] for f in only_linear]
    # a scale far too large for the values: most of them round to zero
    fq = prepared.fc.activation_post_process
    with torch.no_grad():
        fq.scale.mul_(1000)
    rows = profile_featuremap(
        get_raw_features(prepared, data[0], prefixes=["fc"], float_values=True)
    )
    assert rows[-1]["attr"] == "output" and rows[-1]["to_zero"] > 0.9


def test_integer_model_features_carry_their_scales(bayes):
    data = batches()
    prepared = calibrated(float_chain(data), data)
    integer = fxq.convert_fx(prepared)
    rows = profile_featuremap(get_raw_features(integer, data[0]))
    conv = next(r for r in rows if r["layer"] == "convs_1" and r["attr"] == "output")
    assert conv["dtype"] == "qint8"
    assert conv["scale"] == float(prepared.get_submodule("convs.1").activation_post_process.scale)
    assert conv["clipped"] == 0.0 and conv["to_zero"] == 0.0
    assert isinstance(integer, nn.Module)
