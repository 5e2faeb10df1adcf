"""QDQ ONNX (QuantizeLinear / DequantizeLinear around float ops): loads in onnx.checker with
full checking, runs in onnxruntime, and stays within a stated distance of the integer model
(the difference is measured, in LSB of each output's scale)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fxq
import fxq.export
from fxq.export.onnx import graph_to_onnx
from tests.export.helpers import outputs, registry_model
from tests.test_registry import _cases

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


def lsb_difference(graph, model, integer, x) -> list[np.ndarray]:
    """|QDQ - integer| in units of each output's scale (1 for float outputs)."""
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {i.name: t.numpy() for i, t in zip(session.get_inputs(), x)})
    producers = {o: n for n in graph.nodes for o in n.outputs}
    diffs = []
    for name, e, g in zip(graph.outputs, outputs(integer, x), got):
        node = producers.get(name)
        scale = graph.tensors[name].scale
        if scale is None and node is not None and node.op == "dequantize":
            scale = node.attrs["scale"]
        diffs.append(np.abs(e.astype(np.float64) - g) / (scale or 1.0))
    return diffs


@pytest.mark.parametrize(("row_name", "target"), _cases())
def test_registry_op_qdq_within_two_lsb(bayes, row_name, target):
    integer, x = registry_model(row_name, target)
    graph = fxq.export.to_graph(integer, x)
    model = graph_to_onnx(graph, mode="qdq")
    assert {n.op_type for n in model.graph.node} >= {"QuantizeLinear", "DequantizeLinear"}
    for d in lsb_difference(graph, model, integer, x):
        # QuantizeLinear rounds half to even, float ops replace multipliers and tables
        assert d.max() <= 2.0 + 1e-2, (row_name, d.max())


def test_small_convnet_qdq_difference(bayes):
    from torch import nn

    model = nn.Sequential(
        fxq.QuantStub(),
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1, groups=4),
        nn.ReLU6(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
        fxq.DeQuantStub(),
    ).eval()
    qat = fxq.prepare_qat_fx(model, {"": fxq.qconfig.default_qat_8bit_fake_quant_qconfig})
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    with torch.no_grad():
        qat(torch.randn(8, 3, 16, 16))
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
    integer = fxq.convert_fx(qat)
    x = (torch.randn(8, 3, 16, 16),)
    graph = fxq.export.to_graph(integer, x)
    (d,) = lsb_difference(graph, graph_to_onnx(graph, mode="qdq"), integer, x)
    # half-even QuantizeLinear and float requantization: off by one LSB here and there,
    # compounding layer after layer
    assert d.max() <= 3.0 and (d < 0.5).mean() >= 0.75, (d.max(), (d < 0.5).mean())


def test_int16_qdq_uses_opset_21(bayes):
    from torch import nn

    from fxq.qconfig import default_qat_8bit_weight_16bit_act_fake_quant_qconfig as q16

    model = nn.Sequential(
        fxq.QuantStub(), nn.Conv2d(3, 8, 3), nn.Sigmoid(), nn.Flatten(), fxq.DeQuantStub()
    ).eval()
    qat = fxq.prepare_qat_fx(model, {"": q16})
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    qat(torch.randn(2, 3, 6, 6))
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
    integer = fxq.convert_fx(qat)
    x = torch.randn(2, 3, 6, 6)
    graph = fxq.export.to_graph(integer, x)
    onnx_model = graph_to_onnx(graph, mode="qdq")
    assert onnx_model.opset_import[0].version == 21
    (d,) = lsb_difference(graph, onnx_model, integer, (x,))
    assert d.max() <= 2.0 + 1e-2
