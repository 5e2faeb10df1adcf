"""torch's own exporters are never silently wrong on an fxq integer model: ``torch.jit.trace``
records the exact torch path (the C kernel is skipped while tracing), ``torch.onnx.export``
raises an error that points to ``fxq.export``."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fxq
from fxq.quantized import native


@pytest.fixture
def integer(bayes):
    model = nn.Sequential(
        fxq.QuantStub(),
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 4, 3),
        nn.Sigmoid(),
        fxq.DeQuantStub(),
    ).eval()
    qat = fxq.prepare_qat_fx(model, {"": fxq.qconfig.default_qat_8bit_fake_quant_qconfig})
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    qat(torch.randn(2, 3, 8, 8))
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
    return fxq.convert_fx(qat)


def test_jit_trace_is_exact_with_the_native_kernel(integer):
    x = torch.randn(2, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(integer, (x,), check_trace=False)
    for v in (x, 3 * torch.randn(4, 3, 8, 8)):
        assert torch.equal(traced(v), integer(v))
    if native.available():  # outside a trace the C kernel still runs
        assert not torch.jit.is_tracing()


def test_torch_onnx_export_points_to_fxq_export(integer, tmp_path):
    with pytest.raises(native.ExporterError, match=r"fxq\.export\.to_onnx"):
        torch.onnx.export(
            integer, (torch.randn(2, 3, 8, 8),), str(tmp_path / "m.onnx"), dynamo=False
        )
    assert not (tmp_path / "m.onnx").exists()
