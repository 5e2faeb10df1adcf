"""Float ONNX models in (``fxq.onnx_in``): the integer model from the ONNX file equals the
integer model from the PyTorch source, calibrated on the same data, bit for bit.

The ONNX files are exported here with ``torch.onnx.export`` (both exporters: the
TorchScript one, which folds BatchNorms and writes a dynamic batch with ``Shape`` ops,
and the default ``torch.export`` one); nothing is downloaded.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import onnx
import pytest
import torch
import torchvision
from torch import nn

import fxq
from fxq.calibration import calibrate, ptq
from fxq.onnx_in import OnnxImportError, load_onnx, unsupported_ops
from fxq.qconfig import default_calib_8bit_fake_quant_qconfig as calib_q8
from fxq.utils.sample_data import photo_crops, pretrained_mobilenet_v2
from tests.helpers import sqnr


def _export(model: nn.Module, x: torch.Tensor, path: Path, dynamo: bool) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporters' deprecation and progress notes
        if dynamo:
            torch.onnx.export(model, (x,), str(path), dynamo=True, verbose=False)
        else:
            torch.onnx.export(
                model,
                (x,),
                str(path),
                dynamo=False,
                input_names=["input"],
                dynamic_axes={"input": {0: "batch"}},
            )
    return path


def _integer(model: nn.Module, data: list[torch.Tensor], recipe=calibrate) -> nn.Module:
    prepared = recipe(fxq.prepare_qat_fx(model, {"": calib_q8}), data)
    fxq.set_fake_quantize(prepared, fxq.FakeQuantState.VALIDATION)
    return fxq.convert_fx(prepared)


def _small_vit() -> nn.Module:
    vit = torchvision.models.VisionTransformer(
        image_size=32,
        patch_size=8,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        mlp_dim=64,
        num_classes=10,
    )
    nn.init.normal_(vit.heads.head.weight, std=0.2)  # torchvision zero-initialises the head
    return vit.eval()


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_resnet18_from_onnx_equals_resnet18_from_pytorch(bayes, tmp_path, dynamo):
    model = torchvision.models.resnet18(num_classes=10).eval()
    data = [photo_crops(4, size=64, seed=s) for s in range(3)]
    path = _export(model, data[0], tmp_path / "resnet18.onnx", dynamo)
    from_onnx = load_onnx(path)
    x = photo_crops(4, size=64, seed=9)
    with torch.no_grad():
        assert torch.allclose(from_onnx(x), model(x), atol=1e-4)  # the float models agree
        expected = _integer(model, data)(x)
        got = _integer(from_onnx, data)(x)
    assert expected.abs().max() > 1  # not a degenerate all-zero output
    assert torch.equal(got, expected)


def test_pretrained_mobilenet_v2_from_onnx_with_ptq(bayes, tmp_path):
    """Bit for bit with ``ptq``'s learned rounding, offsets and bias correction. Its
    depthwise equalization scales a BatchNorm's gamma and beta where the PyTorch model has
    one and the folded weights where the ONNX file has them (the exporter folded it):
    the same factors, rounded in another order, so the two integer models agree closely
    but not bit for bit."""
    model = pretrained_mobilenet_v2().eval()
    data = [photo_crops(4, size=64, seed=s) for s in range(2)]
    from_onnx = load_onnx(_export(model, data[0][:1], tmp_path / "mnv2.onnx", dynamo=False))
    layers = (nn.Conv2d, nn.Linear)
    assert {n for n, m in from_onnx.named_modules() if isinstance(m, layers)} == {
        n for n, m in model.named_modules() if isinstance(m, layers)
    }  # the TorchScript exporter's scopes give the PyTorch names back
    x = photo_crops(8, size=64, seed=7)
    with torch.no_grad():
        reference = model(x)
    results = {}
    for equalize in (False, True):

        def recipe(p, d, equalize=equalize):
            return ptq(p, d, iters=2, equalize=equalize)

        expected_model = _integer(model, data, recipe)
        got_model = _integer(from_onnx, data, recipe)
        with torch.no_grad():
            results[equalize] = expected_model(x), got_model(x)
    expected, got = results[False]
    assert expected.abs().max() > 1
    assert torch.equal(got, expected)
    expected, got = results[True]
    assert sqnr(expected, got) > 20
    assert abs(sqnr(reference, got) - sqnr(reference, expected)) < 0.5


def test_small_vit_from_onnx_both_exporters(bayes, tmp_path):
    """The exporters write attention decomposed (MatMul, Mul by the square root of the
    scale on q and on k, Softmax, MatMul), and fxq quantizes each step of it, as it would
    the same decomposed PyTorch code; from the PyTorch source ``nn.MultiheadAttention`` is
    one attention op. The integer models then differ: the test compares each with the
    float model. Both exporters' files give the same integer model."""
    model = _small_vit()
    data = [torch.randn(2, 3, 32, 32) for _ in range(3)]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        reference = model(x)
        from_pytorch = _integer(model, data)(x)
    # torch.export's exporter: shapes written as constants
    from_dynamo = load_onnx(_export(model, x, tmp_path / "vit_dynamo.onnx", dynamo=True))
    with torch.no_grad():
        assert torch.allclose(from_dynamo(x), reference, atol=1e-5)
        got = _integer(from_dynamo, data)(x)
    assert sqnr(reference, got) > sqnr(reference, from_pytorch) - 1.0 > 10
    # TorchScript's exporter, dynamic batch: its Shape ops need the input's shape
    path = _export(model, x, tmp_path / "vit_ts.onnx", dynamo=False)
    with pytest.raises(
        OnnxImportError,
        match=r"ONNX node '/Shape' \(Shape\): the shape of 'input' is not fixed by the file; "
        r"pass load_onnx\(..., input_shapes=\{'input': \(...\)\}\)",
    ):
        load_onnx(path)
    from_script = load_onnx(path, input_shapes={"input": (2, 3, 32, 32)})
    with torch.no_grad():
        assert torch.equal(_integer(from_script, data)(x), got)


def test_unsupported_ops_are_listed_with_their_node_names_before_any_work(tmp_path):
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["a"], name="relu0"),
            helper.make_node("TopK", ["a", "k"], ["b", "i"], name="topk0", axis=1),
            helper.make_node("NonMaxSuppression", ["b", "a"], ["n"], name="nms0"),
            helper.make_node("TopK", ["a", "k"], ["c", "j"], name="topk1", axis=1),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("n", TensorProto.INT64, None)],
        [helper.make_tensor("k", TensorProto.INT64, [1], [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "unsupported.onnx"
    onnx.save(model, str(path))
    assert unsupported_ops(path) == {"NonMaxSuppression": ["nms0"], "TopK": ["topk0", "topk1"]}
    with pytest.raises(
        OnnxImportError,
        match=r"the ONNX model has 3 node\(s\) of op types fxq cannot convert: "
        r"NonMaxSuppression \(nms0\); TopK \(topk0, topk1\)\. Supported: ",
    ):
        load_onnx(path)


def test_a_missing_or_broken_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no ONNX file at '.*nothing\.onnx'"):
        load_onnx(tmp_path / "nothing.onnx")
    (tmp_path / "broken.onnx").write_bytes(b"not a protobuf at all")
    with pytest.raises(OnnxImportError, match=r"'.*broken\.onnx' is not a readable ONNX file"):
        load_onnx(tmp_path / "broken.onnx")


def _graph_model(nodes, inputs=None, outputs=None, opset=17, initializers=()):
    """A one-graph ONNX model from ``onnx.helper`` parts: input ``x`` [1, 4], output ``y``."""
    from onnx import TensorProto, helper

    if inputs is None:
        inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])]
    if outputs is None:
        outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8  # one that onnxruntime reads
    return model


@pytest.mark.parametrize(
    ("opset", "shape", "attrs"),
    [
        (11, [2, 3, 4], {}),  # default axis 1: softmax over dims 1 and 2 jointly
        (11, None, {"axis": 1}),  # rank unknown when the file is read
        (11, [2, 3, 4], {"axis": 1}),
        (11, [2, 3, 4], {"axis": 0}),  # over everything
        (12, ["batch", 3, 4], {"axis": -2}),  # negative, batch left open
        (12, None, {"axis": -2}),
        (11, [2, 3, 4, 1], {"axis": 2}),  # the dims after the axis are all 1
        (11, [2, 3, 4], {"axis": -1}),
        (13, [2, 3, 4], {}),  # opset 13: default axis -1, no flattening
        (17, [2, 3, 4], {"axis": 1}),
    ],
)
def test_softmax_follows_the_opset_semantics_as_onnxruntime_does(opset, shape, attrs):
    """Before opset 13 ONNX's Softmax coerces its input to 2-D at ``axis`` (default 1) and
    normalizes over every dimension from there on; from 13 on over ``axis`` (default -1)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    model = _graph_model(
        [helper.make_node("Softmax", ["x"], ["y"], name="sm", **attrs)],
        inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        opset=opset,
    )
    x = torch.randn(2, 3, 4, 1) if shape == [2, 3, 4, 1] else torch.randn(2, 3, 4)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = torch.from_numpy(session.run(None, {"x": x.numpy()})[0])
    got = load_onnx(model)(x)
    assert got.shape == expected.shape
    assert (got - expected).abs().max() < 1e-6


def test_softmax_before_opset_13_with_an_axis_out_of_range_is_refused():
    from onnx import helper

    model = _graph_model([helper.make_node("Softmax", ["x"], ["y"], name="sm", axis=2)], opset=11)
    with pytest.raises(
        OnnxImportError,
        match=r"ONNX node 'sm' \(Softmax, opset 11\): axis 2 is out of range for its 2-D input "
        r"'x' \(shape \[1, 4\]\); the file is malformed: check it with onnx.checker.check_model",
    ):
        load_onnx(model)


def _relu(inp, out, name):
    from onnx import helper

    return helper.make_node("Relu", [inp], [out], name=name)


_CHECK = r"check it with onnx\.checker\.check_model"


@pytest.mark.parametrize(
    ("nodes", "message"),
    [
        (
            [_relu("x", "a", "Relu_0"), _relu("nope", "y", "Add_3")],
            r"ONNX node 'Add_3' \(Relu\) reads 'nope', which no initializer, graph input or "
            r"earlier node produces: the file is malformed; " + _CHECK,
        ),
        (
            [_relu("a", "y", "second"), _relu("x", "a", "first")],
            r"ONNX node 'second' \(Relu\) reads 'a', which node 'first' \(Relu\) produces after "
            r"it: the nodes are not in topological order; sort them \(re-export the model\) "
            r"and " + _CHECK,
        ),
        (
            [_relu("x", "z", "r")],
            r"the ONNX graph's output 'y' is produced by no node, initializer or graph input: "
            r"the file is malformed; " + _CHECK,
        ),
        (
            [_relu("x", "y", "r1"), _relu("x", "y", "r2")],
            r"ONNX node 'r2' \(Relu\) produces 'y', which node 'r1' \(Relu\) already produces: "
            r"every value needs one producer; rename one of them \(re-export the model\) "
            r"and " + _CHECK,
        ),
        (
            [_relu("x", "x", "r"), _relu("x", "y", "r1")],
            r"ONNX node 'r' \(Relu\) produces 'x', which a graph input already produces",
        ),
        (
            [_relu("x", "a", ""), _relu("b", "y", "")],
            r"ONNX node #1 \(Relu, unnamed\) reads 'b', which no initializer",
        ),
    ],
    ids=[
        "dangling",
        "unsorted",
        "output-unproduced",
        "produced-twice",
        "input-shadowed",
        "unnamed",
    ],
)
def test_a_malformed_graph_is_refused_naming_the_node_or_output(nodes, message):
    with pytest.raises(OnnxImportError, match=message):
        load_onnx(_graph_model(nodes))


def test_a_graph_without_outputs_or_with_an_output_twice_is_refused():
    from onnx import TensorProto, helper

    with pytest.raises(
        OnnxImportError,
        match=r"the ONNX graph 'g' declares no outputs, so the model would compute nothing; "
        r"list the values it returns in graph\.output \(re-export it\)",
    ):
        load_onnx(_graph_model([_relu("x", "y", "r")], outputs=[]))
    twice = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)] * 2
    with pytest.raises(
        OnnxImportError,
        match=r"the ONNX graph declares output 'y' twice; every output needs its own name: "
        r"re-export the model and " + _CHECK,
    ):
        load_onnx(_graph_model([_relu("x", "y", "r")], outputs=twice))
    with pytest.raises(OnnxImportError, match=r"the ONNX model has no graph"):
        load_onnx(onnx.ModelProto())


def test_an_empty_file_is_refused(tmp_path):
    (tmp_path / "empty.onnx").write_bytes(b"")
    message = r"'.*empty\.onnx' is empty \(0 bytes\): the export or the copy did not finish"
    with pytest.raises(OnnxImportError, match=message):
        load_onnx(tmp_path / "empty.onnx")
    with pytest.raises(OnnxImportError, match=message):
        unsupported_ops(tmp_path / "empty.onnx")
