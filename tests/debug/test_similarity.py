"""featuremap_similarity: layers matched by name, each layer's own error, files."""

from __future__ import annotations

import copy
import html.parser
import math

import pytest
import torch

import fxq
from fxq.debug import featuremap_similarity
from fxq.debug.compare import float_fake_quant
from tests.debug.models import SharedConvNet, batches, calibrated, clip_output, float_chain
from tests.helpers import sqnr


class _Html(html.parser.HTMLParser):
    """Counts rows per table and inline SVGs; records links, scripts and external sources."""

    def __init__(self) -> None:
        super().__init__()
        self.table: str | None = None
        self.rows: dict[str, list[list[str]]] = {}
        self.row: list[str] | None = None
        self.cell: list[str] | None = None
        self.svgs = 0
        self.scripts = 0
        self.links: list[str] = []
        self.external: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self.table = a.get("id", "")
            self.rows[self.table] = []
        elif tag == "tr" and self.table is not None:
            self.row = []
        elif tag == "td" and self.row is not None:
            self.cell = []
        elif tag == "svg":
            self.svgs += 1
        elif tag == "script":
            self.scripts += 1
        elif tag == "a":
            self.links.append(a.get("href", ""))
        for key in ("src", "href"):
            if str(a.get(key, "")).startswith(("http:", "https:", "//")):
                self.external.append(a[key])

    def handle_endtag(self, tag):
        if tag == "table":
            self.table = None
        elif tag == "tr" and self.row is not None:
            if self.row:
                self.rows[self.table].append(self.row)
            self.row = None
        elif tag == "td" and self.cell is not None:
            self.row.append("".join(self.cell).strip())
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell.append(data)


def parse_html(path) -> _Html:
    parser = _Html()
    parser.feed(path.read_text(encoding="utf-8"))
    assert parser.scripts == 0 and not parser.external, "the page must be self-contained"
    return parser


@pytest.fixture
def chain(bayes):
    data = batches()
    model = float_chain(data)
    return model, calibrated(model, data), data


def test_float_vs_calibrated_rows_match_the_models(chain):
    model, prepared, data = chain
    rows = featuremap_similarity(model, prepared, data[0])
    layers = [r["layer"] for r in rows]
    assert layers[:5] == ["x_quant", "convs_0", "convs_1", "convs_2", "convs_3"]
    assert "fc" in layers
    last = rows[layers.index("fc")]
    with torch.no_grad():
        expected = sqnr(model.eval()(data[0]), prepared(data[0]))
    assert last["sqnr"] == pytest.approx(expected, abs=1e-6)
    for r in rows:
        assert 15 < r["sqnr"] < 60 or r["layer"] == "flatten"
        assert r["cosine"] > 0.95
        # a layer's own error is never more than what it shows with its inherited error, roughly
        if r["op_sqnr"] is not None and r["layer"] != "x_quant":
            assert r["op_sqnr"] >= r["sqnr"] - 1.0
    # a quantized output is off by at most about half a step per rounding it went through
    assert rows[0]["max_lsb"] <= 0.5 + 1e-6
    assert rows[1]["op_max_lsb"] < 2.0


def test_a_clipped_layer_is_ranked_first_by_its_own_error(chain, tmp_path):
    model, prepared, data = chain
    clip_output(prepared, "convs.1")
    rows = featuremap_similarity(model, prepared, data[0], similarity_func="sqnr", out_dir=tmp_path)
    worst = min((r for r in rows if r["op_sqnr"] is not None), key=lambda r: r["op_sqnr"])
    assert worst["layer"] == "convs_1"
    # downstream layers inherit the error but add little of their own
    by_name = {r["layer"]: r for r in rows}
    assert by_name["convs_2"]["sqnr"] < 10 and by_name["convs_2"]["op_sqnr"] > 25
    ordered = (tmp_path / "ordered_op_error_similarity.txt").read_text().splitlines()
    assert ordered[2].split()[1] == "convs_1"  # after the header and the rule
    text = (tmp_path / "similarity.txt").read_text().splitlines()
    assert [line.split()[1] for line in text[2:]] == [r["layer"] for r in rows]
    page = parse_html(tmp_path / "similarity.html")
    assert page.svgs == 1
    assert len(page.rows["similarity"]) == len(rows)
    assert page.rows["ordered"][0][1] == "convs_1"


def test_qat_vs_integer_is_exact_and_float_vs_integer_matches_float_vs_qat(chain):
    model, prepared, data = chain
    integer = fxq.convert_fx(prepared)
    exact = featuremap_similarity(prepared, integer, data[0])
    assert all(r["sqnr"] == math.inf and r["max_abs"] == 0 for r in exact)
    assert all(r["op_max_lsb"] in (0.0, None) for r in exact)
    vs_qat = {r["layer"]: r["sqnr"] for r in featuremap_similarity(model, prepared, data[0])}
    vs_int = {r["layer"]: r["sqnr"] for r in featuremap_similarity(model, integer, data[0])}
    for layer, value in vs_qat.items():
        assert vs_int[layer] == pytest.approx(value, abs=1e-9)


def test_the_same_model_in_two_arithmetics(chain):
    _, prepared, data = chain
    float_quant = copy.deepcopy(prepared)
    with float_fake_quant(float_quant):  # training's float fake quant, not the integer kernels
        rows = featuremap_similarity(float_quant, prepared, data[0])
    # the same input quantize, then a step or two apart where float rounding meets a half
    assert rows[0]["layer"] == "x_quant" and rows[0]["sqnr"] == math.inf
    assert len(rows) == 8 and all(40 < r["sqnr"] < math.inf for r in rows[1:])
    assert all(r["max_lsb"] <= 2 + 1e-5 for r in rows if r["max_lsb"] is not None)


def test_a_calibrating_model_is_measured_in_validation(chain):
    """A model still in CALIBRATION state (as ``calibrate`` leaves it) computes in float;
    the tool measures it in VALIDATION, leaving its state and its scales as they were."""
    model, prepared, data = chain
    calibrating = fxq.set_fake_quantize(copy.deepcopy(prepared), "calibration")
    scales = {n: b.clone() for n, b in calibrating.named_buffers() if n.endswith("scale")}
    rows = featuremap_similarity(model, calibrating, data[0] * 10)
    assert rows == featuremap_similarity(model, prepared, data[0] * 10)
    assert {m.state for m in calibrating.modules() if hasattr(m, "set_fake_quant_state")} == {
        fxq.FakeQuantState.CALIBRATION
    }
    assert all(torch.equal(b, scales[n]) for n, b in calibrating.named_buffers() if n in scales)


def test_a_shared_conv_gives_one_row_per_call(bayes):
    data = batches()
    model = SharedConvNet().eval()
    prepared = calibrated(model, data)
    rows = {r["layer"]: r for r in featuremap_similarity(model, prepared, data[0])}
    assert rows["conv"]["module"] == "conv" and rows["conv_1"]["module"] == "conv_call1"
    with torch.no_grad():
        expected = sqnr(model(data[0]), prepared(data[0]))
    assert rows["conv_1"]["sqnr"] == pytest.approx(expected, abs=1e-6)
    assert rows["conv"]["scale"] != rows["conv_1"]["scale"]  # each call has its own output scale
    assert rows["conv_1"]["op_sqnr"] > rows["conv_1"]["sqnr"]


def test_bad_arguments_are_explained(chain):
    model, prepared, data = chain
    with pytest.raises(ValueError, match="unknown similarity"):
        featuremap_similarity(model, prepared, data[0], similarity_func="kl-ish")
    with pytest.raises(TypeError, match="model2"):
        featuremap_similarity(model, "prepared", data[0])


def test_fx_wrap_regions_standalone_modules_and_float_regions(bayes):
    from tests.helpers import TinyRetinaNet

    data = batches(hw=16)
    model = TinyRetinaNet().eval()
    qconfig = fxq.qconfig.default_calib_8bit_fake_quant_qconfig
    prepared = fxq.prepare_qat_fx(
        model, {"": qconfig, "module_name": {"lat2": None}}, example_inputs=(data[0],)
    )
    from tests.helpers import calibrate

    calibrate(prepared, data)
    fxq.set_fake_quantize(prepared, "validation")
    rows = {r["layer"]: r for r in featuremap_similarity(model, prepared, data[0])}
    # the float region (lat2) matches its float twin exactly, given the same (quantized) input
    assert rows["lat2"]["type"] == "Conv2d" and rows["lat2"]["op_sqnr"] > 100
    # shared heads: one row per pyramid level
    assert rows["cls_head_conv"]["module"] == "cls_head.conv"
    assert rows["cls_head_conv_1"]["module"] == "cls_head_conv_call1"  # prepare's clone
    # the linear inside the @fx_wrap() post-process: one row per call, its own error
    standalone = [r for r in rows.values() if r["type"].endswith("(standalone)")]
    assert {r["module"] for r in standalone} == {"box_scale"}
    assert all(r["op_sqnr"] > 20 for r in standalone)
    integer = fxq.convert_fx(prepared)
    exact = featuremap_similarity(prepared, integer, data[0])
    assert any(r["type"].endswith("(standalone)") for r in exact)
    assert all(r["max_abs"] == 0 for r in exact)
