"""Selection: integers picked, never computed.

* ``extremum``: ``maximum`` / ``minimum`` of two operands already on the output's grid;
* ``where``: ``where(condition, a, b)`` of operands on the output's grid (or plain tensors of
  the output dtype), a ``constants`` entry replacing an operand by an integer (a Python
  number on the output grid); the condition is the first input, or the ``condition``
  parameter (a constant of the model).

Operands reach the output grid through ``fxq.primitives.requant.requantize`` first.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fxq.primitives.arith import DTYPES
from fxq.primitives.core import Call, Primitive, ir_dtype, is_recording, record, register
from fxq.primitives.schema import Ctx, OpSpec, Param, is_float, is_int

try:
    import torch
except ImportError:  # the numpy runtime without torch
    torch = None

__all__ = ["extremum", "where"]

_FNS = ("maximum", "minimum")


# -- numpy --------------------------------------------------------------------------------------
def _numpy_extremum(node, inputs):
    pick = np.maximum if node.attrs["fn"] == "maximum" else np.minimum
    return [pick(inputs[0], inputs[1])]


def _numpy_where(node, inputs):
    a = node.attrs
    tensors = iter(inputs)
    condition = node.params.get("condition")
    if condition is None:
        condition = next(tensors)
    dt = DTYPES[a["dtype"]]
    a_, b_ = (next(tensors) if c is None else np.asarray(c, dt) for c in a["constants"])
    return [np.where(condition, a_, b_).astype(dt)]


# -- integer ONNX -------------------------------------------------------------------------------
def _onnx_extremum(w, node, outs: list[str]) -> None:
    op_type = "Max" if node.attrs["fn"] == "maximum" else "Min"
    xs = [w.as_float(i) for i in node.inputs]  # exact: int8 / int16 values
    w.cast(w.op(op_type, xs), w.store(node.outputs[0]), outs[0])


def _condition(w, node) -> tuple[str, list[str]]:
    """A ``where`` node's condition (its param, or its first input) and its other inputs."""
    if "condition" in node.params:
        return w.const(node.params["condition"], hint="condition"), list(node.inputs)
    return w.name(node.inputs[0]), list(node.inputs[1:])


def _onnx_where(w, node, outs: list[str]) -> None:
    a = node.attrs
    cond, inputs = _condition(w, node)
    tensors = iter(inputs)
    xs = [
        w.name(next(tensors)) if c is None else w.const(np.asarray(c, a["dtype"]))
        for c in a["constants"]
    ]
    w.op("Where", [cond, *xs], outs[0])


# -- QDQ ONNX -----------------------------------------------------------------------------------
def _qdq_extremum(w, node, outs: list[str]) -> None:
    op_type = "Max" if node.attrs["fn"] == "maximum" else "Min"
    w.qdq(w.op(op_type, [w.name(i) for i in node.inputs]), node.outputs[0], outs[0])


def _qdq_where(w, node, outs: list[str]) -> None:
    scale = w.graph.tensors[node.outputs[0]].scale
    if scale is None:  # plain tensors (a mask): as in the integer form
        _onnx_where(w, node, outs)
        return
    cond, inputs = _condition(w, node)
    tensors = iter(inputs)
    xs = [
        w.name(next(tensors)) if c is None else w.const(np.float32(c * scale))
        for c in node.attrs["constants"]
    ]
    w.qdq(w.op("Where", [cond, *xs]), node.outputs[0], outs[0])


# -- file schema --------------------------------------------------------------------------------
def _check_extremum(c: Ctx) -> None:
    if c.attrs["fn"] not in _FNS:
        raise c.fail(f"fn {c.attrs['fn']!r} (one of {list(_FNS)})")


def _check_where(c: Ctx) -> None:
    k = c.attrs["constants"]
    number = is_float if c.attrs["dtype"] == "float32" else is_int
    if not isinstance(k, list) or len(k) != 2 or not all(e is None or number(e) for e in k):
        raise c.fail(f"constants {k!r} is not two entries of null or a number of its dtype")
    condition = "condition" not in c.params  # the condition is the first input
    if len(c.node["inputs"]) != sum(e is None for e in k) + condition:
        raise c.fail(f"{len(c.node['inputs'])} inputs for constants {k}")
    if condition and c.in_dtypes[0] != "bool":
        raise c.fail(f"a condition input of dtype {c.in_dtypes[0]} (bool)")
    operands = c.in_dtypes[1:] if condition else c.in_dtypes
    if any(d != c.attrs["dtype"] for d in operands):
        raise c.fail(f"operands of dtypes {operands} for dtype {c.attrs['dtype']}")


register(
    Primitive(
        "extremum",
        _numpy_extremum,
        _onnx_extremum,
        OpSpec((2,), {"fn": "str"}, {}, _check_extremum),
        _qdq_extremum,
        "`maximum` / `minimum` of two operands on the output grid",
    )
)
register(
    Primitive(
        "where",
        _numpy_where,
        _onnx_where,
        OpSpec(
            (0, 1, 2, 3),
            {"constants": "any", "dtype": "anydtype"},
            {"condition": Param(("bool",), None, False)},
            _check_where,
        ),
        _qdq_where,
        "`where(condition, a, b)`; an operand may be a constant integer",
    )
)


# -- torch --------------------------------------------------------------------------------------
if torch is not None:
    from torch import Tensor

    from fxq.dtypes import QDType

    def extremum(a: Tensor, b: Tensor, fn: str, dtype: QDType) -> Tensor:
        """``torch.maximum`` / ``torch.minimum`` (``fn``) of integers on the grid of
        ``dtype``."""
        y = torch.maximum(a, b) if fn == "maximum" else torch.minimum(a, b)
        if is_recording():
            d = ir_dtype(dtype)
            record(Call("extremum", [a, b], [y], [d], {"fn": fn}))
        return y

    def where(condition: Tensor, a: Tensor | int, b: Tensor | int, dtype: QDType) -> Tensor:
        """``torch.where(condition, a, b)`` of integers on the output grid of ``dtype``; an
        operand may be a Python integer (a number already on that grid)."""
        like = a if isinstance(a, Tensor) else b
        kind = like.dtype if isinstance(like, Tensor) else torch.float32
        ops = [
            v if isinstance(v, Tensor) else torch.tensor(v, dtype=kind, device=condition.device)
            for v in (a, b)
        ]
        y = torch.where(condition, *ops)
        if is_recording():
            d = ir_dtype(dtype)
            constants: list[Any] = [None if isinstance(v, Tensor) else int(v) for v in (a, b)]
            tensors = [v for v in (a, b) if isinstance(v, Tensor)]
            attrs = {"dtype": d, "constants": constants}
            record(Call("where", [condition, *tensors], [y], [d], attrs))
        return y
