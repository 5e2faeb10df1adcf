"""``F.grid_sample`` with a constant grid (a buffer, quantized at convert): its integers
become a parameter of the IR node; the numpy runtime and integer ONNX are bit-exact on every
march, QDQ ONNX within 1 LSB."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxq
import fxq.export
from fxq.export.onnx import graph_to_onnx
from fxq.qconfig import default_qat_8bit_fake_quant_qconfig as Q8
from tests.export.helpers import run_onnx


class _ConstantGrid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = fxq.QuantStub()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("grid", torch.rand(1, 5, 4, 2, generator=g) * 2.2 - 1.1)

    def forward(self, x):
        x = self.quant(x)
        nearest = F.grid_sample(x, self.grid, mode="nearest", align_corners=True)
        return nearest + F.grid_sample(x, self.grid, padding_mode="border", align_corners=False)


@pytest.mark.parametrize("march", ["bayes", "bayes-e", "bernoulli2"])
def test_constant_grid_exports_bit_exactly(march):
    fxq.set_march(march)
    model = _ConstantGrid().eval()
    x = torch.randn(1, 3, 6, 7, generator=torch.Generator().manual_seed(1))
    qat = fxq.prepare_qat_fx(model, {"": Q8})
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    with torch.no_grad():
        qat(x)
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
    integer = fxq.convert_fx(qat)
    with torch.no_grad():
        expected = qat(x)
        got = integer(x)
    got = got.dequantize() if isinstance(got, fxq.QTensor) else got
    assert torch.equal(expected, got)
    graph = fxq.export.to_graph(integer, (x,))
    assert [n.op for n in graph.nodes].count("grid_sample") == 2
    (numpy_out,) = graph.run(x.numpy())
    assert np.array_equal(numpy_out, got.numpy())
    (onnx_out,) = run_onnx(graph_to_onnx(graph), (x,))
    assert np.array_equal(onnx_out, got.numpy())
    (qdq_out,) = run_onnx(graph_to_onnx(graph, mode="qdq"), (x,))
    lsb = float(integer.get_submodule("add").output_scale)
    assert np.abs(qdq_out - got.numpy()).max() <= lsb * (1 + 1e-3)
