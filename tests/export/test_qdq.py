"""QDQ ONNX (QuantizeLinear / DequantizeLinear around float ops): loads in onnx.checker with
full checking, runs in onnxruntime, and stays within a stated distance of the integer model
(the difference is measured, in LSB of each output's scale; every registry op:
tests/export/test_graph.py)."""

from __future__ import annotations

import pytest
import torch

import fxq
import fxq.export
from fxq.export.onnx import graph_to_onnx
from tests.export.helpers import lsb_difference

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


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
