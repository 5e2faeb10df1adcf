"""Export rules of plain tensors: the bool, integer and float tensors (not quantized values)
that graph inputs such as token ids and attention masks feed, and the constants they meet.

* ``CAST_METHODS``: ``x.to(dtype)``, ``x.bool()``, ``x.long()``, ... -> a ``cast`` node;
* ``PLAIN_RULES``: comparisons (``compare``), logical ops on bool tensors (``logical``),
  ``torch.where`` / ``masked_fill`` (``where`` with its condition as an input); the elementwise
  arithmetic of ``moves.FLOAT_RULES`` (``float``) takes integer operands too;
* a value that no graph input feeds (a buffer, ``torch.arange`` of a size, a module applied to
  such values) is a constant: it is computed while exporting and becomes a ``constant`` node
  where an exported op reads it (``materialize``).

Each rule is ``rule(exporter, node, module, args, kwargs, result)`` and follows torch's type
promotion exactly (``docs/integer_graph.md``, 2, "Plain tensors").
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.fx import Node

from fxq.export.common import _Exporter, _np, depends_on_inputs, rule_in
from fxq.qtensor import QTensor

__all__ = [
    "PLAIN_RULES",
    "CAST_METHODS",
    "TORCH_DTYPES",
    "plain_rule",
    "materialize",
    "cast_rule",
    "emit_cast",
    "number_attr",
]

#: torch dtype -> IR dtype of the plain tensors the graph may hold
TORCH_DTYPES: dict[torch.dtype, str] = {
    torch.bool: "bool",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.float32: "float32",
}

#: Tensor methods that convert the dtype (``x.to(torch.bool)``, ``x.long()``); a call that keeps
#: the dtype (``x.to(device)``) moves nothing and is exported as the same tensor
CAST_METHODS = frozenset({"to", "type", "bool", "long", "int", "float"})


def _ir_dtype(ex: _Exporter, t: torch.dtype) -> str:
    dtype = TORCH_DTYPES.get(t)
    if dtype is None:
        raise ex.error(f"tensors of {t} are not exported (bool, int32, int64, float32 only)")
    return dtype


# -- constants -------------------------------------------------------------------------------------
def materialize(ex: _Exporter, obj: Tensor | QTensor, producer: Node) -> str:
    """Emit a ``constant`` node holding ``obj`` (a value no graph input feeds, made by the FX
    node ``producer``) and return its tensor name.

    A constant computed from the graph's input sizes whose axis 0 is the batch (e.g. a
    ``buffer.expand(batch, -1)``) is stored as its one row when all rows are equal and repeated
    to the batch size at run time (attribute ``batch``); when the rows differ it fixes the
    graph's batch size.
    """
    value = _np(obj.int_repr()) if isinstance(obj, QTensor) else _np(obj)
    if not isinstance(obj, QTensor):
        _ir_dtype(ex, obj.dtype)
    saved, ex.fx_node = ex.fx_node, producer
    try:
        like: list[str] = []
        batched_inputs = [i for i in ex.inputs if ex.batched.get(i)]
        if (
            ex.batch is not None
            and ex.batch > 1
            and value.ndim
            and value.shape[0] == ex.batch
            and depends_on_inputs(producer)
        ):
            if batched_inputs and bool((value == value[:1]).all()):
                value, like = np.ascontiguousarray(value[:1]), batched_inputs[:1]
            else:
                ex.fixed.append(f"{producer.name}: a constant computed from the batch size")
        (name,) = ex.emit(
            "constant",
            like,
            [obj],
            {"batch": bool(like)},
            {"value": value},
            batched=bool(like),
            suffix="_constant",
        )
    finally:
        ex.fx_node = saved
    return name


# -- casts ---------------------------------------------------------------------------------------
def cast_rule(ex: _Exporter, n: Node, module, args, kwargs, result) -> None:
    """``x.to(dtype)`` and the other ``CAST_METHODS``: torch's conversion (``docs/integer_graph.md``,
    ``cast``)."""
    if not isinstance(result, Tensor):
        raise ex.error("a cast whose result is not a tensor")
    emit_cast(ex, ex.name_of(args[0]), args[0].shape, _ir_dtype(ex, result.dtype), result)


def emit_cast(ex: _Exporter, name: str, shape: Any, dtype: str, result: Tensor | None) -> str:
    """A ``cast`` of the IR tensor ``name`` to ``dtype``; ``result`` is the value it stands for
    (a stand-in of ``shape`` when None)."""
    if ex.tensors[name].dtype == dtype:
        return name
    out = result if result is not None else torch.zeros(tuple(shape), dtype=_TORCH[dtype])
    (y,) = ex.emit(
        "cast", [name], [out], {"dtype": dtype}, suffix="" if result is not None else "_cast"
    )
    return y


_TORCH = {v: k for k, v in TORCH_DTYPES.items()}


# -- operands ------------------------------------------------------------------------------------
def number_attr(ex: _Exporter, v: Any, dtype: str) -> int | float:
    """A Python number operand as the JSON attribute of an op computing in ``dtype``."""
    if dtype in ("bool", "int32", "int64", "int8", "int16"):
        if float(v) != int(v):
            raise ex.error(f"the number {v} is not an integer (the op computes in {dtype})")
        return int(v)
    if not math.isfinite(float(v)):
        raise ex.error(f"the number {v} is not finite (write it as a tensor constant)")
    if dtype == "float32" and float(np.float32(v)) != float(v):
        raise ex.error(f"the number {v} is not a float32 number (torch rounds it)")
    return float(v)


def _binary(args: tuple, kwargs: dict) -> tuple[Any, Any]:
    a = args[0] if args else kwargs.get("input")
    b = args[1] if len(args) > 1 else kwargs.get("other")
    return a, b


# -- comparisons ---------------------------------------------------------------------------------
def _compare(fn: str) -> Callable[..., None]:
    def rule(ex: _Exporter, n: Node, module, args, kwargs, result) -> None:
        a, b = _binary(args, kwargs)
        compute = _ir_compute(ex, torch.result_type(a, b))
        attrs: dict[str, Any] = {"fn": fn, "compute_dtype": compute}
        tensors = [v for v in (a, b) if isinstance(v, Tensor)]
        if len(tensors) == 1:
            scalar = b if isinstance(a, Tensor) else a
            attrs["scalar"] = number_attr(ex, scalar, compute)
            attrs["scalar_first"] = not isinstance(a, Tensor)
        ex.emit(
            "compare",
            [ex.name_of(t) for t in tensors],
            [result],
            attrs,
            batched=_batched(ex, tensors),
        )

    return rule


def _ir_compute(ex: _Exporter, t: torch.dtype) -> str:
    if t is torch.float64:
        return "float64"
    return _ir_dtype(ex, t)


def _batched(ex: _Exporter, tensors: list[Any]) -> bool:
    return any(ex.batched.get(ex.name_of(t), False) for t in tensors)


# -- logical ops ---------------------------------------------------------------------------------
def _logical(fn: str, bitwise: bool) -> Callable[..., None]:
    def rule(ex: _Exporter, n: Node, module, args, kwargs, result) -> None:
        operands = [args[0] if args else kwargs["input"]]
        if fn != "not":
            operands.append(_binary(args, kwargs)[1])
        if not all(isinstance(v, Tensor) for v in operands):
            raise ex.error(f"logical {fn} with a number operand is not exported")
        if bitwise and any(v.dtype is not torch.bool for v in operands):
            raise ex.error(
                f"bitwise {fn} of {[str(v.dtype) for v in operands]} tensors is not exported "
                "(bool tensors only)"
            )
        names = [emit_cast(ex, ex.name_of(v), v.shape, "bool", None) for v in operands]
        ex.emit("logical", names, [result], {"fn": fn}, batched=_batched(ex, operands))

    return rule


# -- where / masked_fill ---------------------------------------------------------------------------
def _operand(ex: _Exporter, v: Any, dtype: str) -> str:
    """An operand of ``where`` in the output dtype: a graph tensor (cast if needed), or a number
    as a 0-d ``constant`` (numbers such as ``-inf`` have no JSON form)."""
    if isinstance(v, Tensor):
        return emit_cast(ex, ex.name_of(v), v.shape, dtype, None)
    value = torch.tensor(v, dtype=_TORCH[dtype])
    (name,) = ex.emit(
        "constant",
        [],
        [value],
        {"batch": False},
        {"value": _np(value)},
        batched=False,
        suffix="_value",
    )
    return name


def _where(ex: _Exporter, condition: Any, a: Any, b: Any, result: Tensor) -> None:
    if not isinstance(condition, Tensor) or condition.dtype is not torch.bool:
        raise ex.error("where / masked_fill with a condition that is not a bool tensor")
    dtype = _ir_dtype(ex, result.dtype)
    names = [ex.name_of(condition), *(_operand(ex, v, dtype) for v in (a, b))]
    tensors = [v for v in (condition, a, b) if isinstance(v, Tensor)]
    ex.emit(
        "where",
        names,
        [result],
        {"dtype": dtype, "constants": [None, None]},
        batched=_batched(ex, tensors),
    )


def _rule_where(ex: _Exporter, n: Node, module, args, kwargs, result) -> None:
    """``torch.where(condition, a, b)`` of plain tensors and numbers (torch's promotion)."""
    values = list(args) + [kwargs[k] for k in ("condition", "input", "other") if k in kwargs]
    if len(values) != 3:
        raise ex.error("torch.where(condition) (the indices form) is not exported")
    _where(ex, *values, result)


def _rule_where_method(ex: _Exporter, n: Node, module, args, kwargs, result) -> None:
    """``x.where(condition, y)``: ``torch.where(condition, x, y)``."""
    x = args[0]
    condition = args[1] if len(args) > 1 else kwargs["condition"]
    other = args[2] if len(args) > 2 else kwargs["other"]
    _where(ex, condition, x, other, result)


def _rule_masked_fill(ex: _Exporter, n: Node, module, args, kwargs, result) -> None:
    """``x.masked_fill(mask, value)``: ``where(mask, value, x)``."""
    x = args[0] if args else kwargs["input"]
    mask = args[1] if len(args) > 1 else kwargs["mask"]
    value = args[2] if len(args) > 2 else kwargs["value"]
    _where(ex, mask, value, x, result)


_COMPARE_TARGETS = {
    "eq": (operator.eq, torch.eq, "eq", "__eq__"),
    "ne": (operator.ne, torch.ne, torch.not_equal, "ne", "not_equal", "__ne__"),
    "lt": (operator.lt, torch.lt, torch.less, "lt", "less", "__lt__"),
    "le": (operator.le, torch.le, torch.less_equal, "le", "less_equal", "__le__"),
    "gt": (operator.gt, torch.gt, torch.greater, "gt", "greater", "__gt__"),
    "ge": (operator.ge, torch.ge, torch.greater_equal, "ge", "greater_equal", "__ge__"),
}
_LOGICAL_TARGETS = {
    ("and", False): (torch.logical_and, "logical_and"),
    ("or", False): (torch.logical_or, "logical_or"),
    ("xor", False): (torch.logical_xor, "logical_xor"),
    ("not", False): (torch.logical_not, "logical_not"),
    ("and", True): (operator.and_, operator.iand, torch.bitwise_and, "bitwise_and", "__and__"),
    ("or", True): (operator.or_, operator.ior, torch.bitwise_or, "bitwise_or", "__or__"),
    ("xor", True): (operator.xor, operator.ixor, torch.bitwise_xor, "bitwise_xor", "__xor__"),
    ("not", True): (operator.invert, torch.bitwise_not, "bitwise_not", "__invert__"),
}

#: target (function or Tensor method name) -> rule, for ops on plain tensors
PLAIN_RULES: dict[Any, Callable[..., None]] = {
    **{t: _compare(fn) for fn, ts in _COMPARE_TARGETS.items() for t in ts},
    **{t: _logical(fn, bitwise) for (fn, bitwise), ts in _LOGICAL_TARGETS.items() for t in ts},
    torch.where: _rule_where,
    "where": _rule_where_method,
    torch.masked_fill: _rule_masked_fill,
    "masked_fill": _rule_masked_fill,
}


def plain_rule(target: Any) -> Callable[..., None] | None:
    """The rule of a plain-tensor op (an in-place method ``x.masked_fill_`` as its
    out-of-place twin), or None."""
    return rule_in(PLAIN_RULES, target)
