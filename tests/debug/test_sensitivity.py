"""sensitivity: the bad value ranked first, every row equal to a full forward per value."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxq
from fxq.debug import sensitivity
from fxq.debug.compare import float_fake_quant
from fxq.debug.sensitivity import quantized_values
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


class BranchNet(nn.Module):
    """A stem feeding two branches that meet again: a value in one branch leaves the other."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.left = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 1))
        self.right = nn.Sequential(nn.Conv2d(8, 8, 1), nn.ReLU())
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.stem(x))
        both = torch.cat([self.left(x), self.right(x)], 1)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(both, 1), 1))


class InPlaceNet(nn.Module):
    """A value overwritten in place after another layer has read it."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.conv = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        x = self.stem(x)
        y = self.conv(x)
        x.neg_()  # after conv has read x (an op left float: prepare keeps it in place)
        return torch.cat([x, y], 1)


@contextlib.contextmanager
def only_this(fq, mode, dtype):
    """``fq`` toggled against the baseline, as the docstring of ``sensitivity`` states it."""
    saved = (fq.__dict__.get("bypassed"), fq.dtype, fq.scale.clone())
    if dtype is not None:
        with torch.no_grad():
            fq.scale.mul_(fq.dtype.qmax / dtype.qmax)
        fq.dtype = dtype
    else:
        fq.bypassed = mode == "float_one"
    try:
        yield
    finally:
        if saved[0] is None:
            fq.__dict__.pop("bypassed", None)
        else:
            fq.bypassed = saved[0]
        fq.dtype = saved[1]
        with torch.no_grad():
            fq.scale.copy_(saved[2])


def brute_force(model, prepared, data, mode="quantize_one", dtype=None):
    """The model-output SQNR of every value: one full forward of every batch per value."""
    with torch.no_grad():
        ref = torch.cat([model(x).flatten() for x in data])
    fxq.set_fake_quantize(prepared, "validation")
    baseline = bypass if mode == "quantize_one" and dtype is None else float_fake_quant
    found = {}
    for value in quantized_values(prepared):
        if dtype is not None and value.kind == "weight":
            continue
        with torch.no_grad(), baseline(prepared), only_this(value.fake_quant, mode, dtype):
            out = torch.cat([prepared(x).flatten() for x in data])
        found[(value.name, value.kind)] = sqnr(ref, out)
    return found


def assert_as_brute_force(model, prepared, data, **kwargs):
    rows = sensitivity(model, prepared, data, **kwargs)
    expected = brute_force(model, prepared, data, **kwargs)
    assert {(r["name"], r["kind"]) for r in rows} == set(expected)
    for r in rows:
        assert r["sqnr"] == pytest.approx(expected[(r["name"], r["kind"])], abs=1e-6), r
    return rows


@pytest.mark.parametrize("mode", ["quantize_one", "float_one", "int16"])
def test_every_row_equals_a_full_forward(clipped, mode):
    model, prepared, data = clipped
    kwargs = {"dtype": fxq.qint16} if mode == "int16" else {"mode": mode}
    rows = assert_as_brute_force(model, prepared, data[:2], **kwargs)
    assert len({r["sqnr"] for r in rows}) > len(rows) // 2  # the values do differ


@pytest.mark.filterwarnings("ignore:.*no integer implementation")  # InPlaceNet's neg_
@pytest.mark.parametrize("net", [BranchNet, InPlaceNet])
def test_branches_and_in_place_ops_give_what_a_full_run_gives(bayes, net):
    torch.manual_seed(0)
    data = batches()
    model = net().eval()
    prepared = calibrated(model, data)
    for mode in ("quantize_one", "float_one"):
        assert_as_brute_force(model, prepared, data[:2], mode=mode)


class TwoHeads(nn.Module):
    """Two outputs: ``{"main": conv(x), "aux": fc(pool(conv(x)))}``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = self.conv(x)
        return {"main": y, "aux": self.fc(y.mean((2, 3)))}


def test_output_fn_compares_the_output_that_matters(bayes):
    data = batches()
    model = TwoHeads().eval()
    prepared = calibrated(model, data)
    clip_output(prepared, "fc")  # a clipped aux head: harmful to "aux" only
    both = {(r["name"], r["kind"]): r["sqnr"] for r in sensitivity(model, prepared, data[0])}
    main = {
        (r["name"], r["kind"]): r["sqnr"]
        for r in sensitivity(model, prepared, data[0], output_fn=lambda out: out["main"])
    }
    fc = ("fc", "activation")
    assert min(both, key=both.get) == fc and both[fc] < 30  # measured: 27.1 dB
    assert main[fc] == main[("fc", "weight")] == main[("mean", "activation")] == float("inf")
    conv = ("conv", "activation")
    assert main[conv] == pytest.approx(sqnr_of(model, prepared, data[0], "conv"), abs=1e-6)


def sqnr_of(model, prepared, x, path: str) -> float:
    """The SQNR of ``out["main"]`` with only ``path``'s output quantized."""
    fq = prepared.get_submodule(path).activation_post_process
    with torch.no_grad(), bypass(prepared):
        fq.bypassed = False
        out = prepared(x)["main"]
        del fq.bypassed
        return sqnr(model(x)["main"], out)
