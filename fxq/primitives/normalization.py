"""Normalization and softmax: integer statistics, a reciprocal square root or exponential
table, and a requantization (``docs/arithmetic.md``, sections 14-16).

* ``normalize``: LayerNorm (rows of ``n`` elements) and GroupNorm (``groups`` per sample):
  mean and variance in integers, ``rsqrt`` from a table, then the int8 affine;
* ``l2_normalize``: ``x / max(||x||, eps)`` over ``axes`` with the same ``rsqrt``;
* ``softmax``: (log-)softmax over ``axis`` with a base-2 exponential table, an optional
  ``keep`` mask (an input or a constant) and ``causal`` masking.

The torch side is the integer modules' own kernels (``fxq.quantized.normalization``,
``fxq.quantized.softmax``), which record each call here (``record_softmax`` for attention's
masked softmax).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from fxq.primitives.arith import DTYPES, RANGES, requant, sat32, shift_round
from fxq.primitives.core import Call, Primitive, is_recording, record, register
from fxq.primitives.schema import INT_DTYPES, RESULT_ATTRS, SHIFT, Ctx, OpSpec, Param, is_int

__all__ = ["keep_mask", "record_softmax"]

Node = Any  # fxq.export.graph.Node (fxq.export is above this package)


# -- numpy --------------------------------------------------------------------------------------
def _numpy_bit_length(v: np.ndarray) -> np.ndarray:
    """``floor(log2(v)) + 1`` of non-negative int64 values, exactly (0 for 0)."""
    b = np.frexp(v.astype(np.float64))[1].astype(np.int64)
    over = (b > 0) & (np.left_shift(np.int64(1), np.maximum(b - 1, 0)) > v)
    return b - over


def _numpy_normalize_rows(x: np.ndarray, a: dict, table: np.ndarray) -> np.ndarray:
    """``Z = sat(shift_round(D R, F + e - Q))`` over the last axis (``docs/arithmetic.md``, 14)."""
    n, t, f, rounding = a["n"], a["index_bits"], a["fraction_bits"], a["rounding"]
    s1 = x.sum(-1, keepdims=True)
    s2 = (x * x).sum(-1, keepdims=True)
    d = n * x - s1
    v = np.maximum(n * s2 - s1 * s1 + a["eps_term"], 1)
    e = (_numpy_bit_length(v) - t + 1) // 2
    m = shift_round(v, 2 * e, rounding)
    r = table.astype(np.int64)[m - (1 << (t - 2))]
    z = shift_round(d * r, f + e - a["q_bits"], rounding)
    return np.clip(z, *RANGES[a["z_dtype"]])


def _numpy_normalize(node, inputs):
    a, p = node.attrs, node.params
    x = inputs[0].astype(np.int64)
    if a["groups"] is None:
        z = _numpy_normalize_rows(x.reshape(-1, a["n"]), a, p["rsqrt_table"])
    else:
        rows = _numpy_normalize_rows(x.reshape(x.shape[0], a["groups"], -1), a, p["rsqrt_table"])
        z = rows.reshape(x.shape[0], x.shape[1], -1)
    acc = sat32(z * p["weight"].astype(np.int64) + p["bias"].astype(np.int64))
    y = requant(acc, p["multiplier"], p["shift"], a["dtype"], a["rounding"])
    return [y.reshape(x.shape)]


def _numpy_l2_normalize(node, inputs):
    """``x / max(||x||_2, eps)`` over ``axes`` (``docs/arithmetic.md``, 27):
    ``Z = sat(shift_round(X R, F + e - Q))``, ``(R, e)`` the rsqrt of ``max(sum X**2, E, 1)``,
    then ``Y = sat(shift_round(Z M, S))``."""
    a, p = node.attrs, node.params
    t, f, rounding = a["index_bits"], a["fraction_bits"], a["rounding"]
    x = inputs[0].astype(np.int64)
    axes = tuple(a["axes"])
    v = np.maximum((x * x).sum(axis=axes, keepdims=True), max(a["eps_term"], 1))
    e = (_numpy_bit_length(v) - t + 1) // 2
    m = shift_round(v, 2 * e, rounding)
    r = p["rsqrt_table"].astype(np.int64)[m - (1 << (t - 2))]
    z = np.clip(shift_round(x * r, f + e - a["q_bits"], rounding), *RANGES[a["z_dtype"]])
    return [requant(z, p["multiplier"], p["shift"], a["dtype"], a["rounding"])]


def _numpy_softmax(node, inputs):
    """(Log-)softmax along ``axis`` (``docs/arithmetic.md``, 15); ``causal`` keeps ``j <= i``
    over the last two axes, the ``keep`` parameter or second input (a bool mask) the entries it
    marks."""
    a, p = node.attrs, node.params
    axis, rounding = a["axis"], a["rounding"]
    x = inputs[0].astype(np.int64)
    # the keep-mask (attention masks), broadcast against x: a constant, or the second input
    keep = inputs[1] if len(inputs) > 1 else p.get("keep")
    if a["causal"]:
        rows, cols = x.shape[-2], x.shape[-1]
        tri = np.tril(np.ones((rows, cols), dtype=bool))
        keep = tri if keep is None else keep & tri
    if keep is not None:
        x = np.where(keep, x, np.iinfo(np.int64).min // 4)
    u = x.max(axis=axis, keepdims=True) - x
    if keep is not None:
        u = np.where(keep, u, 0)
    t = shift_round(u * np.int64(a["exp_multiplier"]), a["exp_shift"], rounding)
    bits = a["exp_fraction_bits"]
    e = shift_round(
        p["exp2_table"].astype(np.int64)[t & ((1 << bits) - 1)], np.minimum(t >> bits, 40), rounding
    )
    if keep is not None:
        e = np.where(keep, e, 0)
    total = e.sum(axis=axis, keepdims=True)
    if a["log"]:
        ti = a["log_index_bits"]
        ex = _numpy_bit_length(total) - ti
        m = shift_round(total, ex, rounding)
        lg = (
            p["log_table"].astype(np.int64)[m - (1 << (ti - 1))]
            + (ex + ti) * a["ln2"]
            + a["log_offset"]
        )
        v = shift_round(u * np.int64(a["log_multiplier"]), a["log_shift"], rounding)
        y = shift_round(-(v + lg) * np.int64(a["out_multiplier"]), a["out_shift"], rounding)
    else:
        g = a["out_shift"]
        num = e * (np.int64(a["out_multiplier"]) << max(-g, 0))
        den = np.maximum(total, 1) << max(g, 0)
        y = (2 * num + den) // (2 * den)
    return [np.clip(y, *RANGES[a["dtype"]]).astype(DTYPES[a["dtype"]])]


# -- integer ONNX -------------------------------------------------------------------------------
def _bit_length(wr, v: str) -> str:
    """``floor(log2 v) + 1`` of a non-negative int64 tensor: the count of powers of two <= v."""
    powers = wr.const(np.array([1 << i for i in range(63)], np.int64), hint="pow2")
    ge = wr.op("GreaterOrEqual", [wr.op("Unsqueeze", [v, wr.const([-1], np.int64)]), powers])
    return wr.op("ReduceSum", [wr.cast(ge, "int64"), wr.const([-1], np.int64)], keepdims=0)


def _shift_round_wide(wr, v: str, shift: str, rounding: str, node: Node) -> str:
    """``shift_round(v, shift)`` of a non-negative int64 ``v`` of up to 62 bits (integer ops)."""
    if rounding != "half_up":
        raise ValueError(f"node {node.name!r}: only half-up rounding is exported for {node.op}")
    lo, hi = wr.int_const(0), wr.int_const(62)
    half = wr.pow2_int(wr.op("Clip", [wr.op("Sub", [shift, wr.int_const(1)]), lo, hi]))
    right = wr.op("Div", [wr.op("Add", [v, half]), wr.pow2_int(wr.op("Clip", [shift, lo, hi]))])
    left = wr.op("Mul", [v, wr.pow2_int(wr.op("Clip", [wr.op("Neg", [shift]), lo, hi]))])
    return wr.op("Where", [wr.op("Greater", [shift, wr.int_const(0)]), right, left])


def _normalize_rows(wr, rows: str, node: Node) -> str:
    """``Z`` of ``docs/arithmetic.md`` 14 over the last axis of int64 ``rows`` -> int64."""
    a = node.attrs
    axes = wr.const([-1], np.int64)
    s1 = wr.op("ReduceSum", [rows, axes], keepdims=1)
    s2 = wr.op("ReduceSum", [wr.op("Mul", [rows, rows]), axes], keepdims=1)
    n = wr.int_const(a["n"])
    d = wr.op("Sub", [wr.op("Mul", [rows, n]), s1])
    v = wr.op(
        "Sub",
        [
            wr.op("Mul", [s2, n]),
            wr.op("Sub", [wr.op("Mul", [s1, s1]), wr.int_const(a["eps_term"])]),
        ],
    )
    return _times_rsqrt(wr, d, wr.op("Max", [v, wr.int_const(1)]), node)


def _times_rsqrt(wr, d: str, v: str, node: Node) -> str:
    """``sat(shift_round(d * R, F + e - Q))`` with ``(R, e) = integer_rsqrt(v)`` (the
    table of ``docs/arithmetic.md`` 14, shared by LayerNorm / GroupNorm and l2 normalize)."""
    a, p = node.attrs, node.params
    t = a["index_bits"]
    # e = floor((b - T + 1) / 2): Div truncates, so shift the numerator positive first
    b = _bit_length(wr, v)
    e = wr.op(
        "Sub",
        [
            wr.op("Div", [wr.op("Add", [b, wr.int_const(41 - t)]), wr.int_const(2)]),
            wr.int_const(20),
        ],
    )
    m = _shift_round_wide(wr, v, wr.op("Mul", [e, wr.int_const(2)]), a["rounding"], node)
    index = wr.op("Sub", [m, wr.int_const(1 << (t - 2))])
    r = wr.op("Gather", [wr.const(p["rsqrt_table"].astype(np.int64), hint="rsqrt"), index], axis=0)
    shift = wr.op("Add", [e, wr.int_const(a["fraction_bits"] - a["q_bits"])])
    z = wr.shift_round_var(wr.op("Mul", [d, r]), shift, a["rounding"])
    lo, hi = RANGES[a["z_dtype"]]
    return wr.op("Clip", [z, wr.int_const(lo), wr.int_const(hi)])


def _onnx_normalize(wr, node: Node, outs: list[str]) -> None:
    a, p = node.attrs, node.params
    x = wr.name(node.inputs[0])
    x64 = wr.cast(x, "int64")
    if a["groups"] is None:
        rows = wr.op("Reshape", [x64, wr.const(np.array([-1, a["n"]], np.int64))])
        z = _normalize_rows(wr, rows, node)
    else:
        rows = wr.op("Reshape", [x64, wr.const(np.array([0, a["groups"], -1], np.int64))])
        channels = p["weight"].shape[0] if p["weight"].size > 1 else p["bias"].shape[0]
        z = wr.op(
            "Reshape",
            [
                _normalize_rows(wr, rows, node),
                wr.const(np.array([0, channels, -1], np.int64)),
            ],
        )
    acc = wr.op("Mul", [z, wr.const(p["weight"].astype(np.int64), hint="weight")])
    acc = wr.sat32(wr.op("Add", [acc, wr.const(p["bias"].astype(np.int64), hint="bias")]))
    tmp = wr.requant(
        acc,
        p["multiplier"],
        p["shift"],
        a["dtype"],
        a["rounding"],
        None,
        None,
        wr.fresh("normalized"),
    )
    wr.op("Reshape", [tmp, wr.op("Shape", [x])], outs[0])


def _onnx_l2_normalize(wr, node: Node, outs: list[str]) -> None:
    """``docs/arithmetic.md`` 27: int64 sum of squares, the rsqrt table, two roundings."""
    a, p = node.attrs, node.params
    x = wr.cast(wr.name(node.inputs[0]), "int64")
    axes = wr.const(np.array(a["axes"], np.int64))
    s2 = wr.op("ReduceSum", [wr.op("Mul", [x, x]), axes], keepdims=1)
    v = wr.op("Max", [s2, wr.int_const(max(a["eps_term"], 1))])
    z = _times_rsqrt(wr, x, v, node)
    wr.requant(z, p["multiplier"], p["shift"], a["dtype"], a["rounding"], None, None, outs[0])


def keep_mask(wr, node: Node) -> str | None:
    """A softmax node's bool keep-mask: its ``keep`` param or second input, and with
    ``causal`` the lower triangle; None when it keeps everything."""
    p = node.params
    mask = p.get("keep")  # a constant keep-mask (attention masks)
    if node.attrs["causal"]:
        shape = wr.graph.tensors[node.inputs[0]].shape
        tri = np.tril(np.ones((shape[-2], shape[-1]), dtype=bool))
        mask = tri if mask is None else mask & tri
    keep = None if mask is None else wr.const(mask, hint="keep")
    if len(node.inputs) > 1:  # computed in the graph (e.g. from an attention_mask input)
        given = wr.name(node.inputs[1])
        keep = given if keep is None else wr.op("And", [given, keep])
    return keep


def _onnx_softmax(wr, node: Node, outs: list[str]) -> None:
    a, p = node.attrs, node.params
    rounding = a["rounding"]
    axes = wr.const([a["axis"]], np.int64)
    x = wr.cast(wr.name(node.inputs[0]), "int64")
    zero = wr.int_const(0)
    keep = keep_mask(wr, node)
    if keep is not None:
        x = wr.op("Where", [keep, x, wr.int_const(np.iinfo(np.int64).min // 4)])
    u = wr.op("Sub", [wr.op("ReduceMax", [x, axes], keepdims=1), x])
    if keep is not None:
        u = wr.op("Where", [keep, u, zero])
    product = wr.op("Mul", [u, wr.int_const(a["exp_multiplier"])])
    t = wr.shift_round(product, a["exp_shift"], rounding)
    one = wr.int_const(1 << a["exp_fraction_bits"])
    k = wr.op("Min", [wr.op("Div", [t, one]), wr.int_const(40)])
    f = wr.op("Mod", [t, one])
    entry = wr.op("Gather", [wr.const(p["exp2_table"].astype(np.int64), hint="exp2"), f], axis=0)
    e = wr.shift_round_var(entry, k, rounding)
    if keep is not None:
        e = wr.op("Where", [keep, e, zero])
    total = wr.op("ReduceSum", [e, axes], keepdims=1)
    if a["log"]:
        ti = a["log_index_bits"]
        ex = wr.op("Sub", [_bit_length(wr, total), wr.int_const(ti)])
        m = _shift_round_wide(wr, total, ex, rounding, node)
        index = wr.op("Sub", [m, wr.int_const(1 << (ti - 1))])
        lg = wr.op("Gather", [wr.const(p["log_table"].astype(np.int64), hint="log"), index], axis=0)
        lg = wr.op(
            "Add",
            [
                lg,
                wr.op("Mul", [wr.op("Add", [ex, wr.int_const(ti)]), wr.int_const(a["ln2"])]),
            ],
        )
        lg = wr.op("Add", [lg, wr.int_const(a["log_offset"])])
        v = wr.shift_round(
            wr.op("Mul", [u, wr.int_const(a["log_multiplier"])]), a["log_shift"], rounding
        )
        acc = wr.op(
            "Mul",
            [wr.op("Neg", [wr.op("Add", [v, lg])]), wr.int_const(a["out_multiplier"])],
        )
        y = wr.shift_round(acc, a["out_shift"], rounding)
    else:
        g = a["out_shift"]
        num = wr.op("Mul", [e, wr.int_const(a["out_multiplier"] << max(-g, 0))])
        den = wr.op("Mul", [wr.op("Max", [total, wr.int_const(1)]), wr.int_const(1 << max(g, 0))])
        two = wr.int_const(2)
        y = wr.op(
            "Div",
            [wr.op("Add", [wr.op("Mul", [num, two]), den]), wr.op("Mul", [den, two])],
        )
    lo, hi = RANGES[a["dtype"]]
    y = wr.op("Clip", [y, wr.int_const(lo), wr.int_const(hi)])
    wr.cast(y, a["dtype"], outs[0])


# -- QDQ ONNX -----------------------------------------------------------------------------------
def _qdq_normalize(wr, node: Node, outs: list[str]) -> None:
    """The float normalization (mean, variance, ``1 / sqrt``) with the int8 affine weight and
    the int32 bias dequantized."""
    a, p = node.attrs, node.params
    x = wr.name(node.inputs[0])
    axes = wr.const([-1], np.int64)
    if a["groups"] is None:
        rows = wr.op("Reshape", [x, wr.const(np.array([-1, a["n"]], np.int64))])
    else:
        rows = wr.op("Reshape", [x, wr.const(np.array([0, a["groups"], -1], np.int64))])
    d = wr.op("Sub", [rows, wr.op("ReduceMean", [rows, axes], keepdims=1)])
    var = wr.op("ReduceMean", [wr.op("Mul", [d, d]), axes], keepdims=1)
    eps = wr.const(np.float32(a["eps"]))
    y = wr.op("Div", [d, wr.op("Sqrt", [wr.op("Add", [var, eps])])])
    if a["groups"] is not None:
        channels = p["bias"].shape[0]
        y = wr.op("Reshape", [y, wr.const(np.array([0, channels, -1], np.int64))])
    # the int8 weight and the int32 bias (at s_w 2**-q_bits: a power of two from s_w) with
    # one scale per element of their first axis
    w, bias = p["weight"], p["bias"].astype(np.int32)
    s_w = np.broadcast_to(p["weight_scale"].astype(np.float32).reshape(-1), w.shape[:1])
    s_b = np.broadcast_to(np.ldexp(s_w, -a["q_bits"]), bias.shape[:1])
    y = wr.op("Mul", [y, wr.dq_const(w, s_w, axis=0)])
    y = wr.op("Add", [y, wr.dq_const(bias, s_b, axis=0, hint="bias")])
    y = wr.op("Reshape", [y, wr.op("Shape", [x])])
    wr.qdq(y, node.outputs[0], outs[0])


def _qdq_l2_normalize(wr, node: Node, outs: list[str]) -> None:
    """The float ``x / max(||x||_2, eps)`` between Q / DQ pairs."""
    a = node.attrs
    x = wr.name(node.inputs[0])
    axes = wr.const(np.array(a["axes"], np.int64))
    norm = wr.op("Sqrt", [wr.op("ReduceSum", [wr.op("Mul", [x, x]), axes], keepdims=1)])
    norm = wr.op("Max", [norm, wr.const(np.float32(a["eps"]))])
    wr.qdq(wr.op("Div", [x, norm]), node.outputs[0], outs[0])


def _qdq_softmax(wr, node: Node, outs: list[str]) -> None:
    a = node.attrs
    x = wr.name(node.inputs[0])
    keep = keep_mask(wr, node)
    if keep is not None:
        # an additive mask with a finite fill: a row with nothing kept is uniform here and
        # zeroed below, as in fxq (Add / Mul, not Where: onnxruntime 1.32's extended graph
        # optimizations fail on a Where in this position)
        kept = wr.op("Cast", [keep], to=wr.types["float32"])
        one = wr.const(1.0, np.float32)
        bias = wr.op("Mul", [wr.op("Sub", [kept, one]), wr.const(1e30, np.float32)])
        x = wr.op("Add", [x, bias])
    # written out (Exp, ReduceSum, Div) so that onnxruntime does not fuse the pair into its
    # own 8-bit QLinearSoftmax, whose numerics differ from both
    axes = wr.const([a["axis"]], np.int64)
    shifted = wr.op("Sub", [x, wr.op("ReduceMax", [x, axes], keepdims=1)])
    exp = wr.op("Exp", [shifted])
    total = wr.op("ReduceSum", [exp, axes], keepdims=1)
    if a["log"]:
        y = wr.op("Sub", [shifted, wr.op("Log", [total])])
    else:
        y = wr.op("Div", [exp, total])
    if keep is not None and not a["log"]:
        y = wr.op("Mul", [y, kept])
    wr.qdq(y, node.outputs[0], outs[0])


# -- file schema --------------------------------------------------------------------------------
def _rsqrt(c: Ctx) -> None:
    a = c.attrs
    if not 3 <= a["index_bits"] <= 16 or not 0 <= a["fraction_bits"] <= 40:
        raise c.fail(f"index_bits {a['index_bits']}, fraction_bits {a['fraction_bits']}")
    if a["z_dtype"] not in ("int8", "int16") or not 0 <= a["q_bits"] <= 31 or a["eps_term"] < 0:
        raise c.fail(f"z_dtype {a['z_dtype']!r}, q_bits {a['q_bits']}, eps_term {a['eps_term']}")
    c.size("rsqrt_table", 3 * (1 << (a["index_bits"] - 2)) + 1)


def _check_normalize(c: Ctx) -> None:
    _rsqrt(c)
    a = c.attrs
    if a["n"] < 1 or (a["groups"] is not None and a["groups"] < 1):
        raise c.fail(f"n {a['n']}, groups {a['groups']}")


def _check_l2(c: Ctx) -> None:
    _rsqrt(c)
    for i, axis in enumerate(c.attrs["axes"]):
        c.axis(f"axes[{i}]", axis)


def _check_softmax(c: Ctx) -> None:
    a = c.attrs
    c.axis("axis", a["axis"])
    if len(c.in_dtypes) > 1 and (c.in_dtypes[1] != "bool" or "keep" in c.params):
        raise c.fail("a keep-mask input that is not bool, or with a keep param too")
    if not 1 <= a["exp_fraction_bits"] <= 16:
        raise c.fail(f"exp_fraction_bits {a['exp_fraction_bits']} outside 1..16")
    c.size("exp2_table", 1 << a["exp_fraction_bits"])
    if a["causal"] and c.rank() < 2:
        raise c.fail("a causal softmax of a rank-1 input")
    if a["log"]:
        for k in ("log_multiplier", "log_shift", "log_index_bits", "ln2", "log_offset"):
            if not is_int(a.get(k)):
                raise c.fail(f"log-softmax attribute {k!r} is {a.get(k)!r}, not an integer")
        if not 2 <= a["log_index_bits"] <= 16 or "log_table" not in c.params:
            raise c.fail(f"log_index_bits {a['log_index_bits']} or no param 'log_table'")
        c.size("log_table", (1 << (a["log_index_bits"] - 1)) + 1)


RSQRT_ATTRS = {
    "eps_term": "int",
    "q_bits": "int",
    "index_bits": "int",
    "fraction_bits": "int",
    "z_dtype": "str",
    "dtype": "qdtype",
    "rounding": "rounding",
}

_SPECS = {
    "normalize": OpSpec(
        (1,),
        {**RSQRT_ATTRS, "n": "int", "groups": "int?"},
        {
            "rsqrt_table": Param(INT_DTYPES, (1,)),
            "weight": Param(("int8",)),
            "bias": Param(("int32", "int64")),
            "weight_scale": Param(("float32", "float64"), None, False),
            "multiplier": SHIFT,
            "shift": SHIFT,
        },
        _check_normalize,
    ),
    "l2_normalize": OpSpec(
        (1,),
        {**RSQRT_ATTRS, "axes": "ints"},
        {"rsqrt_table": Param(INT_DTYPES, (1,)), "multiplier": SHIFT, "shift": SHIFT},
        _check_l2,
    ),
    "softmax": OpSpec(
        (1, 2),
        {
            "axis": "int",
            "log": "bool",
            "causal": "bool",
            "exp_multiplier": "int",
            "exp_shift": "int",
            "exp_fraction_bits": "int",
            "out_multiplier": "int",
            "out_shift": "int",
            **RESULT_ATTRS,
        },
        {
            "exp2_table": Param(INT_DTYPES, (1,)),
            "log_table": Param(INT_DTYPES, (1,), False),
            "keep": Param(("bool",), None, False),
        },
        _check_softmax,
    ),
}
_DOCS = {
    "normalize": "LayerNorm / GroupNorm: integer mean and variance, rsqrt table, int8 affine",
    "l2_normalize": "`x / max(||x||, eps)` with the rsqrt table",
    "softmax": "(log-)softmax with a base-2 exponential table, keep mask, causal masking",
}
for _op, _numpy, _onnx, _qdq in (
    ("normalize", _numpy_normalize, _onnx_normalize, _qdq_normalize),
    ("l2_normalize", _numpy_l2_normalize, _onnx_l2_normalize, _qdq_l2_normalize),
    ("softmax", _numpy_softmax, _onnx_softmax, _qdq_softmax),
):
    register(Primitive(_op, _numpy, _onnx, _SPECS[_op], _qdq, _DOCS[_op]))


# -- recording ----------------------------------------------------------------------------------
def record_softmax(
    x: Any,
    y: Any,
    dtype: str,
    build: Callable[[], tuple[dict[str, Any], Mapping[str, Any]]],
    keep: Any = None,
    causal: bool = False,
    scale: float | None = None,
) -> None:
    """Record that ``y`` (IR dtype ``dtype``) is the integer softmax of ``x`` that ``build()``
    describes (the node's attributes and tables, ``fxq.quantized.softmax.softmax_node``; built
    only while an export records).

    Args:
        keep: a bool keep-mask tensor broadcast against ``x`` (the node's second input: a mask
            of the graph, or a constant of the model), or None.
        causal: whether only ``j <= i`` of the last two axes is kept as well (the kernels
            build that triangle at the input's size, so the sequence length may be dynamic).
        scale: the output grid's scale, where the result stays inside the module.
    """
    if is_recording():
        attrs, params = build()
        attrs = {**attrs, "causal": bool(causal)}
        inputs = [x] if keep is None else [x, keep]
        record(Call("softmax", inputs, [y], [dtype], attrs, params, [scale]))
