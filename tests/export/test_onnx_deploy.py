"""Deployable integer ONNX: integer and float32 tensors only (no float64, which many runtimes
and NPU importers lack), bit-exact with fxq's integer model in onnxruntime at every
optimization level; the float32 requantization (``fxq.primitives.onnx_requant``) is exact on
adversarial accumulators (ties, saturation points, the proven bounds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import fxq
import fxq.export
from fxq.export.onnx import graph_to_onnx
from fxq.export.onnx_integer import IntegerWriter
from fxq.primitives.arith import requant as _requant
from fxq.primitives.onnx_requant import plan_f32_requant, plan_mul_requant, write_f32_requant
from tests.export.helpers import assert_equal_outputs, outputs, torchvision_model

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

LEVELS = (
    ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
)


def float64_tensors(model) -> list[str]:
    """Every float64 in an ONNX model: DOUBLE initializers and every node output that
    ``onnx.shape_inference`` types DOUBLE (each output must get a type)."""
    from onnx import TensorProto, shape_inference

    found = [
        f"initializer {i.name}"
        for i in model.graph.initializer
        if i.data_type == TensorProto.DOUBLE
    ]
    graph = shape_inference.infer_shapes(model, strict_mode=True).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.output]}
    for node in graph.node:
        for o in node.output:
            assert types.get(o, 0) != 0, f"shape inference left {node.op_type} {o} untyped"
            if types[o] == TensorProto.DOUBLE:
                found.append(f"{node.op_type} {o}")
    return found


def run_at(model, feeds: dict, level) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.log_severity_level = 3
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return session.run(None, feeds)


def _calibrated(model: nn.Module, qconfig, x: torch.Tensor) -> nn.Module:
    qat = fxq.prepare_qat_fx(model.eval(), {"": qconfig}, float_ops="ignore")
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    with torch.no_grad():
        qat(x)
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
    return fxq.convert_fx(qat)


def _zoo():
    from tests.zoo import Zoo

    torch.manual_seed(0)
    q8 = fxq.qconfig.default_qat_8bit_fake_quant_qconfig
    return _calibrated(Zoo(), q8, torch.randn(4, 3, 16, 16)), torch.randn(2, 3, 16, 16) * 3


def _int16_limbs():
    from fxq.qconfig import default_qat_8bit_weight_16bit_act_fake_quant_qconfig as q16

    torch.manual_seed(0)
    model = nn.Sequential(
        fxq.QuantStub(),
        nn.Conv2d(3, 8, 3),
        nn.ReLU(),
        nn.Conv2d(8, 8, 5, padding=2),  # int16 input: limbs, int64 requantization
        nn.PReLU(8),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
        nn.Softmax(-1),
        fxq.DeQuantStub(),
    )
    return _calibrated(model, q16, torch.randn(2, 3, 9, 9)), torch.randn(3, 3, 9, 9)


def _residual_convnet():
    """conv + add + relu (the residual requantized inside the conv), relu6, a linear head."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant, self.dequant = fxq.QuantStub(), fxq.DeQuantStub()
            self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU6())
            self.conv = nn.Conv2d(16, 16, 3, padding=1)
            self.relu = nn.ReLU()
            self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5))

        def forward(self, x):
            x = self.stem(self.quant(x))
            return self.dequant(self.head(self.relu(self.conv(x) + x)))

    torch.manual_seed(0)
    q8 = fxq.qconfig.default_qat_8bit_fake_quant_qconfig
    return _calibrated(Block(), q8, torch.randn(4, 3, 12, 12)), torch.randn(3, 3, 12, 12) * 2


_MODELS = {
    "zoo": _zoo,
    "int16_limbs": _int16_limbs,
    "residual_convnet": _residual_convnet,
    "resnet18": lambda: torchvision_model("resnet18", size=32),
    "mobilenet_v2": lambda: torchvision_model("mobilenet_v2", size=32),
}


@pytest.mark.parametrize("name", list(_MODELS))
def test_integer_onnx_has_no_float64_and_is_exact_at_every_level(bayes, name):
    integer, x = _MODELS[name]()
    graph = fxq.export.to_graph(integer, x)
    model = graph_to_onnx(graph)
    assert float64_tensors(model) == []
    expected = outputs(integer, (x,))
    feeds = {model.graph.input[0].name: x.numpy()}
    for level in LEVELS:
        assert_equal_outputs(expected, run_at(model, feeds, level))
    if name in ("mobilenet_v2", "residual_convnet"):  # the float32 requantization is in use
        assert any(n.op_type == "QuantizeLinear" for n in model.graph.node)


def _requant_model(plan, shape, dtype, lo, hi, scaled=False):
    w = IntegerWriter(None, {})
    write_f32_requant(w, "acc", plan, len(shape), 1, dtype, lo, hi, "y", scaled)
    h, T = onnx.helper, onnx.TensorProto
    graph = h.make_graph(
        w.nodes,
        "requant",
        [h.make_tensor_value_info("acc", T.FLOAT, list(shape))],
        [h.make_tensor_value_info("y", w.types[dtype], list(shape))],
        w.inits,
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 19)])
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    assert float64_tensors(model) == []
    return model


def _adversarial(m: np.ndarray, s: np.ndarray, bound: int, rng) -> np.ndarray:
    """Accumulators per channel (axis 1): random ones, +-bound, and those next to every
    rounding tie and saturation point ``acc m = (q + 1/2) 2**s``."""
    cols = []
    for mc, sc in zip(m.tolist(), s.tolist()):
        vals = [rng.integers(-bound, bound + 1, 200), np.array([-bound, bound, 0, 1, -1])]
        if mc and sc > 0:
            q = np.arange(-140, 140)
            tie = ((2 * q + 1) << (sc - 1)) // mc
            vals += [tie - 1, tie, tie + 1]
        v = np.clip(np.concatenate(vals), -bound, bound)
        cols.append(rng.permutation(np.resize(v, 1200)))
    return np.stack(cols, 0).T.reshape(1200, len(cols), 1).astype(np.int64)


@pytest.mark.parametrize("seed", range(9))
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize(
    ("dtype", "lo", "hi"), [("int8", None, None), ("int8", 0, 90), ("int8", 0, None)]
)
def test_float32_requantization_is_exact_on_adversarial_accumulators(seed, scaled, dtype, lo, hi):
    """Per-channel multipliers of both signs and shifts up to 25 (ResNet-18's), with the
    split's ``2**-k`` applied by the writer or already in the accumulator (``scaled``, as a
    conv with scaled weights gives it); per-channel and common clamps both occur."""
    rng = np.random.default_rng(seed)
    channels = 5
    m = rng.integers(1 << 14, 1 << 15, channels)
    m[0] = 1 << 14
    m[1] = -m[1] if seed % 3 == 0 else m[1]
    s = rng.integers(12 + 2 * seed, 14 + 2 * seed, channels) if seed < 7 else np.full(channels, 25)
    bound = int(rng.integers(1 << 12, 1 << 20)) if seed < 7 else (1 << 24) - 1
    from fxq.primitives.arith import bounds as _bounds

    qlo, qhi = _bounds(dtype, lo, hi)
    plan = plan_f32_requant(m, s, bound, qlo, qhi, dtype == "int8")
    if plan is None:
        pytest.skip("no float32 plan for these multipliers (the writer uses int64)")
    if seed >= 7:  # the widest case the writer plans (ResNet-18's shifts)
        assert (plan.low is None or plan.low.size > 1) or (plan.high is None or plan.high.size > 1)
    acc = _adversarial(m, s, bound, rng)
    model = _requant_model(plan, acc.shape, dtype, qlo, qhi, scaled)
    shape = (1, channels, 1)
    expected = _requant(acc, m.reshape(shape), s.reshape(shape), dtype, "half_up", lo, hi)
    feed = acc * np.ldexp(1.0, -plan.split).reshape(shape) if scaled else acc
    assert (feed.astype(np.float32) == feed).all()
    for level in (LEVELS[0], LEVELS[-1]):
        (got,) = run_at(model, {"acc": feed.astype(np.float32)}, level)
        assert_equal_outputs([expected], [got])


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(("lo", "hi"), [(-128, 127), (0, 90), (0, 127)])
def test_mul_requantization_is_exact_where_planned(seed, lo, hi):
    """``QuantizeLinear(acc c + e, 1)`` (``plan_mul_requant``) on adversarial accumulators,
    wherever the planner accepts the multipliers (ties included: ``m = 2**14``)."""
    rng = np.random.default_rng(seed)
    channels = 5
    m = rng.integers(1 << 14, 1 << 15, channels)
    m[0] = 1 << 14 if seed % 2 else m[0]
    m[1] = -m[1] if seed % 3 == 0 else m[1]
    s = rng.integers(12 + seed, 14 + seed, channels)
    bound = int(rng.integers(1 << 12, 1 << 20))
    plan = plan_mul_requant(m, s, bound, lo, hi)
    if plan is None:
        pytest.skip("no float32 multipliers for these (the writer uses the split)")
    acc = _adversarial(m, s, bound, rng)
    model = _requant_model(plan, acc.shape, "int8", lo, hi)
    shape = (1, channels, 1)
    expected = _requant(acc, m.reshape(shape), s.reshape(shape), "int8", "half_up", lo, hi)
    for level in LEVELS:
        (got,) = run_at(model, {"acc": acc.astype(np.float32)}, level)
        assert_equal_outputs([expected], [got])


def test_high_precision_output_is_the_one_float64_exception(bayes):
    """A high-precision (float32) conv output is ``float32(float64(acc) * s_x s_w)`` in the
    integer model, two roundings float32 arithmetic does not reproduce: its few tensors are
    float64 and named ``high_precision__*`` (docs/integer_graph.md, 4); exact."""
    torch.manual_seed(0)
    model = nn.Sequential(
        fxq.QuantStub(), nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 1), fxq.DeQuantStub()
    ).eval()
    qconfig = {
        "": fxq.qconfig.default_qat_8bit_fake_quant_qconfig,
        "module_name": [("3", fxq.qconfig.default_qat_out_8bit_fake_quant_qconfig)],
    }
    qat = fxq.prepare_qat_fx(model, qconfig)
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    qat(torch.randn(2, 3, 9, 9))
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
    integer, x = fxq.convert_fx(qat), torch.randn(2, 3, 9, 9)
    model = graph_to_onnx(fxq.export.to_graph(integer, x))
    found = float64_tensors(model)
    assert found and all(f.split()[-1].startswith("high_precision__") for f in found), found
    (got,) = run_at(model, {model.graph.input[0].name: x.numpy()}, LEVELS[-1])
    assert_equal_outputs(outputs(integer, (x,)), [got])


def test_plan_refuses_what_float32_cannot_hold():
    m, s = np.array([32767]), np.array([31])
    assert plan_f32_requant(m, s, 1 << 24, -128, 127, True) is None  # accumulator too wide
    assert plan_f32_requant(m, s, 1 << 23, -32768, 32767, False) is None  # int16: Z too wide
    plan = plan_f32_requant(np.array([3]), np.array([0]), 1000, -128, 127, True)
    assert plan is not None and not plan.split.any() and plan.shift.tolist() == [0]
