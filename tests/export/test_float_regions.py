"""Float regions export (``docs/integer_graph.md``, 2, "Float regions"): a qconfig of ``None``
on a block in the middle, float post-processing after the last dequantize, and the float ops
one by one, in the numpy runtime and in onnxruntime, against torch's float result within the
stated tolerance; the integer parts after a float region exact given the same float input."""

from __future__ import annotations

import inspect
import json
import warnings
import zipfile
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxq
import fxq.export
from fxq.export import runtime as rt
from fxq.qconfig import default_qat_8bit_fake_quant_qconfig as q8
from tests.export.helpers import run_onnx
from tests.helpers import calibrate

#: the contract of docs/integer_graph.md (2, "Float regions"): max |error| of a float part
#: relative to the largest |value| of the tensor
NUMPY_TOLERANCE = 1e-5
ONNX_TOLERANCE = 1e-4


def _convert(model: nn.Module, qconfig: dict, batches: list[torch.Tensor]) -> nn.Module:
    torch.manual_seed(0)
    qat = calibrate(fxq.prepare_qat_fx(model.eval(), qconfig), batches)
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxq.convert_fx(qat)


def _relative_error(expected: np.ndarray, got: np.ndarray) -> float:
    """max |got - expected| / max |expected| over the finite entries (the others must agree)."""
    finite = np.isfinite(expected)
    assert np.array_equal(np.isfinite(got), finite)
    assert np.array_equal(expected[~finite], got[~finite], equal_nan=True)
    scale = float(np.abs(expected[finite]).max()) or 1.0
    return float(np.abs(got[finite].astype(np.float64) - expected[finite]).max()) / scale


def _torch_outputs(model: nn.Module, *x: torch.Tensor) -> list[np.ndarray]:
    with torch.no_grad():
        out = model(*x)
    return [o.numpy() for o in (out if isinstance(out, tuple) else (out,))]


# -- (a) a None-qconfig conv + bn + relu block in the middle of a CNN ----------------------------
class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)))


class _MiddleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = fxq.QuantStub(), fxq.DeQuantStub()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block = _Block()
        self.head = nn.Conv2d(8, 8, 3, stride=2)
        self.fc = nn.Linear(8, 5)
        self.block.bn.running_mean.uniform_(-0.5, 0.5)
        self.block.bn.running_var.uniform_(0.5, 2.0)
        self.block.bn.weight.data.uniform_(0.5, 1.5)
        self.block.bn.bias.data.uniform_(-0.2, 0.2)

    def forward(self, x):
        x = torch.relu(self.stem(self.quant(x)))
        x = torch.relu(self.head(self.block(x)))
        return self.dequant(self.fc(x.mean((2, 3))))


@pytest.fixture(scope="module")
def middle():
    """The converted ``_MiddleNet`` (march bayes) and its graph."""
    from fxq import march as march_module

    saved = march_module._global_march
    fxq.set_march("bayes")
    try:
        torch.manual_seed(0)
        data = [torch.randn(8, 3, 16, 16) for _ in range(3)]
        integer = _convert(_MiddleNet(), {"": q8, "module_name": [("block", None)]}, data)
        graph = fxq.export.to_graph(integer, torch.randn(2, 3, 16, 16))
    finally:
        march_module._global_march = saved
    return integer, graph


def _region_values(integer: nn.Module, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The integer model's float region output (the fused block) and its re-quantized integers."""
    seen = {}
    hooks = [
        integer.get_submodule("block.conv").register_forward_hook(
            lambda m, i, o: seen.__setitem__("float", o.numpy())
        ),
        integer.get_submodule("block_conv_quant").register_forward_hook(
            lambda m, i, o: seen.__setitem__("int", o.int_repr().numpy())
        ),
    ]
    with torch.no_grad():
        integer(x)
    for h in hooks:
        h.remove()
    return seen["float"], seen["int"]


def test_middle_region_exports_as_float_ops(middle):
    integer, graph = middle
    ops = [n.op for n in graph.nodes]
    assert ops[:3] == ["quantize", "conv", "dequantize"]
    assert ops[3:7] == ["float_conv", "float_batch_norm", "float_unary", "quantize"]
    assert graph.dynamic_batch and graph.format_version() == 3
    conv = graph.nodes[3]
    assert conv.attrs["groups"] == 2 and conv.params["weight"].dtype == np.float32
    assert np.array_equal(conv.params["weight"], integer.block.conv.op.weight.detach().numpy())


def test_middle_region_numpy_and_onnxruntime_within_the_contract(middle):
    integer, graph = middle
    torch.manual_seed(1)
    x = torch.randn(64, 3, 16, 16)
    expected_float, expected_int = _region_values(integer, x)
    # the float region and its re-quantization, read from the graph as extra outputs
    inner = fxq.export.to_graph(
        integer, x[:2], outputs=["block_conv", "block_conv_quant", "dequant"]
    )
    got_float, got_int, got = inner.run(x.numpy())
    assert _relative_error(expected_float, got_float) <= NUMPY_TOLERANCE
    steps = np.abs(got_int.astype(np.int64) - expected_int)
    assert steps.max() <= 1 and (steps == 0).mean() >= 0.999
    # the integer part after the float region is exact given the same float input
    scale = inner.tensors["block_conv_quant"].scale
    assert np.array_equal(rt.quantize(expected_float, scale, "int8"), expected_int)
    # the model's outputs: equal but where a re-quantized value moved one step (which the
    # integer layers after it carry on, by a few output steps at most)
    (expected,) = _torch_outputs(integer, x)
    out_scale = next(n for n in graph.nodes if n.name == "dequant").attrs["scale"]
    for got_out in (graph.run(x.numpy())[0], run_onnx(fxq.export.to_onnx(integer, x[:2]), (x,))[0]):
        diff = np.abs(got_out - expected) / out_scale
        assert (diff < 1e-3).mean() >= 0.99 and diff.max() <= 3


def test_middle_region_onnx_float_part_within_the_contract(middle):
    integer, _ = middle
    torch.manual_seed(2)
    x = torch.randn(16, 3, 16, 16)
    expected_float, expected_int = _region_values(integer, x)
    model = fxq.export.to_onnx(integer, x[:2], outputs=["block_conv", "block_conv_quant"])
    got_float, got_int = run_onnx(model, (x,))
    assert _relative_error(expected_float, got_float) <= ONNX_TOLERANCE
    steps = np.abs(got_int.astype(np.int64) - expected_int)
    assert steps.max() <= 1 and (steps == 0).mean() >= 0.999


# -- (b) the vendor-typical float tail ----------------------------------------------------------
class _SoftmaxTail(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = fxq.QuantStub(), fxq.DeQuantStub()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU())
        self.classifier = nn.Conv2d(8, 10, 7)

    def forward(self, x):
        x = self.features(self.quant(x))
        return self.dequant(self.classifier(x)).flatten(1).softmax(-1)


def test_float_softmax_tail(bayes):
    torch.manual_seed(0)
    # the qconfig decides what is quantized (not the stubs): None keeps the softmax in float
    qconfig = {"": q8, "module_type": {"softmax": None}}
    integer = _convert(_SoftmaxTail(), qconfig, [torch.randn(8, 3, 16, 16) for _ in range(2)])
    x = torch.randn(32, 3, 16, 16)
    graph = fxq.export.to_graph(integer, x[:2])
    assert [n.op for n in graph.nodes][-3:] == ["dequantize", "reshape", "float_softmax"]
    (expected,) = _torch_outputs(integer, x)
    assert _relative_error(expected, graph.run(x.numpy())[0]) <= NUMPY_TOLERANCE
    onnx_out = run_onnx(fxq.export.to_onnx(integer, x[:2]), (x,))[0]
    assert _relative_error(expected, onnx_out) <= ONNX_TOLERANCE
    assert np.allclose(onnx_out.sum(-1), 1.0, atol=1e-5)


# -- (c) a float LayerNorm / Linear / GELU region in a transformer-style block --------------------
class _Mlp(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(self.norm(x))))


class _Encoder(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.quant, self.dequant = fxq.QuantStub(), fxq.DeQuantStub()
        self.embed = nn.Linear(8, dim)
        self.mlp = _Mlp(dim)
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        x = self.embed(self.quant(x))
        x = x + self.mlp(x)
        return self.dequant(self.head(x))


def test_float_transformer_mlp_region(bayes):
    torch.manual_seed(0)
    data = [torch.randn(4, 10, 8) for _ in range(3)]
    integer = _convert(_Encoder(), {"": q8, "module_name": [("mlp", None)]}, data)
    x = torch.randn(16, 10, 8)
    graph = fxq.export.to_graph(integer, x[:2])
    ops = [n.op for n in graph.nodes]
    assert [o for o in ops if o.startswith("float_")] == [
        "float_layer_norm",
        "float_linear",
        "float_unary",
        "float_linear",
    ]
    names = ["mlp_fc2", "mlp_fc2_quant", "dequant"]
    inner = fxq.export.to_graph(integer, x[:2], outputs=names)
    seen = {}
    hook = integer.get_submodule("mlp.fc2").register_forward_hook(
        lambda m, i, o: seen.__setitem__("float", o.numpy())
    )
    (expected,) = _torch_outputs(integer, x)
    hook.remove()
    for got_float, _, got in (
        inner.run(x.numpy()),
        run_onnx(fxq.export.to_onnx(integer, x[:2], outputs=names), (x,)),
    ):
        assert _relative_error(seen["float"], got_float) <= ONNX_TOLERANCE
        out_scale = inner.tensors["dequant"].scale or graph.nodes[-1].attrs["scale"]
        diff = np.abs(got - expected) / out_scale
        assert (diff < 1e-3).mean() >= 0.99 and diff.max() <= 3


# -- the float ops one by one ------------------------------------------------------------------
class _Wrap(nn.Module):
    def __init__(self, fn: Callable, *modules: nn.Module) -> None:
        super().__init__()
        self.fn, self.m = fn, nn.ModuleList(modules)

    def forward(self, x):
        return self.fn(self.m, x)


class _Tail(nn.Module):
    """quantize, conv, dequantize, then a float tail (qconfig None)."""

    def __init__(self, fn: Callable, *modules: nn.Module) -> None:
        super().__init__()
        self.quant, self.dequant = fxq.QuantStub(), fxq.DeQuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.tail = _Wrap(fn, *modules)

    def forward(self, x):
        return self.tail(self.dequant(self.conv(self.quant(x))))


def _bn() -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(8).eval()
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    bn.weight.data.uniform_(0.5, 2)
    bn.bias.data.uniform_(-1, 1)
    return bn


_f = lambda *ts: torch.cat([t.flatten(1) for t in ts], 1)  # noqa: E731

#: name -> (float tail, its modules, the IR ops it must export to)
_OPS: dict[str, tuple[Callable, list[Callable[[], nn.Module]], set[str]]] = {
    "conv2d": (
        lambda m, x: _f(m[0](x), F.conv2d(x, m[1].weight, None, 1, "same")),
        [lambda: nn.Conv2d(8, 6, 3, stride=2, padding=(1, 2), dilation=(1, 2), groups=2),
         lambda: nn.Conv2d(8, 6, 4)],
        {"float_conv"},
    ),
    "conv1d": (lambda m, x: m[0](x.flatten(2)), [lambda: nn.Conv1d(8, 6, 5, 3, 2)], {"float_conv"}),
    "linear_matmul": (
        lambda m, x: _f(m[0](x.transpose(1, 3)), torch.bmm(x.flatten(2), x.flatten(2).transpose(1, 2)) @ x[:, :, :, :1].flatten(2)),
        [lambda: nn.Linear(8, 5)],
        {"float_linear", "float_matmul"},
    ),
    "batch_norm": (lambda m, x: m[0](x), [_bn], {"float_batch_norm"}),
    "layer_norm": (
        lambda m, x: _f(m[0](x), F.layer_norm(x, (16,), eps=1e-3)),
        [lambda: nn.LayerNorm([16, 16])],
        {"float_layer_norm"},
    ),
    "activations": (
        lambda m, x: _f(
            F.relu(x), F.relu6(4 * x), F.gelu(x), F.gelu(x, approximate="tanh"), x.sigmoid(),
            torch.tanh(x), F.silu(x), F.hardswish(x), F.hardsigmoid(x), m[0](x), x.exp(),
            x.abs().log(), x.abs().sqrt(), x.clamp(-0.1, 0.3), x.clamp(min=0.2), F.hardtanh(x),
        ),
        [nn.GELU],
        {"float_unary"},
    ),
    "softmax": (lambda m, x: _f(x.softmax(1), F.log_softmax(x, -1), m[0](x)), [lambda: nn.Softmax(2)], {"float_softmax"}),
    "max_pool": (
        lambda m, x: _f(F.max_pool2d(x, 3, 2, 1, ceil_mode=True), F.max_pool2d(x, 2, dilation=2), m[0](x), F.max_pool1d(x.flatten(2), 4, 3, 2, ceil_mode=True)),
        [lambda: nn.MaxPool2d((2, 3), (3, 2), 1, dilation=(2, 1), ceil_mode=True)],
        {"float_pool"},
    ),
    "avg_pool": (
        lambda m, x: _f(
            F.avg_pool2d(x, 3, 2, 1, ceil_mode=True),
            F.avg_pool2d(x, 3, 2, 1, count_include_pad=False, ceil_mode=True),
            F.avg_pool2d(x, (3, 2), 2, 1, count_include_pad=False),
            m[0](x), F.avg_pool1d(x.flatten(2), 4, 3, 2, ceil_mode=True),
        ),
        [lambda: nn.AvgPool2d(2)],
        {"float_pool"},
    ),
    "adaptive_avg_pool": (
        lambda m, x: _f(F.adaptive_avg_pool2d(x, (5, 3)), F.adaptive_avg_pool2d(x, 1), m[0](x)),
        [lambda: nn.AdaptiveAvgPool2d((7, 16))],
        {"float_adaptive_pool"},
    ),
    "interpolate": (
        lambda m, x: _f(
            F.interpolate(x, scale_factor=2.5, mode="bilinear"),
            F.interpolate(x, size=(7, 11), mode="bilinear", align_corners=True),
            F.interpolate(x, size=(7, 11), mode="bilinear"),
            F.interpolate(x, scale_factor=1.5), F.interpolate(x, size=(5, 40)), m[0](x),
            F.interpolate(x.flatten(2), size=100, mode="linear"),
        ),
        [lambda: nn.UpsamplingBilinear2d(scale_factor=2)],
        {"float_interpolate"},
    ),
    "reductions": (
        lambda m, x: _f(x.mean((2, 3)), x.sum(1), torch.amax(x, (1, 2)), torch.amin(x, -1, keepdim=True), x.mean(-1)),
        [],
        {"float_reduce"},
    ),
    "cat_stack": (
        lambda m, x: torch.stack([torch.cat([x, x.exp()], 1), torch.cat([x * 2, x], 1)], 2),
        [],
        {"concat", "reshape"},
    ),
    "detection_decode": (
        lambda m, x: torch.cat([x[:, :2] + x[:, 2:4].exp() * 0.5, x[:, 4:].sigmoid()], 1),
        [],
        {"float", "float_unary", "concat"},
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(_OPS))
def test_float_op_in_numpy_and_onnxruntime(name, bayes, tmp_path):
    fn, modules, ops = _OPS[name]
    torch.manual_seed(0)
    model = _Tail(fn, *[make() for make in modules])
    integer = _convert(
        model, {"": q8, "module_name": [("tail", None)]}, [torch.randn(4, 3, 16, 16)]
    )
    x = torch.randn(3, 3, 16, 16)
    graph = fxq.export.to_graph(integer, x[:2])
    assert ops <= {n.op for n in graph.nodes} and graph.dynamic_batch
    (expected,) = _torch_outputs(integer, x)
    assert _relative_error(expected, graph.run(x.numpy())[0]) <= NUMPY_TOLERANCE
    graph.save(tmp_path / "g.fxq")
    assert np.array_equal(
        fxq.export.load(tmp_path / "g.fxq").run(x.numpy())[0], graph.run(x.numpy())[0]
    )
    got = run_onnx(fxq.export.to_onnx(integer, x[:2]), (x,))[0]
    assert _relative_error(expected, got) <= ONNX_TOLERANCE


def test_float_ops_in_qdq_onnx(middle):
    integer, _ = middle
    x = torch.randn(4, 3, 16, 16)
    (expected,) = _torch_outputs(integer, x)
    got = run_onnx(fxq.export.to_onnx(integer, x[:2], mode="qdq"), (x,))[0]
    assert np.abs(got - expected).max() <= 0.1 * np.abs(expected).max()


def test_a_softmax_over_the_batch_fixes_the_batch_size(bayes):
    model = _Tail(lambda m, x: x.softmax(0))
    integer = _convert(model, {"": q8, "module_name": [("tail", None)]}, [torch.randn(4, 3, 8, 8)])
    assert not fxq.export.to_graph(integer, torch.randn(2, 3, 8, 8)).dynamic_batch


# -- (d) an op without a rule is refused at export, by name and source line ----------------------
def _cumsum(m, x):
    return torch.cumsum(x, 1)


def test_an_unsupported_float_op_is_refused_with_its_name_and_line(bayes):
    integer = _convert(
        _Tail(_cumsum), {"": q8, "module_name": [("tail", None)]}, [torch.randn(2, 3, 8, 8)]
    )
    line = inspect.getsourcelines(_cumsum)[1] + 1
    with pytest.raises(fxq.export.ExportError, match=r"cumsum") as e:
        fxq.export.to_graph(integer, torch.randn(2, 3, 8, 8))
    assert f"test_float_regions.py:{line}" in str(e.value)
    assert "float op without an export rule" in str(e.value)
    # cumsum has no integer form: the advice is to export the network before it
    assert str(e.value).endswith(
        "it has no integer form either: export the network before it "
        "(to_graph(model, x, outputs=[<the nodes it reads>])) and run it after the graph"
    )


def _grid_sample(m, x):
    return F.grid_sample(x, x[:, :2].permute(0, 2, 3, 1).tanh(), align_corners=False)


def test_a_float_op_with_an_integer_form_is_advised_a_qconfig(bayes):
    integer = _convert(
        _Tail(_grid_sample), {"": q8, "module_name": [("tail", None)]}, [torch.randn(2, 3, 8, 8)]
    )
    with pytest.raises(fxq.export.ExportError, match="grid_sample") as e:
        fxq.export.to_graph(integer, torch.randn(2, 3, 8, 8))
    assert str(e.value).endswith(
        "give it a qconfig so that it is quantized, or keep it out of the exported part"
    )


def test_an_unsupported_argument_is_refused_at_export(bayes):
    conv = nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect")
    integer = _convert(
        _Tail(lambda m, x: m[0](x), conv),
        {"": q8, "module_name": [("tail", None)]},
        [torch.randn(2, 3, 8, 8)],
    )
    with pytest.raises(fxq.export.ExportError, match=r"padding_mode 'reflect'"):
        fxq.export.to_graph(integer, torch.randn(2, 3, 8, 8))


# -- (e) a saved file with a float region -------------------------------------------------------
def test_a_saved_float_region_loads_and_runs_the_same(middle, tmp_path):
    integer, graph = middle
    path = tmp_path / "g.fxq"
    graph.save(path)
    with zipfile.ZipFile(path) as z:
        assert json.loads(z.read("graph.json"))["version"] == 3
    loaded = fxq.export.load(path)
    x = torch.randn(5, 3, 16, 16).numpy()
    assert np.array_equal(loaded.run(x)[0], graph.run(x)[0])
    assert loaded.format_version() == 3


def test_a_damaged_float_node_is_a_format_error(middle, tmp_path):
    _, graph = middle
    path = tmp_path / "g.fxq"
    graph.save(path)
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    meta = json.loads(members["graph.json"])
    node = next(n for n in meta["nodes"] if n["op"] == "float_unary")
    node["attrs"]["fn"] = "erf"
    members["graph.json"] = json.dumps(meta).encode()
    with zipfile.ZipFile(path, "w") as z:
        for n, data in members.items():
            z.writestr(n, data)
    with pytest.raises(fxq.export.IntegerGraphFormatError, match=r"fn 'erf' is not one of"):
        fxq.export.load(path)
