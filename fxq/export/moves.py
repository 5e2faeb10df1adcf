"""Export rules of pass-through ops (``VALUE_RULES``: ReLU, max pooling; every other
pass-through row moves integers, found by running the op on source indices) and of the
float ops a float region may hold (``FLOAT_RULES``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.fx import Node
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxq import registry
from fxq.export.common import _dtype, _Exporter, _np  # noqa: F401
from fxq.export.plain import TORCH_DTYPES, number_attr
from fxq.primitives.window import per_axis
from fxq.qtensor import QTensor

__all__ = ["VALUE_RULES", "MOVEMENT_CUSTOM_ROWS", "FLOAT_RULES", "value_rule"]


# -- pass-through rows that compute on values --------------------------------------------------
def _rule_relu(ex: _Exporter, n, module, args, kwargs, result) -> None:
    x = args[0]
    ex.emit("clip", [ex.name_of(x)], [result], {"lo": 0, "hi": x.qdtype.qmax})


_POOL_ARGS = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")


def _rule_max_pool(ex: _Exporter, n, module, args, kwargs, result) -> None:
    x = args[0]
    if module is not None:
        p = {k: getattr(module, k) for k in _POOL_ARGS}
    else:
        p = dict(zip(_POOL_ARGS, args[1:]))
        p.update(kwargs)
    dims = int(registry.row_for(n, ex.modules)[0].name[-2])
    k = per_axis(p["kernel_size"], dims)
    stride = p.get("stride")
    values = result[0] if isinstance(result, tuple) else result
    ex.emit(
        "max_pool",
        [ex.name_of(x)],
        [values],
        {
            "kernel": k,
            "stride": k
            if stride is None or stride == [] or stride == ()
            else per_axis(stride, dims),
            "padding": per_axis(p.get("padding", 0), dims),
            "dilation": per_axis(p.get("dilation", 1), dims),
            "ceil_mode": bool(p.get("ceil_mode", False)),
        },
    )


def _rule_adaptive_max_pool(ex: _Exporter, n, module, args, kwargs, result) -> None:
    x = args[0]
    values = result[0] if isinstance(result, tuple) else result
    dims = int(registry.row_for(n, ex.modules)[0].name[-2])
    ex.emit(
        "adaptive_max_pool",
        [ex.name_of(x)],
        [values],
        {"output_size": list(values.shape[-dims:])},
    )


def _rule_indexed(ex: _Exporter, n, module, args, kwargs, result) -> None:
    """``index_select`` / ``gather``: integers move by a constant index (a source-index rule);
    an index computed in the graph would be baked in with its example value, so it is refused."""
    index = args[2] if len(args) > 2 else kwargs.get("index")
    if isinstance(index, Tensor) and id(index) in ex.names:
        raise ex.error(
            "its index tensor is computed in the graph (or is a graph input); fxq exports "
            "index_select / gather with constant indices only"
        )
    _movement(ex, n, module, args, kwargs, result)


def _rule_extreme(ex: _Exporter, n, module, args, kwargs, result) -> None:
    """``amax`` / ``amin``: the largest / smallest integers over ``dim`` (the grid is kept)."""
    x = args[0] if args else kwargs["input"]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", ())
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    dims = [dim] if isinstance(dim, int) else list(dim)
    axes = sorted(d % x.dim() for d in dims) if dims else list(range(x.dim()))
    fn = registry.row_for(n, ex.modules)[0].name
    ex.emit(
        "reduce_extreme", [ex.name_of(x)], [result], {"fn": fn, "axes": axes, "keepdim": keepdim}
    )


def _rule_arg_extreme(ex: _Exporter, n, module, args, kwargs, result) -> None:
    """``argmax`` / ``argmin``: int64 indices of the largest / smallest integers (first on ties)."""
    x = args[0] if args else kwargs["input"]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    fn = registry.row_for(n, ex.modules)[0].name
    axis = None if dim is None else int(dim) % x.dim()
    ex.emit("arg_extreme", [ex.name_of(x)], [result], {"fn": fn, "axis": axis, "keepdim": keepdim})


#: pass-through registry rows (name without the 1d/2d/3d) whose QTensor op computes on values
VALUE_RULES: dict[str, Callable[..., None]] = {
    "relu": _rule_relu,
    "max_pool": _rule_max_pool,
    "adaptive_max_pool": _rule_adaptive_max_pool,
    "index_select": _rule_indexed,
    "gather": _rule_indexed,
    "amax": _rule_extreme,
    "amin": _rule_extreme,
    "argmax": _rule_arg_extreme,
    "argmin": _rule_arg_extreme,
}

#: pass-through rows that QTensor implements itself ("custom") and that only move integers,
#: so the source-index rule exports them; a new "custom" row must be added here or to
#: VALUE_RULES (it might compute on values, which source indices cannot capture)
MOVEMENT_CUSTOM_ROWS = frozenset(
    {"dropout", "pad", "pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "contiguous",
     "interpolate", "to"}
)  # fmt: skip


def value_rule(row_name: str) -> Callable[..., None] | None:
    """The value rule of a pass-through row (``max_pool2d`` -> ``max_pool``), or None."""
    return VALUE_RULES.get(row_name.rstrip("123d")) or VALUE_RULES.get(row_name)


# -- pass-through rows that move integers ------------------------------------------------------
def _call_float(ex: _Exporter, n: Node, module, args, kwargs) -> Any:
    if n.op == "call_module":
        return module(*args, **kwargs)
    if n.op == "call_function":
        return n.target(*args, **kwargs)
    return getattr(args[0], n.target)(*args[1:], **kwargs)


def _movement(ex: _Exporter, n: Node, module, args, kwargs, result) -> None:
    """Export an op that only moves values (integers, or the float values of a float
    region) by running it on source indices."""
    leaves, spec = tree_flatten((args, kwargs))
    graph = [
        i for i, v in enumerate(leaves) if isinstance(v, (Tensor, QTensor)) and id(v) in ex.names
    ]
    if not graph:  # a constant (named when it is materialized)
        graph = [i for i, v in enumerate(leaves) if isinstance(v, (Tensor, QTensor))]
    pos = graph[0]
    src = leaves[pos]
    moved_type = QTensor if isinstance(src, QTensor) else Tensor
    if len(graph) > 1 and _method_name(n) not in _SHAPE_ONLY:
        raise ex.error(
            "it moves values by another tensor of the graph (an index computed from the inputs); "
            "fxq exports moves by constant indices only"
        )
    numel = src.numel()
    index = torch.arange(1, numel + 1, dtype=torch.float64).reshape(src.shape)
    swapped = [
        index if i == pos else (v.dequantize().double() if isinstance(v, QTensor) else v)
        for i, v in enumerate(leaves)
    ]
    a2, k2 = tree_unflatten(swapped, spec)
    with torch.no_grad():
        moved = _call_float(ex, n, module, a2, k2)
    res_leaves = tree_flatten(result)[0]
    moved_leaves = tree_flatten(moved)[0]
    in_name = ex.name_of(src)
    outputs = [(r, o) for r, o in zip(res_leaves, moved_leaves) if isinstance(r, moved_type)]
    for j, (r, o) in enumerate(outputs):
        if id(r) in ex.names:
            continue
        suffix = "" if len(outputs) == 1 else f"_{j}"
        _emit_movement(ex, n, in_name, src, r, o.to(torch.float64) - 1, suffix)


#: movement ops whose second tensor gives a shape only
_SHAPE_ONLY = frozenset({"view_as", "reshape_as", "expand_as"})


def _method_name(n: Node) -> str:
    return n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")


def _emit_movement(
    ex: _Exporter, n: Node, in_name: str, src: QTensor, r: QTensor, idx: Tensor, suffix: str
) -> None:
    numel = src.numel()
    batch = ex.batch
    flat = idx.reshape(-1).round().to(torch.int64)
    in_shape, out_shape = list(src.shape), list(r.shape)
    batched = ex.batched.get(in_name, False) and out_shape[:1] == [batch] and batch
    per_sample = False
    if batched:
        per = numel // batch
        rows = flat.reshape(batch, -1)
        base = rows[0]
        ok = bool(((base >= -1) & (base < per)).all())
        if ok:
            offs = torch.arange(batch).reshape(-1, 1) * per
            expected = torch.where(base >= 0, base + offs, torch.full_like(rows, -1))
            ok = torch.equal(expected, rows)
        per_sample = ok
    if per_sample:
        index = rows[0]
        trailing = out_shape[1:]
        identity = index.numel() == per and torch.equal(index, torch.arange(per))
    else:
        index = flat
        trailing = out_shape
        identity = index.numel() == numel and torch.equal(index, torch.arange(numel))
    if identity:
        if out_shape == in_shape:
            ex.alias(r, in_name)
            return
        shape = [0, *trailing] if per_sample else out_shape
        if not per_sample and ex.batched.get(in_name, False):
            ex.fixed.append(f"{n.name} reshapes across the batch dimension")
        ex.emit("reshape", [in_name], [r], {"shape": shape}, batched=per_sample, suffix=suffix)
        return
    perm = _as_transpose(n, in_shape, flat, out_shape)
    if perm is not None and (perm[0] == 0 or not ex.batched.get(in_name, False)):
        ex.emit("transpose", [in_name], [r], {"perm": perm}, batched=perm[0] == 0, suffix=suffix)
        return
    if not per_sample and ex.batched.get(in_name, False):
        ex.fixed.append(f"{n.name} moves values across samples of the batch")
    ex.emit(
        "gather",
        [in_name],
        [r],
        {"per_sample": per_sample, "shape": trailing},
        {"index": index.numpy().astype(np.int64)},
        batched=per_sample,
        suffix=suffix,
    )


def _as_transpose(
    n: Node, in_shape: list[int], flat: Tensor, out_shape: list[int]
) -> list[int] | None:
    """The permutation when the op is a permute / transpose (checked on the indices)."""
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    if name not in ("permute", "transpose", "t", "movedim", "swapaxes", "swapdims"):
        return None
    rank = len(in_shape)
    args = [a for a in n.args[1:]]
    perm = list(range(rank))
    try:
        if name == "permute":
            dims = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
            perm = [int(d) % rank for d in dims]
        elif name == "t":
            perm = perm[::-1]
        else:
            a, b = int(args[0]) % rank, int(args[1]) % rank
            perm[a], perm[b] = perm[b], perm[a]
    except (TypeError, ValueError, IndexError):
        return None
    ref = torch.arange(flat.numel()).reshape(in_shape).permute(perm).reshape(-1)
    return perm if torch.equal(ref, flat) and list(ref.shape) else None


# -- float ops --------------------------------------------------------------------------------
FLOAT_RULES: dict[Any, str] = {
    operator.neg: "neg",
    torch.neg: "neg",
    "neg": "neg",
    operator.add: "add",
    operator.iadd: "add",
    torch.add: "add",
    "add": "add",
    operator.sub: "sub",
    operator.isub: "sub",
    torch.sub: "sub",
    "sub": "sub",
    operator.mul: "mul",
    operator.imul: "mul",
    torch.mul: "mul",
    "mul": "mul",
    operator.truediv: "div",
    operator.itruediv: "div",
    torch.div: "div",
    "div": "div",
}


def _float_op(ex: _Exporter, fn: str, args, kwargs, result: Tensor) -> None:
    """Elementwise arithmetic of plain tensors (float32, or int32 / int64 ids and masks) and
    numbers, in the result's dtype as torch computes it (operands converted to it first)."""
    if kwargs:
        raise ex.error("float ops with keyword arguments are not exported")
    dtype = TORCH_DTYPES.get(result.dtype)
    if dtype not in ("float32", "int32", "int64"):
        raise ex.error(
            f"float ops are exported in float32 (or int32 / int64 arithmetic) only (got "
            f"{result.dtype})"
        )
    tensors = [a for a in args if isinstance(a, Tensor)]
    scalars = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
    if len(tensors) + len(scalars) != len(args):
        raise ex.error("float op arguments must be tensors or numbers")
    attrs: dict[str, Any] = {"fn": fn}
    if dtype != "float32":
        attrs["dtype"] = dtype
    if scalars:
        attrs["scalar"] = number_attr(ex, scalars[0], dtype)
        attrs["scalar_first"] = not isinstance(args[0], Tensor)
    names = [ex.name_of(t) for t in tensors]
    batched = any(ex.batched.get(name, False) for name in names)
    ex.emit("float", names, [result], attrs, batched=batched)
