import warnings

import pytest
import torch
from torch import nn

import fxq
from fxq.qconfig import default_calib_8bit_fake_quant_qconfig as q8
from tests.helpers import ResidualNet, calibrate


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 1)
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x):
        y = torch.sort(self.conv(x), dim=1).values  # no integer sort: falls back to float
        return self.fc(y.mean((2, 3)))


def test_summary_rows_of_a_known_model(bayes, capsys):
    prepared = fxq.prepare_qat_fx(Small(), {"": q8})
    rows = fxq.summary(prepared)
    table = capsys.readouterr().out
    assert "unsupported" in table and "yes: runs in float" in table
    by_node = {r["node"]: r for r in rows}
    assert [r["node"] for r in rows] == [
        "x",
        "x_quant",
        "conv",
        "sort",
        "getattr_1",
        "getattr_1_quant",
        "mean",
        "fc",
        "output",
    ]
    assert by_node["conv"]["type"] == "Conv2d" and by_node["conv"]["qconfig"] == "global: ''"
    assert (
        by_node["sort"]["unsupported"] == "yes: runs in float" and by_node["sort"]["march"] == "no"
    )
    assert by_node["conv"]["output"] == "qint8 (not calibrated)"
    calibrate(prepared, [torch.randn(2, 3, 4, 4)])
    converted = fxq.convert_fx(prepared)
    rows = fxq.summary(converted, show=False)
    by_node = {r["node"]: r for r in rows}
    scale = converted.conv.output_scale.item()
    assert by_node["conv"]["output"] == f"qint8 @ {scale:.6g}"
    assert by_node["conv_dequant"]["type"] == "DeQuantize"
    assert by_node["sort"]["unsupported"] == "yes: runs in float"
    assert by_node["getattr_1_quant"]["type"] == "Quantize"  # re-quantized after the float sort
    assert by_node["mean"]["inputs"] == by_node["getattr_1_quant"]["output"]


def test_summary_shows_fusions_scales_and_qconfig_sources(bayes):
    prepared = fxq.prepare_qat_fx(ResidualNet(), {"": q8, "module_name": {"conv1": None}})
    calibrate(prepared, [torch.randn(2, 3, 8, 8)])
    rows = {r["node"]: r for r in fxq.summary(prepared, show=False)}
    assert rows["conv2"]["type"] == "Conv2d+bn+add+relu"
    assert rows["conv1"]["type"] == "Fused[conv_bn_relu]" and rows["conv1"]["output"] == "float32"
    assert rows["conv1"]["qconfig"] == "module_name: conv1" and rows["conv1"]["unsupported"] == ""
    assert rows["conv2"]["inputs"].count("qint8 @") == 2
    converted = {r["node"]: r for r in fxq.summary(fxq.convert_fx(prepared), show=False)}
    assert converted["conv2"]["type"] == "Conv2d+add+relu"


def test_summary_needs_a_graph_module():
    with pytest.raises(TypeError, match="expects a GraphModule"):
        fxq.summary(torch.nn.Linear(2, 2))


def test_integer_tensors_and_index_arithmetic_are_not_reported_as_float(bayes):
    """Token ids, positions from torch.arange and masks are integer tensors: prepare never
    quantizes them, and summary agrees with its float-op list (here: empty)."""

    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.words = nn.Embedding(50, 8)
            self.positions = nn.Embedding(16, 8)
            self.head = nn.Linear(8, 4)

        def forward(self, ids):
            positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
            keep = (ids > 0).to(torch.int64).unsqueeze(-1)
            h = self.words(ids) + self.positions(positions)
            return self.head(h * keep.to(h.dtype))

    ids = torch.randint(1, 50, (2, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxq.FloatOpWarning)
        qat = fxq.prepare_qat_fx(
            Tokens(), {"": fxq.qconfig.default_qat_8bit_fake_quant_qconfig}, example_inputs=(ids,)
        )
    rows = fxq.summary(qat)
    assert [r["node"] for r in rows if r["unsupported"]] == []
    arange = next(r for r in rows if r["node"] == "arange")
    assert arange["output"] == "integer tensor"
