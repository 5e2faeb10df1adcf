"""Integer ONNX: onnxruntime's CPU provider equals fxq's integer model bit for bit on the op
zoo, int16 activations and torchvision models (every registry op: tests/export/test_graph.py);
the files pass ``onnx.checker`` with full checking (``graph_to_onnx`` runs it)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch import nn

import fxq
import fxq.export
from fxq.export.onnx import OPSET, graph_to_onnx
from tests.export.helpers import assert_equal_outputs, outputs, run_onnx, torchvision_model

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


def test_zoo_file_names_opset_and_dynamic_batch(bayes, tmp_path):
    from tests.zoo import Zoo

    qat = fxq.prepare_qat_fx(
        Zoo().eval(), {"": fxq.qconfig.default_qat_8bit_fake_quant_qconfig}, float_ops="ignore"
    )
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    with torch.no_grad():
        for _ in range(2):
            qat(torch.randn(2, 3, 16, 16))
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
    integer = fxq.convert_fx(qat)
    path = tmp_path / "zoo.onnx"
    fxq.export.to_onnx(
        integer, torch.randn(2, 3, 16, 16), path, input_names=["image"], output_names=["a", "b"]
    )
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    assert model.opset_import[0].version == OPSET >= 17
    assert [i.name for i in model.graph.input] == ["image"]
    assert [o.name for o in model.graph.output] == ["a", "b"]
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"
    for batch in (2, 7):
        x = torch.randn(batch, 3, 16, 16) * 3
        assert_equal_outputs(outputs(integer, (x,)), run_onnx(model, (x,)))


def test_int16_and_limb_split_conv(bayes):
    from fxq.qconfig import default_qat_8bit_weight_16bit_act_fake_quant_qconfig as q16

    model = nn.Sequential(
        fxq.QuantStub(),
        nn.Conv2d(3, 8, 3),
        nn.ReLU(),
        nn.Conv2d(8, 8, 5, padding=2),  # int16 input, 200 weights: two limbs
        nn.Tanh(),
        nn.MaxPool2d(2, ceil_mode=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
        fxq.DeQuantStub(),
    ).eval()
    qat = fxq.prepare_qat_fx(model, {"": q16})
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    qat(torch.randn(2, 3, 9, 9))
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
    integer = fxq.convert_fx(qat)
    x = torch.randn(3, 3, 9, 9)
    onnx_model = fxq.export.to_onnx(integer, x)
    assert any(n.op_type == "Floor" for n in onnx_model.graph.node)
    assert_equal_outputs(outputs(integer, (x,)), run_onnx(onnx_model, (x,)))


FAST = ("mobilenet_v2", "shufflenet_v2_x1_0")
ALL = (
    "resnet18", "resnet50", "mobilenet_v2", "mobilenet_v3_large", "shufflenet_v2_x1_0",
    "efficientnet_b0", "regnet_x_400mf", "squeezenet1_1", "densenet121", "googlenet",
    "mnasnet1_0", "resnext50_32x4d",
)  # fmt: skip


@pytest.mark.parametrize("name", ALL if os.environ.get("FXQ_EXPORT_ALL_MODELS") else FAST)
def test_torchvision_model(bayes, name):
    """numpy runtime and integer ONNX, both bit-exact, and the QDQ ONNX runs
    (FXQ_EXPORT_ALL_MODELS=1: all twelve
    models of tests/test_models.py, about 4 minutes on two cores)."""
    integer, x = torchvision_model(name, size=32)
    expected = outputs(integer, (x,))
    graph = fxq.export.to_graph(integer, x)
    assert_equal_outputs(expected, graph.run(x.numpy()))
    assert_equal_outputs(expected, run_onnx(graph_to_onnx(graph), (x,)))
    (qdq,) = run_onnx(graph_to_onnx(graph, mode="qdq"), (x,))  # runs; not bit-exact
    assert qdq.shape == expected[0].shape and np.isfinite(qdq).all()


def test_unknown_mode_is_an_error(bayes):
    with pytest.raises(ValueError, match="unknown mode 'float'"):
        fxq.export.to_onnx(None, None, mode="float")
