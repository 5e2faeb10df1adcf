"""The numpy reference kernels of the integer graph (``docs/integer_graph.md``).

``kernel(op)`` finds an op's kernel: a primitive's (defined beside its torch kernel in
``fxq.primitives``), else ``KERNELS`` (the ops still defined here).

This module imports numpy, the standard library and the numpy side of
``fxq.primitives``: no torch. Every kernel computes in exact integer arithmetic: int64 values,
explicit rounding shifts and saturation; float64 matrix products are used
only where every partial sum is an integer below ``2**53`` (so every float
operation is exact whatever the summation order), which the kernels check.

A kernel is ``kernel(node, inputs) -> outputs``: ``node`` is the graph node
(``op``, ``attrs``, ``params``), ``inputs`` the numpy arrays of its inputs,
the result a list of arrays, one per output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fxq.primitives import PRIMITIVES
from fxq.primitives.arith import DTYPES, quantize, shift_round
from fxq.primitives.window import adaptive_windows

__all__ = [
    "KERNELS",
    "kernel",
    "shift_round",
    "quantize",
    "DTYPES",
    "FLOAT_FNS",
    "COMPARE_FNS",
    "LOGICAL_FNS",
    "PLAIN_DTYPES",
]

#: dtypes of the tensors that are not quantized values: graph inputs (token ids, masks), casts,
#: comparisons and the arithmetic of a float or integer region (``docs/integer_graph.md``, 2)
PLAIN_DTYPES = ("bool", "int32", "int64", "float32")


# -- clamps ----------------------------------------------------------------------------------
def _k_clip(node, inputs):
    a = node.attrs
    x = inputs[0]
    return [np.clip(x, a["lo"], a["hi"]).astype(x.dtype)]


def _k_float(node, inputs):
    """Elementwise arithmetic in ``dtype`` (float32 when absent, or an integer dtype): every
    operand is first converted to ``dtype`` (as torch converts to the result dtype), then one
    IEEE float32 operation (or exact int64/int32 arithmetic, wrapping as torch does)."""
    a = node.attrs
    fn, dt = a["fn"], DTYPES[a.get("dtype") or "float32"]
    xs = [np.asarray(x).astype(dt) for x in inputs]
    if a.get("scalar") is not None:
        s = dt(a["scalar"])
        xs = [xs[0], s] if not a.get("scalar_first") else [s, xs[0]]
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        if fn == "neg":
            return [np.negative(xs[0]).astype(dt)]
        return [_FLOAT_BINARY[fn](xs[0], xs[1]).astype(dt)]


_FLOAT_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}
#: the ``fn`` values a ``float`` node may have
FLOAT_FNS = ("neg", *_FLOAT_BINARY)


# -- plain tensors: constants, casts, comparisons, logical ops ----------------------------------
def _k_constant(node, inputs):
    """The ``value`` parameter; with ``dynamic`` (``[axis, input, input_axis]`` entries), cut
    along ``axis`` to that input's size; with ``batch``, its one row repeated along axis 0 to
    the batch size of the input (``N`` of a dynamic-batch graph)."""
    value = node.params["value"]
    for axis, i, in_axis in node.attrs.get("dynamic") or ():
        size = inputs[i].shape[in_axis]
        if size > value.shape[axis]:
            raise ValueError(
                f"a size of {size} along axis {axis}; the constant holds {value.shape[axis]} "
                "(the dimension's declared max)"
            )
        value = value[(slice(None),) * axis + (slice(0, size),)]
    if node.attrs["batch"]:
        value = np.broadcast_to(value, (inputs[0].shape[0], *value.shape[1:]))
    return [np.array(value)]


def cast(x: np.ndarray, dtype: str) -> np.ndarray:
    """torch's ``x.to(dtype)``: to ``bool`` ``x != 0``; float to integer truncates toward zero
    (NaN and values outside the integer range are undefined, in torch and in ONNX); integer to
    float32 rounds to nearest even."""
    x = np.asarray(x)
    if dtype == "bool":
        return x != 0
    with np.errstate(invalid="ignore"):
        return x.astype(DTYPES[dtype])


def _k_cast(node, inputs):
    return [cast(inputs[0], node.attrs["dtype"])]


_COMPARE = {
    "eq": np.equal,
    "ne": np.not_equal,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
}
#: the ``fn`` values a ``compare`` node may have
COMPARE_FNS = tuple(_COMPARE)


def _k_compare(node, inputs):
    """``a <fn> b`` with both operands first converted to ``compute_dtype`` (torch's common
    dtype of the two), a ``scalar`` standing for a missing operand."""
    a = node.attrs
    dt = a["compute_dtype"]
    xs = [cast(x, dt) for x in inputs]
    if a.get("scalar") is not None:
        s = cast(np.asarray(a["scalar"]), dt)
        xs = [s, xs[0]] if a.get("scalar_first") else [xs[0], s]
    return [_COMPARE[a["fn"]](xs[0], xs[1])]


_LOGICAL = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}
#: the ``fn`` values a ``logical`` node may have
LOGICAL_FNS = ("not", *_LOGICAL)


def _k_logical(node, inputs):
    fn = node.attrs["fn"]
    if fn == "not":
        return [np.logical_not(inputs[0])]
    return [_LOGICAL[fn](inputs[0], inputs[1])]


# -- max pooling --------------------------------------------------------------------------------
def _pool_windows(n: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    eff = d * (k - 1) + 1
    num = n + 2 * p - eff
    out = (-(-num // s) if ceil_mode else num // s) + 1
    if ceil_mode and (out - 1) * s >= n + p:
        out -= 1
    return out


def pool_end_pads(attrs: dict, sizes: Sequence[int]) -> list[int]:
    """Per pooled axis, the padding after the end that gives torch's window count
    (``ceil_mode``) with ``attrs``' kernel, stride, padding and dilation; never negative."""
    pads = []
    for i, n in enumerate(sizes):
        k, s, p, d = (
            attrs["kernel"][i],
            attrs["stride"][i],
            attrs["padding"][i],
            attrs["dilation"][i],
        )
        need = (_pool_windows(n, k, s, p, d, attrs["ceil_mode"]) - 1) * s + d * (k - 1) + 1
        pads.append(max(need - n - p, 0))
    return pads


def max_pool_windows(x, attrs: dict, low, combine) -> Any:
    """Max pooling over the trailing ``len(kernel)`` axes of ``x`` with torch's windows
    (``ceil_mode``, ``dilation``): padded with ``low`` (which never wins), the windows
    combined by ``combine(best, next)``."""
    kernel, stride, padding, dilation = (
        attrs["kernel"], attrs["stride"], attrs["padding"], attrs["dilation"]
    )  # fmt: skip
    dims = len(kernel)
    lead = x.ndim - dims
    outs = [
        _pool_windows(
            x.shape[lead + i], kernel[i], stride[i], padding[i], dilation[i], attrs["ceil_mode"]
        )
        for i in range(dims)
    ]
    pads = list(zip(padding, pool_end_pads(attrs, x.shape[lead:])))
    xp = np.pad(x, [(0, 0)] * lead + pads, constant_values=low)
    y = None
    for offs in np.ndindex(*kernel):
        sel = [slice(None)] * lead + [
            slice(o * dilation[i], o * dilation[i] + (outs[i] - 1) * stride[i] + 1, stride[i])
            for i, o in enumerate(offs)
        ]
        v = xp[tuple(sel)]
        y = v if y is None else combine(y, v)
    return y


def _k_max_pool(node, inputs):
    x = inputs[0]
    return [max_pool_windows(x, node.attrs, np.iinfo(x.dtype).min, np.maximum)]


def _k_adaptive_max_pool(node, inputs):
    x = inputs[0]
    size = node.attrs["output_size"]
    for i, o in enumerate(size):
        axis = x.ndim - len(size) + i
        parts = [
            np.take(x, range(s, e), axis=axis).max(axis=axis, keepdims=True)
            for s, e in adaptive_windows(x.shape[axis], o)
        ]
        x = np.concatenate(parts, axis=axis)
    return [x]


# -- data movement ------------------------------------------------------------------------------
def _target_shape(x: np.ndarray, shape: Sequence[int]) -> list[int]:
    return [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]


def _k_reshape(node, inputs):
    x = inputs[0]
    return [x.reshape(_target_shape(x, node.attrs["shape"]))]


def _k_transpose(node, inputs):
    return [np.asarray(np.transpose(inputs[0], node.attrs["perm"]), order="C")]


def _k_gather(node, inputs):
    """Per sample (``per_sample``) or over the whole tensor: ``y.flat[i] = x.flat[index[i]]``,
    0 where ``index[i] == -1``."""
    x = inputs[0]
    idx = node.params["index"].astype(np.int64)
    shape = list(node.attrs["shape"])
    if node.attrs["per_sample"]:
        flat = x.reshape(x.shape[0], -1)
        shape = [x.shape[0], *shape]
    else:
        flat = x.reshape(1, -1)
    if (idx < 0).any():
        flat = np.concatenate([flat, np.zeros((flat.shape[0], 1), flat.dtype)], axis=1)
        idx = np.where(idx < 0, flat.shape[1] - 1, idx)
    return [flat[:, idx].reshape(shape)]


def _k_concat(node, inputs):
    return [np.concatenate(inputs, axis=node.attrs["axis"])]


# -- reductions to extremes ---------------------------------------------------------------------
def _k_reduce_extreme(node, inputs):
    """``amax`` / ``amin`` of the integers over ``axes``."""
    a = node.attrs
    pick = np.max if a["fn"] == "amax" else np.min
    return [pick(inputs[0], axis=tuple(a["axes"]), keepdims=a["keepdim"])]


def _k_arg_extreme(node, inputs):
    """``argmax`` / ``argmin`` (int64; over the flattened tensor for ``axis`` null)."""
    a = node.attrs
    pick = np.argmax if a["fn"] == "argmax" else np.argmin
    x = inputs[0]
    if a["axis"] is None:
        out = np.asarray(pick(x.reshape(-1)), np.int64)
        return [out.reshape([1] * x.ndim) if a["keepdim"] else out]
    return [pick(x, axis=a["axis"], keepdims=a["keepdim"]).astype(np.int64)]


#: op name -> kernel
KERNELS: dict[str, Callable[[Any, list[np.ndarray]], list[np.ndarray]]] = {
    "clip": _k_clip,
    "max_pool": _k_max_pool,
    "adaptive_max_pool": _k_adaptive_max_pool,
    "reshape": _k_reshape,
    "transpose": _k_transpose,
    "gather": _k_gather,
    "concat": _k_concat,
    "float": _k_float,
    "constant": _k_constant,
    "cast": _k_cast,
    "compare": _k_compare,
    "logical": _k_logical,
    "reduce_extreme": _k_reduce_extreme,
    "arg_extreme": _k_arg_extreme,
}


def kernel(op: str) -> Callable[[Any, list[np.ndarray]], list[np.ndarray]]:
    """The numpy kernel of an integer op: its primitive's (``fxq.primitives``), else
    ``KERNELS[op]``.

    Raises:
        KeyError: no kernel has that op.
    """
    primitive = PRIMITIVES.get(op)
    return primitive.numpy if primitive is not None else KERNELS[op]
