"""torch's own exporters are never silently wrong on an fxq integer model: ``torch.export``
captures it exactly (the native kernels as the custom ops ``fxq::requantize*``),
``torch.jit.trace`` records the exact torch path (the C kernel is skipped while tracing),
``torch.onnx.export`` (TorchScript or dynamo) raises an error that points to ``fxq.export``."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

import fxq
from fxq.quantized import native
from tests.export.helpers import registry_model, torchvision_model
from tests.test_registry import _cases


def _same(a, b) -> bool:
    """Equal outputs, bit for bit (nested structures of tensors)."""
    a, b = tree_leaves(a), tree_leaves(b)
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def _batch(name: str = "batch") -> torch.export.Dim:
    return torch.export.Dim(name, min=1, max=64)


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


@pytest.fixture
def residual(bayes):
    """conv+bn+relu, a conv with a fused residual add, sigmoid (int8)."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.dq = fxq.QuantStub(), fxq.DeQuantStub()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.bn = nn.BatchNorm2d(8)
            self.conv2 = nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x):
            y = torch.relu(self.bn(self.conv(self.q(x))))
            return self.dq(torch.sigmoid(self.conv2(y) + y))

    qat = fxq.prepare_qat_fx(Net().eval(), {"": fxq.qconfig.default_qat_8bit_fake_quant_qconfig})
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    with torch.no_grad():
        qat(torch.randn(2, 3, 8, 8))
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
    return fxq.convert_fx(qat)


def test_torch_export_is_exact_with_a_dynamic_batch(residual, tmp_path):
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        expected = residual(x)
        ep = torch.export.export(residual, (x,), dynamic_shapes=({0: _batch()},))
        targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
        # one op per requantization, the fused residual included
        assert {"fxq.requantize.default", "fxq.requantize_add.default"} <= targets
        assert _same(ep.module()(x), expected)
        for batch in (1, 5):
            v = 3 * torch.randn(batch, 3, 8, 8)
            assert _same(ep.module()(v), residual(v))
        # torch.export.save / load (needs fxq imported: the custom ops)
        torch.export.save(ep, tmp_path / "m.pt2")
        assert _same(torch.export.load(tmp_path / "m.pt2").module()(x), expected)
        # the model itself is untouched: same numbers, no trace left in its caches
        assert _same(residual(x), expected)
    for m in residual.modules():
        assert all(
            type(t) is torch.Tensor
            for t in getattr(m, "_derived", {}).values()
            if isinstance(t, torch.Tensor)
        )
        assert not getattr(m._buffers, "real", {})


def test_torch_export_without_the_native_kernel(residual, monkeypatch):
    """FXQ_NATIVE=0: the eager model and the custom ops compute in torch, with equal results."""
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        expected = residual(x)
        monkeypatch.setattr(native, "_LIB", None)
        monkeypatch.setattr(native, "_TRIED", True)
        assert not native.available()
        ep = torch.export.export(residual, (x,))
        assert _same(residual(x), expected)
        assert _same(ep.module()(x), expected)


def test_integer_modules_copy_and_pickle_after_export(residual):
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.export.export(residual, (x,))
        expected = residual(x)
        for clone in (copy.deepcopy(residual), pickle.loads(pickle.dumps(residual))):
            assert _same(clone(x), expected)


@pytest.fixture
def zoo(bayes):
    from tests.zoo import Zoo

    qat = fxq.prepare_qat_fx(
        Zoo().eval(), {"": fxq.qconfig.default_qat_8bit_fake_quant_qconfig}, float_ops="ignore"
    )
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    with torch.no_grad():
        for _ in range(2):
            qat(torch.randn(2, 3, 16, 16))
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
    return fxq.convert_fx(qat)


def test_torch_export_of_the_op_zoo(zoo):
    """Every op family, a float region (neg) in the middle, another batch size."""
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        ep = torch.export.export(zoo, (x,), dynamic_shapes=({0: _batch()},))
        for v in (x, 2 * torch.randn(5, 3, 16, 16)):
            assert _same(ep.module()(v), zoo(v))


def test_torch_export_of_mobilenet_v2(bayes):
    pytest.importorskip("torchvision")
    integer, x = torchvision_model("mobilenet_v2", size=32)
    with torch.no_grad():
        ep = torch.export.export(integer, (x,), dynamic_shapes=({0: _batch()},))
        for v in (x, torch.randn(3, 3, 32, 32)):
            assert _same(ep.module()(v), integer(v))


def test_torch_onnx_dynamo_export_points_to_fxq_export(integer, tmp_path):
    pytest.importorskip("onnxscript")
    with pytest.raises(Exception) as info:
        torch.onnx.export(
            integer, (torch.randn(2, 3, 8, 8),), str(tmp_path / "m.onnx"), dynamo=True
        )
    chain, e = [], info.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    assert any(isinstance(e, native.ExporterError) for e in chain)
    assert "fxq.export.to_onnx" in str(info.value)
    assert not (tmp_path / "m.onnx").exists()


def _one_case_per_row() -> list:
    seen, cases = set(), []
    for case in _cases():
        row_name, _ = case.values
        if row_name not in seen:
            seen.add(row_name)
            cases.append(case)
    return cases


@pytest.mark.parametrize(("row_name", "target"), _one_case_per_row())
def test_torch_export_of_registry_ops(bayes, row_name, target):
    integer, x = registry_model(row_name, target)
    with torch.no_grad():
        ep = torch.export.export(integer, tuple(x))
        assert _same(ep.module()(*x), integer(*x))
