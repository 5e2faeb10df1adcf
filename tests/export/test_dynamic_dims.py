"""Dynamic dimensions declared at export (``to_graph(..., dynamic_dims=...)``,
``docs/integer_graph.md``, 1): graphs and integer ONNX files that run, bit for bit, at sizes
other than the example's, and clear refusals where a size is baked into the model."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest
import torch
from torch import nn

import fxq
import fxq.export
from fxq.export import Dim, ExportError, GraphInputError, IntegerGraphFormatError
from fxq.export.onnx import graph_to_onnx
from tests.export.helpers import (
    assert_exact_in_runtimes,
    convert_calibrated,
    hf_model,
    torchvision_model,
)


def _reload(graph, tmp_path) -> fxq.export.IntegerGraph:
    graph.save(tmp_path / "g.fxq")
    return fxq.export.load(tmp_path / "g.fxq")


@pytest.fixture(scope="module")
def resnet():
    fxq.set_march("bayes")
    integer, x = torchvision_model("resnet18", 64)
    graph = fxq.export.to_graph(integer, x, dynamic_dims={"x": {2: "H", 3: "W"}})
    return integer, graph


def test_resnet18_height_width_dynamic_exact(resnet, tmp_path) -> None:
    integer, graph = resnet
    assert graph.tensors["x"].shape == ["N", 3, "H", "W"]
    assert graph.dims == {"H": {"min": 1, "max": None}, "W": {"min": 1, "max": None}}
    assert graph.format_version() == 4
    graph = _reload(graph, tmp_path)
    model = graph_to_onnx(graph)
    dims = [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["N", 3, "H", "W"]
    torch.manual_seed(1)
    for h, w in ((64, 64), (96, 80)):
        assert_exact_in_runtimes(integer, graph, model, (torch.randn(2, 3, h, w),))


def test_resnet18_run_checks_symbols(resnet) -> None:
    _, graph = resnet
    with pytest.raises(GraphInputError) as e:
        graph.run(np.zeros((2, 4, 64, 64), np.float32))
    assert str(e.value) == (
        "input 'x': got shape [2, 4, 64, 64], expected Nx3xHxW (dimension 1 is 4, expected 3); "
        "this size is fixed at export (declare it in dynamic_dims to make it dynamic)"
    )


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.dq = fxq.QuantStub(), fxq.DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, a, b):
        return self.dq(self.conv(self.q(a)) + self.conv(self.q(b)))


class _FixedReshape(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.dq = fxq.QuantStub(), fxq.DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return self.dq(self.conv(self.q(x)).reshape(x.shape[0], 4, 8, 8))


class _FixedPool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.dq = fxq.QuantStub(), fxq.DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(2)

    def forward(self, x):
        return self.dq(self.pool(self.conv(self.q(x))))


def _converted(model: nn.Module, *inputs: torch.Tensor) -> nn.Module:
    torch.manual_seed(0)
    return convert_calibrated(model, [inputs, tuple(torch.randn_like(t) for t in inputs)])


def test_mismatched_symbol_sizes_at_run_time() -> None:
    a, b = torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8)
    integer = _converted(_TwoInputs(), a, b)
    graph = fxq.export.to_graph(
        integer, (a, b), dynamic_dims={"a": {2: "H", 3: "W"}, "b": {2: "H", 3: "W"}}
    )
    ok = [np.random.randn(2, 3, 12, 10).astype(np.float32)] * 2
    expected = integer(*[torch.from_numpy(v) for v in ok]).numpy()
    assert np.array_equal(graph.run(*ok)[0], expected)
    with pytest.raises(GraphInputError) as e:
        graph.run(ok[0], np.zeros((2, 3, 12, 9), np.float32))
    assert str(e.value) == (
        "input 'b': dimension 3 ('W') is 9, but 'W' is 10 in input 'a'; give every input the "
        "same size there"
    )


def test_refuses_reshape_to_fixed_size() -> None:
    x = torch.randn(2, 3, 8, 8)
    integer = _converted(_FixedReshape(), x)
    with pytest.raises(ExportError) as e:
        fxq.export.to_graph(integer, x, dynamic_dims={"x": {2: "H"}})
    msg = str(e.value)
    assert msg.startswith(
        "fxq.export: cannot keep 'H' (dimension 2 of input 'x') dynamic: the model fails at H=16 "
        "(exported at H=8) in node 'reshape' ("
    )
    assert "test_dynamic_dims.py:" in msg and "RuntimeError: shape '[2, 4, 8, 8]'" in msg


def test_refuses_adaptive_pool_to_fixed_size() -> None:
    x = torch.randn(2, 3, 8, 8)
    integer = _converted(_FixedPool(), x)
    with pytest.raises(ExportError) as e:
        fxq.export.to_graph(integer, x, dynamic_dims={"x": {3: "W"}})
    msg = str(e.value)
    assert msg.startswith(
        "fxq.export: cannot keep 'W' (dimension 3 of input 'x') dynamic: node 'pool_axis_matmul0' "
        "(op axis_matmul, "
    )
    assert msg.endswith(
        "has arrays ['matrix_1'] that depend on the size (they differ at W=8 and W=16); export "
        "with that size fixed (leave 'W' out of dynamic_dims), or change the model so that the "
        "op follows the size"
    )


def test_refuses_bad_declarations() -> None:
    x = torch.randn(2, 3, 8, 8)
    integer = _converted(_FixedPool(), x)
    with pytest.raises(ExportError, match=r"axis 0 is the batch dimension, dynamic already"):
        fxq.export.to_graph(integer, x, dynamic_dims={"x": {0: "B"}})
    with pytest.raises(ExportError, match=r"names input 'y', which the converted graph"):
        fxq.export.to_graph(integer, x, dynamic_dims={"y": {2: "H"}})


def test_loader_refuses_undeclared_symbols(resnet, tmp_path) -> None:
    _, graph = resnet
    graph.save(tmp_path / "g.fxq")
    with zipfile.ZipFile(tmp_path / "g.fxq") as z:
        members = {n: z.read(n) for n in z.namelist()}
    meta = json.loads(members["graph.json"])
    del meta["dims"]["W"]
    members["graph.json"] = json.dumps(meta).encode()
    with zipfile.ZipFile(tmp_path / "bad.fxq", "w") as z:
        for n, data in members.items():
            z.writestr(n, data)
    with pytest.raises(IntegerGraphFormatError, match=r"has size 'W', which is not 'N' nor"):
        fxq.export.load(tmp_path / "bad.fxq")


def _text(batch: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, length // 2 :] = 0
    return {
        "input_ids": torch.randint(0, 100, (batch, length), generator=g),
        "attention_mask": mask,
    }


def test_bert_sequence_length_dynamic_exact(tmp_path) -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, extra = hf_model("bert")
    integer = convert_calibrated(model, [_text(2, 8, 1), _text(3, 8, 2)], **extra)
    graph = fxq.export.to_graph(
        integer,
        _text(2, 7, 3),
        dynamic_dims={"input_ids": {1: Dim("L", max=64)}, "attention_mask": {1: "L"}},
    )
    assert graph.tensors["input_ids"].shape == ["N", "L"]
    graph = _reload(graph, tmp_path)
    onnx_model = graph_to_onnx(graph)
    for batch, length in ((2, 7), (3, 11)):
        assert_exact_in_runtimes(integer, graph, onnx_model, _text(batch, length, length))
    with pytest.raises(GraphInputError) as e:
        graph.run(*[v.numpy() for v in _text(2, 65, 0).values()])
    assert str(e.value) == (
        "input 'input_ids': dimension 1 ('L') is 65, outside the range declared at export (1 to 64)"
    )


def test_bert_constant_needs_max() -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, extra = hf_model("bert")
    integer = convert_calibrated(model, [_text(2, 8, 1)], **extra)
    with pytest.raises(ExportError) as e:
        fxq.export.to_graph(
            integer,
            _text(2, 7, 3),
            dynamic_dims={"input_ids": {1: "L"}, "attention_mask": {1: "L"}},
        )
    assert "holds a constant as long as 'L'" in str(e.value)
    assert "declare its largest size, fxq.export.Dim('L', max=...)" in str(e.value)
