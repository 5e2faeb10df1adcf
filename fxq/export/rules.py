"""Export rules of the integer modules (one per ``fxq.quantized`` class in ``RULES``).

A rule is ``rule(exporter, module, args, kwargs, result)``: it reads what the integer module
computed with for the scales its inputs carry and emits IR nodes (``exporter.emit``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from fxq.march import Rounding
from fxq.qtensor import QTensor
from fxq.quantized import (
    attention,
    grid_sample,
    interpolate,
    pooling,
    softmax,
)
from fxq.quantized import functional as qf
from fxq.quantized import stubs as qstubs
from fxq.quantized.base import multiplier_for

#: the exporter (``fxq.export.build._Exporter``; not imported: build imports this module)
_Exporter = Any

__all__ = ["RULES", "depends_on_inputs", "graph_keep"]


def _dtype(q: QTensor) -> str:
    return {"qint8": "int8", "qint16": "int16", "qint32": "int32"}[q.qdtype.name]


def _rounding(module: nn.Module) -> str:
    return "half_up" if module.rounding is Rounding.HALF_UP else "half_even"


def _np(t: Tensor, dtype: Any = None) -> np.ndarray:
    a = t.detach().cpu().numpy()
    return a.astype(dtype) if dtype is not None else a.copy()


def _ints(v: Any, d: int) -> list[int]:
    if isinstance(v, (tuple, list)):
        v = list(v)
        return [int(x) for x in (v * d if len(v) == 1 else v)]
    return [int(v)] * d


# -- rules: stubs ---------------------------------------------------------------------------
def _rule_quantize(ex: _Exporter, m: qstubs.Quantize, args, kwargs, result) -> None:
    x = args[0]
    if not isinstance(x, (Tensor, QTensor)):
        return
    if isinstance(x, Tensor) and id(x) not in ex.names:
        # a constant (a buffer): its integers are the consumer's parameter (a constant
        # grid_sample grid); a consumer that cannot take one names the node in its error
        return
    if isinstance(x, QTensor):
        _requantize_to(ex, x, m.scale, m.dtype, m, result)
        return
    ex.emit(
        "quantize",
        [ex.name_of(x)],
        [result],
        {"scale": float(m.scale), "dtype": _dtype(result), "rounding": _rounding(m)},
    )


def _emit_requantize(
    ex: _Exporter, source: str, result, module, mult, shift, lo=None, hi=None, suffix=""
) -> list[str]:
    """A ``requantize`` node: ``source`` times ``mult`` shifted right by ``shift``, rounded
    as ``module``'s march rounds, into ``result``'s dtype (clamped to ``[lo, hi]`` when set)."""
    return ex.emit(
        "requantize",
        [source],
        [result],
        {"dtype": _dtype(result), "rounding": _rounding(module), "lo": lo, "hi": hi},
        {"multiplier": _np(mult, np.int64), "shift": _np(shift, np.int64)},
        suffix=suffix,
    )


def _on_output_grid(ex: _Exporter, m, t: QTensor, suffix: str) -> str:
    """The name of ``t`` on ``m``'s output scale and dtype: ``t`` itself when it is already
    there, else a ``requantize`` node with ``m.rescale(t.scale)``'s multiplier and shift."""
    if torch.equal(t.scale, m.output_scale.to(t.scale.device)) and t.qdtype is m.out_dtype:
        return ex.name_of(t)
    mult, shift = m.rescale(t.scale)
    moved = _placeholder(t.shape, m.output_scale, m.out_dtype)
    (name,) = _emit_requantize(ex, ex.name_of(t), moved, m, mult, shift, suffix=suffix)
    return name


def _requantize_to(ex: _Exporter, x: QTensor, scale: Tensor, dtype, module, result, suffix=""):
    if torch.equal(x.scale, scale.to(x.scale.device)) and x.qdtype is dtype:
        ex.alias(result, ex.name_of(x))
        return
    m, s = multiplier_for(
        module, qf.scale_ratio(x.scale, scale), {"input": x.scale, "output": scale}
    )
    _emit_requantize(ex, ex.name_of(x), result, module, m, s, suffix=suffix)


def _rule_dequantize(ex: _Exporter, m: nn.Module, args, kwargs, result) -> None:
    dtype = getattr(m, "dtype_of_model", None)
    if dtype is not None and dtype.dtype is not torch.float32:
        raise ex.error(f"the model runs its float regions in {dtype.dtype}; export a float32 model")
    ins, _ = tree_flatten(args[0])
    outs, _ = tree_flatten(result)
    for i, (a, b) in enumerate(zip(ins, outs)):
        if isinstance(a, QTensor):
            if a.scale.numel() != 1:
                raise ex.error("per-channel QTensors are not exported")
            ex.emit(
                "dequantize",
                [ex.name_of(a)],
                [b],
                {"scale": float(a.scale)},
                suffix="" if len(ins) == 1 else f"_{i}",
            )
        elif isinstance(a, Tensor):
            ex.alias(b, ex.name_of(a))


# -- rules: weighted ------------------------------------------------------------------------
# -- rules: elementwise ---------------------------------------------------------------------
# -- rules: clamps and tables ---------------------------------------------------------------
# -- rules: pooling, reductions, resampling --------------------------------------------------
def _sum_then_requant(
    ex: _Exporter,
    m: nn.Module,
    x: QTensor,
    result: QTensor,
    axes: list[int],
    matrices: list[np.ndarray],
    counts: Tensor,
    keep_shape: list[int] | None = None,
) -> None:
    """``axis_matmul`` (exact window sums), an optional reshape, then ``requantize`` with one
    multiplier per output position (``M_d 2**-S_d ~ s_x / (d s_y)`` for window count ``d``)."""
    if any(a == 0 for a in axes) and ex.batched.get(ex.name_of(x), False):
        raise ex.error("reducing over the batch dimension is not exported")
    sums_shape = list(x.shape)
    for a, mat in zip(axes, matrices):
        sums_shape[a] = mat.shape[1]
    sums = torch.zeros(sums_shape, dtype=torch.int64)
    (name,) = ex.emit(
        "axis_matmul",
        [ex.name_of(x)],
        [sums],
        {"axes": axes},
        {f"matrix_{i}": mat.astype(np.int32) for i, mat in enumerate(matrices)},
        suffix="_sum",
    )
    if keep_shape is not None and list(keep_shape) != sums_shape:
        flat = torch.zeros(keep_shape, dtype=torch.int64)
        shape = [0 if i == 0 and ex.batched[name] else s for i, s in enumerate(keep_shape)]
        (name,) = ex.emit("reshape", [name], [flat], {"shape": shape}, suffix="_reshape")
    counts = counts.to(torch.float64).cpu()
    distinct, inverse = torch.unique(counts, return_inverse=True)
    s_y = m.output_scale.to(torch.float64).cpu()
    real = x.scale.to(torch.float64).cpu() / (distinct * s_y)
    mult, shift = multiplier_for(m, real, {"input": x.scale, "output": s_y})
    if distinct.numel() > 1:  # one multiplier per output position
        mult, shift = mult[inverse], shift[inverse]
    _emit_requantize(ex, name, result, m, mult, shift)
    if distinct.numel() == 1:  # the multiplier for any other count (dynamic dims)
        s_x = x.scale

        def by_count(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            r = s_x.to(torch.float64).cpu() / (torch.from_numpy(counts) * s_y)
            mm, ss = multiplier_for(m, r, {"input": s_x, "output": s_y})
            return _np(mm, np.int64).reshape(-1), _np(ss, np.int64).reshape(-1)

        ex.counts[ex.nodes[-1].name] = by_count


def _window_matrix(n: int, o: int, windows: list[tuple[int, int]]) -> np.ndarray:
    a = np.zeros((n, o), dtype=np.int64)
    for j, (s, e) in enumerate(windows):
        a[max(s, 0) : min(e, n), j] = 1
    return a


def _rule_avg_pool(ex: _Exporter, m: pooling.AvgPool, args, kwargs, result) -> None:
    x = args[0]
    params = m.arguments(args[1:], kwargs)
    dims = m.pool_dims(x)
    k = _ints(params["kernel_size"], dims)
    stride = params["stride"]
    st = k if stride is None or stride == [] or stride == () else _ints(stride, dims)
    pad = _ints(params["padding"], dims)
    out_sizes = list(result.shape[-dims:])
    in_sizes = list(x.shape[-dims:])
    axes = [x.dim() - dims + i for i in range(dims)]
    mats = [
        _window_matrix(n, o, [(j * s - p, j * s - p + kk) for j in range(o)])
        for n, o, s, p, kk in zip(in_sizes, out_sizes, st, pad, k)
    ]
    # torch's divisor of every output position, as the integer module computes it
    counts = m.window_counts(in_sizes, params).reshape(out_sizes)
    _sum_then_requant(ex, m, x, result, axes, mats, counts)


def _rule_adaptive_avg_pool(ex: _Exporter, m: pooling.AdaptiveAvgPool, args, kwargs, result):
    x = args[0]
    dims = m.pool_dims(x)
    out_sizes = list(result.shape[-dims:])
    in_sizes = list(x.shape[-dims:])
    axes = [x.dim() - dims + i for i in range(dims)]
    from .runtime import adaptive_windows

    windows = [adaptive_windows(n, o) for n, o in zip(in_sizes, out_sizes)]
    mats = [_window_matrix(n, o, w) for n, o, w in zip(in_sizes, out_sizes, windows)]
    counts = torch.ones(out_sizes, dtype=torch.float64)
    for i, w in enumerate(windows):
        shape = [1] * dims
        shape[i] = len(w)
        counts = counts * torch.tensor([e - s for s, e in w], dtype=torch.float64).reshape(shape)
    _sum_then_requant(ex, m, x, result, axes, mats, counts)


def _reduction(ex: _Exporter, m: nn.Module, args, kwargs, result, mean: bool) -> None:
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis"))
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    dims = sorted(pooling.reduce_dims(x, dim))
    mats = [np.ones((x.shape[d], 1), dtype=np.int64) for d in dims]
    count = math.prod(x.shape[d] for d in dims) if mean else 1
    counts = torch.full(tuple(result.shape), float(count))
    _sum_then_requant(ex, m, x, result, dims, mats, counts, None if keepdim else list(result.shape))


def _rule_mean(ex, m, args, kwargs, result) -> None:
    _reduction(ex, m, args, kwargs, result, True)


def _rule_sum(ex, m, args, kwargs, result) -> None:
    _reduction(ex, m, args, kwargs, result, False)


def _rule_interpolate(ex: _Exporter, m: interpolate.Interpolate, args, kwargs, result) -> None:
    x = args[0]
    dims = x.dim() - 2
    in_sizes = list(x.shape[2:])
    _, scales, align = m.plan(in_sizes, args[1:], kwargs)
    out_sizes = list(result.shape[2:])
    mats = []
    one = 1 << qf.INTERP_FRACTION_BITS
    for n, o, s in zip(in_sizes, out_sizes, scales):
        i0, i1, w1 = qf.linear_weights(n, o, s, align, "cpu")
        a = np.zeros((n, o), dtype=np.int64)
        for j in range(o):
            a[int(i0[j]), j] += one - int(w1[j])
            a[int(i1[j]), j] += int(w1[j])
        mats.append(a)
    sums = torch.zeros(x.shape[:2] + tuple(out_sizes), dtype=torch.int64)
    (name,) = ex.emit(
        "axis_matmul",
        [ex.name_of(x)],
        [sums],
        {"axes": list(range(2, 2 + dims))},
        {f"matrix_{i}": a.astype(np.int32) for i, a in enumerate(mats)},
        suffix="_sum",
    )
    mult, s = m.requantization(x)
    _emit_requantize(ex, name, result, m, mult, s)


def _rule_grid_sample(ex: _Exporter, m: grid_sample.GridSample, args, kwargs, result) -> None:
    x, grid = args[0], args[1]
    p = grid_sample.grid_arguments(tuple(args[2:]), kwargs)
    params = {}
    for axis, size in (("x", x.shape[3]), ("y", x.shape[2])):
        mult, s = multiplier_for(
            m,
            grid_sample.coordinate_factor(grid.scale, size, p["align_corners"]),
            {"grid": grid.scale},
            left_shift=True,
        )
        params[f"multiplier_{axis}"] = _np(mult, np.int64)
        params[f"shift_{axis}"] = _np(s, np.int64)
    inputs = [ex.name_of(x)]
    if id(grid) in ex.names:
        inputs.append(ex.name_of(grid))
    else:  # a constant grid (a quantized buffer): its integers are a parameter
        params["grid"] = _np(grid.values(), np.int16 if grid.qdtype.bits > 8 else np.int8)
    sums = torch.zeros(tuple(result.shape), dtype=torch.int64)
    (name,) = ex.emit(
        "grid_sample",
        inputs,
        [sums],
        {
            "mode": p["mode"],
            "padding_mode": p["padding_mode"],
            "align_corners": p["align_corners"],
            "fraction_bits": qf.INTERP_FRACTION_BITS,
            "grid_scale": float(grid.scale),
            "rounding": _rounding(m),
        },
        params,
        suffix="_sum",
    )
    mult, s = m.output_factor(x.scale, p["mode"])
    _emit_requantize(ex, name, result, m, mult, s)


# -- rules: normalization and softmax -------------------------------------------------------
def _fx_argument(ex: _Exporter, value: Any) -> Any:
    """The FX argument (a Node, or a constant) of the current node whose value is ``value``."""
    n = ex.fx_node
    nodes = tree_flatten((n.args, n.kwargs))[0]
    values = tree_flatten(ex.fetch_args_kwargs_from_env(n))[0]
    return next((a for a, v in zip(nodes, values) if v is value), None)


def rule_in(table: dict, target: Any) -> Callable[..., None] | None:
    """``table``'s rule for an FX call ``target`` (a module class, a function or a ``Tensor``
    method name; an in-place method ``x.relu_`` as its out-of-place twin); None when it has
    none."""
    try:
        rule = table.get(target)
    except TypeError:  # an unhashable target
        return None
    if rule is None and isinstance(target, str) and target.endswith("_"):
        rule = table.get(target.rstrip("_"))
    return rule


def depends_on_inputs(arg: Any) -> bool:
    """Whether an FX argument is computed from a graph input (placeholder)."""
    from torch.fx import Node

    seen: set = set()
    stack = [arg] if isinstance(arg, Node) else []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            return True
        stack.extend(node.all_input_nodes)
    return False


def constant_bool(ex: _Exporter, value: Tensor, what: str, batch_axis: bool) -> np.ndarray:
    """A bool tensor (an attention keep-mask, a ``where`` condition) as an IR parameter.

    The value must be a constant of the model (a buffer, or computed from constants and
    sizes only); it is baked in. When its first axis is the batch axis (``batch_axis``) and
    longer than 1, it fixes the graph's batch size.

    Raises:
        ExportError: the value is computed from the graph's inputs.
    """
    computed = id(value) in ex.names or (
        id(value) not in ex.constants and depends_on_inputs(_fx_argument(ex, value))
    )
    if computed:
        raise ex.error(
            f"its {what} is computed from the graph's inputs, which this op exports only as a "
            "constant of the model (buffers, or tensors built from constants and sizes); "
            "F.scaled_dot_product_attention and torch.where take masks computed from the "
            "inputs. Export the part after the mask, or make the mask a buffer"
        )
    keep = _np(value.to(torch.bool))
    if batch_axis and keep.shape[0] > 1:
        ex.fixed.append(f"{ex.fx_node.name}: its constant {what} has a batch axis")
    return keep


def _keep_of(ex: _Exporter, keep: Tensor, masks: list[tuple[Any, str, bool]]) -> np.ndarray:
    """The constant keep-mask of an attention node, computed from ``masks``: ``(mask, its
    argument name, whether its first axis is the batch axis)``, each checked constant."""
    for mask, what, batch_axis in masks:
        if mask is not None:
            constant_bool(ex, mask, what, batch_axis)
    return _np(keep.to(torch.bool))


def _placeholder(shape, scale: Tensor, dtype) -> QTensor:
    return QTensor(torch.zeros(tuple(shape), dtype=torch.float32), scale.reshape(1), dtype)


def graph_keep(ex: _Exporter, mask: Any, what: str) -> str | None:
    """The IR name of the bool keep-mask of an attention mask computed from the graph's inputs
    (e.g. from ``attention_mask``), emitting its nodes; None for a constant mask.

    As ``attention.keep_mask`` with ``attend=True``: a bool mask is the keep-mask; a float mask
    keeps the entries that are not ``<= ADDITIVE_MASK_LIMIT`` (``compare`` then ``logical``); a
    mask computed by quantized ops (``(1.0 - mask) * finfo.min`` quantized) is dequantized first.

    Raises:
        ExportError: a quantized mask with per-channel scales or an offset.
    """
    if id(mask) not in ex.names:
        return None
    name = ex.name_of(mask)
    if isinstance(mask, QTensor):
        if mask.scale.numel() != 1 or mask.offset:
            raise ex.error(f"its {what} is quantized per channel or with an offset")
        values = torch.zeros(tuple(mask.shape), dtype=torch.float32)
        (name,) = ex.emit(
            "dequantize", [name], [values], {"scale": float(mask.scale)}, suffix=f"_{what}"
        )
    elif mask.dtype is torch.bool:
        return name
    left = torch.zeros(tuple(mask.shape), dtype=torch.bool)
    limit = attention.ADDITIVE_MASK_LIMIT
    attrs = {"fn": "le", "compute_dtype": "float32", "scalar": float(limit)}
    (left_name,) = ex.emit(
        "compare", [name], [left], {**attrs, "scalar_first": False}, suffix=f"_{what}_left_out"
    )
    keep = torch.zeros(tuple(mask.shape), dtype=torch.bool)
    (keep_name,) = ex.emit("logical", [left_name], [keep], {"fn": "not"}, suffix=f"_{what}_keep")
    return keep_name


def _emit_attention_core(
    ex, m, q, k, v, requants, soft, causal, result, inner, scale, suffix="", keep=None
):
    """IR nodes of ``attention.attention_core``: transpose, matmul, softmax, matmul.

    ``causal``: False, True, or a constant bool keep-mask (numpy) that broadcasts against the
    scores (the softmax node's ``keep`` parameter); ``keep``: the IR name of a bool keep-mask
    computed in the graph (the softmax node's second input), or None."""
    (m_s, k_s), (m_o, k_o) = requants
    rank = k.dim()
    perm = list(range(rank - 2)) + [rank - 1, rank - 2]
    k_t = _placeholder([*k.shape[:-2], k.shape[-1], k.shape[-2]], k.scale, k.qdtype)
    (kt_name,) = ex.emit(
        "transpose", [ex.name_of(k)], [k_t], {"perm": perm}, suffix=f"{suffix}_key_t"
    )
    scores = _placeholder([*q.shape[:-1], k.shape[-2]], m.scores_scale, inner)
    probs = _placeholder(scores.shape, m.probs_scale, inner)
    (s_name,) = ex.emit(
        "matmul",
        [ex.name_of(q), kt_name],
        [scores],
        {
            "multiplier": int(m_s.reshape(-1)[0]),
            "shift": int(k_s.reshape(-1)[0]),
            "factor": float(scale),
            "dtype": _dtype(scores),
            "rounding": _rounding(m),
        },
        suffix=f"{suffix}_scores",
    )
    attrs, tables = softmax.softmax_node(soft, False, rank - 1, _rounding(m), _dtype(probs))
    params = {k: _np(t, np.int64) for k, t in tables.items()}
    if isinstance(causal, np.ndarray):
        params["keep"] = causal
    else:
        attrs["causal"] = bool(causal)
    inputs = [s_name] if keep is None else [s_name, keep]
    (p_name,) = ex.emit("softmax", inputs, [probs], attrs, params, suffix=f"{suffix}_probs")
    ex.emit(
        "matmul",
        [p_name, ex.name_of(v)],
        [result],
        {
            "multiplier": int(m_o.reshape(-1)[0]),
            "shift": int(k_o.reshape(-1)[0]),
            "dtype": _dtype(result),
            "rounding": _rounding(m),
        },
        suffix=suffix,
    )
    return probs


def _rule_sdpa(ex: _Exporter, m: attention.ScaledDotProductAttention, args, kwargs, result):
    q, k, v = args[:3]
    options = attention.sdpa_arguments(args[3:], kwargs)
    scale = attention.sdpa_scale(options, q.shape[-1])
    m_s, k_s, soft, m_o, k_o = m.plan(q, k, v, scale)
    causal = bool(options["is_causal"])
    mask = options["attn_mask"]
    keep = None if mask is None else graph_keep(ex, mask, "attn_mask")
    if mask is not None and keep is None:  # a constant: the keep-mask (with is_causal) as a param
        constant = attention.sdpa_keep(m.name, mask, causal, q.shape[-2], k.shape[-2], q.device)
        causal = _keep_of(ex, constant, [(mask, "attn_mask", mask.dim() == q.dim())])
    _emit_attention_core(
        ex,
        m,
        q,
        k,
        v,
        ((m_s, k_s), (m_o, k_o)),
        soft,
        causal,
        result,
        m.inner_dtype,
        scale,
        keep=keep,
    )


def _emit_linear(ex, m, x, weight, weight_scale, bias, mult, shift, result, suffix: str) -> str:
    params = {
        "weight": _np(weight, np.int8),
        "weight_scale": _np(weight_scale, np.float32).reshape(-1),
        "multiplier": _np(mult, np.int32),
        "shift": _np(shift, np.int32),
    }
    if bias is not None:
        params["bias"] = _np(bias, np.int32)
    attrs = {
        "out_dtype": _dtype(result),
        "rounding": _rounding(m),
        "lo": None,
        "hi": None,
        "float_max": None,
        "activation": None,
    }
    (name,) = ex.emit("linear", [ex.name_of(x)], [result], attrs, params, suffix=suffix)
    return name


def _rule_mha(ex: _Exporter, m: attention.MultiheadAttention, args, kwargs, result) -> None:
    query, key, value = args[:3]
    if not m.batch_first:
        raise ex.error("nn.MultiheadAttention is exported with batch_first=True only")
    plan = m.plan(query, key, value)
    e, h = m.embed_dim, m.num_heads
    options = attention.mha_arguments(args[3:], kwargs)
    padding, attn_mask = options["key_padding_mask"], options["attn_mask"]
    keep = attention.mha_keep(m.name, padding, attn_mask, query.shape[0], h)
    if keep is not None:
        batched_attn = attn_mask is not None and attn_mask.dim() == 3  # [B * H, L, S]
        masks = [(padding, "key_padding_mask", True), (attn_mask, "attn_mask", batched_attn)]
        keep = _keep_of(ex, keep, masks)
    heads = []
    for x, name, (w, b, mult, shift) in zip((query, key, value), "qkv", plan["proj"]):
        scale = getattr(m, f"{name}_scale")
        proj = _placeholder(x.shape, scale, m.proj_dtype)
        _emit_linear(ex, m, x, w, _part_scale(m, name), b, mult, shift, proj, f"_{name}_proj")
        split = _placeholder([x.shape[0], x.shape[1], h, e // h], scale, m.proj_dtype)
        ex.emit(
            "reshape",
            [ex.name_of(proj)],
            [split],
            {"shape": [0, x.shape[1], h, e // h]},
            suffix=f"_{name}_split",
        )
        head = _placeholder([x.shape[0], h, x.shape[1], e // h], scale, m.proj_dtype)
        ex.emit(
            "transpose",
            [ex.name_of(split)],
            [head],
            {"perm": [0, 2, 1, 3]},
            suffix=f"_{name}_heads",
        )
        heads.append(head)
    q, k, v = heads
    ctx = _placeholder(q.shape, m.context_scale, m.proj_dtype)
    probs = _emit_attention_core(
        ex,
        m,
        q,
        k,
        v,
        (plan["scores"], plan["context"]),
        plan["softmax"],
        False if keep is None else keep,
        ctx,
        m.inner_dtype,
        1.0 / math.sqrt(e // h),
        suffix="_attention",
    )
    merged_t = _placeholder([q.shape[0], q.shape[2], h, e // h], m.context_scale, m.proj_dtype)
    ex.emit("transpose", [ex.name_of(ctx)], [merged_t], {"perm": [0, 2, 1, 3]}, suffix="_merge_t")
    merged = _placeholder([q.shape[0], q.shape[2], e], m.context_scale, m.proj_dtype)
    ex.emit(
        "reshape", [ex.name_of(merged_t)], [merged], {"shape": [0, q.shape[2], e]}, suffix="_merge"
    )
    out, weights = result
    w, b, mult, shift = plan["out"]
    _emit_linear(ex, m, merged, w, m.out_weight_scale, b, mult, shift, out, "")
    if weights is None:
        return
    source = ex.name_of(probs)
    if weights.dim() == 3:  # the mean over heads: an exact sum, then s_p / (H s_y)
        sums = torch.zeros((probs.shape[0], 1, *probs.shape[2:]), dtype=torch.int64)
        (source,) = ex.emit(
            "axis_matmul",
            [source],
            [sums],
            {"axes": [1]},
            {"matrix_0": np.ones((h, 1), np.int32)},
            suffix="_weights_sum",
        )
        flat = torch.zeros(tuple(weights.shape), dtype=torch.int64)
        (source,) = ex.emit(
            "reshape", [source], [flat], {"shape": [0, *weights.shape[1:]]}, suffix="_weights_flat"
        )
        mult, shift = plan["weights_mean"]
    else:
        mult, shift = plan["weights"]
    _emit_requantize(ex, source, weights, m, mult, shift, suffix="_weights")


def _part_scale(m: attention.MultiheadAttention, name: str) -> Tensor:
    e = m.embed_dim
    i = "qkv".index(name)
    return m.in_weight_scale[i * e : (i + 1) * e]


#: integer module class -> export rule ``(exporter, module, args, kwargs, result)``
RULES: dict[type, Callable[..., None]] = {
    qstubs.Quantize: _rule_quantize,
    qstubs.DeQuantize: _rule_dequantize,
    pooling.AvgPool: _rule_avg_pool,
    pooling.AdaptiveAvgPool: _rule_adaptive_avg_pool,
    pooling.Mean: _rule_mean,
    pooling.Sum: _rule_sum,
    interpolate.Interpolate: _rule_interpolate,
    grid_sample.GridSample: _rule_grid_sample,
    attention.ScaledDotProductAttention: _rule_sdpa,
    attention.MultiheadAttention: _rule_mha,
}
