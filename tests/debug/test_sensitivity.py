"""sensitivity: the bad value ranked first, cached prefixes equal to full runs."""

from __future__ import annotations

import pytest
import torch

import fxq
from fxq.debug import sensitivity
from fxq.fake_quantize import bypass
from tests.debug.models import SharedConvNet, batches, calibrated, clip_output, float_chain
from tests.debug.test_similarity import parse_html
from tests.helpers import sqnr


@pytest.fixture
def clipped(bayes):
    data = batches()
    model = float_chain(data)
    prepared = calibrated(model, data)
    clip_output(prepared, "convs.1")
    return model, prepared, data


def test_the_clipped_activation_is_ranked_first(clipped, tmp_path):
    model, prepared, data = clipped
    state = prepared.get_submodule("convs.1").activation_post_process.state
    rows = sensitivity(model, prepared, data[:2], out_dir=tmp_path)
    assert (rows[0]["name"], rows[0]["kind"]) == ("convs.1", "activation")
    assert rows[0]["sqnr"] < 10 < rows[1]["sqnr"]
    assert rows[0]["baseline"] > 100  # nothing quantized: the float model (BN folded) itself
    # 5 activations + 4 conv weights + the linear's weight + the input quant + pooling
    names = {(r["name"], r["kind"]) for r in rows}
    assert ("x_quant", "activation") in names and ("fc", "weight") in names
    assert len(rows) == len(names)
    # the model is left as it was
    assert prepared.get_submodule("convs.1").activation_post_process.state is state
    page = parse_html(tmp_path / "sensitivity.html")
    assert page.svgs == 1 and len(page.rows["sensitivity"]) == len(rows)
    assert "convs.1" in (tmp_path / "sensitivity.txt").read_text().splitlines()[3]


def test_cached_prefixes_give_what_a_full_run_gives(clipped):
    model, prepared, data = clipped
    rows = {(r["name"], r["kind"]): r for r in sensitivity(model, prepared, data[0])}
    for path, kind in (("convs.2", "activation"), ("convs.3", "weight")):
        module = prepared.get_submodule(path)
        fq = module.activation_post_process if kind == "activation" else module.weight_fake_quant
        with torch.no_grad(), bypass(prepared):
            fq.bypassed = False
            out = prepared(data[0])
            del fq.bypassed
            expected = sqnr(model(data[0]), out)
        assert rows[(path, kind)]["sqnr"] == pytest.approx(expected, abs=1e-6)


def test_float_one_and_int16_find_the_same_culprit(clipped):
    model, prepared, data = clipped
    left_float = sensitivity(model, prepared, data[0], mode="float_one")
    assert (left_float[0]["name"], left_float[0]["kind"]) == ("convs.1", "activation")
    assert left_float[0]["sqnr"] > left_float[0]["baseline"] + 10
    # int16 keeps the range, so it cannot undo a clip; it helps where the step is too coarse
    coarse = calibrated(model, data)
    clip_output(coarse, "convs.2", factor=30.0)  # a range 30 times too wide
    wider = sensitivity(model, coarse, data[0], dtype=fxq.qint16, metric="cosine")
    assert (wider[0]["name"], wider[0]["kind"]) == ("convs.2", "activation")
    assert wider[0]["cosine"] > wider[0]["baseline"]
    fq = coarse.get_submodule("convs.2").activation_post_process
    assert fq.dtype is fxq.qint8 and fq.bypassed is False


def test_a_user_metric_and_a_shared_conv(bayes):
    data = batches()
    model = SharedConvNet().eval()
    prepared = calibrated(model, data)
    rows = sensitivity(
        model, prepared, data[0], metric=lambda ref, out: -float((ref - out).abs().max())
    )
    names = {(r["name"], r["kind"]) for r in rows}
    assert {("conv", "activation"), ("conv_call1", "activation"), ("conv", "weight")} <= names
    assert ("conv_call1", "weight") not in names  # one weight, shared by both calls
    assert "<lambda>" in rows[0]


def test_kinds_select_the_values(clipped):
    model, prepared, data = clipped
    everything = {(r["name"], r["kind"]): r["sqnr"] for r in sensitivity(model, prepared, data[0])}
    weights = sensitivity(model, prepared, data[0], kinds=["weight"])
    assert {r["kind"] for r in weights} == {"weight"}
    assert len(weights) == sum(k == "weight" for _, k in everything)
    for r in weights:
        assert r["sqnr"] == pytest.approx(everything[(r["name"], "weight")], abs=1e-9)


def test_bad_arguments(clipped):
    model, prepared, data = clipped
    with pytest.raises(ValueError, match="kinds"):
        sensitivity(model, prepared, data[0], kinds=["weights"])
    with pytest.raises(ValueError, match="mode"):
        sensitivity(model, prepared, data[0], mode="one")
    with pytest.raises(TypeError, match="prepare_qat_fx"):
        sensitivity(model, model, data[0])
