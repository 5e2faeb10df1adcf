"""``fxq.primitives``: each primitive is defined once (torch, numpy, ONNX, schema side by side)
and ``to_graph`` records the primitive calls an integer module's own ``forward`` makes.

The first test is "adding an op" end to end: a primitive and an integer class written here,
with no export rule and no change to ``fxq.export``, export to the integer graph, its file and
the integer ONNX bit for bit."""

from __future__ import annotations

import threading

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

import fxq
import fxq.export
from fxq.export import build
from fxq.primitives import PRIMITIVES, Call, Primitive, is_recording, record, recording
from fxq.primitives.core import register
from fxq.primitives.schema import OpSpec
from fxq.qtensor import QTensor
from fxq.quantized.base import QuantizedModule


# -- a new op: halve toward zero, a primitive of its own ----------------------------------------
def _numpy_halve(node, inputs):
    x = inputs[0].astype(np.int64)
    return [(np.sign(x) * (np.abs(x) >> 1)).astype(np.int8)]


def _onnx_halve(w, node, outs):
    x = w.as_int(node.inputs[0])
    half = w.op("Div", [x, w.int_const(2)])  # integer Div truncates toward zero
    w.cast(half, "int8", outs[0])


def _halve(v: torch.Tensor) -> torch.Tensor:
    y = torch.trunc(v / 2)
    if is_recording():
        record(Call("test_halve", [v], [y], ["int8"]))
    return y


class Halve(QuantizedModule):
    """``x / 2`` toward zero on the same grid (an int8 op no fxq class computes)."""

    def forward(self, x: QTensor) -> QTensor:
        return QTensor(_halve(x.values()), x.scale, x.qdtype)


@pytest.fixture
def halve_primitive():
    primitive = register(
        Primitive("test_halve", _numpy_halve, _onnx_halve, OpSpec((1,), {}, {}), doc="x / 2")
    )
    yield primitive
    del PRIMITIVES[primitive.name]


def _converted(model: nn.Module, x: torch.Tensor) -> torch.fx.GraphModule:
    qat = fxq.prepare_qat_fx(model.eval(), {"": fxq.qconfig.default_qat_8bit_fake_quant_qconfig})
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    qat(x)
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
    return fxq.convert_fx(qat)


def _insert_after(gm: torch.fx.GraphModule, target_op: str, name: str, module: nn.Module):
    """Insert ``module`` after the first node calling ``target_op`` (a deploy-style edit)."""
    node = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == target_op)
    gm.add_submodule(name, module)
    with gm.graph.inserting_after(node):
        new = gm.graph.call_module(name, (node,))
    node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
    gm.recompile()
    return gm


def test_a_new_op_exports_with_a_primitive_and_no_export_code(bayes, halve_primitive, tmp_path):
    x = torch.randn(3, 3, 8, 8)
    model = nn.Sequential(fxq.QuantStub(), nn.Conv2d(3, 4, 3), fxq.DeQuantStub())
    gm = _insert_after(_converted(model, x), "1", "halve", Halve(fxq.get_march()))
    assert build.rule_for_module(gm.halve) is build.record_calls
    want = gm(x).numpy()

    graph = fxq.export.to_graph(gm, x)
    assert [n.op for n in graph.nodes] == ["quantize", "conv", "test_halve", "dequantize"]
    assert np.array_equal(graph.run(x.numpy())[0], want)
    graph.save(tmp_path / "g.fxq")  # the file schema is the primitive's OpSpec
    assert np.array_equal(fxq.export.load(tmp_path / "g.fxq").run(x.numpy())[0], want)
    fxq.export.to_onnx(gm, x, tmp_path / "g.onnx")
    session = ort.InferenceSession(str(tmp_path / "g.onnx"))
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    assert np.array_equal(got, want)


class _Unrecorded(QuantizedModule):
    """Computes integers without a primitive: export cannot know what it did."""

    def forward(self, x: QTensor) -> QTensor:
        return QTensor(x.values().neg(), x.scale, x.qdtype)


def test_an_integer_result_no_primitive_made_is_an_export_error(bayes):
    x = torch.randn(2, 3, 8, 8)
    model = nn.Sequential(fxq.QuantStub(), nn.Conv2d(3, 4, 3), fxq.DeQuantStub())
    gm = _insert_after(_converted(model, x), "1", "neg", _Unrecorded(fxq.get_march()))
    with pytest.raises(build.ExportError) as err:
        fxq.export.to_graph(gm, x)
    message = str(err.value)
    assert "node 'neg'" in message and "_Unrecorded returned a tensor" in message
    assert "fxq.primitives" in message and "forward hook" in message


def test_a_hook_that_replaces_an_output_is_named(bayes):
    """A forward hook that returns a value replaces the module's output with something no
    primitive call made: export says so instead of exporting what the hook did not do."""
    x = torch.randn(2, 3, 8, 8)
    model = nn.Sequential(fxq.QuantStub(), nn.Conv2d(3, 4, 3), fxq.DeQuantStub())
    gm = _converted(model, x)
    stale = gm.get_submodule("1")(gm.get_submodule("0")(x))  # an earlier call's output
    gm.get_submodule("1").register_forward_hook(lambda m, i, o: stale)
    with pytest.raises(build.ExportError, match="forward hook that replaces"):
        fxq.export.to_graph(gm, x)


def test_recorded_nodes_carry_what_forward_computed_with(bayes):
    """A LookupTable's exported table is the one its forward indexed (not a second build),
    and the function it tabulates is named for the QDQ form."""
    x = torch.randn(2, 3, 8, 8)
    model = nn.Sequential(fxq.QuantStub(), nn.Conv2d(3, 4, 3), nn.GELU(), fxq.DeQuantStub())
    gm = _converted(model, x)
    calls: list[Call] = []
    with recording(calls.append):
        gm(x)
    (lut,) = [c for c in calls if c.op == "lut"]
    graph = fxq.export.to_graph(gm, x)
    (node,) = [n for n in graph.nodes if n.op == "lut"]
    assert np.array_equal(node.params["table"], lut.params["table"].numpy())
    assert node.attrs == {
        "dtype": "int8",
        "function": "gelu",
        "function_args": {"approximate": "none"},
    }


def test_recording_is_per_thread_and_not_nested():
    calls: list[Call] = []
    v = torch.tensor([3.0, -3.0])
    with recording(calls.append):
        with pytest.raises(RuntimeError, match="already active"), recording(calls.append):
            pass
        thread = threading.Thread(target=_halve, args=(v,))
        thread.start()
        thread.join()
        assert calls == []  # another thread's call is not this export's
        _halve(v)
    assert [c.op for c in calls] == ["test_halve"]
    assert not is_recording()
    _halve(v)
    assert len(calls) == 1


def test_every_primitive_is_whole():
    """Each registered primitive has its numpy kernel, ONNX lowering and file schema, and is
    no longer also defined in fxq.export (one definition)."""
    from fxq.export import onnx_integer, qdq, runtime, validate

    names = {"lut", "segment_lut", "embedding", "requantize", "prelu", "extremum", "where"}
    names |= {"add", "mul", "divide", "matmul", "conv", "linear", "channel_affine", "softmax"}
    assert names | {"normalize", "l2_normalize"} <= set(PRIMITIVES)
    for name, p in PRIMITIVES.items():
        assert callable(p.numpy) and callable(p.onnx) and isinstance(p.spec, OpSpec), name
        assert runtime.kernel(name) is p.numpy
        assert name not in runtime.KERNELS and name not in validate.OP_SPECS, name
        assert not hasattr(onnx_integer.IntegerWriter, f"op_{name}"), name
        assert not hasattr(qdq.QDQWriter, f"op_{name}"), name


def test_torch_export_keeps_a_table_lookup_as_one_op(bayes):
    x = torch.randn(2, 3, 8, 8)
    model = nn.Sequential(fxq.QuantStub(), nn.Conv2d(3, 4, 3), nn.Sigmoid(), fxq.DeQuantStub())
    gm = _converted(model, x)
    program = torch.export.export(gm, (x,))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "fxq.lut.default" in targets
    assert torch.equal(program.module()(x), gm(x))


class _Arithmetic(nn.Module):
    """An integer matmul, residual add, product, division and leaky ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = fxq.QuantStub()
        self.dequant = fxq.DeQuantStub()
        self.fc = nn.Linear(8, 8)
        self.act = nn.LeakyReLU(0.1)

    def forward(self, x):
        x = self.quant(x)
        y = self.act(self.fc(x))
        s = torch.matmul(y, x.transpose(-2, -1))
        z = (y + x) * x
        return self.dequant(s), self.dequant(z / (y.abs() + 1))


def test_torch_export_keeps_each_arithmetic_primitive_as_one_op(bayes):
    x = torch.randn(2, 5, 8)
    gm = _converted(_Arithmetic(), x)
    program = torch.export.export(gm, (x,))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    for op in ("quantize", "matmul", "add", "mul", "divide", "prelu"):
        assert f"fxq.{op}.default" in targets, op
    xs = torch.randn(2, 5, 8) * 2
    for got, want in zip(program.module()(xs), gm(xs)):
        assert torch.equal(got, want)


def test_a_call_without_an_exported_form_names_the_node(bayes):
    """An unbatched convolution runs (as torch's does) but has no exported form: the error
    names the node and says what to do."""
    x = torch.randn(2, 3, 8, 8)
    model = nn.Sequential(fxq.QuantStub(), nn.Conv2d(3, 4, 3), fxq.DeQuantStub())
    gm = _converted(model, x)
    with pytest.raises(build.ExportError, match=r"node '_1'.*unbatched convolution inputs"):
        fxq.export.to_graph(gm, x[0])


class _SoftmaxOverBatch(nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=0)


def test_a_recorded_reduction_over_the_batch_fixes_the_graphs_batch_size(bayes):
    """Softmax over axis 0 mixes the samples of a batch: the graph could not take another
    batch size, so it is exported with the example's (``Call.axis0``), as a float op across
    the batch is, and refuses another by name."""
    from fxq.export import GraphInputError
    from fxq.export.onnx import graph_to_onnx
    from tests.export.helpers import assert_exact_in_runtimes

    x = torch.randn(2, 3, 8, 8)
    model = nn.Sequential(
        fxq.QuantStub(), nn.Conv2d(3, 4, 3), _SoftmaxOverBatch(), fxq.DeQuantStub()
    )
    gm = _converted(model, x)
    graph = fxq.export.to_graph(gm, x)
    assert not graph.dynamic_batch
    assert_exact_in_runtimes(gm, graph, graph_to_onnx(graph), (torch.randn(2, 3, 8, 8),))
    with pytest.raises(GraphInputError, match="exported with a fixed batch size"):
        graph.run(np.zeros((3, 3, 8, 8), np.float32))


class _Moves(nn.Module):
    """cat / stack / einsum: operands requantized, moved and multiplied inside the module."""

    def __init__(self):
        super().__init__()
        self.q = fxq.QuantStub()
        self.a, self.b = nn.Conv2d(3, 4, 3), nn.Conv2d(3, 4, 3)
        self.dq = fxq.DeQuantStub()

    def forward(self, x):
        x = self.q(x)
        a, b = self.a(x), self.b(x)
        f, g = a.flatten(2), b.flatten(2)
        return (
            self.dq(torch.cat([a, b], 1)),
            self.dq(torch.stack([a, b], 2)),
            self.dq(torch.einsum("bij,bkj->bik", f, g)),  # b transposed
            self.dq(torch.einsum("bji,bjk->bki", f, g)),  # a and the output transposed
        )


def test_moves_inside_a_module_are_recorded_and_keep_the_batch_dynamic(bayes, tmp_path):
    gm = _converted(_Moves(), torch.randn(4, 3, 8, 8))
    x = torch.randn(2, 3, 8, 8)
    graph = fxq.export.to_graph(gm, x)
    ops = [n.op for n in graph.nodes]
    assert ops.count("transpose") == 3 and ops.count("concat") == 2 and "reshape" in ops
    stacked = [n for n in graph.nodes if n.op == "reshape" and n.name.startswith("stack")]
    assert [n.attrs["shape"][0] for n in stacked] == [0, 0]  # the batch stays dynamic
    fxq.export.to_onnx(gm, x, tmp_path / "m.onnx")
    session = ort.InferenceSession(str(tmp_path / "m.onnx"))
    for batch in (2, 5):
        xb = torch.randn(batch, 3, 8, 8)
        want = [t.numpy() for t in gm(xb)]
        got = graph.run(xb.numpy())
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
        got = session.run(None, {session.get_inputs()[0].name: xb.numpy()})
        assert all(np.array_equal(a, b) for a, b in zip(got, want))


# -- attention: recorded like any integer module, masks from the graph's inputs included --------
class _PaddedAttention(nn.Module):
    """``nn.MultiheadAttention`` and ``F.scaled_dot_product_attention`` over a padded batch: the
    padding mask comes from the int64 input ``mask`` (``mask == 0``), with a constant causal
    ``attn_mask`` (a buffer of ``-inf``) for one call and the averaged weights returned."""

    def __init__(self):
        super().__init__()
        self.q, self.dq = fxq.QuantStub(), fxq.DeQuantStub()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
        self.register_buffer("causal", torch.zeros(6, 6).masked_fill(causal, float("-inf")))

    def forward(self, x, mask):
        h = self.q(x)
        pad = mask == 0
        out, weights = self.mha(h, h, h, key_padding_mask=pad, attn_mask=self.causal)
        plain, _ = self.mha(h, h, h, key_padding_mask=pad, need_weights=False)
        heads = h.view(h.shape[0], 6, 2, 4).transpose(1, 2)
        keep = ~pad[:, None, None, :]
        sdpa = torch.nn.functional.scaled_dot_product_attention(heads, heads, heads, attn_mask=keep)
        return self.dq(out), self.dq(weights), self.dq(plain), self.dq(sdpa)


def _padded(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, 6, dtype=torch.long)
    mask[0, 3:] = 0
    return torch.randn(batch, 6, 8, generator=g), mask


def test_attention_exports_by_recording_with_a_padding_mask_from_the_inputs(bayes):
    from fxq.export.onnx import graph_to_onnx
    from fxq.quantized import attention
    from tests.export.helpers import assert_exact_in_runtimes, convert_calibrated

    classes = (attention.ScaledDotProductAttention, attention.MultiheadAttention)
    assert not hasattr(build, "RULES")  # no integer class has a hand-written export rule
    torch.manual_seed(0)
    integer = convert_calibrated(_PaddedAttention(), [_padded(2, 1), _padded(3, 2)])
    found = [m for m in integer.modules() if isinstance(m, classes)]
    assert {type(m) for m in found} == set(classes)
    assert all(build.rule_for_module(m) is build.record_calls for m in found)
    graph = fxq.export.to_graph(integer, _padded(2))
    assert graph.dynamic_batch and graph.tensors["mask"].dtype == "int64"
    softmax = [n for n in graph.nodes if n.op == "softmax"]
    # the keep-masks are computed in the graph: each softmax's second input
    assert len(softmax) == 3 and all(
        len(n.inputs) == 2 and not n.params.get("keep") for n in softmax
    )
    assert {"axis_matmul", "linear", "compare", "logical", "constant"} <= {
        n.op for n in graph.nodes
    }
    onnx_model = graph_to_onnx(graph)
    for batch, seed in ((2, 3), (3, 4), (1, 5)):
        assert_exact_in_runtimes(integer, graph, onnx_model, _padded(batch, seed))
    # the mask is an input: padding changes the kept tokens' outputs
    x, mask = _padded(2, 3)
    a = graph.run(x.numpy(), mask.numpy())[0]
    b = graph.run(x.numpy(), np.ones_like(mask.numpy()))[0]
    assert not np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_attention_refusals_and_constant_masks_of_the_batch_size(bayes):
    from tests.export.helpers import registry_model

    # a constant keep-mask with one row per sample (the registry's example) fixes the batch
    sdpa = torch.nn.functional.scaled_dot_product_attention
    integer, x = registry_model("scaled_dot_product_attention", sdpa)
    assert not fxq.export.to_graph(integer, x).dynamic_batch

    class SequenceFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.dq = fxq.QuantStub(), fxq.DeQuantStub()
            self.mha = nn.MultiheadAttention(8, 2)

        def forward(self, x):
            h = self.q(x)
            return self.dq(self.mha(h, h, h)[0])

    x = torch.randn(5, 2, 8)
    gm = _converted(SequenceFirst(), x)
    with pytest.raises(fxq.export.ExportError, match=r"'mha'.*batch_first=True only"):
        fxq.export.to_graph(gm, x)


class _WholeReductions(nn.Module):
    """Reductions over every axis: torch gives 0-d tensors (``x.sum()``, ``x.mean()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        y = self.conv(x)
        return y.sum(), y.mean(), y.mean((0, 1, 2, 3)), y.sum((1, 2, 3)), torch.amax(y)


def test_whole_tensor_reductions_keep_the_float_ops_shapes_and_export_exactly():
    from fxq.export.onnx import graph_to_onnx
    from tests.export.helpers import assert_exact_in_runtimes, convert_calibrated

    torch.manual_seed(0)
    model = _WholeReductions().eval()
    batches = [(torch.randn(2, 3, 8, 8),) for _ in range(2)]
    with torch.no_grad():
        shapes = [tuple(t.shape) for t in model(*batches[0])]
    assert shapes == [(), (), (), (2,), ()]
    integer = convert_calibrated(model, batches)
    with torch.no_grad():
        got = integer(*batches[0])
    # a sum or mean of the whole tensor was (1,) in VALIDATION and the integer model
    assert [tuple(t.shape) for t in got] == shapes
    graph = fxq.export.to_graph(integer, batches[0])
    # a sum over the samples exports (it was refused), with the batch size fixed, as a float
    # op across the batch fixes it
    assert not graph.dynamic_batch
    assert_exact_in_runtimes(integer, graph, graph_to_onnx(graph), batches[1])


class _ReluForOneSample(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        if x.shape[0] == 1:  # decided from the example's batch size
            y = torch.relu(y)
        return y


def test_a_branch_decided_from_the_batch_size_fixes_it():
    from tests.export.helpers import convert_calibrated

    torch.manual_seed(0)
    x = torch.randn(1, 3, 8, 8)
    integer = convert_calibrated(_ReluForOneSample().eval(), [(x,)])
    graph = fxq.export.to_graph(integer, (x,))
    assert not graph.dynamic_batch  # a batch of 3 would take the other branch
    with torch.no_grad():
        assert np.array_equal(graph.run(x.numpy())[0], integer(x).numpy())
    # a branch on the spatial sizes keeps the batch dynamic (ResizesUnlessSquare16's)
    from tests.fx.test_tracer import ResizesUnlessSquare16

    x = torch.randn(2, 3, 16, 16)
    integer = convert_calibrated(ResizesUnlessSquare16().eval(), [(x,)])
    assert fxq.export.to_graph(integer, (x,)).dynamic_batch
