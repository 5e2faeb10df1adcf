"""Requantization: integers on one grid moved onto another.

* ``requantize``: ``clamp(shift_round(x * M, S), lo, hi)`` with ``M 2**-S ~ s_x / s_y`` (one
  multiplier, or one per channel; ``lo`` / ``hi`` tighter bounds: a clamp, ReLU6). With
  ``count_axes`` (a mean over dimensions that are dynamic at export) the multiplier and shift
  are tables indexed by the element count of those axes of a second input.
* ``prelu``: the two sides of a (leaky / parametric) ReLU requantized apart:
  ``x >= 0``: ``requantize(x, M, S)``; ``x < 0``: ``requantize(x * sign[c], N[c], T[c])``
  with ``N[c] 2**-T[c] ~ |a[c]| s_x / s_y``.

* ``quantize``: float values onto a grid, ``clamp(round(x / s))`` (the IEEE float32 division,
  as ``fxq.quantized.functional.quantize``);
* ``dequantize``: integers back to float32, ``q * s``.

The rounding shift is exact integer arithmetic (``fxq.quantized.functional.requantize_exact``
in torch, ``fxq.primitives.arith.requant`` in numpy).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fxq.primitives.arith import RANGES, bounds, quantize, requant
from fxq.primitives.core import (
    Call,
    NotExportable,
    Primitive,
    ir_dtype,
    is_recording,
    record,
    register,
    traced,
)
from fxq.primitives.schema import RESULT_ATTRS, SHIFT, Ctx, OpSpec

try:
    import torch
except ImportError:  # the numpy runtime without torch
    torch = None

__all__ = ["requantize", "prelu", "quantize_values", "dequantize", "MAX_COUNT_TABLE"]

#: the longest multiplier table of a requantize by element count (``count_axes``)
MAX_COUNT_TABLE = 1 << 24


# -- numpy --------------------------------------------------------------------------------------
def _numpy_requantize(node, inputs):
    a, p = node.attrs, node.params
    mult, shift = p["multiplier"], p["shift"]
    if a.get("count_axes") is not None:
        count = int(np.prod([inputs[1].shape[k] for k in a["count_axes"]]))
        if not 0 < count < mult.size:
            raise ValueError(
                f"the mean is over {count} elements; the graph's multipliers cover 1 to "
                f"{mult.size - 1} (export with a larger Dim(..., max=...))"
            )
        mult, shift = mult[count : count + 1], shift[count : count + 1]
    return [requant(inputs[0], mult, shift, a["dtype"], a["rounding"], a["lo"], a["hi"])]


def _numpy_prelu(node, inputs):
    a, p = node.attrs, node.params
    x = inputs[0].astype(np.int64)
    shape = [1] * x.ndim
    if p["neg_multiplier"].size > 1:
        shape[a["axis"]] = -1
    per = {k: p[k].reshape(shape) for k in ("neg_multiplier", "neg_shift", "neg_sign")}
    pos = requant(x, p["multiplier"], p["shift"], a["dtype"], a["rounding"])
    neg = requant(
        x * per["neg_sign"], per["neg_multiplier"], per["neg_shift"], a["dtype"], a["rounding"]
    )
    return [np.where(x >= 0, pos, neg)]


def _numpy_quantize(node, inputs):
    a = node.attrs
    return [quantize(inputs[0], a["scale"], a["dtype"], a["rounding"])]


def _numpy_dequantize(node, inputs):
    with np.errstate(over="ignore"):  # beyond float32's range: +-inf, as in torch
        return [inputs[0].astype(np.float32) * np.float32(node.attrs["scale"])]


# -- integer ONNX -------------------------------------------------------------------------------
def _onnx_requantize(w, node, outs: list[str]) -> None:
    a, p = node.attrs, node.params
    x = w.as_int(node.inputs[0])
    if a.get("count_axes") is None:
        w.requant(
            x, p["multiplier"], p["shift"], a["dtype"], a["rounding"], a["lo"], a["hi"], outs[0]
        )
        return
    # multiplier and shift by element count: gathered from their tables at run time
    shape = w.op("Shape", [w.name(node.inputs[1])])
    sizes = w.op("Gather", [shape, w.const(np.array(a["count_axes"], np.int64))])
    count = w.op("ReduceProd", [sizes], keepdims=0)
    m = w.op("Gather", [w.const(p["multiplier"].astype(np.int64)), count], axis=0)
    shift = w.op("Gather", [w.const(p["shift"].astype(np.int64)), count], axis=0)
    v = w.shift_round_var(w.op("Mul", [x, m]), shift, a["rounding"])
    lo, hi = bounds(a["dtype"], a["lo"], a["hi"])
    v = w.op("Clip", [v, w.int_const(lo), w.int_const(hi)])
    w.cast(v, a["dtype"], outs[0])


def _onnx_prelu(w, node, outs: list[str]) -> None:
    a, p = node.attrs, node.params
    rank = w.rank(node.inputs[0])
    neg = [p[k].astype(np.int64) for k in ("neg_multiplier", "neg_shift", "neg_sign")]
    if neg[0].size > 1:
        neg = [w.channel(v, rank, a["axis"]) for v in neg]
    nm, ns, sign = neg
    x = w.as_int(node.inputs[0])
    dtype = w.store(node.outputs[0])
    d, r = a["dtype"], a["rounding"]
    # Where on int64 (onnxruntime has no int16 Where), then the cast
    pos = w.requant(x, p["multiplier"], p["shift"], d, r, None, None, None)
    neg_out = w.requant(x, nm * sign, ns, d, r, None, None, None)
    ge = w.op("GreaterOrEqual", [x, w.int_const(0)])
    w.cast(w.op("Where", [ge, pos, neg_out]), dtype, outs[0])


def _onnx_quantize(w, node, outs: list[str]) -> None:
    """``x / s`` in float32, rounded exactly (half up: ``floor(v) + (v - floor(v) >= 1/2)``),
    clipped and cast."""
    a = node.attrs
    v = w.op("Div", [w.name(node.inputs[0]), w.const(a["scale"], np.float32)])
    if a["rounding"] == "half_up":
        low = w.op("Floor", [v])
        frac = w.op("Sub", [v, low])
        up = w.cast(w.op("GreaterOrEqual", [frac, w.const(0.5, np.float32)]), "float32")
        v = w.op("Add", [low, up])
    else:
        v = w.op("Round", [v])
    lo, hi = RANGES[a["dtype"]]
    v = w.op("Clip", [v, w.const(float(lo), np.float32), w.const(float(hi), np.float32)])
    w.cast(v, a["dtype"], outs[0])


def _onnx_dequantize(w, node, outs: list[str]) -> None:
    x = w.as_float(node.inputs[0])
    w.op("Mul", [x, w.const(node.attrs["scale"], np.float32)], outs[0])


# -- QDQ ONNX -----------------------------------------------------------------------------------
def _qdq_requantize(w, node, outs: list[str]) -> None:
    """A float ``Mul`` only where the factor is not 1 (averaging ``1 / count``, resampling
    weights), the bounds as a ``Clip``, then the output's Q / DQ pair."""
    a, p = node.attrs, node.params
    t = w.graph.tensors[node.outputs[0]]
    r = np.ldexp(p["multiplier"].astype(np.float64), -p["shift"].astype(np.int64))
    factor = r * t.scale / w.fscale(node.inputs[0])
    v = w.name(node.inputs[0])
    if np.abs(factor - 1).max() > 1e-3:
        v = w.op("Mul", [v, w.const(factor.astype(np.float32), hint="factor")])
    if a["lo"] is not None or a["hi"] is not None:
        lo = -np.inf if a["lo"] is None else a["lo"] * t.scale
        hi = np.inf if a["hi"] is None else a["hi"] * t.scale
        v = w.op("Clip", [v, w.const(lo, np.float32), w.const(hi, np.float32)])
    w.qdq(v, node.outputs[0], outs[0])


def _qdq_prelu(w, node, outs: list[str]) -> None:
    """``PRelu`` with the slopes the integer multipliers hold, between Q / DQ pairs."""
    p, rank = node.params, w.rank(node.inputs[0])
    t = w.graph.tensors[node.outputs[0]]
    r = np.ldexp(p["multiplier"].astype(np.float64), -p["shift"].astype(np.int64))
    rn = np.ldexp(p["neg_multiplier"].astype(np.float64), -p["neg_shift"].astype(np.int64))
    sign = p["neg_sign"].astype(np.float64)
    if rn.size > 1:
        rn, sign = (w.channel(v, rank, node.attrs["axis"]) for v in (rn, sign))
    factor = t.scale / w.fscale(node.inputs[0])
    x = w.op("Mul", [w.name(node.inputs[0]), w.const(r * factor, np.float32)])
    slope = (rn * sign / r).astype(np.float32)
    w.qdq(w.op("PRelu", [x, w.const(slope, np.float32)]), node.outputs[0], outs[0])


def _qdq_quantize(w, node, outs: list[str]) -> None:
    w.qdq(w.name(node.inputs[0]), node.outputs[0], outs[0])


def _qdq_dequantize(w, node, outs: list[str]) -> None:
    w.op("Identity", [w.name(node.inputs[0])], outs[0])


# -- file schema --------------------------------------------------------------------------------
def _check_requantize(c: Ctx) -> None:
    axes = c.attrs.get("count_axes")
    if axes is None:
        if len(c.node["inputs"]) != 1:
            raise c.fail("two inputs without count_axes")
        return
    if len(c.node["inputs"]) != 2:
        raise c.fail("count_axes needs a second input (the tensor whose elements are counted)")
    rank = len(c.in_shapes[1])
    if not axes or any(not 0 <= a < rank for a in axes):
        raise c.fail(f"count_axes {axes} outside the rank {rank} of the second input")
    for k in ("multiplier", "shift"):
        if c.params[k].ndim != 1 or not 2 <= c.params[k].size <= MAX_COUNT_TABLE:
            raise c.fail(f"{k} is not a table of 2 to {MAX_COUNT_TABLE} entries")


def _check_prelu(c: Ctx) -> None:
    c.axis("axis", c.attrs["axis"])
    size = c.params["neg_multiplier"].size
    if any(c.params[k].size != size for k in ("neg_shift", "neg_sign")):
        raise c.fail("neg_multiplier, neg_shift and neg_sign differ in size")


register(
    Primitive(
        "requantize",
        _numpy_requantize,
        _onnx_requantize,
        OpSpec(
            (1, 2),
            {**RESULT_ATTRS, "lo": "int?", "hi": "int?", "count_axes": "ints?"},
            {"multiplier": SHIFT, "shift": SHIFT},
            _check_requantize,
        ),
        _qdq_requantize,
        "`clamp(shift_round(x * multiplier, shift), lo, hi)`; by element count with `count_axes`",
    )
)
_PRELU_PARAMS = ("multiplier", "shift", "neg_multiplier", "neg_shift", "neg_sign")
register(
    Primitive(
        "prelu",
        _numpy_prelu,
        _onnx_prelu,
        OpSpec(
            (1,), {"axis": "int", **RESULT_ATTRS}, dict.fromkeys(_PRELU_PARAMS, SHIFT), _check_prelu
        ),
        _qdq_prelu,
        "each side of 0 requantized with its own multiplier (per-channel slopes)",
    )
)


register(
    Primitive(
        "quantize",
        _numpy_quantize,
        _onnx_quantize,
        OpSpec((1,), {"scale": "float", **RESULT_ATTRS}, {}),
        _qdq_quantize,
        "`clamp(round(x / scale))` of float values (the float32 IEEE division)",
    )
)
register(
    Primitive(
        "dequantize",
        _numpy_dequantize,
        _onnx_dequantize,
        OpSpec((1,), {"scale": "float"}, {}),
        _qdq_dequantize,
        "`q * scale` in float32",
    )
)


# -- torch --------------------------------------------------------------------------------------
if torch is not None:
    from torch import Tensor

    from fxq.dtypes import QDType, as_qdtype
    from fxq.march import Rounding
    from fxq.quantized import functional as qf

    def requantize(
        v: Tensor,
        multiplier: Tensor,
        shift: Tensor,
        dtype: QDType,
        rounding: Rounding,
        lo: int | None = None,
        hi: int | None = None,
        scale: Tensor | None = None,
    ) -> Tensor:
        """``clamp(shift_round(v * multiplier, shift), lo, hi)`` of exact integers ``v``
        (one multiplier and shift), as exact float32 values of ``dtype``.

        Args:
            scale: the output grid's scale, for the exported tensor (an operand moved onto a
                module's output grid; a module's result takes the scale it is returned with).
        """
        y = qf.requantize_exact(v, multiplier, shift, dtype, rounding, None, lo, hi, as_float=True)
        if is_recording():
            d = ir_dtype(dtype)
            attrs: dict[str, Any] = {
                "dtype": d,
                "rounding": rounding.value,
                "lo": lo,
                "hi": hi,
            }
            params = {"multiplier": multiplier.long(), "shift": shift.long()}
            scales = [None if scale is None else float(scale)]
            record(Call("requantize", [v], [y], [d], attrs, params, scales))
        return y

    @torch.library.custom_op("fxq::prelu", mutates_args=())
    def _prelu_op(v: Tensor, plan: list[Tensor], axis: int, dtype: str, rounding: str) -> Tensor:
        """``prelu`` as one op: ``plan`` holds its five arrays in ``_PRELU_PARAMS`` order."""
        return prelu(v, *plan, axis, as_qdtype(dtype), Rounding(rounding))

    @_prelu_op.register_fake
    def _(v, plan, axis, dtype, rounding):
        return v.new_empty(v.shape, dtype=torch.float32)

    def prelu(
        v: Tensor,
        multiplier: Tensor,
        shift: Tensor,
        neg_multiplier: Tensor,
        neg_shift: Tensor,
        neg_sign: Tensor,
        axis: int,
        dtype: QDType,
        rounding: Rounding,
    ) -> Tensor:
        """Each side of 0 of exact integers ``v`` requantized apart: ``v >= 0`` by
        ``multiplier, shift``, ``v < 0`` as ``v * neg_sign[c]`` by ``neg_multiplier[c],
        neg_shift[c]`` (one, or one per channel of ``axis``); exact float32 values of
        ``dtype``."""
        if traced():  # one fxq::prelu op in the traced graph
            plan = [multiplier, shift, neg_multiplier, neg_shift, neg_sign]
            y = _prelu_op(v, plan, axis, dtype.name, rounding.value)
        else:  # the kernel (also the op's implementation, which calls this function eagerly)
            per_channel = neg_multiplier.numel() > 1
            shape = [1] * v.dim()
            if per_channel:
                shape[axis] = -1
            sign = neg_sign.to(v.device).reshape(shape)
            pos = qf.requantize_exact(v, multiplier, shift, dtype, rounding, as_float=True)
            neg = qf.requantize_exact(
                v * sign,
                neg_multiplier,
                neg_shift,
                dtype,
                rounding,
                axis if per_channel else None,
                as_float=True,
            )
            y = torch.where(v >= 0, pos, neg)
        if is_recording():
            d = ir_dtype(dtype)
            attrs = {"dtype": d, "rounding": rounding.value, "axis": axis}
            values = (multiplier, shift, neg_multiplier, neg_shift, neg_sign)
            params = {k: t.long() for k, t in zip(_PRELU_PARAMS, values)}
            record(Call("prelu", [v], [y], [d], attrs, params))
        return y

    @torch.library.custom_op("fxq::quantize", mutates_args=())
    def _quantize_op(x: Tensor, scale: Tensor, dtype: str, rounding: str) -> Tensor:
        """``quantize_values`` as one op."""
        return quantize_values(x, scale, as_qdtype(dtype), Rounding(rounding))

    @_quantize_op.register_fake
    def _(x, scale, dtype, rounding):
        q = as_qdtype(dtype)
        return x.new_empty(x.shape, dtype=torch.float32 if q.bits <= 24 else q.storage)

    def quantize_values(x: Tensor, scale: Tensor, dtype: QDType, rounding: Rounding) -> Tensor:
        """``clamp(round(x / scale))`` of a float tensor (``fxq.quantized.functional.quantize``:
        any real dtype, the float32 scale) as exact float32 values of ``dtype`` (storage form
        beyond 24 bits)."""
        if traced():  # one fxq::quantize op in the traced graph
            q = _quantize_op(x, scale, dtype.name, rounding.value)
        else:
            q = qf.quantize(x, scale, dtype, rounding, as_float=dtype.bits <= 24)
        if is_recording():
            d = ir_dtype(dtype)
            attrs = {"scale": float(scale), "dtype": d, "rounding": rounding.value}
            record(Call("quantize", [x], [q], [d], attrs))
        return q

    def dequantize(q: Any, dtype: Any = None) -> Tensor:
        """A QTensor's real values ``(q + offset) * scale`` in float32 (then ``dtype``, a
        float region's dtype, where given).

        Raises:
            NotExportable: while an export records, for a per-channel QTensor, one stored with
                an offset, or a ``dtype`` other than float32.
        """
        out = q.dequantize()
        if dtype is not None and dtype is not out.dtype:
            out = out.to(dtype)
        if is_recording():
            if dtype is not None and dtype is not torch.float32:
                raise NotExportable(
                    f"the model runs its float regions in {dtype}; export a float32 model"
                )
            if q.scale.numel() != 1:
                raise NotExportable("per-channel QTensors are not exported")
            if q.offset:
                raise NotExportable(
                    f"dequantizing a tensor stored with offset {q.offset} is not exported "
                    "(an offset activation read by a float op): calibrate without offsets"
                )
            record(Call("dequantize", [q.values()], [out], ["float32"], {"scale": float(q.scale)}))
        return out
