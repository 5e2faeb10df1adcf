"""Exact window sums and resampling: average pooling, mean / sum, (bi)linear interpolation and
``grid_sample``.

* ``axis_matmul``: ``x`` contracted with an integer matrix ``A_i [n_in, n_out]`` along each of
  its ``axes`` (exact int64 sums): the windows of average pooling (0 / 1 entries), whole axes
  of ``mean`` / ``sum`` (a column of ones, or ``ones``: whole axes at any size), the
  fixed-point neighbour weights of linear interpolation. A ``requantize`` then divides by the
  window's element count or the weights' unit (``fxq.primitives.requant``);
* ``grid_sample``: fixed-point sampling coordinates from an integer grid and the exact
  bilinear (or nearest) gather-and-sum (``docs/arithmetic.md``, grid_sample).

The integer modules (``fxq.quantized.pooling``, ``interpolate``, ``grid_sample``) compute the
sums with torch's own pooling and gathers (exact in float64 / int64) and record here the
``axis_matmul`` / ``grid_sample`` node that computes the same sums (``record_window_sums``,
``record_grid_sample``), then requantize through ``requantize_by_count`` or
``fxq.primitives.requant.requantize``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fxq.primitives import movement
from fxq.primitives.arith import exact_dot, shift_round
from fxq.primitives.core import (
    Call,
    Primitive,
    ir_dtype,
    is_recording,
    record,
    record_built,
    register,
)
from fxq.primitives.schema import SHIFT, Ctx, OpSpec, Param, is_int

try:
    import torch
except ImportError:  # the numpy runtime without torch
    torch = None

__all__ = [
    "per_axis",
    "adaptive_windows",
    "window_matrix",
    "record_window_sums",
    "record_grid_sample",
    "requantize_by_count",
    "drop_axes",
]

_F32_EXACT = 1 << 24  # float32 holds every integer below 2**24 exactly


def per_axis(v: Any, d: int) -> list[int]:
    """A pooling / convolution parameter (an int, or one or ``d`` entries) as ``d`` ints."""
    if isinstance(v, (tuple, list)):
        v = list(v)
        return [int(x) for x in (v * d if len(v) == 1 else v)]
    return [int(v)] * d


def adaptive_windows(n: int, o: int) -> list[tuple[int, int]]:
    """torch's adaptive pooling windows ``[floor(i n / o), ceil((i + 1) n / o))``."""
    return [((i * n) // o, -((-(i + 1) * n) // o)) for i in range(o)]


def window_matrix(n: int, o: int, windows: Sequence[tuple[int, int]]) -> np.ndarray:
    """The 0 / 1 matrix ``[n, o]`` summing, for output ``j``, the inputs of its window
    ``[start, end)`` (clipped to ``[0, n)``: padding adds nothing)."""
    a = np.zeros((n, o), dtype=np.int32)
    for j, (s, e) in enumerate(windows):
        a[max(s, 0) : min(e, n), j] = 1
    return a


# -- numpy --------------------------------------------------------------------------------------
def _numpy_axis_matmul(node, inputs):
    x = inputs[0].astype(np.int64)
    if node.attrs.get("ones"):  # whole axes summed, at any size (exact in int64)
        return [x.sum(tuple(node.attrs["axes"]), keepdims=True)]
    for i, axis in enumerate(node.attrs["axes"]):
        m = node.params[f"matrix_{i}"].astype(np.int64)
        moved = np.moveaxis(x, axis, -1)
        bound = int(np.abs(moved).max() if moved.size else 0) * int(np.abs(m).sum(0).max())
        out = exact_dot(moved, m, bound, "...k,kj->...j")
        x = np.moveaxis(out, -1, axis)
    return [x]


def _grid_gather(x: np.ndarray, iy: np.ndarray, ix: np.ndarray, border: bool) -> np.ndarray:
    """``x[n, c, iy, ix]`` for int64 ``x (N, C, H, W)`` and ``iy, ix (N, Ho, Wo)``; 0 outside
    the input unless ``border``."""
    n, c, h, w = x.shape
    valid = (iy >= 0) & (iy < h) & (ix >= 0) & (ix < w)
    index = (np.clip(iy, 0, h - 1) * w + np.clip(ix, 0, w - 1)).reshape(n, 1, -1)
    out = np.take_along_axis(x.reshape(n, c, h * w), index, axis=2).reshape(n, c, *iy.shape[1:])
    return out if border else out * valid[:, None].astype(np.int64)


def _numpy_grid_sample(node, inputs):
    a, p = node.attrs, node.params
    x = inputs[0].astype(np.int64)
    g = (inputs[1] if len(inputs) > 1 else p["grid"]).astype(np.int64)
    bits, rounding = a["fraction_bits"], a["rounding"]
    border = a["padding_mode"] == "border"
    h, w = x.shape[-2:]
    coords = []
    for i, (axis, size) in enumerate((("x", w), ("y", h))):
        c = shift_round(g[..., i] * p[f"multiplier_{axis}"], p[f"shift_{axis}"], rounding)
        c = c + ((size - 1) << (bits - 1))
        coords.append(np.clip(c, 0, (size - 1) << bits) if border else c)
    px, py = coords
    if a["mode"] == "nearest":
        iy, ix = shift_round(py, bits, rounding), shift_round(px, bits, rounding)
        return [_grid_gather(x, iy, ix, border)]
    one = 1 << bits
    x0, y0, wx1, wy1 = px >> bits, py >> bits, px & (one - 1), py & (one - 1)
    acc = np.zeros(x.shape[:2] + px.shape[1:], np.int64)
    for iy, wy in ((y0, one - wy1), (y0 + 1, wy1)):
        for ix, wx in ((x0, one - wx1), (x0 + 1, wx1)):
            acc += _grid_gather(x, iy, ix, border) * (wy * wx)[:, None]
    return [acc]


# -- integer ONNX -------------------------------------------------------------------------------
def _onnx_axis_matmul(wr, node, outs: list[str]) -> None:
    """One ``MatMul`` per axis: float32 while the sums stay below ``2**24`` (``mag`` bounds the
    values after each step), int64 after."""
    rank = wr.rank(node.inputs[0])
    x = wr.name(node.inputs[0])
    if node.attrs.get("ones"):  # whole axes summed, at any size
        axes = wr.const(np.array(node.attrs["axes"], np.int64))
        wr.op("ReduceSum", [wr.cast(x, "int64"), axes], outs[0], keepdims=1)
        return
    mag = 1 << (wr.bits(node.inputs[0]) - 1)
    dtype = None
    for i, axis in enumerate(node.attrs["axes"]):
        matrix = node.params[f"matrix_{i}"].astype(np.int64)
        mag *= int(np.abs(matrix).sum(0).max()) if matrix.size else 0
        if dtype != "int64":
            dtype = "float32" if mag < _F32_EXACT else "int64"
        x = wr.cast(x, dtype)
        m = wr.const(matrix.astype(np.float32 if dtype == "float32" else np.int64), hint="matrix")
        if axis == rank - 1:
            x = wr.op("MatMul", [x, m])
            continue
        perm = list(range(rank))
        perm[axis], perm[-1] = perm[-1], perm[axis]
        x = wr.op(
            "Transpose", [wr.op("MatMul", [wr.op("Transpose", [x], perm=perm), m])], perm=perm
        )
    wr.cast(x, "int64", outs[0])


def _onnx_grid_gather(wr, x: str, iy: str, ix: str, size: tuple[int, ...], border: bool) -> str:
    """``x[n, c, iy, ix]`` of an int64 ``x`` reshaped to ``(N, C, H*W)``, for int64 coordinates
    ``iy, ix (N, Ho, Wo)``; 0 outside the input unless ``border``."""
    c, h, w, ho, wo = size

    def clip(v: str, n: int) -> str:
        return wr.op("Clip", [v, wr.int_const(0), wr.int_const(n - 1)])

    index = wr.op("Add", [wr.op("Mul", [clip(iy, h), wr.int_const(w)]), clip(ix, w)])
    index = wr.op("Reshape", [index, wr.const([0, 1, -1], np.int64)])
    index = wr.op("Expand", [index, wr.const([1, c, 1], np.int64)])
    out = wr.op("GatherElements", [x, index], axis=2)
    out = wr.op("Reshape", [out, wr.const([0, c, ho, wo], np.int64)])
    if border:
        return out
    zero = wr.int_const(0)
    inside = [
        wr.op(cmp, [v, bound])
        for v, n in ((iy, h), (ix, w))
        for cmp, bound in (("GreaterOrEqual", zero), ("Less", wr.int_const(n)))
    ]
    valid = wr.op("And", [wr.op("And", inside[:2]), wr.op("And", inside[2:])])
    valid = wr.op("Unsqueeze", [wr.cast(valid, "int64"), wr.const([1], np.int64)])
    return wr.op("Mul", [out, valid])


def _onnx_grid_sample(wr, node, outs: list[str]) -> None:
    """int64 arithmetic, as the numpy kernel: the coordinates ``shift_round(G m, s)``
    (``|G m| < 2**31``), the neighbours gathered, the weighted sum (``|acc| < 2**33``)."""
    a, p = node.attrs, node.params
    bits, rounding = a["fraction_bits"], a["rounding"]
    border = a["padding_mode"] == "border"
    _, c, h, w = wr.graph.tensors[node.inputs[0]].shape
    x = wr.op("Reshape", [wr.as_int(node.inputs[0]), wr.const([0, 0, -1], np.int64)])
    if len(node.inputs) > 1:
        ho, wo = wr.graph.tensors[node.inputs[1]].shape[1:3]
        g = wr.as_int(node.inputs[1])
    else:  # a constant grid
        ho, wo = p["grid"].shape[1:3]
        g = wr.const(p["grid"].astype(np.int64), hint="grid")
    coords = []
    for i, (axis, size) in enumerate((("x", w), ("y", h))):
        gi = wr.op("Gather", [g, wr.const([i], np.int64)], axis=3)
        gi = wr.op("Squeeze", [gi, wr.const([3], np.int64)])
        gi = wr.op("Mul", [gi, wr.const(np.asarray(p[f"multiplier_{axis}"], np.int64))])
        v = wr.shift_round(gi, p[f"shift_{axis}"], rounding)
        v = wr.op("Add", [v, wr.int_const((size - 1) << (bits - 1))])
        if border:
            v = wr.op("Clip", [v, wr.int_const(0), wr.int_const((size - 1) << bits)])
        coords.append(v)
    px, py = coords
    size = (c, h, w, ho, wo)
    if a["mode"] == "nearest":
        iy = wr.shift_round(py, bits, rounding)
        ix = wr.shift_round(px, bits, rounding)
        wr.cast(_onnx_grid_gather(wr, x, iy, ix, size, border), "int64", outs[0])
        return
    one = wr.int_const(1 << bits)
    x0, y0 = wr.floor_shift(px, bits), wr.floor_shift(py, bits)
    wx1 = wr.op("Sub", [px, wr.op("Mul", [x0, one])])
    wy1 = wr.op("Sub", [py, wr.op("Mul", [y0, one])])
    y1 = wr.op("Add", [y0, wr.int_const(1)])
    x1 = wr.op("Add", [x0, wr.int_const(1)])
    wx0, wy0 = wr.op("Sub", [one, wx1]), wr.op("Sub", [one, wy1])
    acc = None
    for iy, wy in ((y0, wy0), (y1, wy1)):
        for ix, wx in ((x0, wx0), (x1, wx1)):
            weight = wr.op("Unsqueeze", [wr.op("Mul", [wy, wx]), wr.const([1], np.int64)])
            term = wr.op("Mul", [_onnx_grid_gather(wr, x, iy, ix, size, border), weight])
            acc = term if acc is None else wr.op("Add", [acc, term])
    wr.cast(acc, "int64", outs[0])


# -- QDQ ONNX -----------------------------------------------------------------------------------
def _qdq_axis_matmul(wr, node, outs: list[str]) -> None:
    """Float ``MatMul``s on the dequantized values; the sums are in units of the input's scale
    (the ``requantize`` after them divides by the count)."""
    wr.set_unit(node.outputs[0], wr.fscale(node.inputs[0]))
    rank = wr.rank(node.inputs[0])
    x = wr.name(node.inputs[0])
    axes = node.attrs["axes"]
    if node.attrs.get("ones"):
        wr.op("ReduceSum", [x, wr.const(np.array(axes, np.int64))], outs[0], keepdims=1)
        return
    for i, axis in enumerate(axes):
        m = wr.const(node.params[f"matrix_{i}"].astype(np.float32), hint="matrix")
        last = i == len(axes) - 1
        if axis == rank - 1:
            x = wr.op("MatMul", [x, m], outs[0] if last else None)
            continue
        perm = list(range(rank))
        perm[axis], perm[-1] = perm[-1], perm[axis]
        moved = wr.op("MatMul", [wr.op("Transpose", [x], perm=perm), m])
        x = wr.op("Transpose", [moved], outs[0] if last else None, perm=perm)


def _qdq_grid_sample(wr, node, outs: list[str]) -> None:
    """ONNX GridSample on the dequantized input and grid; bilinear sums are in units of
    ``2**-2F`` of the input's scale (the requantize that follows divides them out)."""
    a = node.attrs
    wr.set_unit(node.outputs[0], wr.fscale(node.inputs[0]))
    bilinear = a["mode"] == "bilinear"
    if len(node.inputs) > 1:
        grid = wr.name(node.inputs[1])
    else:  # a constant grid: its dequantized values
        grid = wr.const(node.params["grid"].astype(np.float32) * np.float32(a["grid_scale"]))
    y = wr.op(
        "GridSample",
        [wr.name(node.inputs[0]), grid],
        None if bilinear else outs[0],
        mode="bilinear" if bilinear else "nearest",  # onnxruntime 1.x: not "linear"
        padding_mode=a["padding_mode"],
        align_corners=int(a.get("align_corners", 0)),
    )
    if bilinear:
        one = np.float32(1 << (2 * a["fraction_bits"]))
        wr.op("Mul", [y, wr.const(one, np.float32)], outs[0])


# -- file schema --------------------------------------------------------------------------------
def _check_axis_matmul(c: Ctx) -> None:
    if c.attrs.get("ones"):
        for i, axis in enumerate(c.attrs["axes"]):
            c.axis(f"axes[{i}]", axis)
        if any(k.startswith("matrix_") for k in c.params):
            raise c.fail("matrices with ones (whole axes summed)")
        return
    for i, axis in enumerate(c.attrs["axes"]):
        c.axis(f"axes[{i}]", axis)
        m = c.params.get(f"matrix_{i}")
        if m is None or m.ndim != 2:
            raise c.fail(f"no 2-d param 'matrix_{i}' for axes[{i}]")
        size = c.in_shapes[0][axis]
        if is_int(size) and size != m.shape[0]:
            raise c.fail(f"matrix_{i} has {m.shape[0]} rows for an axis of {size}")
    extra = [k for k in c.params if k.startswith("matrix_")]
    if len(extra) != len(c.attrs["axes"]):
        raise c.fail(f"{len(extra)} matrices for {len(c.attrs['axes'])} axes")


def _check_grid_sample(c: Ctx) -> None:
    a = c.attrs
    if a["mode"] not in ("bilinear", "nearest") or a["padding_mode"] not in ("zeros", "border"):
        raise c.fail(f"mode {a['mode']!r} / padding_mode {a['padding_mode']!r}")
    if not 1 <= a["fraction_bits"] <= 16:
        raise c.fail(f"fraction_bits {a['fraction_bits']} outside 1..16")
    if c.rank() != 4 or (len(c.node["inputs"]) == 1 and "grid" not in c.params):
        raise c.fail("grid_sample takes a rank-4 input and a grid (an input or param 'grid')")
    for k in ("multiplier_x", "shift_x", "multiplier_y", "shift_y"):
        c.size(k, 1)


register(
    Primitive(
        "axis_matmul",
        _numpy_axis_matmul,
        _onnx_axis_matmul,
        OpSpec(
            (1,), {"axes": "ints", "ones": "bool?"}, {}, _check_axis_matmul, extra_params="matrix_"
        ),
        _qdq_axis_matmul,
        "exact int64 sums `x` times an integer matrix along each of `axes` (window sums)",
    )
)
register(
    Primitive(
        "grid_sample",
        _numpy_grid_sample,
        _onnx_grid_sample,
        OpSpec(
            (1, 2),
            {"mode": "str", "padding_mode": "str", "fraction_bits": "int", "rounding": "rounding"},
            {
                "multiplier_x": SHIFT,
                "shift_x": SHIFT,
                "multiplier_y": SHIFT,
                "shift_y": SHIFT,
                "grid": Param(("int8", "int16"), (4,), False),
            },
            _check_grid_sample,
        ),
        _qdq_grid_sample,
        "fixed-point sampling coordinates, then the exact bilinear / nearest gather-and-sum",
    )
)


# -- torch --------------------------------------------------------------------------------------
if torch is not None:
    from torch import Tensor

    from fxq.dtypes import QDType
    from fxq.march import Rounding
    from fxq.quantized import functional as qf

    def record_window_sums(
        x: Tensor,
        sums: Tensor,
        axes: Sequence[int],
        matrices: Callable[[], Sequence[np.ndarray]] | None,
    ) -> None:
        """Record that ``sums`` (exact integers; torch's pooling, a sum, the interpolation's
        weighted neighbours) is ``x`` contracted along ``axes`` with ``matrices()`` (built only
        while an export records; None: whole axes, a column of ones each). ``sums`` keeps
        ``x``'s rank. A sum over axis 0 is refused where it is the dynamic batch."""

        def build() -> tuple[dict[str, Any], dict[str, Any]]:
            mats = (
                [np.ones((x.shape[a], 1), np.int32) for a in axes]
                if matrices is None
                else matrices()
            )
            params = {f"matrix_{i}": np.asarray(m, np.int32) for i, m in enumerate(mats)}
            return {"axes": [int(a) for a in axes]}, params

        axis0 = "not_batch" if 0 in axes else "any"
        record_built("axis_matmul", [x], sums, "int64", build, axis0=axis0)

    def record_grid_sample(
        x: Tensor,
        grid: Tensor,
        acc: Tensor,
        attrs: dict[str, Any],
        coordinates: Callable[[], dict[str, Tensor]],
    ) -> None:
        """Record that ``acc`` is the ``grid_sample`` accumulator of ``x``'s integers at the
        integer ``grid`` (``attrs``: mode, padding_mode, align_corners, fraction_bits,
        grid_scale, rounding; ``coordinates()``: the coordinate multipliers and shifts)."""
        record_built("grid_sample", [x, grid], acc, "int64", lambda: (attrs, coordinates()))

    def requantize_by_count(
        sums: Tensor,
        factor: Tensor,
        dtype: QDType,
        rounding: Rounding,
        plan: Callable[[], tuple[Tensor, Tensor]],
        by_count: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> Tensor:
        """``clamp(round(sums * M_d 2**-S_d))`` of exact window sums, one factor per output
        position (``factor``: ``M_d 2**-S_d`` in float64, broadcasting against ``sums``), in
        ``dtype``'s storage.

        Args:
            plan: the multiplier and shift behind ``factor`` (int64, shaped like it), for the
                exported ``requantize`` node (called only while an export records).
            by_count: the multiplier and shift for other element counts (the dynamic sizes
                of a whole-axes mean), when one count serves every position.
        """
        v = qf.round_float(sums.to(torch.float64) * factor, rounding, inplace=True, exact=False)
        y = v.clamp_(dtype.qmin, dtype.qmax).to(dtype.storage)
        if is_recording():
            mult, shift = plan()
            d = ir_dtype(dtype)
            attrs = {"dtype": d, "rounding": rounding.value, "lo": None, "hi": None}
            params = {"multiplier": mult.long(), "shift": shift.long()}
            record(Call("requantize", [sums], [y], [d], attrs, params, counts=by_count))
        return y

    def drop_axes(sums: Tensor, axes: Sequence[int]) -> Tensor:
        """``sums`` without its summed ``axes`` (size 1: a reduction's ``keepdim=False``),
        recorded as a ``reshape`` that keeps a dynamic batch unless axis 0 is dropped."""
        shape = [n for i, n in enumerate(sums.shape) if i not in axes]
        return movement.reshape(sums, shape, "int64", keeps_batch=0 not in axes and bool(shape))
