"""QuantAnalysis: the bad sample found, the bad layer ranked first by every tool, one report."""

from __future__ import annotations

import pytest
import torch

from fxq.debug import QuantAnalysis
from tests.debug.models import batches, calibrated, clip_output, float_chain
from tests.debug.test_similarity import parse_html


def test_quant_analysis_finds_the_bad_sample_and_the_bad_layer(bayes, tmp_path):
    data = batches()
    model = float_chain(data)
    prepared = calibrated(model, data)
    clip_output(prepared, "convs.1", factor=0.2)
    val = batches(count=2, seed=1)
    val[1][2] *= 2.0  # beyond the calibrated ranges: clips more than any other sample
    qa = QuantAnalysis(model, prepared, tmp_path)
    cases = qa.auto_find_bad_case(val)
    assert (cases[0]["batch"], cases[0]["sample"]) == (1, 2)
    assert len(cases) == 8 and cases[0]["metric"] < cases[-1]["metric"]
    assert torch.equal(qa.bad_case[0], val[1][2:3])
    results = qa.run()
    worst_layer = min(
        (r for r in results["compare_per_layer"] if r["op_sqnr"] is not None),
        key=lambda r: r["op_sqnr"],
    )
    assert worst_layer["layer"] == "convs_1"
    assert (results["sensitivity"][0]["name"], results["sensitivity"][0]["kind"]) == (
        "convs.1",
        "activation",
    )
    report = parse_html(tmp_path / "report.html")
    for link in report.links:
        assert (tmp_path / link).is_file(), link
    assert set(report.links) == {
        "compare_per_layer/similarity.html",
        "statistic/statistic.html",
        "weights/weight_comparison.html",
        "sensitivity/sensitivity.html",
    }
    assert report.rows["bad-cases"][0][1:3] == ["1", "2"]
    assert report.rows["worst-layers"][0][0] == "convs_1"
    assert report.rows["sensitivity"][0][1] == "convs.1"
    assert (tmp_path / "bad_case.txt").read_text().splitlines()[3].split()[1:3] == ["1", "2"]


def test_quant_analysis_needs_a_bad_case_and_a_quantized_model(bayes, tmp_path):
    data = batches()
    model = float_chain(data)
    with pytest.raises(TypeError, match="prepare_qat_fx"):
        QuantAnalysis(model, model, tmp_path)
    qa = QuantAnalysis(model, calibrated(model, data), tmp_path, input_fn=lambda b: (b[0],))
    with pytest.raises(RuntimeError, match="auto_find_bad_case"):
        qa.compare_per_layer()
    rows = qa.auto_find_bad_case([(x, None) for x in data], num_steps=1, metric="l1")
    assert len(rows) == 4 and rows[0]["metric"] >= rows[-1]["metric"]
