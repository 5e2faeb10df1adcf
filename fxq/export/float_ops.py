"""Export rules of the float ops of float regions (``docs/integer_graph.md``, 2, "Float
regions"): the part of a model that a qconfig of ``None`` keeps in float between a dequantize
and a quantize, and float post-processing after the last dequantize.

Each rule reads the float op's arguments (a float module's parameters become the node's
float32 parameters) and emits one IR node of ``fxq.export.runtime_float`` (a ``Fused`` float
chain one node per part); ``FLOAT_OP_RULES`` maps a module class, a function or a ``Tensor``
method name to its rule, called as ``rule(exporter, node, module, args, kwargs, result)``. An op
that has no rule is refused by ``to_graph`` (``ExportError`` naming the node, the op and its
source line); so is an argument a rule does not export (e.g. a weight computed in the graph, a
``padding_mode`` other than zeros), by the rule itself.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx import Node

from fxq.export.common import _Exporter, rule_in
from fxq.fused import Fused
from fxq.primitives.window import per_axis
from fxq.quantized.pooling import AVG_POOL_PARAMS

__all__ = ["FLOAT_OP_RULES", "float_op_rule"]


# -- arguments ----------------------------------------------------------------------------------
def _get(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _float_input(ex: _Exporter, v: Any) -> str:
    """The IR name of a float32 tensor operand (a constant one becomes a ``constant`` node)."""
    if not isinstance(v, Tensor) or v.dtype is not torch.float32:
        what = v.dtype if isinstance(v, Tensor) else type(v).__name__
        raise ex.error(f"float ops are exported on float32 tensors (got {what})")
    return ex.name_of(v)


def _param(ex: _Exporter, v: Any, what: str) -> np.ndarray | None:
    """A weight, bias or statistic as a float32 array (None stays None); refused when the graph
    computes it (it would be frozen at its example value)."""
    if v is None:
        return None
    if not isinstance(v, Tensor):
        raise ex.error(f"its {what} is a {type(v).__name__}, not a tensor")
    if id(v) in ex.names and id(v) not in ex.constants:
        raise ex.error(
            f"its {what} is computed in the graph (from an input); float ops are exported with "
            "constant weights only"
        )
    return v.detach().cpu().to(torch.float32).numpy().copy()


def _params(**arrays: np.ndarray | None) -> dict[str, np.ndarray]:
    return {k: v for k, v in arrays.items() if v is not None}


def _fix_batch(ex: _Exporter, name: str, axes: list[int], what: str) -> None:
    """A graph whose op computes across the batch dimension has a fixed batch size."""
    if 0 in axes and ex.batched.get(name, False):
        ex.fixed.append(f"{ex.fx_node.name}: {what} across the batch dimension")


def _emit(
    ex: _Exporter,
    op: str,
    inputs: list[str],
    out: Tensor,
    attrs: dict[str, Any],
    params: dict[str, np.ndarray] | None = None,
    suffix: str = "",
) -> str:
    batched = any(ex.batched.get(i, False) for i in inputs[:1])
    (name,) = ex.emit(op, inputs, [out], attrs, params or {}, batched=batched, suffix=suffix)
    return name


# -- convolution, linear, matmul ------------------------------------------------------------------
def _pads(ex: _Exporter, padding: Any, k: list[int], dilation: list[int]) -> list[list[int]]:
    dim = len(k)
    if padding == "valid":
        return [[0, 0]] * dim
    if padding == "same":  # torch's split: the extra element after
        total = [d * (ki - 1) for ki, d in zip(k, dilation)]
        return [[t // 2, t - t // 2] for t in total]
    if isinstance(padding, str):
        raise ex.error(f"padding {padding!r}")
    return [[p, p] for p in per_axis(padding, dim)]


def _conv(ex: _Exporter, x: Tensor, w: Any, b: Any, geometry: tuple, out: Tensor, suffix=""):
    stride, padding, dilation, groups = geometry
    weight = _param(ex, w, "weight")
    dim = weight.ndim - 2
    if x.dim() != dim + 2:
        raise ex.error(
            f"a {dim}-d float convolution of a rank-{x.dim()} input is exported with a batch "
            "dimension only ([N, C, *spatial])"
        )
    k = list(weight.shape[2:])
    dilation = per_axis(dilation, dim)
    attrs = {
        "dim": dim,
        "stride": per_axis(stride, dim),
        "dilation": dilation,
        "groups": int(groups),
        "pads": _pads(ex, padding, k, dilation),
    }
    params = _params(weight=weight, bias=_param(ex, b, "bias"))
    return _emit(ex, "float_conv", [_float_input(ex, x)], out, attrs, params, suffix)


def _module_conv(ex: _Exporter, m: nn.Module, x: Tensor, out: Tensor, suffix: str = "") -> str:
    if m.padding_mode != "zeros":
        raise ex.error(
            f"float convolution with padding_mode {m.padding_mode!r} (exported: 'zeros'); pad "
            "with F.pad first"
        )
    geometry = (m.stride, m.padding, m.dilation, m.groups)
    return _conv(ex, x, m.weight, m.bias, geometry, out, suffix)


def _linear(ex: _Exporter, x: Tensor, w: Any, b: Any, out: Tensor, suffix: str = "") -> str:
    name = _float_input(ex, x)
    if x.dim() == 1:
        _fix_batch(ex, name, [0], "a linear layer sums")
    params = _params(weight=_param(ex, w, "weight"), bias=_param(ex, b, "bias"))
    return _emit(ex, "float_linear", [name], out, {}, params, suffix)


def _rule_conv(ex: _Exporter, n: Node, module, args, kwargs, result) -> None:
    if module is not None:
        _module_conv(ex, module, args[0], result)
        return
    x, w = _get(args, kwargs, 0, "input"), _get(args, kwargs, 1, "weight")
    geometry = tuple(
        _get(args, kwargs, i, k, d)
        for i, k, d in ((3, "stride", 1), (4, "padding", 0), (5, "dilation", 1), (6, "groups", 1))
    )
    _conv(ex, x, w, _get(args, kwargs, 2, "bias"), geometry, result)


def _rule_linear(ex: _Exporter, n: Node, module, args, kwargs, result) -> None:
    if module is not None:
        _linear(ex, args[0], module.weight, module.bias, result)
        return
    x = _get(args, kwargs, 0, "input")
    _linear(ex, x, _get(args, kwargs, 1, "weight"), _get(args, kwargs, 2, "bias"), result)


def _rule_matmul(ex: _Exporter, n: Node, module, args, kwargs, result) -> None:
    a, b = _get(args, kwargs, 0, "input"), _get(args, kwargs, 1, "other")
    names = [_float_input(ex, a), _float_input(ex, b)]
    if a.dim() == 1:
        _fix_batch(ex, names[0], [0], "a matmul sums")
    if b.dim() <= 2:
        _fix_batch(ex, names[1], [0], "a matmul sums")
    ex.emit("float_matmul", names, [result], {})


# -- normalization ------------------------------------------------------------------------------
def _batch_norm(ex: _Exporter, x: Tensor, stats: tuple, eps: float, out: Tensor, suffix="") -> str:
    mean, var, w, b = stats
    if mean is None or var is None:
        raise ex.error("a batch norm without running statistics (track_running_stats=False)")
    if x.dim() < 2:
        raise ex.error(f"a batch norm of a rank-{x.dim()} input")
    params = _params(
        mean=_param(ex, mean, "running mean"),
        var=_param(ex, var, "running variance"),
        weight=_param(ex, w, "weight"),
        bias=_param(ex, b, "bias"),
    )
    return _emit(
        ex, "float_batch_norm", [_float_input(ex, x)], out, {"eps": float(eps)}, params, suffix
    )


def _module_batch_norm(ex: _Exporter, m: nn.Module, x: Tensor, out: Tensor, suffix="") -> str:
    if m.training:
        raise ex.error("a batch norm in training mode (call model.eval() before exporting)")
    stats = (m.running_mean, m.running_var, m.weight, m.bias)
    return _batch_norm(ex, x, stats, m.eps, out, suffix)


def _rule_batch_norm(ex: _Exporter, n: Node, module, args, kwargs, result) -> None:
    if module is not None:
        _module_batch_norm(ex, module, args[0], result)
        return
    if _get(args, kwargs, 5, "training", False):
        raise ex.error("F.batch_norm with training=True (batch statistics) is not exported")
    stats = tuple(
        _get(args, kwargs, i, k) for i, k in ((1, "running_mean"), (2, "running_var"))
    ) + tuple(_get(args, kwargs, i, k) for i, k in ((3, "weight"), (4, "bias")))
    _batch_norm(ex, args[0], stats, _get(args, kwargs, 7, "eps", 1e-5), result)


def _rule_layer_norm(ex: _Exporter, n: Node, module, args, kwargs, result) -> None:
    if module is not None:
        x, shape, eps = args[0], module.normalized_shape, module.eps
        w, b = module.weight, module.bias
    else:
        x, shape = _get(args, kwargs, 0, "input"), _get(args, kwargs, 1, "normalized_shape")
        w, b = _get(args, kwargs, 2, "weight"), _get(args, kwargs, 3, "bias")
        eps = _get(args, kwargs, 4, "eps", 1e-5)
    shape = [int(shape)] if isinstance(shape, int) else list(shape)
    name = _float_input(ex, x)
    _fix_batch(ex, name, list(range(x.dim() - len(shape), x.dim())), "a layer norm normalizes")
    params = _params(weight=_param(ex, w, "weight"), bias=_param(ex, b, "bias"))
    attrs = {"ndim": len(shape), "eps": float(eps)}
    _emit(ex, "float_layer_norm", [name], result, attrs, params)


# -- elementwise functions ------------------------------------------------------------------------
def _bound(ex: _Exporter, v: Any) -> float | None:
    if v is None:
        return None
    if isinstance(v, (Tensor, bool)) or not isinstance(v, (int, float)):
        raise ex.error(f"a clamp bound that is not a number ({type(v).__name__})")
    return float(np.float32(v))  # torch compares with the bound converted to float32


def _unary(ex: _Exporter, fn: str, x: Tensor, out: Tensor, suffix: str = "", lo=None, hi=None):
    attrs: dict[str, Any] = {"fn": fn}
    if fn == "clamp":
        attrs.update(lo=lo, hi=hi)
    return _emit(ex, "float_unary", [_float_input(ex, x)], out, attrs, suffix=suffix)


def _unary_rule(fn: str) -> Callable[..., None]:
    def rule(ex: _Exporter, n: Node, module, args, kwargs, result) -> None:
        _unary(ex, fn, _get(args, kwargs, 0, "input"), result)

    return rule


def _rule_gelu(ex: _Exporter, n: Node, module, args, kwargs, result) -> None:
    approximate = module.approximate if module is not None else kwargs.get("approximate", "none")
    fn = {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
    if fn is None:
        raise ex.error(f"gelu with approximate={approximate!r}")
    _unary(ex, fn, args[0], result)


def _rule_clamp(ex: _Exporter, n: Node, module, args, kwargs, result) -> None:
    if module is not None:  # nn.Hardtanh
        lo, hi = module.min_val, module.max_val
    elif n.target is F.hardtanh:
        lo, hi = _get(args, kwargs, 1, "min_val", -1.0), _get(args, kwargs, 2, "max_val", 1.0)
    else:
        lo, hi = _get(args, kwargs, 1, "min"), _get(args, kwargs, 2, "max")
    _unary(ex, "clamp", args[0], result, lo=_bound(ex, lo), hi=_bound(ex, hi))


def _rule_softmax(log: bool) -> Callable[..., None]:
    def rule(ex: _Exporter, n: Node, module, args, kwargs, result) -> None:
        x = _get(args, kwargs, 0, "input")
        dim = module.dim if module is not None else _get(args, kwargs, 1, "dim")
        dtype = None if module is not None else kwargs.get("dtype")
        if dim is None or dtype is not None:
            raise ex.error(
                "softmax without an explicit dim, or with a dtype, is not exported; write "
                "x.softmax(dim)"
            )
        name = _float_input(ex, x)
        axis = int(dim) % max(x.dim(), 1)
        _fix_batch(ex, name, [axis], "a softmax normalizes")
        _emit(ex, "float_softmax", [name], result, {"axis": axis, "log": log})

    return rule


# -- pooling and resampling -----------------------------------------------------------------------
_MAX_POOL = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
_AVG_POOL = AVG_POOL_PARAMS  # torch's avg_pool arguments, in order


def _pool_rule(fn: str, dims: int) -> Callable[..., None]:
    names = _MAX_POOL if fn == "max" else _AVG_POOL

    def rule(ex: _Exporter, n: Node, module, args, kwargs, result) -> None:
        x = args[0] if args else kwargs["input"]
        if module is not None:
            p = {k: getattr(module, k, None) for k in names}
        else:
            p = {k: _get(args, kwargs, i + 1, k) for i, k in enumerate(names)}
        if p.get("return_indices") or p.get("divisor_override") is not None:
            raise ex.error("pooling with return_indices or divisor_override is not exported")
        if x.dim() != dims + 2:
            raise ex.error(f"a {dims}-d pooling of a rank-{x.dim()} input ([N, C, *spatial])")
        k = per_axis(p["kernel_size"], dims)
        stride = p["stride"]
        attrs = {
            "fn": fn,
            "kernel": k,
            "stride": k if stride is None or stride in ([], ()) else per_axis(stride, dims),
            "padding": per_axis(p["padding"] or 0, dims),
            "dilation": per_axis(p.get("dilation") or 1, dims),
            "ceil_mode": bool(p["ceil_mode"]),
            "count_include_pad": bool(p.get("count_include_pad", True) is not False),
        }
        _emit(ex, "float_pool", [_float_input(ex, x)], result, attrs)

    return rule


def _rule_adaptive_avg(ex: _Exporter, n: Node, module, args, kwargs, result) -> None:
    x = args[0] if args else kwargs["input"]
    target = type(module) if module is not None else n.target
    dims = 2 if target in (F.adaptive_avg_pool2d, nn.AdaptiveAvgPool2d) else 1
    if x.dim() != dims + 2:
        raise ex.error(f"a {dims}-d pooling of a rank-{x.dim()} input ([N, C, *spatial])")
    attrs = {"output_size": list(result.shape[-dims:])}
    _emit(ex, "float_adaptive_pool", [_float_input(ex, x)], result, attrs)


_INTERPOLATE = ("size", "scale_factor", "mode", "align_corners", "recompute_scale_factor")


def _rule_interpolate(ex: _Exporter, n: Node, module, args, kwargs, result) -> None:
    x = args[0] if args else kwargs["input"]
    if isinstance(module, nn.UpsamplingBilinear2d):
        p = {"scale_factor": module.scale_factor, "mode": "bilinear", "align_corners": True}
    elif module is not None:
        p = {k: getattr(module, k, None) for k in _INTERPOLATE}
    else:
        p = {k: _get(args, kwargs, i + 1, k) for i, k in enumerate(_INTERPOLATE)}
        if kwargs.get("antialias"):
            raise ex.error("interpolate with antialias=True is not exported")
    mode = p.get("mode") or "nearest"
    if mode not in ("nearest", "bilinear", "linear"):
        raise ex.error(f"interpolate mode {mode!r} (exported: nearest, bilinear, linear)")
    dims = x.dim() - 2
    if not 1 <= dims <= 3 or (mode == "bilinear" and dims != 2) or (mode == "linear" and dims != 1):
        raise ex.error(f"interpolate mode {mode!r} of a rank-{x.dim()} input")
    factor = p.get("scale_factor")
    if factor is not None and not p.get("recompute_scale_factor"):
        factors = [float(f) for f in (factor if isinstance(factor, (list, tuple)) else [factor])]
        factors = factors * dims if len(factors) == 1 else factors
    else:
        factors = None  # torch's ratio is input size / output size
    attrs = {
        "mode": "nearest" if mode == "nearest" else "linear",
        "align_corners": bool(p.get("align_corners")) if mode != "nearest" else False,
        "size": list(result.shape[2:]),
        "scale_factor": factors,
    }
    _emit(ex, "float_interpolate", [_float_input(ex, x)], result, attrs)


# -- reductions, cat, stack ---------------------------------------------------------------------
def _reduce_rule(fn: str) -> Callable[..., None]:
    def rule(ex: _Exporter, n: Node, module, args, kwargs, result) -> None:
        x = _get(args, kwargs, 0, "input")
        dim = _get(args, kwargs, 1, "dim")
        keepdim = bool(_get(args, kwargs, 2, "keepdim", False))
        if kwargs.get("dtype") is not None:
            raise ex.error(f"{fn} with a dtype is not exported")
        dims = [] if dim is None else [dim] if isinstance(dim, int) else list(dim)
        axes = sorted({int(d) % max(x.dim(), 1) for d in dims}) if dims else list(range(x.dim()))
        name = _float_input(ex, x)
        _fix_batch(ex, name, axes, f"a {fn} reduces")
        _emit(ex, "float_reduce", [name], result, {"fn": fn, "axes": axes, "keepdim": keepdim})

    return rule


def _tensors(ex: _Exporter, values: Any, result: Tensor) -> list[Tensor]:
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, Tensor) for v in values):
        raise ex.error("cat / stack of something other than a list of tensors")
    if any(v.dtype != result.dtype for v in values):
        raise ex.error(
            f"cat / stack of tensors of dtypes {[str(v.dtype) for v in values]} (torch promotes "
            "them; convert them to one dtype first)"
        )
    return list(values)


def _rule_cat(ex: _Exporter, n: Node, module, args, kwargs, result) -> None:
    values = _tensors(ex, _get(args, kwargs, 0, "tensors"), result)
    axis = int(_get(args, kwargs, 1, "dim", 0)) % result.dim()
    names = [ex.name_of(v) for v in values]
    for name in names:
        _fix_batch(ex, name, [axis], "a cat joins")
    ex.emit("concat", names, [result], {"axis": axis})


def _rule_stack(ex: _Exporter, n: Node, module, args, kwargs, result) -> None:
    values = _tensors(ex, _get(args, kwargs, 0, "tensors"), result)
    axis = int(_get(args, kwargs, 1, "dim", 0)) % result.dim()
    names = []
    for i, v in enumerate(values):
        name = ex.name_of(v)
        batched = ex.batched.get(name, False)
        _fix_batch(ex, name, [axis], "a stack joins")
        shape = list(v.shape)
        shape.insert(axis, 1)
        if batched and axis > 0:
            shape[0] = 0  # the batch size of the input
        (y,) = ex.emit(
            "reshape",
            [name],
            [v.unsqueeze(axis)],
            {"shape": shape},
            batched=batched and axis > 0,
            suffix=f"_unsqueeze_{i}",
        )
        names.append(y)
    ex.emit("concat", names, [result], {"axis": axis})


# -- a float chain that fuse_fx made (a qconfig of None keeps it float) --------------------------
_CHAIN_MODULES: dict[type, Callable[..., str]] = {
    **{c: _module_conv for c in (nn.Conv1d, nn.Conv2d, nn.Conv3d)},
    nn.Linear: lambda ex, m, x, out, suffix="": _linear(ex, x, m.weight, m.bias, out, suffix),
    **{c: _module_batch_norm for c in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)},
}


def _rule_fused(ex: _Exporter, n: Node, module: Fused, args, kwargs, result) -> None:
    """``act(bn(op(x)) + residual)``: one node per part, as torch runs them."""
    x = args[0]
    residual = _get(args, kwargs, 1, "residual")
    steps: list[tuple[str, Callable[[Tensor], Tensor], Any]] = [("op", module.op, module.op)]
    if module.bn is not None:
        steps.append(("bn", module.bn, module.bn))
    if module.add:
        steps.append(("add", lambda y: y + residual, None))
    if module.activation is not None:
        act = {"relu": F.relu, "relu6": F.relu6}[module.activation]
        steps.append((module.activation, act, None))
    name = ex.name_of(x)
    value = x
    for i, (part, fn, sub) in enumerate(steps):
        last = i == len(steps) - 1
        with torch.no_grad():
            out = result if last else fn(value)
        suffix = "" if last else f"_{part}"
        if sub is not None:
            emit = _CHAIN_MODULES.get(type(sub))
            if emit is None:
                raise ex.error(f"a float {type(sub).__name__} in a fused chain is not exported")
            name = emit(ex, sub, value, out, suffix)
        elif part == "add":
            names = [name, _float_input(ex, residual)]
            (name,) = ex.emit("float", names, [out], {"fn": "add"}, suffix=suffix)
        else:
            name = _unary(ex, part, value, out, suffix)
        value = out


# -- the table ----------------------------------------------------------------------------------
_UNARY_TARGETS: dict[str, tuple[Any, ...]] = {
    "relu": (nn.ReLU, F.relu, torch.relu, "relu"),
    "relu6": (nn.ReLU6, F.relu6),
    "sigmoid": (nn.Sigmoid, torch.sigmoid, F.sigmoid, "sigmoid"),
    "tanh": (nn.Tanh, torch.tanh, F.tanh, "tanh"),
    "silu": (nn.SiLU, F.silu),
    "hardswish": (nn.Hardswish, F.hardswish),
    "hardsigmoid": (nn.Hardsigmoid, F.hardsigmoid),
    "exp": (torch.exp, "exp"),
    "log": (torch.log, "log"),
    "sqrt": (torch.sqrt, "sqrt"),
    "abs": (torch.abs, operator.abs, "abs", "__abs__"),
}

#: module class, function or ``Tensor`` method name -> export rule of a float op
FLOAT_OP_RULES: dict[Any, Callable[..., None]] = {
    **{t: _unary_rule(fn) for fn, ts in _UNARY_TARGETS.items() for t in ts},
    **{t: _rule_conv for t in (nn.Conv1d, nn.Conv2d, nn.Conv3d, F.conv1d, F.conv2d, F.conv3d)},
    **{t: _rule_linear for t in (nn.Linear, F.linear)},
    **{t: _rule_matmul for t in (operator.matmul, torch.matmul, torch.bmm, "matmul", "bmm")},
    **{t: _rule_batch_norm for t in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)},
    F.batch_norm: _rule_batch_norm,
    **{t: _rule_layer_norm for t in (nn.LayerNorm, F.layer_norm)},
    **{t: _rule_gelu for t in (nn.GELU, F.gelu)},
    **{t: _rule_clamp for t in (nn.Hardtanh, F.hardtanh, torch.clamp, torch.clip, "clamp", "clip")},
    **{t: _rule_softmax(False) for t in (nn.Softmax, F.softmax, torch.softmax, "softmax")},
    **{
        t: _rule_softmax(True)
        for t in (nn.LogSoftmax, F.log_softmax, torch.log_softmax, "log_softmax")
    },
    nn.MaxPool1d: _pool_rule("max", 1),
    nn.MaxPool2d: _pool_rule("max", 2),
    F.max_pool1d: _pool_rule("max", 1),
    F.max_pool2d: _pool_rule("max", 2),
    nn.AvgPool1d: _pool_rule("avg", 1),
    nn.AvgPool2d: _pool_rule("avg", 2),
    F.avg_pool1d: _pool_rule("avg", 1),
    F.avg_pool2d: _pool_rule("avg", 2),
    **{
        t: _rule_adaptive_avg
        for t in (
            nn.AdaptiveAvgPool1d,
            nn.AdaptiveAvgPool2d,
            F.adaptive_avg_pool1d,
            F.adaptive_avg_pool2d,
        )
    },
    **{
        t: _rule_interpolate
        for t in (F.interpolate, nn.Upsample, nn.UpsamplingBilinear2d, nn.UpsamplingNearest2d)
    },
    **{t: _reduce_rule(fn) for fn in ("mean", "sum", "amax", "amin") for t in (fn,)},
    torch.mean: _reduce_rule("mean"),
    torch.sum: _reduce_rule("sum"),
    torch.amax: _reduce_rule("amax"),
    torch.amin: _reduce_rule("amin"),
    torch.cat: _rule_cat,
    torch.concat: _rule_cat,
    torch.stack: _rule_stack,
    Fused: _rule_fused,
}


def float_op_rule(target: Any) -> Callable[..., None] | None:
    """The rule of a float op: ``target`` is a module class, a function or a ``Tensor`` method
    name (an in-place method ``x.relu_`` as its out-of-place twin); None when it has none."""
    return rule_in(FLOAT_OP_RULES, target)
