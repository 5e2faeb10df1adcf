"""Table lookup: the integer form of every pointwise non-linear function, and embeddings.

* ``lut``: an int8 input indexes a 256-entry table, ``y = T[q + 128]``;
* ``segment_lut``: an int16 input is interpolated in fixed point between the knots of two
  65-knot tables (a dense one around 0, a sparse one over all of int16), then saturated;
* ``embedding``: integer ids index the rows of a table already at the output scale.

Tables are built at convert (``lut_int8``, ``build_segment_lut``) from the float function
evaluated in float64; ``lut`` / ``segment_lut`` are what ``forward`` calls. Each has, below, its
torch kernel, its numpy kernel, its integer-ONNX and QDQ lowerings and its file schema.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from fxq.primitives.arith import DTYPES, RANGES, shift_round
from fxq.primitives.core import Call, Primitive, ir_dtype, is_recording, record, register
from fxq.primitives.schema import Ctx, OpSpec, Param

try:
    import torch
except ImportError:  # the numpy runtime without torch: numpy kernels and lowerings only
    torch = None

__all__ = [
    "SegmentLUT",
    "lut_int8",
    "build_segment_lut",
    "lut",
    "segment_lut",
    "embedding",
    "SPARSE_BITS",
]

#: the sparse table's segments are 2**SPARSE_BITS int16 steps wide (65 knots cover int16)
SPARSE_BITS = 10
#: the widest dense segment tried (``build_segment_lut``), and what a file may declare
MAX_DENSE_BITS = 10
KNOTS = 65


# -- numpy --------------------------------------------------------------------------------------
def _numpy_lut(node, inputs):
    table = node.params["table"]
    return [table[inputs[0].astype(np.int64) + 128]]


def _numpy_segment(q, knots, start, bits, rounding):
    offset = q - start
    k = np.clip(offset >> bits, 0, KNOTS - 2)
    r = offset - (k << bits)
    y0 = knots[k]
    return y0 + shift_round((knots[k + 1] - y0) * r, bits, rounding)


def _numpy_segment_lut(node, inputs):
    a, p = node.attrs, node.params
    q = inputs[0].astype(np.int64)
    bits = a["dense_bits"]
    half = 32 << bits
    dense = _numpy_segment(
        np.clip(q, -half, half - 1), p["dense"].astype(np.int64), -half, bits, a["rounding"]
    )
    sparse = _numpy_segment(
        q, p["sparse"].astype(np.int64), -32768, a["sparse_bits"], a["rounding"]
    )
    y = np.where((q >= -half) & (q < half), dense, sparse)
    lo, hi = RANGES[a["dtype"]]
    return [np.clip(y, lo, hi).astype(DTYPES[a["dtype"]])]


def _numpy_embedding(node, inputs):
    return [node.params["table"][inputs[0].astype(np.int64)]]


# -- integer ONNX -------------------------------------------------------------------------------
def _onnx_lut(w, node, outs: list[str]) -> None:
    idx = w.op("Add", [w.cast(w.name(node.inputs[0]), "int64"), w.const(128, np.int64)])
    w.op("Gather", [w.const(node.params["table"], hint="table"), idx], outs[0], axis=0)


def _onnx_segment(w, q: str, knots: np.ndarray, start: int, bits: int, rounding: str) -> str:
    offset = w.op("Sub", [q, w.const(start, np.int64)])
    k = w.op("Div", [offset, w.const(1 << bits, np.int64)])  # offset >= 0: floor
    k = w.op("Clip", [k, w.const(0, np.int64), w.const(KNOTS - 2, np.int64)])
    r = w.op("Sub", [offset, w.op("Mul", [k, w.const(1 << bits, np.int64)])])
    table = w.const(knots.astype(np.int64), hint="knots")
    y0 = w.op("Gather", [table, k], axis=0)
    y1 = w.op("Gather", [table, w.op("Add", [k, w.const(1, np.int64)])], axis=0)
    dy = w.op("Mul", [w.op("Sub", [y1, y0]), r])
    return w.op("Add", [y0, w.shift_round(dy, bits, rounding)])


def _onnx_segment_lut(w, node, outs: list[str]) -> None:
    a, p = node.attrs, node.params
    q = w.cast(w.name(node.inputs[0]), "int64")
    bits = a["dense_bits"]
    half = 32 << bits
    clamped = w.op("Clip", [q, w.const(-half, np.int64), w.const(half - 1, np.int64)])
    dense = _onnx_segment(w, clamped, p["dense"], -half, bits, a["rounding"])
    sparse = _onnx_segment(w, q, p["sparse"], -32768, a["sparse_bits"], a["rounding"])
    inside = w.op(
        "And",
        [
            w.op("GreaterOrEqual", [q, w.const(-half, np.int64)]),
            w.op("Less", [q, w.const(half, np.int64)]),
        ],
    )
    y = w.op("Where", [inside, dense, sparse])
    lo, hi = RANGES[a["dtype"]]
    y = w.op("Clip", [y, w.int_const(lo), w.int_const(hi)])
    w.cast(y, a["dtype"], outs[0])


def _onnx_embedding(w, node, outs: list[str]) -> None:
    table = node.params["table"]
    if w.store(node.outputs[0]) == "float32":  # QDQ: the float table, then Q / DQ
        scale = np.float32(w.graph.tensors[node.outputs[0]].scale)
        table = table.astype(np.float32) * scale
    y = w.op("Gather", [w.const(table, hint="table"), w.name(node.inputs[0])], axis=0)
    w.cast(y, w.store(node.outputs[0]), outs[0])


# -- QDQ ONNX: the float function between the input's DQ and the output's Q ----------------------
_SIMPLE = {"sigmoid": "Sigmoid", "tanh": "Tanh", "exp": "Exp", "mish": "Mish", "abs": "Abs"}


def _float_function(w, node, x: str) -> str:
    """The float function the table tabulates, as ONNX ops on ``x`` (the attrs
    ``function`` and ``function_args`` name it)."""
    a = node.attrs
    fn, args = a.get("function"), a.get("function_args", {})
    c = lambda v: w.const(v, np.float32)  # noqa: E731
    if fn in _SIMPLE:
        return w.op(_SIMPLE[fn], [x])
    if fn == "hardswish":
        return w.op("HardSwish", [x])
    if fn == "hardsigmoid":
        return w.op("HardSigmoid", [x], alpha=1 / 6, beta=0.5)
    if fn == "silu":
        return w.op("Mul", [x, w.op("Sigmoid", [x])])
    if fn == "gelu" and args.get("approximate", "none") == "none":  # Gelu is opset 20
        half = w.op("Mul", [x, c(0.5)])
        erf = w.op("Erf", [w.op("Mul", [x, c(1 / np.sqrt(2.0))])])
        return w.op("Mul", [half, w.op("Add", [erf, c(1.0)])])
    if fn == "leaky_relu":
        return w.op("LeakyRelu", [x], alpha=float(args.get("negative_slope", 0.01)))
    if fn == "elu":
        return w.op("Elu", [x], alpha=float(args.get("alpha", 1.0)))
    if fn == "softplus" and float(args.get("beta", 1.0)) == 1.0:
        return w.op("Softplus", [x])
    raise ValueError(
        f"node {node.name!r} ({node.source}): no QDQ form of the table of {fn!r} {args}; "
        "export with mode='integer'"
    )


def _qdq_table(w, node, outs: list[str]) -> None:
    w.qdq(_float_function(w, node, w.name(node.inputs[0])), node.outputs[0], outs[0])


def _qdq_embedding(w, node, outs: list[str]) -> None:
    """``Gather`` from the table as an int8 / int16 initializer behind a per-tensor
    ``DequantizeLinear`` at the output's scale (the table is already at that scale)."""
    t = w.graph.tensors[node.outputs[0]]
    if t.scale is None:
        _onnx_embedding(w, node, outs)
        return
    table = w.dq_const(node.params["table"], t.scale, hint="table")
    w.op("Gather", [table, w.name(node.inputs[0])], outs[0], axis=0)


# -- file schema --------------------------------------------------------------------------------
def _check_lut(c: Ctx) -> None:
    c.size("table", 256)


def _check_segment_lut(c: Ctx) -> None:
    a = c.attrs
    for k, hi in (("dense_bits", MAX_DENSE_BITS), ("sparse_bits", 16)):
        if not 0 <= a[k] <= hi:
            raise c.fail(f"{k} {a[k]} outside 0..{hi}")
    c.size("dense", KNOTS)
    c.size("sparse", KNOTS)


_FUNCTION = {"function": "str?", "function_args": "any"}

register(
    Primitive(
        "lut",
        _numpy_lut,
        _onnx_lut,
        OpSpec(
            (1,),
            {"dtype": "qdtype", **_FUNCTION},
            {"table": Param(("int8", "int16"), (1,))},
            _check_lut,
        ),
        _qdq_table,
        "int8 input: `y = table[x + 128]` (256 entries)",
    )
)
register(
    Primitive(
        "segment_lut",
        _numpy_segment_lut,
        _onnx_segment_lut,
        OpSpec(
            (1,),
            {
                "dense_bits": "int",
                "sparse_bits": "int",
                "dtype": "qdtype",
                "rounding": "rounding",
                **_FUNCTION,
            },
            {"dense": Param(("int64",), (1,)), "sparse": Param(("int64",), (1,))},
            _check_segment_lut,
        ),
        _qdq_table,
        "int16 input: fixed-point interpolation between 65 knots of a dense and a sparse table",
    )
)

register(
    Primitive(
        "embedding",
        _numpy_embedding,
        _onnx_embedding,
        OpSpec((1,), {"dtype": "qdtype"}, {"table": Param(("int8", "int16"), (2,))}),
        _qdq_embedding,
        "`y[..., :] = table[ids[...], :]` (the table at the output scale)",
    )
)


# -- torch --------------------------------------------------------------------------------------
if torch is not None:
    from torch import Tensor

    from fxq.dtypes import QDType, as_qdtype
    from fxq.march import Rounding
    from fxq.quantized import functional as qf

    @dataclass(frozen=True)
    class SegmentLUT:
        """The two knot tables of an int16 input (``segment_lut``).

        A *dense* table with segments of ``2**dense_bits`` input steps centred on 0, covering
        ``[-32 * 2**dense_bits, 32 * 2**dense_bits)``, and a *sparse* one with segments of
        ``2**SPARSE_BITS`` steps covering all of int16. Between two knots the output is
        ``T[k] + shift_round((T[k+1] - T[k]) * r, bits)`` with ``r`` the offset into the
        segment, then saturated to the output dtype.
        """

        dense: Tensor  # int64 knots, 65
        sparse: Tensor  # int64 knots, 65
        dense_bits: int
        out_dtype: QDType

        SPARSE_BITS = SPARSE_BITS

    def lut_int8(
        fn: Callable[[Tensor], Tensor],
        in_scale: Tensor,
        out_scale: Tensor,
        out_dtype: QDType,
        rounding: Rounding,
    ) -> Tensor:
        """The 256-entry table of ``fn`` for int8 inputs:
        ``T[q + 128] = clamp(round(fn(q * s_in) / s_out))`` with ``fn`` evaluated in float64."""
        q = torch.arange(-128, 128, dtype=torch.float64, device=in_scale.device)
        y = fn(q * in_scale.to(torch.float64)) / out_scale.to(torch.float64)
        return (
            qf.round_float(y, rounding, inplace=True)
            .clamp_(out_dtype.qmin, out_dtype.qmax)
            .to(out_dtype.storage)
        )

    def _knots(fn, in_scale: float, out_scale: float, start: int, step: int, rounding) -> Tensor:
        x = torch.arange(KNOTS, dtype=torch.float64) * step + start
        y = fn(x * in_scale) / out_scale
        return qf.round_float(y, rounding, inplace=True).clamp_(-(1 << 40), 1 << 40).long()

    def build_segment_lut(
        fn: Callable[[Tensor], Tensor],
        in_scale: Tensor,
        out_scale: Tensor,
        out_dtype: QDType,
        rounding: Rounding,
    ) -> SegmentLUT:
        """The int16 tables of ``fn``, with the dense segment width that minimises the largest
        error over every int16 input (in output steps)."""
        s_in, s_out = float(in_scale), float(out_scale)
        sparse = _knots(fn, s_in, s_out, -32768, 1 << SPARSE_BITS, rounding)
        q = torch.arange(-32768, 32768, dtype=torch.int64)
        exact = fn(q.to(torch.float64) * s_in) / s_out
        exact = exact.clamp(out_dtype.qmin, out_dtype.qmax)
        best = None
        for bits in range(0, SPARSE_BITS):
            dense = _knots(fn, s_in, s_out, -32 << bits, 1 << bits, rounding)
            table = SegmentLUT(dense, sparse, bits, out_dtype)
            got = _segment_lut_kernel(q, dense, sparse, bits, rounding, out_dtype)
            err = (got.to(torch.float64) - exact).abs().max().item()
            if best is None or err < best[0]:
                best = (err, table)
        return best[1]

    def _lut_kernel(q: Tensor, table: Tensor) -> Tensor:
        return table[q.to(torch.int64) + 128]

    def _interpolate(q: Tensor, knots: Tensor, start: int, bits: int, rounding) -> Tensor:
        offset = q - start
        k = (offset >> bits).clamp(0, KNOTS - 2)
        r = offset - (k << bits)
        y0 = knots[k]
        return y0 + qf.shift_round((knots[k + 1] - y0) * r, bits, rounding)

    def _segment_lut_kernel(
        q: Tensor, dense: Tensor, sparse: Tensor, bits: int, rounding, out_dtype: QDType
    ) -> Tensor:
        q = q.to(torch.int64)
        half = 32 << bits
        inside = (q >= -half) & (q < half)
        near = _interpolate(q.clamp(-half, half - 1), dense.to(q.device), -half, bits, rounding)
        far = _interpolate(q, sparse.to(q.device), -32768, SPARSE_BITS, rounding)
        y = torch.where(inside, near, far)
        return y.clamp_(out_dtype.qmin, out_dtype.qmax).to(out_dtype.storage)

    @torch.library.custom_op("fxq::lut", mutates_args=())
    def _lut_op(q: Tensor, table: Tensor) -> Tensor:
        return _lut_kernel(q, table)

    @_lut_op.register_fake
    def _(q, table):
        return q.new_empty(q.shape, dtype=table.dtype)

    @torch.library.custom_op("fxq::segment_lut", mutates_args=())
    def _segment_lut_op(
        q: Tensor, dense: Tensor, sparse: Tensor, bits: int, rounding: str, dtype: str
    ) -> Tensor:
        out = as_qdtype(dtype)
        return _segment_lut_kernel(q, dense, sparse, bits, Rounding(rounding), out)

    @_segment_lut_op.register_fake
    def _(q, dense, sparse, bits, rounding, dtype):
        return q.new_empty(q.shape, dtype=as_qdtype(dtype).storage)

    def lut(q: Tensor, table: Tensor, info: Callable[[], dict[str, Any]] | None = None) -> Tensor:
        """``table[q + 128]`` for int8 values ``q`` (any dtype holding them); the table's
        dtype is the result's.

        Args:
            info: the float function's name and arguments (``{"function", "function_args"}``)
                for the exported node, asked for only while an export records.
        """
        if torch.compiler.is_compiling():
            y = _lut_op(q, table)
        else:
            y = _lut_kernel(q, table)
        if is_recording():
            dtype = {torch.int8: "int8", torch.int16: "int16"}[table.dtype]
            attrs = {"dtype": dtype, **(info() if info is not None else {})}
            record(Call("lut", [q], [y], [dtype], attrs, {"table": table}))
        return y

    def segment_lut(
        q: Tensor,
        table: SegmentLUT,
        rounding: Rounding,
        info: Callable[[], dict[str, Any]] | None = None,
    ) -> Tensor:
        """``table`` evaluated on int16 values ``q``; returns ``table.out_dtype`` storage."""
        if torch.compiler.is_compiling():
            y = _segment_lut_op(
                q,
                table.dense,
                table.sparse,
                table.dense_bits,
                rounding.value,
                table.out_dtype.name,
            )
        else:
            y = _segment_lut_kernel(
                q, table.dense, table.sparse, table.dense_bits, rounding, table.out_dtype
            )
        if is_recording():
            dtype = ir_dtype(table.out_dtype)
            attrs = {
                "dense_bits": int(table.dense_bits),
                "sparse_bits": SPARSE_BITS,
                "dtype": dtype,
                **(info() if info is not None else {}),
                "rounding": rounding.value,
            }
            params = {"dense": table.dense, "sparse": table.sparse}
            record(Call("segment_lut", [q], [y], [dtype], attrs, params))
        return y

    def embedding(ids: Tensor, table: Tensor, dtype: QDType) -> Tensor:
        """The rows of ``table`` (exact float32 integers of ``dtype``) at integer ``ids``."""
        y = table[ids.to(table.device)]
        if is_recording():
            d = ir_dtype(dtype)
            params = {"table": table.to(dtype.storage)}
            record(Call("embedding", [ids], [y], [d], {"dtype": d}, params))
        return y
