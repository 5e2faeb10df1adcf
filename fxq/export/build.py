"""``to_graph``: a converted fxq model -> ``IntegerGraph``.

The converted GraphModule runs once on the example inputs under an
``torch.fx.Interpreter``; every node is turned into IR nodes by an export
rule that reads the integer module's parameters *for the scales its inputs
actually carry* (so a graph edit that changes a scale is exported as the
model computes it). The rules:

* ``RULES``: integer module class -> rule (one per ``fxq.quantized`` class
  that the registry names);
* ``VALUE_RULES``: pass-through registry rows that compute on values (ReLU,
  max pooling);
* every other pass-through row only moves integers: its rule applies the float
  op to a tensor of source indices and exports what it finds (an alias, a
  reshape, a transpose or a gather);
* ``FLOAT_RULES``: the float ops a float region may contain (IEEE-exact
  elementwise float32 arithmetic).

A node without a rule raises ``ExportError`` naming the node, its op and its
source line.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Interpreter, Node
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxq import registry
from fxq.fx.tracer import SELF, call_wrapped_method
from fxq.march import Rounding
from fxq.qtensor import QTensor
from fxq.quantized import activation, batchnorm, elementwise, interpolate, matmul, pooling, weighted
from fxq.quantized import functional as qf
from fxq.quantized import stubs as qstubs
from fxq.quantized.base import Standalone, multiplier_for
from fxq.registry import Kind

from .graph import IntegerGraph, TensorInfo
from .graph import Node as IRNode

__all__ = ["to_graph", "ExportError", "RULES", "VALUE_RULES", "FLOAT_RULES"]


class ExportError(RuntimeError):
    """A node of the converted model cannot be exported (the message names it)."""


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


class _Exporter(Interpreter):
    """Runs the converted model and records one or more IR nodes per FX node."""

    def __init__(self, gm: GraphModule, stop_at: list[str] | None = None) -> None:
        super().__init__(gm)
        self.stop_at = stop_at  # FX node names whose values are the graph's outputs
        self.values: dict[str, Any] = {}
        self.modules = dict(gm.named_modules())
        self.nodes: list[IRNode] = []
        self.tensors: dict[str, TensorInfo] = {}
        self.names: dict[int, str] = {}
        self.batched: dict[str, bool] = {}
        self.keep: list[Any] = []  # keeps mapped objects alive (their ids stay unique)
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.batch: int | None = None
        self.fixed: list[str] = []  # why the batch dimension is not dynamic
        self.fx_node: Node | None = None

    # -- bookkeeping -------------------------------------------------------------------------
    def error(self, reason: str) -> ExportError:
        n = self.fx_node
        what = (
            registry.target_name(n.target)
            if n.op != "call_module"
            else type(self.modules[n.target]).__name__
        )
        source = n.meta.get("fxq_source", "") or "unknown source"
        return ExportError(
            f"fxq.export: cannot export node {n.name!r} ({n.op} {what}, {source}): {reason}"
        )

    def name_of(self, obj: Any) -> str:
        name = self.names.get(id(obj))
        if name is None:
            raise self.error(
                f"its input ({type(obj).__name__}) was not produced by an exported op (a value "
                "computed outside the graph, e.g. a constant tensor or an index tensor)"
            )
        return name

    def register(self, obj: Any, name: str, batched: bool) -> str:
        if isinstance(obj, QTensor):
            info = TensorInfo(_dtype(obj), list(obj.shape), float(obj.scale))
        elif isinstance(obj, Tensor):
            dtype = {torch.float32: "float32", torch.int64: "int64"}.get(obj.dtype)
            if dtype is None:
                raise self.error(f"tensors of {obj.dtype} are not exported (float32 only)")
            info = TensorInfo(dtype, list(obj.shape), None)
        else:
            raise self.error(f"cannot export a value of type {type(obj).__name__}")
        base, i = name, 1
        while name in self.tensors:
            i += 1
            name = f"{base}_{i}"
        self.tensors[name] = info
        self.batched[name] = batched and info.shape[:1] == [self.batch]
        self.names[id(obj)] = name
        self.keep.append(obj)
        return name

    def alias(self, obj: Any, name: str) -> None:
        self.names[id(obj)] = name
        self.keep.append(obj)

    def emit(
        self,
        op: str,
        inputs: list[str],
        outputs: list[Any],
        attrs: dict[str, Any] | None = None,
        params: dict[str, np.ndarray] | None = None,
        batched: bool | None = None,
        suffix: str = "",
    ) -> list[str]:
        n = self.fx_node
        if batched is None:
            batched = bool(inputs) and self.batched.get(inputs[0], False)
        names = [
            self.register(o, n.name + suffix + (f"_{i}" if len(outputs) > 1 else ""), batched)
            for i, o in enumerate(outputs)
        ]
        node_name = n.name + suffix
        existing = {x.name for x in self.nodes}
        k = 1
        while node_name in existing:
            k += 1
            node_name = f"{n.name}{suffix}_{k}"
        self.nodes.append(
            IRNode(
                node_name,
                op,
                inputs,
                names,
                attrs or {},
                params or {},
                n.meta.get("fxq_source", ""),
            )
        )
        return names

    # -- interpretation ----------------------------------------------------------------------
    def run_node(self, n: Node) -> Any:
        self.fx_node = n
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if n.op == "call_function" and n.target is call_wrapped_method:
            # the generated code passes the GraphModule where the graph says ``self``
            args = tuple(self.module if a is SELF else a for a in args)
        result = getattr(self, n.op)(n.target, args, kwargs)
        if self.stop_at is not None:
            if all(name in self.values for name in self.stop_at):
                return result  # the rest (host post-processing) is not exported
            if n.name in self.stop_at:
                self.values[n.name] = result
        if n.op == "output" and self.stop_at is not None:
            missing = [name for name in self.stop_at if name not in self.values]
            raise ExportError(f"fxq.export: no node named {missing} in the converted graph")
        if n.op == "placeholder":
            self._placeholder(n, result)
        elif n.op == "output":
            self._output(args)
        elif n.op in ("call_module", "call_function", "call_method"):
            self._call(n, args, kwargs, result)
        return result

    def _placeholder(self, n: Node, value: Any) -> None:
        if not isinstance(value, Tensor):
            return  # a Python value: baked in
        if self.batch is None:
            self.batch = value.shape[0] if value.dim() else None
        t = value.to(torch.float32) if value.is_floating_point() else value
        if t is not value:
            raise self.error("graph inputs must be float32 tensors")
        self.inputs.append(self.register(value, n.name, True))

    def _output(self, args: tuple) -> None:
        leaves, _ = tree_flatten(args[0])
        for leaf in leaves:
            if isinstance(leaf, (Tensor, QTensor)):
                self.outputs.append(self.name_of(leaf))

    def _call(self, n: Node, args: tuple, kwargs: dict, result: Any) -> None:
        module = self.modules.get(n.target) if n.op == "call_module" else None
        if module is not None:
            rule = RULES.get(type(module))
            if rule is not None:
                rule(self, module, args, kwargs, result)
                return
            if isinstance(module, Standalone):
                raise self.error(
                    "a quantized op called from opaque code (Standalone) has no graph position; "
                    "trace through the code (remove @fxq.fx_wrap) to export it"
                )
        leaves = tree_flatten((args, kwargs))[0]
        if not any(isinstance(v, (Tensor, QTensor)) for v in tree_flatten(result)[0]):
            return  # shapes and other Python values: baked into the graph
        if any(isinstance(v, QTensor) for v in leaves):
            row, _ = registry.row_for(n, self.modules)
            if row.kind is not Kind.PASSTHROUGH:
                raise self.error(
                    f"registry row {row.name!r} ({row.kind.value}) on an integer tensor has no "
                    "export rule"
                )
            rule = VALUE_RULES.get(row.name.rstrip("123d")) or VALUE_RULES.get(row.name)
            if rule is not None:
                rule(self, n, module, args, kwargs, result)
            else:
                _movement(self, n, module, args, kwargs, result)
            return
        if any(isinstance(v, Tensor) for v in leaves):
            target = type(module) if module is not None else n.target
            fn = FLOAT_RULES.get(target)
            if fn is None and isinstance(target, str):
                fn = FLOAT_RULES.get(target.rstrip("_"))
            if n.op == "call_function" and n.target is call_wrapped_method:
                raise self.error(
                    f"@fxq.fx_wrap method {n.args[1]!r} is opaque Python (host code); export the "
                    "network before it: to_graph(model, x, outputs=[<the nodes it takes>])"
                )
            if fn is None or not isinstance(result, Tensor):
                raise self.error(
                    "float op without an export rule (exported float ops: neg, add, sub, mul, "
                    "div, bit-exact in IEEE float32); keep it out of the exported part, or give "
                    "it a qconfig so that it is quantized"
                )
            _float_op(self, fn, args, kwargs, result)
        # anything else computes Python values (shapes), which are baked into the graph


# -- rules: stubs ---------------------------------------------------------------------------
def _rule_quantize(ex: _Exporter, m: qstubs.Quantize, args, kwargs, result) -> None:
    x = args[0]
    if not isinstance(x, (Tensor, QTensor)):
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


def _requantize_to(ex: _Exporter, x: QTensor, scale: Tensor, dtype, module, result, suffix=""):
    if torch.equal(x.scale, scale.to(x.scale.device)) and x.qdtype is dtype:
        ex.alias(result, ex.name_of(x))
        return
    m, s = multiplier_for(
        module, qf.scale_ratio(x.scale, scale), {"input": x.scale, "output": scale}
    )
    ex.emit(
        "requantize",
        [ex.name_of(x)],
        [result],
        {"dtype": _dtype(result), "rounding": _rounding(module), "lo": None, "hi": None},
        {"multiplier": _np(m, np.int64), "shift": _np(s, np.int64)},
        suffix=suffix,
    )


def _rule_requantize(ex, m: qstubs.Requantize, args, kwargs, result) -> None:
    _requantize_to(
        ex, args[0], m.scale, m.dtype if hasattr(m, "dtype") else result.qdtype, m, result
    )


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
def _weighted_params(m: weighted._Weighted, p) -> tuple[dict, dict]:
    params: dict[str, np.ndarray] = {
        "weight": _np(m.weight_out_major(), np.int8),
        "weight_scale": _np(m.weight_scale, np.float32).reshape(-1),
    }
    if p.bias is not None:
        params["bias"] = _np(p.bias, np.int32)
    hp = m.high_precision
    if hp:
        params["accumulator_scale"] = _np(p.accumulator_scale, np.float64)
    else:
        params["multiplier"] = _np(p.multiplier, np.int32)
        params["shift"] = _np(p.shift, np.int32)
    if m.add:
        params["residual_multiplier"] = _np(p.residual_multiplier, np.int32)
        params["residual_shift"] = _np(p.residual_shift, np.int32)
    lo, hi = m.lo, m.hi
    attrs = {
        "out_dtype": "float32" if hp else m.out_dtype_name[1:],
        "rounding": _rounding(m),
        "lo": lo,
        "hi": hi,
        "float_max": 6.0 if hp and m.activation == "relu6" else None,
        "activation": m.activation,
    }
    return params, attrs


def _rule_conv(ex: _Exporter, m: weighted._Conv, args, kwargs, result) -> None:
    x = args[0]
    residual = args[1] if len(args) > 1 else kwargs.get("residual")
    if x.dim() != m._DIM + 2:
        raise ex.error("unbatched convolution inputs are not exported; add a batch dimension")
    p = m.requantization(x, residual)
    params, attrs = _weighted_params(m, p)
    d = m._DIM
    k = list(m.weight.shape[2:])
    attrs.update(
        dim=d,
        transposed=m._TRANSPOSED,
        stride=_ints(m.stride, d),
        dilation=_ints(m.dilation, d),
        groups=int(m.groups),
        pad_mode="zeros",
    )
    if m._TRANSPOSED:
        attrs.update(padding=_ints(m.padding, d), output_padding=_ints(m.output_padding, d))
    elif m.padding_mode != "zeros":
        rp = list(m.reversed_padding)
        attrs["pads"] = [[rp[2 * i], rp[2 * i + 1]] for i in range(d)][::-1]
        attrs["pad_mode"] = m.padding_mode
    elif isinstance(m.padding, str):
        if m.padding == "valid":
            attrs["pads"] = [[0, 0]] * d
        else:  # "same": torch puts the odd pixel on the right
            total = [di * (ki - 1) for di, ki in zip(attrs["dilation"], k)]
            attrs["pads"] = [[t // 2, t - t // 2] for t in total]
    else:
        attrs["pads"] = [[v, v] for v in _ints(m.padding, d)]
    inputs = [ex.name_of(x)] + ([ex.name_of(residual)] if m.add else [])
    ex.emit("conv", inputs, [result], attrs, params)


def _rule_linear(ex: _Exporter, m: weighted.Linear, args, kwargs, result) -> None:
    x = args[0]
    residual = args[1] if len(args) > 1 else kwargs.get("residual")
    p = m.requantization(x, residual)
    params, attrs = _weighted_params(m, p)
    inputs = [ex.name_of(x)] + ([ex.name_of(residual)] if m.add else [])
    ex.emit("linear", inputs, [result], attrs, params)


def _rule_batchnorm(ex: _Exporter, m: batchnorm.BatchNorm, args, kwargs, result) -> None:
    x = args[0]
    if torch.equal(x.scale, m.input_scale.to(x.scale.device)):
        bias, mult, shift = m.bias, m.multiplier, m.shift
    else:
        bias, mult, shift = m._derive(x.scale)
    ex.emit(
        "channel_affine",
        [ex.name_of(x)],
        [result],
        {"out_dtype": _dtype(result), "rounding": _rounding(m), "lo": m.lo, "hi": m.hi},
        {
            "weight": _np(m.weight, np.int8),
            "weight_scale": _np(m.weight_scale, np.float32).reshape(-1),
            "bias": _np(bias, np.int32),
            "multiplier": _np(mult, np.int32),
            "shift": _np(shift, np.int32),
        },
    )


# -- rules: elementwise ---------------------------------------------------------------------
def _rule_add(ex: _Exporter, m: elementwise.Add, args, kwargs, result) -> None:
    a, b, alpha = elementwise._operands(args, kwargs)
    tensors, factors, scalars = [], [], 0.0
    for value, factor in ((a, 1.0), (b, m._SIGN * alpha)):
        if isinstance(value, QTensor):
            tensors.append(value)
            factors.append(factor)
        else:
            scalars += float(value) * factor
    ms, n, constant = m._derive([t.scale for t in tensors], factors, scalars)
    ex.emit(
        "add",
        [ex.name_of(t) for t in tensors],
        [result],
        {
            "multipliers": [int(v) for v in ms],
            "shift": int(n.reshape(-1)[0]),
            "constant": None if constant is None else int(constant.reshape(-1)[0]),
            "factors": [float(f) for f in factors],
            "scalar": float(scalars),
            "dtype": _dtype(result),
            "rounding": _rounding(m),
        },
    )


def _rule_mul(ex: _Exporter, m: elementwise.Mul, args, kwargs, result) -> None:
    a, b, _ = elementwise._operands(args, kwargs)
    if isinstance(a, QTensor) and isinstance(b, QTensor):
        mult, s = m._derive([a.scale, b.scale], 1.0)
        inputs, sign, c = [ex.name_of(a), ex.name_of(b)], None, None
    else:
        q, c = (a, b) if isinstance(a, QTensor) else (b, a)
        c = float(c)
        mult, s = m._derive([q.scale], abs(c))
        inputs, sign = [ex.name_of(q)], -1 if c < 0 else 1
    ex.emit(
        "mul",
        inputs,
        [result],
        {
            "multiplier": int(mult.reshape(-1)[0]),
            "shift": int(s.reshape(-1)[0]),
            "sign": sign,
            "scalar": c,
            "dtype": _dtype(result),
            "rounding": _rounding(m),
        },
    )


def _rule_cat(ex: _Exporter, m: elementwise.Cat, args, kwargs, result) -> None:
    tensors = args[0] if args else kwargs["tensors"]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    names = []
    for i, t in enumerate(tensors):
        if torch.equal(t.scale, m.output_scale.to(t.scale.device)) and t.qdtype is m.out_dtype:
            names.append(ex.name_of(t))
            continue
        mult, s = m._derive(t.scale)
        tmp = QTensor(torch.zeros(t.shape, dtype=torch.float32), m.output_scale, m.out_dtype)
        names += ex.emit(
            "requantize",
            [ex.name_of(t)],
            [tmp],
            {"dtype": _dtype(tmp), "rounding": _rounding(m), "lo": None, "hi": None},
            {"multiplier": _np(mult, np.int64), "shift": _np(s, np.int64)},
            suffix=f"_requant{i}",
        )
    ex.emit("concat", names, [result], {"axis": int(dim) % result.dim()})


def _rule_matmul(ex: _Exporter, m: matmul.MatMul, args, kwargs, result) -> None:
    a, b = args[0], args[1]
    _, mult, s = m._derive(a, b, a.shape[-1])
    ex.emit(
        "matmul",
        [ex.name_of(a), ex.name_of(b)],
        [result],
        {
            "multiplier": int(mult.reshape(-1)[0]),
            "shift": int(s.reshape(-1)[0]),
            "dtype": _dtype(result),
            "rounding": _rounding(m),
        },
    )


# -- rules: clamps and tables ---------------------------------------------------------------
def _rule_clamp(ex: _Exporter, m: activation.Clamp, args, kwargs, result) -> None:
    x, rest = args[0], args[1:]
    kwargs = {k: v for k, v in kwargs.items() if k != "inplace"}
    if rest and isinstance(rest[-1], bool):
        rest = rest[:-1]
    lo, hi = activation._clamp_bounds(m.op, m.fn, rest, kwargs)
    mult, s, q_lo, q_hi = m._derive(x.scale, lo, hi)
    ex.emit(
        "requantize",
        [ex.name_of(x)],
        [result],
        {"dtype": _dtype(result), "rounding": _rounding(m), "lo": q_lo, "hi": q_hi},
        {"multiplier": _np(mult, np.int64), "shift": _np(s, np.int64)},
    )


def _rule_lut(ex: _Exporter, m: activation.LookupTable, args, kwargs, result) -> None:
    x = args[0]
    rest = tuple(a for a in args[1:] if not isinstance(a, bool))
    table = m.table(x, rest, kwargs)
    fn = _function(m, rest, kwargs)
    if x.qdtype.bits == 8:
        ex.emit(
            "lut",
            [ex.name_of(x)],
            [result],
            {"dtype": _dtype(result), **fn},
            {"table": _np(table)},
        )
        return
    ex.emit(
        "segment_lut",
        [ex.name_of(x)],
        [result],
        {
            "dense_bits": int(table.dense_bits),
            "sparse_bits": qf.SegmentLUT.SPARSE_BITS,
            "dtype": _dtype(result),
            **fn,
            "rounding": _rounding(m),
        },
        {"dense": _np(table.dense, np.int64), "sparse": _np(table.sparse, np.int64)},
    )


_FUNCTION_ATTRS = {
    "leaky_relu": ("negative_slope",),
    "elu": ("alpha",),
    "softplus": ("beta", "threshold"),
    "gelu": ("approximate",),
}


def _function(m: activation.LookupTable, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The float function a table tabulates: its registry name and constant arguments
    (informational, and what the QDQ form computes in float)."""
    op = m.op
    row = registry.row_for_module(type(op)) if op is not None else None
    name = row.name if row is not None else registry.canonical_key(m.fn)
    if not isinstance(name, str):
        name = getattr(m.fn, "__name__", "unknown")
    values: dict[str, Any] = {}
    if op is not None:
        values = {k: getattr(op, k) for k in _FUNCTION_ATTRS.get(name, ()) if hasattr(op, k)}
    else:
        values = dict(zip(_FUNCTION_ATTRS.get(name, ()), args))
        values.update({k: v for k, v in kwargs.items() if k != "inplace"})
    values = {k: v for k, v in values.items() if isinstance(v, (int, float, str))}
    return {"function": name, "function_args": values}


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
    ex.emit(
        "requantize",
        [name],
        [result],
        {"dtype": _dtype(result), "rounding": _rounding(m), "lo": None, "hi": None},
        {"multiplier": _np(mult[inverse], np.int64), "shift": _np(shift[inverse], np.int64)}
        if distinct.numel() > 1
        else {"multiplier": _np(mult, np.int64), "shift": _np(shift, np.int64)},
    )


def _window_matrix(n: int, o: int, windows: list[tuple[int, int]]) -> np.ndarray:
    a = np.zeros((n, o), dtype=np.int64)
    for j, (s, e) in enumerate(windows):
        a[max(s, 0) : min(e, n), j] = 1
    return a


def _rule_avg_pool(ex: _Exporter, m: pooling.AvgPool, args, kwargs, result) -> None:
    x = args[0]
    params = m._arguments(args[1:], kwargs)
    dims = pooling._pool_dims(m, pooling._AVG, pooling._AVG_MODULES) or x.dim() - 2
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
    fn = pooling._AVG[dims]
    shaped = dict(params)
    ones = torch.ones((1, 1, *in_sizes), dtype=torch.float64)
    if dims == 1:
        fn = pooling._AVG[2]
        ones = ones.unsqueeze(2)
        shaped = {
            kk: (pooling._as_2d(v) if kk in ("kernel_size", "stride", "padding") else v)
            for kk, v in params.items()
        }
        if shaped["padding"] is not None:
            shaped["padding"] = (0, shaped["padding"][1])
    counts = torch.round(fn(ones, **dict(shaped, divisor_override=1)) / fn(ones, **shaped))
    counts = counts.reshape(out_sizes)
    _sum_then_requant(ex, m, x, result, axes, mats, counts)


def _rule_adaptive_avg_pool(ex: _Exporter, m: pooling.AdaptiveAvgPool, args, kwargs, result):
    x = args[0]
    dims = pooling._pool_dims(m, pooling._ADAPTIVE, pooling._ADAPTIVE_MODULES) or x.dim() - 2
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
    dims = sorted(pooling._reduce_dims(x, dim))
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
    p = m._arguments(args[1:], kwargs)
    dims = x.dim() - 2
    in_sizes = list(x.shape[2:])
    sf = p["scale_factor"]
    sfs = (
        [sf] * dims
        if isinstance(sf, (int, float))
        else (list(sf) if sf is not None else [None] * dims)
    )
    if p["size"] is not None:
        scales = [None] * dims
    else:
        scales = [None if p["recompute_scale_factor"] else float(f) for f in sfs]
    out_sizes = list(result.shape[2:])
    mats = []
    one = 1 << qf.INTERP_FRACTION_BITS
    for n, o, s in zip(in_sizes, out_sizes, scales):
        i0, i1, w1 = qf.linear_weights(n, o, s, bool(p["align_corners"]), "cpu")
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
    mult, s = m._derive(x.scale, dims)
    ex.emit(
        "requantize",
        [name],
        [result],
        {"dtype": _dtype(result), "rounding": _rounding(m), "lo": None, "hi": None},
        {"multiplier": _np(mult, np.int64), "shift": _np(s, np.int64)},
    )


#: integer module class -> export rule ``(exporter, module, args, kwargs, result)``
RULES: dict[type, Callable[..., None]] = {
    qstubs.Quantize: _rule_quantize,
    qstubs.Requantize: _rule_requantize,
    qstubs.DeQuantize: _rule_dequantize,
    batchnorm.BatchNorm: _rule_batchnorm,
    weighted.Linear: _rule_linear,
    elementwise.Add: _rule_add,
    elementwise.Sub: _rule_add,
    elementwise.Mul: _rule_mul,
    elementwise.Cat: _rule_cat,
    matmul.MatMul: _rule_matmul,
    activation.Clamp: _rule_clamp,
    activation.LookupTable: _rule_lut,
    pooling.AvgPool: _rule_avg_pool,
    pooling.AdaptiveAvgPool: _rule_adaptive_avg_pool,
    pooling.Mean: _rule_mean,
    pooling.Sum: _rule_sum,
    interpolate.Interpolate: _rule_interpolate,
}
for _cls in (
    weighted.Conv1d,
    weighted.Conv2d,
    weighted.Conv3d,
    weighted.ConvTranspose1d,
    weighted.ConvTranspose2d,
    weighted.ConvTranspose3d,
):
    RULES[_cls] = _rule_conv


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
    k = _ints(p["kernel_size"], dims)
    stride = p.get("stride")
    values = result[0] if isinstance(result, tuple) else result
    ex.emit(
        "max_pool",
        [ex.name_of(x)],
        [values],
        {
            "kernel": k,
            "stride": k if stride is None or stride == [] or stride == () else _ints(stride, dims),
            "padding": _ints(p.get("padding", 0), dims),
            "dilation": _ints(p.get("dilation", 1), dims),
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


#: pass-through registry rows (name without the 1d/2d/3d) whose QTensor op computes on values
VALUE_RULES: dict[str, Callable[..., None]] = {
    "relu": _rule_relu,
    "max_pool": _rule_max_pool,
    "adaptive_max_pool": _rule_adaptive_max_pool,
}


# -- pass-through rows that move integers ------------------------------------------------------
def _call_float(ex: _Exporter, n: Node, module, args, kwargs) -> Any:
    if n.op == "call_module":
        return module(*args, **kwargs)
    if n.op == "call_function":
        return n.target(*args, **kwargs)
    return getattr(args[0], n.target)(*args[1:], **kwargs)


def _movement(ex: _Exporter, n: Node, module, args, kwargs, result) -> None:
    """Export an op that only moves integers by running it on source indices."""
    leaves, spec = tree_flatten((args, kwargs))
    pos = next(i for i, v in enumerate(leaves) if isinstance(v, QTensor))
    src = leaves[pos]
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
    outputs = [(r, o) for r, o in zip(res_leaves, moved_leaves) if isinstance(r, QTensor)]
    for j, (r, o) in enumerate(outputs):
        if id(r) in ex.names:
            continue
        suffix = "" if len(outputs) == 1 else f"_{j}"
        _emit_movement(ex, n, in_name, src, r, o.to(torch.float64) - 1, suffix)


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
    if name not in ("permute", "transpose", "t", "movedim", "swapaxes"):
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
    if kwargs:
        raise ex.error("float ops with keyword arguments are not exported")
    if result.dtype is not torch.float32:
        raise ex.error(f"float ops are exported in float32 only (got {result.dtype})")
    tensors = [a for a in args if isinstance(a, Tensor)]
    scalars = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
    if len(tensors) + len(scalars) != len(args):
        raise ex.error("float op arguments must be tensors or numbers")
    attrs: dict[str, Any] = {"fn": fn}
    if scalars:
        attrs["scalar"] = float(scalars[0])
        attrs["scalar_first"] = not isinstance(args[0], Tensor)
        if float(np.float32(scalars[0])) != float(scalars[0]):
            raise ex.error(f"the scalar {scalars[0]} is not a float32 number (torch rounds it)")
    ex.emit("float", [ex.name_of(t) for t in tensors], [result], attrs)


# -- entry point ---------------------------------------------------------------------------------
def to_graph(
    quantized: GraphModule,
    example_inputs: tuple | Tensor,
    outputs: list[str | Node] | None = None,
) -> IntegerGraph:
    """Export a converted fxq model to an ``IntegerGraph``.

    The model runs once on ``example_inputs`` (on the CPU); every node becomes
    IR nodes whose parameters are what the integer modules computed with.
    Dimension 0 of the inputs is the symbolic batch dimension (use a batch of
    2 or more so that it is told apart from other dimensions).

    Args:
        quantized: the model returned by ``fxq.convert_fx`` (float32, eval mode).
        example_inputs: a tensor or a tuple of tensors.
        outputs: FX nodes (or their names) of ``quantized.graph`` whose values are the
            graph's outputs, in this order; what comes after them is not exported
            (e.g. a detector's ``@fxq.fx_wrap`` post-processing, which runs on the host).
            None: the model's own outputs.

    Returns:
        the ``IntegerGraph``; ``graph.run(*numpy_inputs)`` equals
        ``quantized(*example_inputs)`` bit for bit.

    Raises:
        TypeError: ``quantized`` is not a GraphModule.
        ExportError: a node has no export rule (naming the node, its op and source line),
            or a name in ``outputs`` is not a node of the graph.
    """
    if not isinstance(quantized, GraphModule):
        raise TypeError(
            f"fxq.export.to_graph expects the GraphModule returned by fxq.convert_fx, got "
            f"{type(quantized).__name__}"
        )
    if isinstance(example_inputs, Tensor):
        example_inputs = (example_inputs,)
    march = {m.march for m in quantized.modules() if hasattr(m, "march")}
    if len(march) > 1:
        raise ExportError(f"fxq.export: the model mixes marches {sorted(map(str, march))}")
    names = None if outputs is None else [n if isinstance(n, str) else n.name for n in outputs]
    known = {n.name for n in quantized.graph.nodes}
    unknown = [n for n in names or [] if n not in known]
    if unknown:
        raise ExportError(f"fxq.export: no node named {unknown} in the converted graph")
    ex = _Exporter(quantized, names)
    with torch.no_grad():
        ex.run(*[t.detach().cpu() if isinstance(t, Tensor) else t for t in example_inputs])
    if names is not None:
        for name in names:
            ex.fx_node = next(n for n in quantized.graph.nodes if n.name == name)
            ex._output((ex.values[name],))
    dynamic = not ex.fixed
    tensors = ex.tensors
    if dynamic:
        for name, info in tensors.items():
            if ex.batched.get(name):
                info.shape = ["N", *info.shape[1:]]
    march_name = getattr(next(iter(march)), "value", str(next(iter(march)))) if march else ""
    return IntegerGraph(ex.nodes, tensors, ex.inputs, ex.outputs, march_name, dynamic)
