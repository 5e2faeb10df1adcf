"""The numpy kernels of the float ops of the integer graph (``docs/integer_graph.md``, 2,
"Float regions"): convolution, linear, matmul, normalization, activations, softmax, pooling,
resampling and reductions of float32 tensors that are not quantized (a float region between a
``dequantize`` and a ``quantize``, or float post-processing after the last ``dequantize``).

Every kernel follows torch's definition of the op and computes it in float64 from its float32
inputs, rounding its result to float32 once: the result is the float32 value of the exact
operation (up to float64 rounding), where torch's float32 kernels accumulate in float32 in an
order of their own. The two therefore differ by torch's rounding error, which
``docs/integer_graph.md`` states and the tests measure.

This module imports numpy and the standard library only (no torch), like ``runtime``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

try:  # package import (fxq.export.runtime_float)
    from .runtime import _pool_windows as pool_windows
    from .runtime import adaptive_windows, max_pool_windows
except ImportError:  # pragma: no cover - loaded as a standalone file
    from runtime import _pool_windows as pool_windows  # type: ignore[no-redef]
    from runtime import (
        adaptive_windows,  # type: ignore[no-redef]
        max_pool_windows,  # type: ignore[no-redef]
    )

__all__ = [
    "FLOAT_KERNELS",
    "FLOAT_OPS",
    "UNARY_FNS",
    "REDUCE_FNS",
    "POOL_FNS",
    "INTERPOLATE_MODES",
    "avg_pool_matrices",
    "pool_windows",
    "adaptive_windows",
]


def _f64(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _out(y: np.ndarray) -> list[np.ndarray]:
    with np.errstate(over="ignore", invalid="ignore"):
        return [np.asarray(y).astype(np.float32)]


def _channel(v: np.ndarray, ndim: int, axis: int = 1) -> np.ndarray:
    shape = [1] * ndim
    shape[axis] = -1
    return _f64(v).reshape(shape)


# -- convolution, linear, matmul ------------------------------------------------------------------
def _k_float_conv(node, inputs):
    """``torch.nn.functional.conv{1,2,3}d``: zero padding ``pads`` (``[before, after]`` per
    spatial axis), ``stride``, ``dilation``, ``groups``; weight ``[O, C / groups, *k]``."""
    a, p = node.attrs, node.params
    w = _f64(p["weight"])
    d, g = a["dim"], a["groups"]
    x = np.pad(_f64(inputs[0]), [(0, 0), (0, 0), *[tuple(pp) for pp in a["pads"]]])
    n, c = x.shape[:2]
    o, k = w.shape[0], w.shape[2:]
    stride, dilation = a["stride"], a["dilation"]
    out = [(x.shape[2 + i] - dilation[i] * (k[i] - 1) - 1) // stride[i] + 1 for i in range(d)]
    xg = x.reshape(n, g, c // g, *x.shape[2:])
    wg = w.reshape(g, o // g, c // g, *k)
    letters = "hijl"[:d]
    spec = f"ngc{letters},gpc->ngp{letters}"
    acc = np.zeros((n, g, o // g, *out))
    for offs in np.ndindex(*k):
        sel = (slice(None),) * 3 + tuple(
            slice(offs[i] * dilation[i], offs[i] * dilation[i] + (out[i] - 1) * stride[i] + 1,
                  stride[i])
            for i in range(d)
        )  # fmt: skip
        acc += np.einsum(spec, xg[sel], wg[(slice(None),) * 3 + offs], optimize=True)
    acc = acc.reshape(n, o, *out)
    if "bias" in p:
        acc = acc + _channel(p["bias"], acc.ndim)
    return _out(acc)


def _k_float_linear(node, inputs):
    """``x @ weight.T + bias`` over the last axis."""
    p = node.params
    y = _f64(inputs[0]) @ _f64(p["weight"]).T
    if "bias" in p:
        y = y + _f64(p["bias"])
    return _out(y)


def _k_float_matmul(node, inputs):
    """``torch.matmul`` (numpy's broadcasting rules are torch's)."""
    return _out(np.matmul(_f64(inputs[0]), _f64(inputs[1])))


# -- normalization ------------------------------------------------------------------------------
def _k_float_batch_norm(node, inputs):
    """Eval-mode batch norm over axis 1: ``(x - mean) / sqrt(var + eps) * weight + bias``."""
    p, x = node.params, _f64(inputs[0])
    y = (x - _channel(p["mean"], x.ndim)) / np.sqrt(_channel(p["var"], x.ndim) + node.attrs["eps"])
    if "weight" in p:
        y = y * _channel(p["weight"], x.ndim)
    if "bias" in p:
        y = y + _channel(p["bias"], x.ndim)
    return _out(y)


def _k_float_layer_norm(node, inputs):
    """Layer norm over the last ``ndim`` axes (biased variance), then ``* weight + bias``."""
    a, p, x = node.attrs, node.params, _f64(inputs[0])
    axes = tuple(range(x.ndim - a["ndim"], x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    y = (x - mean) / np.sqrt(var + a["eps"])
    if "weight" in p:
        y = y * _f64(p["weight"])
    if "bias" in p:
        y = y + _f64(p["bias"])
    return _out(y)


# -- elementwise functions ------------------------------------------------------------------------
_erf = np.frompyfunc(math.erf, 1, 1)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _hardsigmoid(x: np.ndarray) -> np.ndarray:
    return np.clip(x + 3.0, 0.0, 6.0) / 6.0


_UNARY: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "relu": lambda x: np.maximum(x, 0.0),
    "relu6": lambda x: np.clip(x, 0.0, 6.0),
    "gelu": lambda x: 0.5 * x * (1.0 + _erf(x * (1.0 / math.sqrt(2.0))).astype(np.float64)),
    "gelu_tanh": lambda x: (
        0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    ),
    "sigmoid": _sigmoid,
    "tanh": np.tanh,
    "silu": lambda x: x * _sigmoid(x),
    "hardswish": lambda x: x * _hardsigmoid(x),
    "hardsigmoid": _hardsigmoid,
    "exp": np.exp,
    "log": np.log,
    "sqrt": np.sqrt,
    "abs": np.abs,
}
#: the ``fn`` values of a ``float_unary`` node (``clamp`` takes ``lo`` / ``hi``)
UNARY_FNS = (*_UNARY, "clamp")


def _k_float_unary(node, inputs):
    """``fn(x)`` as torch defines it (``gelu``: erf form, ``gelu_tanh``: tanh approximation;
    ``clamp``: ``min(max(x, lo), hi)`` with a null bound left open; NaN stays NaN)."""
    a, x = node.attrs, _f64(inputs[0])
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        if a["fn"] == "clamp":
            lo = -np.inf if a.get("lo") is None else a["lo"]
            hi = np.inf if a.get("hi") is None else a["hi"]
            return _out(np.minimum(np.maximum(x, lo), hi))
        return _out(_UNARY[a["fn"]](x))


def _k_float_softmax(node, inputs):
    """(Log-)softmax along ``axis``: ``exp(x - max) / sum exp(x - max)``."""
    a, x = node.attrs, _f64(inputs[0])
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        u = x - x.max(axis=a["axis"], keepdims=True)
        e = np.exp(u)
        total = e.sum(axis=a["axis"], keepdims=True)
        return _out(u - np.log(total) if a["log"] else e / total)


# -- pooling ------------------------------------------------------------------------------------
def _contract(x: np.ndarray, axis: int, m: np.ndarray) -> np.ndarray:
    """``x`` contracted with ``m [n_in, n_out]`` along ``axis``."""
    return np.moveaxis(np.moveaxis(x, axis, -1) @ m, -1, axis)


def avg_pool_matrices(node: Any, shape: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per pooled axis: the 0/1 window matrix ``[n, out]`` and the divisor of each window
    (torch's ``avg_pool``: the window clipped to the padded input when ``count_include_pad``,
    else to the input)."""
    a = node.attrs
    out = []
    for i, n in enumerate(shape):
        k, s, p = a["kernel"][i], a["stride"][i], a["padding"][i]
        o = pool_windows(n, k, s, p, 1, a["ceil_mode"])
        m, div = np.zeros((n, o)), np.zeros(o)
        for j in range(o):
            start = j * s - p
            end = min(start + k, n + p)
            lo, hi = max(start, 0), min(end, n)
            m[lo:hi, j] = 1.0
            div[j] = (end - start) if a["count_include_pad"] else (hi - lo)
        out.append((m, div))
    return out


def _k_float_pool(node, inputs):
    """``max_pool`` (padding never wins; ``dilation``) or ``avg_pool`` (``count_include_pad``)
    over the trailing ``len(kernel)`` axes, torch's window count (``ceil_mode``)."""
    a, x = node.attrs, _f64(inputs[0])
    dims = len(a["kernel"])
    lead = x.ndim - dims
    if a["fn"] == "avg":
        total, div = x, np.ones(())
        for i, (m, d) in enumerate(avg_pool_matrices(node, x.shape[lead:])):
            total = _contract(total, lead + i, m)
            div = div[..., None] * d if div.ndim else d
        return _out(total / div)
    y = max_pool_windows(
        x,
        a,
        -np.inf,
        lambda y, v: np.where((v > y) | np.isnan(v), v, y),  # NaN wins, as in torch
    )
    return _out(y)


def _k_float_adaptive_pool(node, inputs):
    """Adaptive average pooling to ``output_size`` over the trailing axes (torch's windows)."""
    x = _f64(inputs[0])
    size = node.attrs["output_size"]
    lead = x.ndim - len(size)
    for i, o in enumerate(size):
        n = x.shape[lead + i]
        m = np.zeros((n, o))
        for j, (s, e) in enumerate(adaptive_windows(n, o)):
            m[s:e, j] = 1.0 / (e - s)
        x = _contract(x, lead + i, m)
    return _out(x)


# -- resampling -----------------------------------------------------------------------------------
INTERPOLATE_MODES = ("nearest", "bilinear", "linear")


def _ratio(n_in: int, n_out: int, scale_factor: float | None, align_corners: bool) -> np.float32:
    """torch's source-per-destination step (``area_pixel_compute_scale``), as float32."""
    if align_corners:
        return np.float32((n_in - 1) / (n_out - 1) if n_out > 1 else 0.0)
    if scale_factor is not None:
        return np.float32(1.0 / scale_factor)
    return np.float32(n_in / n_out)


def _nearest_index(n_in: int, n_out: int, scale_factor: float | None) -> np.ndarray:
    j = np.arange(n_out)
    if n_out == n_in:
        return j
    if n_out == 2 * n_in:
        return j >> 1
    r = _ratio(n_in, n_out, scale_factor, False)
    return np.minimum(np.floor(j.astype(np.float32) * r).astype(np.int64), n_in - 1)


def _linear_weights(
    n_in: int, n_out: int, scale_factor: float | None, align_corners: bool
) -> np.ndarray:
    """The ``[n_in, n_out]`` matrix of torch's linear interpolation along one axis
    (source coordinates in float32, as torch computes them)."""
    r = _ratio(n_in, n_out, scale_factor, align_corners)
    j = np.arange(n_out, dtype=np.float32)
    if align_corners:
        src = r * j
    else:
        src = np.maximum(r * (j + np.float32(0.5)) - np.float32(0.5), np.float32(0))
    i0 = np.minimum(src.astype(np.int64), n_in - 1)
    lam = np.clip(src - i0.astype(np.float32), 0, 1).astype(np.float64)
    i1 = i0 + (i0 < n_in - 1)
    m = np.zeros((n_in, n_out))
    np.add.at(m, (i0, np.arange(n_out)), 1.0 - lam)
    np.add.at(m, (i1, np.arange(n_out)), lam)
    return m


def _k_float_interpolate(node, inputs):
    """``F.interpolate`` of the trailing ``len(size)`` axes: ``nearest`` (torch's index
    ``floor(j * ratio)``) or ``bilinear`` / ``linear`` (``align_corners``), where
    ``ratio = 1 / scale_factor`` when one was given, else ``n_in / n_out``."""
    a, x = node.attrs, inputs[0]
    size, factors = a["size"], a["scale_factor"] or [None] * len(a["size"])
    lead = x.ndim - len(size)
    if a["mode"] == "nearest":
        for i, (o, f) in enumerate(zip(size, factors)):
            x = np.take(x, _nearest_index(x.shape[lead + i], o, f), axis=lead + i)
        return _out(x)
    y = _f64(x)
    for i, (o, f) in enumerate(zip(size, factors)):
        y = _contract(y, lead + i, _linear_weights(y.shape[lead + i], o, f, a["align_corners"]))
    return _out(y)


# -- reductions ---------------------------------------------------------------------------------
_REDUCE = {"mean": np.mean, "sum": np.sum, "amax": np.max, "amin": np.min}
#: the ``fn`` values of a ``float_reduce`` node
REDUCE_FNS = tuple(_REDUCE)
#: the ``fn`` values of a ``float_pool`` node
POOL_FNS = ("max", "avg")


def _k_float_reduce(node, inputs):
    """``mean`` / ``sum`` / ``amax`` / ``amin`` over ``axes`` (``keepdim``)."""
    a = node.attrs
    with np.errstate(invalid="ignore"):
        y = _REDUCE[a["fn"]](_f64(inputs[0]), axis=tuple(a["axes"]), keepdims=a["keepdim"])
    return _out(y)


#: op name -> kernel, for ``runtime.KERNELS``
FLOAT_KERNELS: dict[str, Callable[[Any, list[np.ndarray]], list[np.ndarray]]] = {
    "float_conv": _k_float_conv,
    "float_linear": _k_float_linear,
    "float_matmul": _k_float_matmul,
    "float_batch_norm": _k_float_batch_norm,
    "float_layer_norm": _k_float_layer_norm,
    "float_unary": _k_float_unary,
    "float_softmax": _k_float_softmax,
    "float_pool": _k_float_pool,
    "float_adaptive_pool": _k_float_adaptive_pool,
    "float_interpolate": _k_float_interpolate,
    "float_reduce": _k_float_reduce,
}
#: the float ops (format version 3)
FLOAT_OPS = frozenset(FLOAT_KERNELS)
