"""The integer graph and its numpy runtime equal fxq's integer model bit for bit:
on every registry op, the op zoo, torchvision models, on every march."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import pytest
import torch
from torch import nn

import fxq
import fxq.export
from fxq import registry
from fxq.export import build
from fxq.export.onnx import graph_to_onnx
from fxq.registry import Kind
from tests.export.helpers import (
    assert_equal_outputs,
    lsb_difference,
    outputs,
    registry_model,
    run_onnx,
    torchvision_model,
)
from tests.helpers import ROOT
from tests.test_registry import _cases


@pytest.mark.parametrize(("row_name", "target"), _cases())
def test_registry_op_exports(bayes, row_name, target, tmp_path):
    """numpy runtime and integer ONNX: bit-exact; QDQ ONNX: within 2 LSB (one conversion)."""
    integer, x = registry_model(row_name, target)
    expected = outputs(integer, x)
    graph = fxq.export.to_graph(integer, x)
    assert_equal_outputs(expected, graph.run(*[t.numpy() for t in x]))
    if row_name in ("conv2d", "add", "sigmoid", "avg_pool2d"):  # the file round trip
        graph.save(tmp_path / "g.fxq")
        loaded = fxq.export.load(tmp_path / "g.fxq")
        assert_equal_outputs(expected, loaded.run(*[t.numpy() for t in x]))
    assert_equal_outputs(expected, run_onnx(graph_to_onnx(graph), x))
    qdq = graph_to_onnx(graph, mode="qdq")
    assert {n.op_type for n in qdq.graph.node} >= {"QuantizeLinear", "DequantizeLinear"}
    for d in lsb_difference(graph, qdq, integer, x):
        # QuantizeLinear rounds half to even, float ops replace multipliers and tables
        assert d.max() <= 2.0 + 1e-2, (row_name, d.max())


def test_every_integer_class_and_passthrough_row_has_an_export_rule():
    from fxq.export import moves

    for row in registry.ROWS:
        if row.integer is not None:  # its forward's primitive calls are recorded
            assert build.rule_for_row(row) is build.record_calls, row.name
        if row.kind is Kind.PASSTHROUGH and row.qtensor == "custom":
            # QTensor computes these itself: a value rule, or declared as moving integers only
            assert moves.value_rule(row.name) or row.name in moves.MOVEMENT_CUSTOM_ROWS, row.name


@pytest.fixture(scope="module")
def zoo():
    from tests.zoo import Zoo

    fxq.set_march("bayes")
    model = Zoo().eval()
    qat = fxq.prepare_qat_fx(
        model, {"": fxq.qconfig.default_qat_8bit_fake_quant_qconfig}, float_ops="ignore"
    )
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    with torch.no_grad():
        for _ in range(2):
            qat(torch.randn(2, 3, 16, 16))
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
    return fxq.convert_fx(qat)


def test_zoo_with_a_float_region_and_another_batch_size(zoo, tmp_path):
    x = torch.randn(2, 3, 16, 16)
    graph = fxq.export.to_graph(zoo, x)
    assert graph.dynamic_batch and graph.tensors[graph.inputs[0]].shape == ["N", 3, 16, 16]
    assert "float" in {n.op for n in graph.nodes}  # the float region (neg) stays float
    graph.save(tmp_path / "zoo.fxq")
    loaded = fxq.export.load(tmp_path / "zoo.fxq")
    for batch in (2, 5):
        x = torch.randn(batch, 3, 16, 16) * 2
        assert_equal_outputs(outputs(zoo, (x,)), loaded.run(x.numpy()))


def test_print_tabular_lists_dtypes_shapes_and_scales(zoo, capsys):
    graph = fxq.export.to_graph(zoo, torch.randn(2, 3, 16, 16))
    text = graph.print_tabular()
    assert text == capsys.readouterr().out.rstrip("\n")
    assert "march bayes" in text and "int8[Nx8x16x16] @ " in text and "float32[Nx5]" in text


def test_file_is_json_and_npy_without_pickle(zoo, tmp_path):
    graph = fxq.export.to_graph(zoo, torch.randn(2, 3, 16, 16))
    graph.save(tmp_path / "zoo.fxq")
    with zipfile.ZipFile(tmp_path / "zoo.fxq") as z:
        meta = json.loads(z.read("graph.json"))
        assert meta["format"] == "fxq.integer_graph" and meta["version"] == 1
        names = z.namelist()
        assert all(n == "graph.json" or n.endswith(".npy") for n in names)
    conv = next(n for n in meta["nodes"] if n["op"] == "conv")
    assert set(conv["params"]) >= {"weight", "bias", "multiplier", "shift"}


def test_runtime_runs_without_torch(zoo, tmp_path):
    x = torch.randn(3, 3, 16, 16)
    graph = fxq.export.to_graph(zoo, x)
    graph.save(tmp_path / "zoo.fxq")
    np.save(tmp_path / "x.npy", x.numpy())
    expected = outputs(zoo, (x,))
    code = f"""
        import importlib.util, sys, types, numpy as np
        sys.modules["torch"] = None  # any import of torch fails
        root = {str(ROOT / "fxq")!r}
        for name, path in (("fxq", root), ("fxq.export", root + "/export")):
            pkg = types.ModuleType(name); pkg.__path__ = [path]; sys.modules[name] = pkg
        from fxq.export import graph
        g = graph.load({str(tmp_path / "zoo.fxq")!r})
        outs = g.run(np.load({str(tmp_path / "x.npy")!r}))
        for i, y in enumerate(outs):
            np.save({str(tmp_path)!r} + f"/y{{i}}.npy", y)
        assert not [m for m in sys.modules if m.startswith("torch") and sys.modules[m] is not None]
    """
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert_equal_outputs(expected, [np.load(tmp_path / f"y{i}.npy") for i in range(len(expected))])


def test_command_line_runner(zoo, tmp_path):
    x = torch.randn(2, 3, 16, 16)
    fxq.export.to_graph(zoo, x).save(tmp_path / "zoo.fxq")
    np.save(tmp_path / "x.npy", x.numpy())
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "fxq.export.run",
            str(tmp_path / "zoo.fxq"),
            str(tmp_path / "x.npy"),
            "-o",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
    )
    assert r.returncode == 0, r.stderr
    assert "output 0" in r.stdout
    assert_equal_outputs(outputs(zoo, (x,)), [np.load(tmp_path / f"out{i}.npy") for i in range(2)])
    # an input of the wrong shape: one line naming the problem, no traceback
    np.save(tmp_path / "bad.npy", np.zeros((2, 3, 8, 8), np.float32))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "fxq.export.run",
            str(tmp_path / "zoo.fxq"),
            str(tmp_path / "bad.npy"),
        ],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
    )
    assert r.returncode == 2
    (line,) = r.stderr.splitlines()
    assert line.startswith("python -m fxq.export.run: error: GraphInputError: input 'x': got shape")


def test_unsupported_float_op_names_node_op_and_source_line(bayes):
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)

        def forward(self, x):
            return torch.cumsum(self.conv(x), 1)  # no integer cumsum: a float op

    qat = fxq.prepare_qat_fx(
        M(), {"": fxq.qconfig.default_qat_8bit_fake_quant_qconfig}, float_ops="ignore"
    )
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    qat(torch.randn(2, 3, 4, 4))
    integer = fxq.convert_fx(qat)
    line = M.forward.__code__.co_firstlineno + 1
    with pytest.raises(fxq.export.ExportError, match=rf"'cumsum'.*{__file__}:{line}.*float op"):
        fxq.export.to_graph(integer, torch.randn(2, 3, 4, 4))


def test_float_tail_that_moves_values_exports(bayes):
    """The vendor-typical ``return self.dequant(self.classifier(x)).flatten(1)``: float ops
    that only move values (flatten, reshape, permute, indexing) export as the integer
    moves do, to the numpy runtime and to ONNX, bit for bit."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant, self.dequant = fxq.QuantStub(), fxq.DeQuantStub()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.classifier = nn.Conv2d(8, 4, 1)

        def forward(self, x):
            x = self.classifier(torch.relu(self.conv(self.quant(x))))
            y = self.dequant(x).flatten(1)
            return y, y.reshape(-1, 4, 64).permute(0, 2, 1)[:, 1:]

    qat = fxq.prepare_qat_fx(Net().eval(), {"": fxq.qconfig.default_qat_8bit_fake_quant_qconfig})
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    qat(torch.randn(2, 3, 8, 8))
    integer = fxq.convert_fx(qat)
    graph = fxq.export.to_graph(integer, torch.randn(2, 3, 8, 8))
    assert [n.op for n in graph.nodes if n.op not in ("quantize", "conv")] == [
        "dequantize",
        "reshape",
        "reshape",
        "transpose",
        "gather",
    ]
    x = torch.randn(3, 3, 8, 8)  # another batch size: the moves are per sample
    expected = outputs(integer, (x,))
    assert_equal_outputs(expected, graph.run(x.numpy()))
    assert_equal_outputs(expected, run_onnx(graph_to_onnx(graph), (x,)))


Features = collections.namedtuple("Features", ["logits", "features"])


def test_namedtuple_output_and_keyword_only_inputs_export(bayes):
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.head = nn.Conv2d(8, 4, 1)

        def forward(self, x, *, bias):
            features = torch.relu(self.conv(x)) + bias
            return Features(self.head(features), features)

    x, bias = torch.randn(2, 3, 8, 8), torch.randn(2, 8, 8, 8)
    inputs = {"x": x, "bias": bias}
    qat = fxq.prepare_qat_fx(
        Net().eval(), {"": fxq.qconfig.default_qat_8bit_fake_quant_qconfig}, example_inputs=inputs
    )
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    qat(**inputs)
    integer = fxq.convert_fx(qat)
    graph = fxq.export.to_graph(integer, inputs)  # keyword example inputs, by name
    assert graph.inputs == ["x", "bias"]
    x, bias = torch.randn(3, 3, 8, 8), torch.randn(3, 8, 8, 8)
    with torch.no_grad():
        expected = integer(x, bias=bias)
    assert isinstance(expected, Features)
    expected = [t.numpy() for t in expected]
    assert_equal_outputs(expected, graph.run(x.numpy(), bias.numpy()))
    assert_equal_outputs(expected, run_onnx(graph_to_onnx(graph), (x, bias)))
    with pytest.raises(
        fxq.export.ExportError,
        match=r"example_inputs lacks the graph input\(s\) \['bias'\]; pass every input the "
        r"model was traced with \(x, bias\)",
    ):
        fxq.export.to_graph(integer, {"x": x})


@pytest.mark.parametrize("march", ["bernoulli2", "bayes-e"])
def test_other_marches(march):
    fxq.set_march(march)
    integer, x = torchvision_model("resnet18", size=32)
    graph = fxq.export.to_graph(integer, x)
    assert graph.march == march
    expected = outputs(integer, (x,))
    assert_equal_outputs(expected, graph.run(x.numpy()))
    assert_equal_outputs(expected, run_onnx(graph_to_onnx(graph), (x,)))


def test_int16_activations(bayes):
    from fxq.qconfig import default_qat_8bit_weight_16bit_act_fake_quant_qconfig as q16

    model = nn.Sequential(
        fxq.QuantStub(),
        nn.Conv2d(3, 8, 3),
        nn.ReLU(),
        nn.Sigmoid(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
        fxq.DeQuantStub(),
    ).eval()
    qat = fxq.prepare_qat_fx(model, {"": q16})
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    qat(torch.randn(2, 3, 8, 8))
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
    integer = fxq.convert_fx(qat)
    x = torch.randn(2, 3, 8, 8)
    graph = fxq.export.to_graph(integer, x)
    assert "segment_lut" in {n.op for n in graph.nodes}
    assert_equal_outputs(outputs(integer, (x,)), graph.run(x.numpy()))


def test_detector_heads_export_without_the_host_post_process(bayes):
    """The detector tutorial's network up to its heads; the @fx_wrap post-process (NMS) runs
    on the host and is not part of the graph."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "fx_wrap_detection", ROOT / "tutorials" / "fx_wrap_detection.py"
    )
    tutorial = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tutorial)
    torch.manual_seed(0)
    model = tutorial.TinyRetinaNet().eval()
    images = tutorial.normalize(tutorial.make_dataset(6, seed=0)[0])
    qat = fxq.prepare_qat_fx(model, {"": fxq.qconfig.default_calib_8bit_fake_quant_qconfig})
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    with torch.no_grad():
        qat(images[:4])
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
    integer = fxq.convert_fx(qat)
    post = next(n for n in integer.graph.nodes if "postprocess" in n.args)
    heads = [
        a
        for a in torch.fx.node.map_aggregate(post.args, lambda v: v)
        for a in (a if isinstance(a, (list, tuple)) else [a])
        if isinstance(a, torch.fx.Node)
        and a.op == "call_module"
        and type(integer.get_submodule(a.target)).__name__ == "DeQuantize"
    ]
    assert len(heads) == 4  # cls and box, two levels
    x = images[4:]
    env: dict[str, torch.Tensor] = {}

    calls = {}
    for n in heads:  # the shared DeQuantize runs once per head, in graph order
        calls.setdefault(n.target, []).append(n.name)
    order = {k: iter(v) for k, v in calls.items()}
    hooks = [
        integer.get_submodule(t).register_forward_hook(
            lambda m, a, out, t=t: env.__setitem__(next(order[t]), out)
        )
        for t in calls
    ]
    with torch.no_grad():
        integer(x)
    for h in hooks:
        h.remove()
    graph = fxq.export.to_graph(integer, x, outputs=heads)
    assert len(graph.outputs) == 4
    assert_equal_outputs([env[n.name].numpy() for n in heads], graph.run(x.numpy()))
    with pytest.raises(fxq.export.ExportError, match=r"fx_wrap method 'anchors'.*outputs="):
        fxq.export.to_graph(integer, x)
    with pytest.raises(fxq.export.ExportError, match="no node named"):
        fxq.export.to_graph(integer, x, outputs=["nope"])


def test_a_prepared_model_is_refused_with_the_conversion_to_do(bayes):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    x = torch.randn(1, 3, 8, 8)
    qat = fxq.prepare_qat_fx(model, {"": fxq.qconfig.default_qat_8bit_fake_quant_qconfig})
    with pytest.raises(TypeError) as info:
        fxq.export.to_graph(qat, x)
    assert str(info.value) == (
        "fxq.export.to_graph expects the integer model from fxq.convert_fx; this is a prepared "
        "(QAT or calibrated) model, whose ops still compute in float with fake quantization. "
        "Convert it first: fxq.export.to_graph(fxq.convert_fx(model), ...)"
    )
