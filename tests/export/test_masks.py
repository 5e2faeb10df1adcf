"""Integer and bool graph inputs (token ids, attention masks) and the plain-tensor ops they feed
export, bit-exact in the numpy runtime and in onnxruntime (``docs/integer_graph.md``, 1-3).

Hugging Face encoders build their attention mask from ``attention_mask`` with casts, indexing,
comparisons and logical ops on bool tensors, then hand it to ``F.scaled_dot_product_attention``:
all of it is exported, and the masks are inputs of the graph, so padded batches run exactly.
"""

from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxq
import fxq.export
from fxq.export import GraphInputError, IntegerGraphFormatError
from fxq.export.onnx import graph_to_onnx
from tests.export.helpers import (
    assert_equal_outputs,
    assert_exact_in_runtimes,
    convert_calibrated,
    graph_arrays,
    hf_model,
    outputs,
)

transformers = pytest.importorskip("transformers")


# -- helpers ---------------------------------------------------------------------------------
def _text(batch: int, length: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """Token ids and an int64 attention mask whose first sequence ends in padding."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, length // 2 :] = 0
    if batch > 2:
        mask[2, 1:] = 0  # one token only
    return {
        "input_ids": torch.randint(0, 100, (batch, length), generator=g),
        "attention_mask": mask,
    }


@pytest.fixture(scope="module")
def hf() -> dict:
    """name -> (integer model, its graph, its integer ONNX), exported on a padded batch of 2."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            torch.manual_seed(0)
            model, extra = hf_model(name)
            integer = convert_calibrated(model, [_text(2, seed=1), _text(3, seed=2)], **extra)
            graph = fxq.export.to_graph(integer, _text(2))
            cache[name] = integer, graph, graph_to_onnx(graph)
        return cache[name]

    return get


# -- Hugging Face models -----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["bert", "distilbert"])
def test_hf_encoder_with_attention_mask_is_bit_exact_in_numpy_and_onnxruntime(hf, name):
    integer, graph, onnx_model = hf(name)
    assert graph.inputs == ["input_ids", "attention_mask"] and graph.dynamic_batch
    assert [graph.tensors[i].dtype for i in graph.inputs] == ["int64", "int64"]
    ops = {n.op for n in graph.nodes}
    assert {"cast", "logical", "constant"} <= ops  # the mask is built in the graph
    softmax = [n for n in graph.nodes if n.op == "softmax"]
    assert softmax and all(len(n.inputs) == 2 and "keep" not in n.params for n in softmax)
    for inputs in (_text(2, seed=3), _text(3, seed=4), _text(1, seed=5)):
        assert_exact_in_runtimes(integer, graph, onnx_model, inputs)
    # the mask is an input, not a constant: padding changes the kept tokens' outputs
    inputs = _text(2, seed=3)
    unpadded = {**inputs, "attention_mask": torch.ones_like(inputs["attention_mask"])}
    a, b = graph.run(*graph_arrays(inputs, graph))[0], graph.run(*graph_arrays(unpadded, graph))[0]
    assert not np.array_equal(a[0, :4], b[0, :4]) and np.array_equal(a[1], b[1])


def test_gpt2_with_attention_mask_exports_at_its_batch_size(hf):
    """GPT-2: ``input_ids.view(-1, L)`` on the int64 input, a causal and a padding mask. Its
    ``Conv1D`` flattens the batch (``x.view(-1, H)``), so the graph has a fixed batch size."""
    integer, graph, onnx_model = hf("gpt2")
    assert not graph.dynamic_batch
    assert_exact_in_runtimes(integer, graph, onnx_model, _text(2, seed=6))


def test_saved_graph_keeps_the_input_dtypes(hf, tmp_path):
    integer, graph, _ = hf("bert")
    graph.save(tmp_path / "bert.fxq")
    with zipfile.ZipFile(tmp_path / "bert.fxq") as z:
        meta = json.loads(z.read("graph.json"))
    assert meta["version"] == 2
    assert [meta["tensors"][i]["dtype"] for i in meta["inputs"]] == ["int64", "int64"]
    assert any(t["dtype"] == "bool" for t in meta["tensors"].values())
    loaded = fxq.export.load(tmp_path / "bert.fxq")
    assert [loaded.tensors[i].dtype for i in loaded.inputs] == ["int64", "int64"]
    inputs = _text(3, seed=7)
    assert_equal_outputs(outputs(integer, inputs), loaded.run(*graph_arrays(inputs, loaded)))


def test_a_wrong_input_dtype_is_a_clear_error(hf):
    integer, graph, _ = hf("bert")
    inputs = _text(2, seed=8)
    ids, mask = graph_arrays(inputs, graph)
    with pytest.raises(
        GraphInputError,
        match=r"input 'attention_mask': got dtype float32, expected int64 \(an integer dtype\)",
    ):
        graph.run(ids, mask.astype(np.float32))
    with pytest.raises(GraphInputError, match=r"input 'attention_mask': got dtype bool"):
        graph.run(ids, mask.astype(bool))
    with pytest.raises(GraphInputError, match=r"input 'input_ids': got dtype uint64 with values"):
        graph.run(np.full_like(ids, 2**63, dtype=np.uint64), mask)
    # any integer dtype that holds the values runs as the exported int64
    expected = outputs(integer, inputs)
    assert_equal_outputs(expected, graph.run(ids.astype(np.int32), mask.astype(np.int8)))


# -- the ops, on small models of our own --------------------------------------------------------
class _MaskOps(nn.Module):
    """Earlier Hugging Face code's additive mask (quantized here) into attention, an integer
    ``where`` on a mask input, comparisons, logical ops, ``masked_fill`` on a float tail and
    int64 arithmetic."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.dq = fxq.QuantStub(), fxq.DeQuantStub()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, mask):
        b, n, _ = x.shape
        additive = (1.0 - mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        h = torch.where(mask.bool()[:, :, None], self.proj(self.q(x)), 0.0)
        h = h.view(b, n, 2, 4).transpose(1, 2)
        y = self.dq(F.scaled_dot_product_attention(h, h, h, attn_mask=additive))
        pad = (mask == 0) | (mask < 0)
        y = y.masked_fill(pad[:, None, :, None], float("-inf"))
        return y, torch.where(~pad, mask * 2 + 1, -1)


def _mask_inputs(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, 6, dtype=torch.long)
    mask[0, 3:] = 0
    return torch.randn(batch, 6, 8, generator=g), mask


def test_mask_ops_export_bit_exact():
    torch.manual_seed(0)
    integer = convert_calibrated(_MaskOps(), [_mask_inputs(2, 1), _mask_inputs(2, 2)])
    graph = fxq.export.to_graph(integer, _mask_inputs(2))
    assert graph.dynamic_batch
    ops = {n.op for n in graph.nodes}
    assert {"compare", "logical", "cast", "where", "float", "constant"} <= ops
    onnx_model = graph_to_onnx(graph)
    for batch, seed in ((2, 3), (3, 4)):
        assert_exact_in_runtimes(integer, graph, onnx_model, _mask_inputs(batch, seed))


class _IdsView(nn.Module):
    """GPT-2's ``input_ids.view(-1, L)`` on the int64 input, then an embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(50, 16), nn.Linear(16, 4)
        self.dq = fxq.DeQuantStub()

    def forward(self, input_ids):
        ids = input_ids.view(-1, input_ids.shape[-1])
        return self.dq(self.head(self.embed(ids)))


def test_ids_view_on_the_int64_input_exports_with_a_dynamic_batch():
    torch.manual_seed(0)
    ids = [torch.randint(0, 50, (2, 5)) for _ in range(3)]
    integer = convert_calibrated(_IdsView(), [(i,) for i in ids[:2]])
    graph = fxq.export.to_graph(integer, ids[2])
    assert graph.dynamic_batch and graph.tensors["input_ids"].dtype == "int64"
    onnx_model = graph_to_onnx(graph)
    for x in (ids[2], torch.randint(0, 50, (3, 5))):
        assert_exact_in_runtimes(integer, graph, onnx_model, (x,))


class _InPlace(nn.Module):
    def __init__(self, assign: bool = False) -> None:
        super().__init__()
        self.embed, self.dq = nn.Embedding(50, 8), fxq.DeQuantStub()
        self.assign = assign

    def forward(self, input_ids):
        shifted = input_ids * 2
        if self.assign:
            shifted[:, 0] = 0
        shifted.add_(3)  # an in-place op on a plain tensor: computed, not dropped
        return self.dq(self.embed(input_ids)), shifted


def test_in_place_ops_export_and_item_assignment_is_refused_with_its_line():
    ids = torch.randint(0, 50, (2, 5))
    integer = convert_calibrated(_InPlace(), [(ids,)])
    graph = fxq.export.to_graph(integer, ids)
    assert_exact_in_runtimes(integer, graph, graph_to_onnx(graph), (torch.randint(0, 50, (3, 5)),))
    integer = convert_calibrated(_InPlace(assign=True), [(ids,)])
    line = _InPlace.forward.__code__.co_firstlineno + 3
    with pytest.raises(
        fxq.export.ExportError, match=rf"'setitem_' .*{__file__}:{line}\): float op without"
    ):
        fxq.export.to_graph(integer, ids)


class _BoolMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.dq = fxq.QuantStub(), fxq.DeQuantStub()
        self.conv = nn.Conv1d(4, 4, 1)

    def forward(self, x, keep):
        y = self.dq(self.conv(self.q(x)))
        return y.masked_fill(~keep[:, None, :], 0.0)


@pytest.fixture(scope="module")
def bool_graph() -> tuple[nn.Module, fxq.export.IntegerGraph, tuple]:
    torch.manual_seed(0)
    keep = torch.tensor([[True, True, False], [True, False, False]])
    data = [(torch.randn(2, 4, 3), keep) for _ in range(2)]
    integer = convert_calibrated(_BoolMask(), data)
    return integer, fxq.export.to_graph(integer, data[0]), data[1]


def test_a_bool_input_is_carried_as_bool(bool_graph, tmp_path):
    integer, graph, inputs = bool_graph
    assert graph.tensors["keep"].dtype == "bool"
    assert_exact_in_runtimes(integer, graph, graph_to_onnx(graph), inputs)
    graph.save(tmp_path / "g.fxq")
    loaded = fxq.export.load(tmp_path / "g.fxq")
    assert loaded.tensors["keep"].dtype == "bool"
    assert_equal_outputs(outputs(integer, inputs), loaded.run(*graph_arrays(inputs, loaded)))
    x, keep = graph_arrays(inputs, graph)
    with pytest.raises(GraphInputError, match=r"input 'keep': got dtype int64, expected bool"):
        loaded.run(x, keep.astype(np.int64))


def test_an_unsupported_op_on_a_mask_is_refused_at_export_with_its_line():
    class Positions(nn.Module):
        """RoBERTa's position ids from the mask: a cumulative sum, which is not exported."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.dq = fxq.DeQuantStub()

        def forward(self, input_ids, mask):
            positions = torch.cumsum(mask, dim=1) * mask
            return self.dq(self.embed(input_ids) + self.embed(positions))

    ids, mask = torch.randint(0, 8, (2, 4)), torch.ones(2, 4, dtype=torch.long)
    integer = convert_calibrated(Positions(), [(ids, mask)])
    line = Positions.forward.__code__.co_firstlineno + 1
    with pytest.raises(
        fxq.export.ExportError, match=rf"'cumsum' .*{__file__}:{line}\).*float op without"
    ):
        fxq.export.to_graph(integer, (ids, mask))


# -- the loader checks the version-2 nodes --------------------------------------------------------
def _edited(graph: fxq.export.IntegerGraph, tmp_path, edit) -> str:
    graph.save(tmp_path / "g.fxq")
    with zipfile.ZipFile(tmp_path / "g.fxq") as z:
        members = {n: z.read(n) for n in z.namelist()}
    meta = json.loads(members["graph.json"])
    edit(meta)
    members["graph.json"] = json.dumps(meta).encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    path = tmp_path / "edited.fxq"
    path.write_bytes(buf.getvalue())
    return str(path)


def _op(meta: dict, op: str) -> dict:
    return next(n for n in meta["nodes"] if n["op"] == op)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda m: _op(m, "logical")["attrs"].update(fn="nand"), r"fn 'nand' is not one of"),
        (
            lambda m: m["tensors"][_op(m, "logical")["outputs"][0]].update(dtype="int8"),
            r"op 'logical'\): inputs or output not bool",
        ),
        (
            lambda m: _op(m, "where")["inputs"].reverse(),
            r"op 'where'\): a condition input of dtype float32",
        ),
        (lambda m: _op(m, "constant").update(attrs={"batch": True}), r"batch True with 0 inputs"),
        (
            lambda m: m["tensors"][_op(m, "constant")["outputs"][0]].update(dtype="int64"),
            r"a float32 value for a int64 output",
        ),
    ],
)
def test_damaged_version_2_nodes_are_refused(bool_graph, tmp_path, edit, match):
    _, graph, _ = bool_graph
    with pytest.raises(IntegerGraphFormatError, match=match):
        fxq.export.load(_edited(graph, tmp_path, edit))


def test_a_damaged_softmax_keep_input_is_refused(hf, tmp_path):
    _, graph, _ = hf("bert")

    def keep_not_bool(m: dict) -> None:
        softmax = _op(m, "softmax")
        softmax["inputs"][1] = softmax["inputs"][0]  # the int16 scores

    with pytest.raises(IntegerGraphFormatError, match=r"a keep-mask input that is not bool"):
        fxq.export.load(_edited(graph, tmp_path, keep_not_bool))
