"""ONNX lowering of the float ops of float regions (``fxq.export.runtime_float``;
``docs/integer_graph.md``, 2, "Float regions", and 4): standard float32 ONNX ops (opset 19 in
integer mode, 21 in QDQ mode), the same in both modes.

``FLOAT_WRITERS`` maps an IR op to ``writer(w, node, outs)``, where ``w`` is the
``IntegerWriter`` (or ``QDQWriter``) writing the model: its ``op``, ``const`` and ``name``
helpers add nodes and initializers. onnxruntime computes these ops in float32 with its own
kernels, so the results are torch's within the tolerance the document states, not bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .graph import Node
from .runtime import pool_end_pads
from .runtime_float import adaptive_windows, avg_pool_matrices

__all__ = ["FLOAT_WRITERS"]

_Writer = Any  # fxq.export.onnx_integer.IntegerWriter (which imports this module)


def _f32(w: _Writer, v: Any, hint: str = "c") -> str:
    return w.const(np.asarray(v, np.float32), hint=hint)


def _axes(w: _Writer, axes: list[int]) -> str:
    return w.const(np.array(axes, np.int64), hint="axes")


# -- convolution, linear, matmul ------------------------------------------------------------------
def _conv(w: _Writer, node: Node, outs: list[str]) -> None:
    a, p = node.attrs, node.params
    inputs = [w.name(node.inputs[0]), _f32(w, p["weight"], "weight")]
    if "bias" in p:
        inputs.append(_f32(w, p["bias"], "bias"))
    pads = [pp[0] for pp in a["pads"]] + [pp[1] for pp in a["pads"]]
    w.op(
        "Conv",
        inputs,
        outs[0],
        kernel_shape=list(p["weight"].shape[2:]),
        strides=a["stride"],
        dilations=a["dilation"],
        pads=pads,
        group=a["groups"],
    )


def _linear(w: _Writer, node: Node, outs: list[str]) -> None:
    p = node.params
    weight_t = _f32(w, np.ascontiguousarray(p["weight"].T), "weight")
    if "bias" not in p:
        w.op("MatMul", [w.name(node.inputs[0]), weight_t], outs[0])
        return
    y = w.op("MatMul", [w.name(node.inputs[0]), weight_t])
    w.op("Add", [y, _f32(w, p["bias"], "bias")], outs[0])


def _matmul(w: _Writer, node: Node, outs: list[str]) -> None:
    w.op("MatMul", [w.name(i) for i in node.inputs], outs[0])


# -- normalization ------------------------------------------------------------------------------
def _batch_norm(w: _Writer, node: Node, outs: list[str]) -> None:
    p = node.params
    n = p["mean"].size
    scale = p.get("weight", np.ones(n, np.float32))
    bias = p.get("bias", np.zeros(n, np.float32))
    inputs = [w.name(node.inputs[0])] + [
        _f32(w, v, k) for k, v in (("scale", scale), ("bias", bias), ("mean", p["mean"]))
    ]
    inputs.append(_f32(w, p["var"], "var"))
    w.op("BatchNormalization", inputs, outs[0], epsilon=float(node.attrs["eps"]))


def _layer_norm(w: _Writer, node: Node, outs: list[str]) -> None:
    a, p = node.attrs, node.params
    shape = w.graph.tensors[node.inputs[0]].shape[-a["ndim"] :]
    scale = p.get("weight")
    if scale is None:
        scale = np.ones([s if isinstance(s, int) else 1 for s in shape], np.float32)
    inputs = [w.name(node.inputs[0]), _f32(w, scale, "scale")]
    if "bias" in p:
        inputs.append(_f32(w, p["bias"], "bias"))
    w.op("LayerNormalization", inputs, outs[0], axis=-a["ndim"], epsilon=float(a["eps"]))


# -- elementwise functions ------------------------------------------------------------------------
def _gelu(w: _Writer, x: str, out: str, approximate: bool) -> None:
    half_x = w.op("Mul", [x, _f32(w, 0.5)])
    if approximate:  # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
        cube = w.op("Mul", [w.op("Mul", [x, x]), x])
        inner = w.op("Add", [x, w.op("Mul", [cube, _f32(w, 0.044715)])])
        t = w.op("Tanh", [w.op("Mul", [inner, _f32(w, math.sqrt(2.0 / math.pi))])])
    else:  # 0.5 x (1 + erf(x / sqrt(2)))
        t = w.op("Erf", [w.op("Mul", [x, _f32(w, 1.0 / math.sqrt(2.0))])])
    w.op("Mul", [half_x, w.op("Add", [t, _f32(w, 1.0)])], out)


def _unary(w: _Writer, node: Node, outs: list[str]) -> None:
    a = node.attrs
    fn, x, out = a["fn"], w.name(node.inputs[0]), outs[0]
    simple = {
        "relu": "Relu",
        "sigmoid": "Sigmoid",
        "tanh": "Tanh",
        "hardswish": "HardSwish",
        "exp": "Exp",
        "log": "Log",
        "sqrt": "Sqrt",
        "abs": "Abs",
    }
    if fn in simple:
        w.op(simple[fn], [x], out)
    elif fn in ("clamp", "relu6"):
        lo, hi = (0.0, 6.0) if fn == "relu6" else (a.get("lo"), a.get("hi"))
        bounds = ["" if v is None else _f32(w, v) for v in (lo, hi)]
        while bounds and bounds[-1] == "":
            bounds.pop()
        w.op("Clip", [x, *bounds], out)
    elif fn == "silu":
        w.op("Mul", [x, w.op("Sigmoid", [x])], out)
    elif fn == "hardsigmoid":  # relu6(x + 3) / 6, as torch writes it
        clipped = w.op("Clip", [w.op("Add", [x, _f32(w, 3.0)]), _f32(w, 0.0), _f32(w, 6.0)])
        w.op("Div", [clipped, _f32(w, 6.0)], out)
    elif fn in ("gelu", "gelu_tanh"):
        _gelu(w, x, out, fn == "gelu_tanh")
    else:
        raise ValueError(f"node {node.name!r}: float_unary fn {fn!r} has no ONNX form")


def _softmax(w: _Writer, node: Node, outs: list[str]) -> None:
    a = node.attrs
    op_type = "LogSoftmax" if a["log"] else "Softmax"
    w.op(op_type, [w.name(node.inputs[0])], outs[0], axis=a["axis"])


# -- pooling and resampling -----------------------------------------------------------------------
def _pool(w: _Writer, node: Node, outs: list[str]) -> None:
    a = node.attrs
    t = w.graph.tensors[node.inputs[0]]
    dims = len(a["kernel"])
    sizes = t.shape[-dims:]
    x = w.name(node.inputs[0])
    common = {"kernel_shape": a["kernel"], "strides": a["stride"]}
    if a["fn"] == "max":
        # the end padding that gives torch's window count (its ceil_mode rule), explicitly
        pads = list(a["padding"]) + pool_end_pads(a, sizes)
        w.op("MaxPool", [x], outs[0], pads=pads, dilations=a["dilation"], **common)
        return
    if not a["ceil_mode"]:
        pads = list(a["padding"]) * 2
        count = int(a["count_include_pad"])
        w.op("AveragePool", [x], outs[0], pads=pads, count_include_pad=count, **common)
        return
    # ceil_mode (torch's divisors of the windows past the end differ from ONNX's): window sums,
    # x contracted with a 0/1 matrix per axis, divided by torch's divisor of each window
    y, div = x, None
    rank = len(t.shape)
    for i, (m, d) in enumerate(avg_pool_matrices(node, sizes)):
        y = _contract(w, y, rank - dims + i, rank, m)
        div = d if div is None else div[..., None] * d
    w.op("Div", [y, _f32(w, div, "divisor")], outs[0])


def _contract(w: _Writer, x: str, axis: int, rank: int, m: np.ndarray) -> str:
    """``x`` contracted with ``m [n_in, n_out]`` along ``axis`` (one of the last two)."""
    if axis == rank - 1:
        return w.op("MatMul", [x, _f32(w, m, "matrix")])
    if axis == rank - 2:
        return w.op("MatMul", [_f32(w, np.ascontiguousarray(m.T), "matrix"), x])
    raise ValueError(f"a contraction along axis {axis} of a rank-{rank} tensor")


def _adaptive_pool(w: _Writer, node: Node, outs: list[str]) -> None:
    size = node.attrs["output_size"]
    t = w.graph.tensors[node.inputs[0]]
    rank, x = len(t.shape), w.name(node.inputs[0])
    if all(o == 1 for o in size):
        axes = list(range(rank - len(size), rank))
        w.op("ReduceMean", [x, _axes(w, axes)], outs[0], keepdims=1)
        return
    for i, o in enumerate(size):
        axis = rank - len(size) + i
        n = t.shape[axis]
        m = np.zeros((n, o), np.float32)
        for j, (s, e) in enumerate(adaptive_windows(n, o)):
            m[s:e, j] = 1.0 / (e - s)
        x = _contract(w, x, axis, rank, m)
    w.op("Identity", [x], outs[0])


def _interpolate(w: _Writer, node: Node, outs: list[str]) -> None:
    a = node.attrs
    x = w.name(node.inputs[0])
    rank, k = len(w.graph.tensors[node.inputs[0]].shape), len(a["size"])
    axes = list(range(rank - k, rank))
    if a["mode"] == "nearest":
        mode = {"mode": "nearest", "coordinate_transformation_mode": "asymmetric"}
        mode["nearest_mode"] = "floor"
    elif a["align_corners"]:
        mode = {"mode": "linear", "coordinate_transformation_mode": "align_corners"}
    else:
        mode = {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"}
    if a["scale_factor"] is not None:  # torch's source step is 1 / scale_factor, as ONNX's
        inputs = [x, "", _f32(w, a["scale_factor"], "scales")]
    else:
        inputs = [x, "", "", w.const(np.array(a["size"], np.int64), hint="sizes")]
    w.op("Resize", inputs, outs[0], axes=axes, **mode)


def _reduce(w: _Writer, node: Node, outs: list[str]) -> None:
    a = node.attrs
    op_type = {"mean": "ReduceMean", "sum": "ReduceSum", "amax": "ReduceMax", "amin": "ReduceMin"}
    inputs = [w.name(node.inputs[0]), _axes(w, a["axes"])]
    w.op(op_type[a["fn"]], inputs, outs[0], keepdims=int(a["keepdim"]))


#: IR op -> ONNX writer (``IntegerWriter.write`` dispatches here)
FLOAT_WRITERS: dict[str, Callable[[_Writer, Node, list[str]], None]] = {
    "float_conv": _conv,
    "float_linear": _linear,
    "float_matmul": _matmul,
    "float_batch_norm": _batch_norm,
    "float_layer_norm": _layer_norm,
    "float_unary": _unary,
    "float_softmax": _softmax,
    "float_pool": _pool,
    "float_adaptive_pool": _adaptive_pool,
    "float_interpolate": _interpolate,
    "float_reduce": _reduce,
}
