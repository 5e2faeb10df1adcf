"""Weighted layers: convolution, linear and per-channel affine (a folded batch norm).

Every one is an exact accumulation of integer products with int8 weights, an int32 bias, the
int32 saturation of the march's accumulator, an optional fused residual (``conv_add``,
``linear_add``: the residual requantized into the accumulator) and one requantization per
output channel (or, ``out_dtype`` float32, the high-precision output ``acc * s_x * s_w``):

* ``conv``: 1-3-d, grouped, dilated, padded (any ``padding_mode``; a ``"zeros"`` border holds
  ``pad_value``, the stored 0 of an input with an offset), or transposed;
* ``linear``: ``x @ W^T`` over the last axis;
* ``channel_affine``: ``x * w[c] + b[c]`` on axis 1.

The torch side is the integer modules' own kernels (``fxq.quantized.weighted``,
``fxq.quantized.batchnorm``); ``conv`` / ``linear`` / ``channel_affine`` below record what they
computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fxq.primitives.arith import bounds as _bounds
from fxq.primitives.arith import dot_bound, exact_dot, requant, sat32, shift_round
from fxq.primitives.core import Primitive, register
from fxq.primitives.onnx_requant import (
    F32Plan,
    MulPlan,
    plan_f32_requant,
    plan_mul_requant,
    write_f32_requant,
)
from fxq.primitives.schema import (
    INT_DTYPES,
    Ctx,
    OpSpec,
    Param,
    geometry,
    is_int,
    is_ints,
    per_channel,
)

__all__ = ["conv_accumulate", "conv_transpose_accumulate", "explicit_pad"]

#: float32 sums of integers are exact below this magnitude
F32_EXACT = 1 << 24
Node = Any  # fxq.export.graph.Node (fxq.export is above this package)


def _channel_shape(ndim: int, axis: int, n: int) -> tuple[int, ...]:
    shape = [1] * ndim
    shape[axis] = n
    return tuple(shape)


# -- numpy --------------------------------------------------------------------------------------
_PAD_MODES = {"zeros": "constant", "reflect": "reflect", "replicate": "edge", "circular": "wrap"}


def _pad(
    x: np.ndarray, pads: Sequence[Sequence[int]], mode: str = "zeros", value: int = 0
) -> np.ndarray:
    """Pad (or crop, for negative amounts) the trailing ``len(pads)`` axes (``"zeros"``
    pads with ``value``)."""
    lead = x.ndim - len(pads)
    grow = [(0, 0)] * lead + [(max(lo, 0), max(hi, 0)) for lo, hi in pads]
    if any(g != (0, 0) for g in grow):
        extra = {"constant_values": value} if mode == "zeros" and value else {}
        x = np.pad(x, grow, mode=_PAD_MODES[mode], **extra)
    crop = [slice(None)] * lead + [
        slice(max(-lo, 0), x.shape[lead + i] - max(-hi, 0)) for i, (lo, hi) in enumerate(pads)
    ]
    return x[tuple(crop)]


def conv_accumulate(
    x: np.ndarray,
    w: np.ndarray,
    stride: Sequence[int],
    pads: Sequence[Sequence[int]],
    dilation: Sequence[int],
    groups: int,
    pad_mode: str = "zeros",
    pad_value: int = 0,
) -> np.ndarray:
    """Exact ``sum X * W`` of an N-d convolution, int64 ``[N, O, *out]``.

    ``x``: ``[N, C, *spatial]``; ``w``: ``[O, C / groups, *k]`` (out-major); a
    ``"zeros"`` border holds ``pad_value``.
    """
    d = w.ndim - 2
    x = _pad(x.astype(np.int64), pads, pad_mode, pad_value)
    k = w.shape[2:]
    span = [(ki - 1) * di + 1 for ki, di in zip(k, dilation)]
    win = np.lib.stride_tricks.sliding_window_view(x, span, axis=tuple(range(2, 2 + d)))
    sel = (
        [slice(None)] * 2
        + [slice(None, None, s) for s in stride]
        + [slice(None, None, di) for di in dilation]
    )
    win = win[tuple(sel)]  # [N, C, *out, *k]
    n, c = x.shape[:2]
    out_sp = win.shape[2 : 2 + d]
    o = w.shape[0]
    win = win.reshape(n, groups, c // groups, *out_sp, *k)
    wg = w.reshape(groups, o // groups, c // groups, *k)
    letters = "defhijlm"[:d]
    kl = "rstuvw"[:d]
    spec = f"ngc{letters}{kl},gpc{kl}->ngp{letters}"
    acc = exact_dot(win, wg, dot_bound(x, w, (c // groups) * int(np.prod(k))), spec)
    return acc.reshape(n, o, *out_sp)


def conv_transpose_accumulate(
    x: np.ndarray,
    w: np.ndarray,
    stride: Sequence[int],
    padding: Sequence[int],
    output_padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> np.ndarray:
    """Exact accumulation of a transposed convolution (out-major ``w``: ``[O, C / g, *k]``),
    as the equivalent convolution of the zero-stuffed input with the flipped kernel."""
    d = w.ndim - 2
    n, c = x.shape[:2]
    sp = x.shape[2:]
    up = np.zeros((n, c, *[(s - 1) * st + 1 for s, st in zip(sp, stride)]), dtype=np.int64)
    up[(slice(None), slice(None), *[slice(None, None, st) for st in stride])] = x
    k = w.shape[2:]
    pads = [
        (di * (ki - 1) - p, di * (ki - 1) - p + op)
        for ki, di, p, op in zip(k, dilation, padding, output_padding)
    ]
    flipped = np.flip(w, axis=tuple(range(2, 2 + d)))
    return conv_accumulate(up, flipped, [1] * d, pads, dilation, groups)


def _numpy_finish(node, acc: np.ndarray, residual: np.ndarray | None, axis: int):
    """Bias, residual, saturation and requantization shared by conv / linear / affine."""
    a, p = node.attrs, node.params
    shape = _channel_shape(acc.ndim, axis % acc.ndim, acc.shape[axis])
    if "bias" in p:
        acc = acc + p["bias"].astype(np.int64).reshape(shape)
    acc = sat32(acc)
    if residual is not None:
        term = shift_round(
            residual.astype(np.int64) * p["residual_multiplier"].astype(np.int64).reshape(shape),
            p["residual_shift"].astype(np.int64).reshape(shape),
            a["rounding"],
        )
        acc = sat32(acc + term)
    if a["out_dtype"] == "float32":  # high precision: float32(acc * s_x * s_w)
        if a["lo"] is not None:
            acc = np.maximum(acc, 0)
        y = acc.astype(np.float64) * p["accumulator_scale"].reshape(shape)
        if a.get("float_max") is not None:
            y = np.minimum(y, a["float_max"])
        return [y.astype(np.float32)]
    m = p["multiplier"].astype(np.int64).reshape(shape)
    s = p["shift"].astype(np.int64).reshape(shape)
    return [requant(acc, m, s, a["out_dtype"], a["rounding"], a["lo"], a["hi"])]


def _numpy_conv(node, inputs):
    a, w = node.attrs, node.params["weight"]
    x = inputs[0]
    if a["transposed"]:
        acc = conv_transpose_accumulate(
            x, w, a["stride"], a["padding"], a["output_padding"], a["dilation"], a["groups"]
        )
    else:
        acc = conv_accumulate(
            x,
            w,
            a["stride"],
            a["pads"],
            a["dilation"],
            a["groups"],
            a["pad_mode"],
            a.get("pad_value", 0),
        )
    return _numpy_finish(node, acc, inputs[1] if len(inputs) > 1 else None, 1)


def _numpy_linear(node, inputs):
    x, w = inputs[0], node.params["weight"]
    acc = exact_dot(x, w, dot_bound(x, w, w.shape[1]), "...k,ok->...o")
    return _numpy_finish(node, acc, inputs[1] if len(inputs) > 1 else None, -1)


def _numpy_channel_affine(node, inputs):
    x = inputs[0].astype(np.int64)
    w = node.params["weight"].astype(np.int64)
    acc = x * w.reshape(_channel_shape(x.ndim, 1, w.shape[0]))
    return _numpy_finish(node, acc, None, 1)


# -- integer ONNX -------------------------------------------------------------------------------
def _finish(
    wr,
    node: Node,
    acc: str,
    rank: int,
    axis: int,
    out: str,
    bias_added: bool = False,
    bound: int | None = None,
) -> None:
    """Bias, saturation, residual and requantization of conv / linear / affine, on the
    int64 accumulator ``acc``.

    ``bias_added``: the kernel added the bias already; ``bound``: a proven bound on
    ``|acc + bias|`` (no int32 saturation is written when it is below ``2**31``; the bias
    is then folded into the requantization's constant term).
    """
    a, p = node.attrs, node.params
    ch = lambda v: wr.channel(np.asarray(v, np.int64), rank, axis)  # noqa: E731
    bias = ch(p["bias"]) if "bias" in p and not bias_added else None
    saturate = bound is None or bound >= 1 << 31
    if bias is not None and (saturate or len(node.inputs) > 1 or a["out_dtype"] == "float32"):
        acc, bias = wr.op("Add", [acc, wr.const(bias)]), None
    if saturate:
        acc = wr.sat32(acc)
    if len(node.inputs) > 1:
        rs = ch(p["residual_shift"])
        rm = np.left_shift(ch(p["residual_multiplier"]), np.maximum(-rs, 0))
        t = wr.op("Mul", [wr.as_int(node.inputs[1]), wr.const(rm)])
        t = wr.shift_round(t, np.maximum(rs, 0), a["rounding"])
        acc = wr.sat32(wr.op("Add", [acc, t]))
    if a["out_dtype"] == "float32":
        # the one float64 exception (docs/integer_graph.md, 4; its tensors are named
        # "high_precision__*"): float32(float64(acc) * accumulator_scale), two roundings
        hp = lambda: wr.fresh("high_precision")  # noqa: E731
        acc = wr.cast(acc, "float64", hp())
        if a["lo"] is not None:
            acc = wr.op("Max", [acc, wr.const(0.0, np.float64, "high_precision")], hp())
        scale = wr.channel(p["accumulator_scale"], rank, axis)
        scale = wr.const(scale, np.float64, "high_precision")
        y = wr.op("Mul", [acc, scale], hp())
        if a.get("float_max") is not None:
            y = wr.op("Min", [y, wr.const(a["float_max"], np.float64, "high_precision")], hp())
        wr.cast(y, "float32", out)
        return
    wr.requant(
        acc,
        ch(p["multiplier"]),
        ch(p["shift"]),
        a["out_dtype"],
        a["rounding"],
        a["lo"],
        a["hi"],
        out,
        0 if bias is None else bias,
    )


def _plan_f32(
    wr, node: Node, rank: int, axis: int, bound: int
) -> tuple[F32Plan | MulPlan, tuple[np.ndarray, np.ndarray] | None] | None:
    """The float32 requantization of conv / linear / affine for an accumulator of exact
    integers with the bias in (``|acc| <= bound``), as ``fxq.export.onnx_requant`` plans
    it, and the residual term's float32 multiplier and shift; None where that plan does
    not apply: a residual too wide, half-even rounding, a float32 output, or steps that
    would pass ``2**24``."""
    a, p = node.attrs, node.params
    if a["out_dtype"] not in ("int8", "int16") or a["rounding"] != "half_up":
        return None
    ch = lambda v: wr.channel(np.asarray(v, np.int64), rank, axis)  # noqa: E731
    term = None
    if len(node.inputs) > 1:  # shift_round(r * rm, rs), exact below 2**23
        rs, rm = ch(p["residual_shift"]), ch(p["residual_multiplier"])
        rm = rm * (np.int64(1) << np.maximum(-rs, 0))
        rs = np.maximum(rs, 0)
        rmax = (1 << (wr.bits(node.inputs[1]) - 1)) * np.abs(rm)
        if rmax.max() >= 1 << 23 or rs.max() > 23:
            return None
        bound += int((-(-rmax // (np.int64(1) << rs))).max()) + 1
        term = (np.ldexp(rm.astype(np.float64), -rs).astype(np.float32), rs)
    lo, hi = _bounds(a["out_dtype"], a["lo"], a["hi"])
    if a["out_dtype"] == "int8":  # one Mul and QuantizeLinear where that is exact
        fast = plan_mul_requant(p["multiplier"], p["shift"], bound, lo, hi)
        if fast is not None:
            return fast, term
    plan = plan_f32_requant(p["multiplier"], p["shift"], bound, lo, hi, a["out_dtype"] == "int8")
    return None if plan is None else (plan, term)


def _finish_f32(
    wr,
    node: Node,
    acc: str,
    rank: int,
    axis: int,
    out: str,
    planned: tuple[F32Plan | MulPlan, tuple[np.ndarray, np.ndarray] | None],
    scaled: bool = False,
) -> None:
    """``_finish`` in float32 for a float32 accumulator ``acc`` (scaled by ``2**-k``
    with ``scaled``) as ``_plan_f32`` planned it."""
    a = node.attrs
    plan, term = planned
    if term is not None:
        r, rs = term
        t = wr.op("Mul", [wr.as_float(node.inputs[1]), wr.const(r)])
        if rs.any():
            t = wr.op("Floor", [wr.op("Add", [t, wr.const(np.float32(0.5))])])
        acc = wr.op("Add", [acc, t])
    lo, hi = _bounds(a["out_dtype"], a["lo"], a["hi"])
    write_f32_requant(wr, acc, plan, rank, axis, a["out_dtype"], lo, hi, out, scaled)


def _l1(w: np.ndarray) -> int:
    """``max_o sum |W[o]|``, which bounds every partial sum with ``max |X|``."""
    return int(np.abs(w.astype(np.int64)).reshape(w.shape[0], -1).sum(1).max()) if w.size else 0


def _limbs(wr, node: Node, w: np.ndarray) -> tuple[int, int]:
    """The fewest float32 limbs (and their width) that keep the conv exact."""
    bits = wr.bits(node.inputs[0])
    l1 = _l1(w)
    for limbs in range(1, 5):
        width = -(-bits // limbs)
        if limbs > 1 and width * (limbs - 1) >= bits:
            continue
        top = bits - width * (limbs - 1)
        mag = 1 << (bits - 1) if limbs == 1 else max((1 << width) - 1, 1 << (top - 1))
        if mag * l1 < F32_EXACT and (limbs == 1 or width <= 8):
            return limbs, width
    raise ValueError(
        f"node {node.name!r}: no exact float32 plan for this conv (sum |W| = {l1} with "
        f"{bits}-bit inputs); use int8 inputs for it"
    )


def _onnx_conv(wr, node: Node, outs: list[str]) -> None:
    a, w = node.attrs, node.params["weight"]
    d = a["dim"]
    x = wr.as_float(node.inputs[0])
    limbs, width = _limbs(wr, node, w)
    if a["transposed"]:
        g = a["groups"]
        k = w.shape[2:]
        wt = w.reshape(g, w.shape[0] // g, w.shape[1], *k).swapaxes(1, 2)
        wt = wt.reshape(g * w.shape[1], w.shape[0] // g, *k)
        kernel = wr.cast(wr.const(wt.astype(np.int8), hint="weight"), "float32")
        attrs = dict(
            strides=a["stride"],
            pads=a["padding"] + a["padding"],
            dilations=a["dilation"],
            group=g,
            output_padding=a["output_padding"],
        )
        op_type = "ConvTranspose"
    else:
        kernel = wr.cast(wr.const(w.astype(np.int8), hint="weight"), "float32")
        # the stored form of 0 of an input with an offset (a float of an integer here)
        x, pads = explicit_pad(wr, x, a, a.get("pad_value", 0))
        attrs = dict(
            strides=a["stride"],
            pads=[p[0] for p in pads] + [p[1] for p in pads],
            dilations=a["dilation"],
            group=a["groups"],
        )
        op_type = "Conv"
    bias = node.params.get("bias")
    bmax = int(np.abs(bias.astype(np.int64)).max()) if bias is not None and bias.size else 0
    bound = (1 << (wr.bits(node.inputs[0]) - 1)) * _l1(w) + bmax
    bias_in_kernel = bias is not None and limbs == 1 and bound < F32_EXACT
    exact = limbs == 1 and (bias is None or bias_in_kernel)
    planned = _plan_f32(wr, node, d + 2, 1, bound) if exact else None
    # the split's 2**-k folded into the weights and bias (exact: powers of two)
    scaled = planned is not None and planned[1] is None and not a["transposed"]
    if scaled and planned[0].split.any():
        step = np.ldexp(1.0, -planned[0].split).astype(np.float32)
        kernel = wr.op("Mul", [kernel, wr.const(step.reshape(-1, *[1] * (d + 1)))])
        bias = None if bias is None else bias * step.astype(np.float64)
    extra = [wr.const(bias.astype(np.float32), hint="bias")] if bias_in_kernel else []
    parts = []
    rest = x
    for i in range(limbs):
        if i < limbs - 1:
            hi = wr.op("Floor", [wr.op("Mul", [rest, wr.const(2.0**-width, np.float32)])])
            limb = wr.op("Sub", [rest, wr.op("Mul", [hi, wr.const(2.0**width, np.float32)])])
            rest = hi
        else:
            limb = rest
        y = wr.op(op_type, [limb, kernel, *extra], **attrs)
        if planned is not None:
            return _finish_f32(wr, node, y, d + 2, 1, outs[0], planned, scaled)
        y = wr.cast(y, "int64")
        if i:
            y = wr.op("Mul", [y, wr.int_const(1 << (i * width))])
        parts.append(y)
    acc = parts[0]
    for part in parts[1:]:
        acc = wr.op("Add", [acc, part])
    _finish(wr, node, acc, d + 2, 1, outs[0], bias_in_kernel, bound)


def explicit_pad(wr, x: str, a: dict, value: float) -> tuple[str, list[list[int]]]:
    """A conv's input padded by a ``Pad`` node where ONNX ``Conv``'s zero padding cannot
    do it (a padding mode, or a border holding ``value`` != 0); returns the input and
    the pads left to the ``Conv``."""
    pads = a["pads"]
    zeros = a["pad_mode"] == "zeros"
    if zeros and not (value and any(p[0] or p[1] for p in pads)):
        return x, pads
    flat = [0, 0] + [p[0] for p in pads] + [0, 0] + [p[1] for p in pads]
    inputs = [x, wr.const(np.array(flat, np.int64))]
    if zeros:
        inputs.append(wr.const(np.array(value, np.float32), hint="pad_value"))
        x = wr.op("Pad", inputs)
    else:
        mode = {"reflect": "reflect", "replicate": "edge", "circular": "wrap"}[a["pad_mode"]]
        x = wr.op("Pad", inputs, mode=mode)
    return x, [[0, 0]] * len(pads)


def _onnx_linear(wr, node: Node, outs: list[str]) -> None:
    w = node.params["weight"]
    bias = node.params.get("bias")
    bmax = int(np.abs(bias.astype(np.int64)).max()) if bias is not None and bias.size else 0
    mag = (1 << (wr.bits(node.inputs[0]) - 1)) * _l1(w)
    weight = wr.const(w.T.astype(np.int8), hint="weight")
    acc = wr.dot(wr.name(node.inputs[0]), weight, mag)
    _finish(wr, node, acc, wr.rank(node.inputs[0]), -1, outs[0], bound=mag + bmax)


def _onnx_channel_affine(wr, node: Node, outs: list[str]) -> None:
    rank = wr.rank(node.inputs[0])
    w, bias = node.params["weight"].astype(np.int64), node.params.get("bias")
    bmax = int(np.abs(bias.astype(np.int64)).max()) if bias is not None and bias.size else 0
    mag = (1 << (wr.bits(node.inputs[0]) - 1)) * (int(np.abs(w).max()) if w.size else 0)
    acc = wr.op(
        "Mul",
        [wr.as_int(node.inputs[0]), wr.const(wr.channel(w, rank, 1), hint="weight")],
    )
    _finish(wr, node, acc, rank, 1, outs[0], bound=mag + bmax)


# -- QDQ ONNX -----------------------------------------------------------------------------------
def _conv_weight(wr, node: Node) -> str:
    """The conv's weight: int8 with one scale per output channel, axis 0 for ``Conv``
    (``(C_out, C_in / g, *k)``); ``ConvTranspose``'s weight is ``(C_in, C_out / g, *k)``, so
    axis 1 where the groups share their scales (``groups == 1``), axis 0 where each group
    has one scale (depthwise: ``C_out == groups``). Other grouped transposed convs have no
    axis that holds their scales: their weight is the float initializer ``int8 * scale``
    (the same float32 values)."""
    a, w = node.attrs, node.params["weight"]
    scale = node.params["weight_scale"].astype(np.float32)
    if not a["transposed"]:
        return wr.dq_const(w, scale, axis=0)
    g, c_out, c_in, k = a["groups"], w.shape[0], w.shape[1], w.shape[2:]
    wt = w.reshape(g, c_out // g, c_in, *k).swapaxes(1, 2).reshape(g * c_in, c_out // g, *k)
    per_group = scale.reshape(g, c_out // g)
    if (per_group == per_group[:1]).all():
        return wr.dq_const(wt, per_group[0], axis=1)
    if (per_group == per_group[:, :1]).all():
        return wr.dq_const(wt, np.repeat(per_group[:, 0], c_in), axis=0)
    rows = np.repeat(per_group, c_in, axis=0).reshape(g * c_in, c_out // g, *[1] * len(k))
    return wr.const(wt.astype(np.float32) * rows, hint="weight")


def _dq_bias(wr, node: Node, shape: tuple[int, ...] | None = None) -> str | None:
    """The int32 bias at ``s_x * s_w`` per output channel (axis 0), ``shape`` its layout."""
    p = node.params
    if "bias" not in p:
        return None
    bias = p["bias"].astype(np.int32)
    s = np.float32(wr.fscale(node.inputs[0])) * p["weight_scale"].astype(np.float32)
    s = np.broadcast_to(s.reshape(-1), bias.shape[:1])
    return wr.dq_const(bias.reshape(shape or bias.shape), s, axis=0, hint="bias")


def _finish_float(wr, node: Node, y: str, rank: int, axis: int, out: str) -> None:
    a = node.attrs
    if len(node.inputs) > 1:
        y = wr.op("Add", [y, _residual(wr, node, rank, axis)])
    t = wr.graph.tensors[node.outputs[0]]
    s = 1.0 if t.scale is None else t.scale
    if a["lo"] is not None or a["hi"] is not None:
        lo = -np.inf if a["lo"] is None else a["lo"] * s
        hi = a.get("float_max") or (np.inf if a["hi"] is None else a["hi"] * s)
        y = wr.op("Clip", [y, wr.const(lo, np.float32), wr.const(hi, np.float32)])
    wr.qdq(y, node.outputs[0], out)


def _residual(wr, node: Node, rank: int, axis: int) -> str:
    """The fused residual as the integer op adds it: times ``g[c] = m_r[c] 2**-k_r[c]
    s_x s_w[c] / s_r`` per output channel, 1 within the multiplier's rounding unless
    ``fxq.calibration.smooth_activations`` gave the layer a residual factor."""
    r = wr.name(node.inputs[1])
    p = node.params
    real = np.ldexp(
        p["residual_multiplier"].astype(np.float64), -p["residual_shift"].astype(np.int64)
    )
    g = (
        real
        * wr.fscale(node.inputs[0])
        * p["weight_scale"].astype(np.float64)
        / wr.fscale(node.inputs[1])
    )
    if np.all(np.abs(g - 1) <= 2.0**-12):
        return r
    return wr.op("Mul", [r, wr.const(wr.channel(g.astype(np.float32), rank, axis))])


def _qdq_conv(wr, node: Node, outs: list[str]) -> None:
    a = node.attrs
    d = a["dim"]
    x = wr.name(node.inputs[0])
    inputs = [x, _conv_weight(wr, node)]
    bias = _dq_bias(wr, node)
    if a["transposed"]:
        attrs = dict(
            strides=a["stride"],
            pads=a["padding"] + a["padding"],
            dilations=a["dilation"],
            group=a["groups"],
            output_padding=a["output_padding"],
        )
        y = wr.op("ConvTranspose", inputs + ([bias] if bias else []), **attrs)
    else:
        # an input with an offset: its dequantized stored 0 is -offset * scale
        value = a.get("pad_value", 0)
        if value:
            value = float(np.float32(value) * np.float32(wr.fscale(node.inputs[0])))
        inputs[0], pads = explicit_pad(wr, x, a, value)
        y = wr.op(
            "Conv",
            inputs + ([bias] if bias else []),
            strides=a["stride"],
            pads=[p[0] for p in pads] + [p[1] for p in pads],
            dilations=a["dilation"],
            group=a["groups"],
        )
    _finish_float(wr, node, y, d + 2, 1, outs[0])


def _qdq_linear(wr, node: Node, outs: list[str]) -> None:
    """``MatMul`` by the int8 weight stored transposed, ``(in, out)``, with its scales on
    axis 1 (the output channels), then the bias ``Add``.

    An input of rank above 2 is multiplied as 2-d rows between ``Reshape`` nodes (the
    rows with the input's Q / DQ pair): onnxruntime 1.32 rewrites ``MatMul`` + ``Add`` of
    a rank-3 input of static shape into a ``Gemm`` between ``Reshape`` nodes and gives
    that ``Reshape`` a Q / DQ pair of its own, which at opset 21 fails to load above
    ORT_ENABLE_BASIC (``close_propagation``)."""
    p = node.params
    w = wr.dq_const(np.ascontiguousarray(p["weight"].T), p["weight_scale"], axis=1)
    x = wr.name(node.inputs[0])
    shape = wr.graph.tensors[node.inputs[0]].shape
    if len(shape) > 2:
        rows = wr.const(np.array([-1, shape[-1]], np.int64))
        x = wr.qdq(wr.op("Reshape", [x, rows]), node.inputs[0], wr.fresh("rows"))
    y = wr.op("MatMul", [x, w])
    bias = _dq_bias(wr, node)
    if bias:
        y = wr.op("Add", [y, bias])
    if len(shape) > 2:
        lead = wr.op(
            "Slice",
            [
                wr.op("Shape", [wr.name(node.inputs[0])]),
                wr.const(np.array([0], np.int64)),
                wr.const(np.array([-1], np.int64)),
            ],
        )
        out = wr.const(np.array([p["weight"].shape[0]], np.int64))
        y = wr.op("Reshape", [y, wr.op("Concat", [lead, out], axis=0)])
    _finish_float(wr, node, y, wr.rank(node.inputs[0]), -1, outs[0])


def _qdq_channel_affine(wr, node: Node, outs: list[str]) -> None:
    """``x * w + b`` per channel (axis 1), the int8 weight and int32 bias stored as
    ``(C, 1, ...)`` so that they broadcast without a ``Reshape``."""
    rank = wr.rank(node.inputs[0])
    p = node.params
    shape = (p["weight"].shape[0],) + (1,) * (rank - 2)
    scale = np.broadcast_to(p["weight_scale"].astype(np.float32).reshape(-1), shape[:1])
    w = wr.dq_const(p["weight"].reshape(shape), scale, axis=0)
    y = wr.op("Mul", [wr.name(node.inputs[0]), w])
    y = wr.op("Add", [y, _dq_bias(wr, node, shape)])
    _finish_float(wr, node, y, rank, 1, outs[0])


# -- file schema --------------------------------------------------------------------------------
def _check_conv(c: Ctx) -> None:
    a, w = c.attrs, c.params["weight"]
    d = a["dim"]
    if not 1 <= d <= 3 or w.ndim != d + 2:
        raise c.fail(f"dim {d} with a rank-{w.ndim} weight (conv weights are [O, C/g, *k])")
    for k in ("stride", "dilation"):
        if len(a[k]) != d or min(a[k], default=1) < 1:
            raise c.fail(f"{k} {a[k]} is not {d} positive integers")
    g = a["groups"]
    if g < 1 or w.shape[0] % g:
        raise c.fail(f"groups {g} does not divide the {w.shape[0]} output channels")
    if a["transposed"]:
        for k in ("padding", "output_padding"):
            if not is_ints(a.get(k)) or len(a[k]) != d:
                raise c.fail(f"{k} {a.get(k)!r} is not {d} integers")
    else:
        pads = a.get("pads")
        if (
            not isinstance(pads, list)
            or len(pads) != d
            or not all(is_ints(p) and len(p) == 2 for p in pads)
        ):
            raise c.fail(f"pads {pads!r} is not {d} pairs of integers")
        if a.get("pad_mode") not in ("zeros", "reflect", "replicate", "circular"):
            raise c.fail(f"pad_mode {a.get('pad_mode')!r} is not zeros/reflect/replicate/circular")
        if not is_int(a.get("pad_value", 0)):
            raise c.fail(f"pad_value {a.get('pad_value')!r} is not an integer")
    if c.rank() != d + 2:
        raise c.fail(f"a rank-{c.rank()} input for a {d}-d conv")
    geometry(c, ("stride", "dilation", "pads", "padding", "output_padding"))
    channels = c.in_shapes[0][1]
    if is_int(channels) and channels != w.shape[1] * g:
        raise c.fail(f"{channels} input channels, the weight takes {w.shape[1] * g}")
    _check_finish(c, w.shape[0])


def _check_finish(c: Ctx, n: int) -> None:
    if c.attrs["out_dtype"] == "float32":
        if "accumulator_scale" not in c.params:
            raise c.fail("a float32 output without param 'accumulator_scale'")
    elif "multiplier" not in c.params or "shift" not in c.params:
        raise c.fail("no params 'multiplier' and 'shift'")
    if ("residual_multiplier" in c.params) != ("residual_shift" in c.params):
        raise c.fail("one of residual_multiplier / residual_shift without the other")
    names = ("bias", "multiplier", "shift", "residual_multiplier", "residual_shift")
    per_channel(c, n, (*names, "accumulator_scale", "weight_scale"))


def _check_linear(c: Ctx) -> None:
    w = c.params["weight"]
    k = c.in_shapes[0][-1] if c.rank() else None
    if c.rank() == 0 or (is_int(k) and k != w.shape[1]):
        raise c.fail(f"an input of shape {c.in_shapes[0]} for a weight of shape {list(w.shape)}")
    _check_finish(c, w.shape[0])


def _check_affine(c: Ctx) -> None:
    if c.rank() < 2:
        raise c.fail(f"a rank-{c.rank()} input (channel_affine needs channels on axis 1)")
    _check_finish(c, c.params["weight"].size)


_W = ("out_dtype", "rounding", "lo", "hi")
_WEIGHTED = {"out_dtype": "outdtype", "rounding": "rounding", "lo": "int?", "hi": "int?"}
_WPARAMS = {
    "weight": Param(("int8",)),
    "bias": Param(("int32", "int64"), (1,), False),
    "weight_scale": Param(("float32", "float64"), None, False),
    "multiplier": Param(INT_DTYPES, None, False),
    "shift": Param(INT_DTYPES, None, False),
    "residual_multiplier": Param(INT_DTYPES, None, False),
    "residual_shift": Param(INT_DTYPES, None, False),
    "accumulator_scale": Param(("float32", "float64"), None, False),
}

_SPECS = {
    "conv": OpSpec(
        (1, 2),
        {
            **_WEIGHTED,
            "dim": "int",
            "transposed": "bool",
            "stride": "ints",
            "dilation": "ints",
            "groups": "int",
            "float_max": "float?",
        },
        _WPARAMS,
        _check_conv,
    ),
    "linear": OpSpec(
        (1, 2),
        {**_WEIGHTED, "float_max": "float?"},
        {**_WPARAMS, "weight": Param(("int8",), (2,))},
        _check_linear,
    ),
    "channel_affine": OpSpec(
        (1,), _WEIGHTED, {**_WPARAMS, "weight": Param(("int8",), (1,))}, _check_affine
    ),
}

register(
    Primitive(
        "conv",
        _numpy_conv,
        _onnx_conv,
        _SPECS["conv"],
        _qdq_conv,
        "exact N-d (transposed) convolution, bias, saturation, residual, requantization",
    )
)
register(
    Primitive(
        "linear",
        _numpy_linear,
        _onnx_linear,
        _SPECS["linear"],
        _qdq_linear,
        "exact `x @ W^T`, bias, saturation, residual, requantization per output channel",
    )
)
register(
    Primitive(
        "channel_affine",
        _numpy_channel_affine,
        _onnx_channel_affine,
        _SPECS["channel_affine"],
        _qdq_channel_affine,
        "`x * w[c] + b[c]` on axis 1, saturation, requantization per channel",
    )
)
