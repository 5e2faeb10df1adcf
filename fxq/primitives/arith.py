"""The numpy side of the integer arithmetic every primitive shares: dtypes, ranges,
rounding shifts. numpy and the standard library only (the runtime runs without torch)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "DTYPES",
    "RANGES",
    "bounds",
    "shift_round",
    "requant",
    "sat32",
    "exact_dot",
    "dot_bound",
    "quantize",
]

#: float64 sums of integers are exact below this magnitude
F64_EXACT = 1 << 53

#: IR dtype name -> numpy dtype
DTYPES: dict[str, Any] = {
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "float32": np.float32,
    "float64": np.float64,
    "bool": np.bool_,
}

#: quantized IR dtype -> its integer range
RANGES = {"int8": (-128, 127), "int16": (-32768, 32767), "int32": (-(1 << 31), (1 << 31) - 1)}


def bounds(dtype: str, lo: int | None, hi: int | None) -> tuple[int, int]:
    qmin, qmax = RANGES[dtype]
    return (qmin if lo is None else max(lo, qmin)), (qmax if hi is None else min(hi, qmax))


def shift_round(v: np.ndarray, shift: np.ndarray | int, rounding: str = "half_up") -> np.ndarray:
    """Arithmetic shift of int64 ``v`` by ``shift`` bits with rounding.

    ``shift > 0``: ``(v + (1 << (shift - 1))) >> shift`` (``half_up``), ties to
    even for ``half_even``; ``shift == 0``: ``v``; ``shift < 0``: ``v << -shift``
    (exact). ``shift`` broadcasts against ``v``.
    """
    v = np.asarray(v, dtype=np.int64)
    s = np.asarray(shift, dtype=np.int64)
    right = np.maximum(s, 0)
    if (s < 0).any():
        v = v << np.maximum(-s, 0)
    half = np.where(right > 0, np.left_shift(1, np.maximum(right - 1, 0)), 0)
    out = (v + half) >> right
    if rounding == "half_up":
        return out
    if rounding == "half_even":
        mask = np.left_shift(1, right) - 1
        tie = (right > 0) & ((v & mask) == half)
        return out - (tie & ((out & 1) == 1))
    raise ValueError(f"unknown rounding {rounding!r}")


def requant(
    acc: np.ndarray,
    multiplier: np.ndarray,
    shift: np.ndarray,
    dtype: str,
    rounding: str,
    lo: int | None = None,
    hi: int | None = None,
) -> np.ndarray:
    """``clamp(shift_round(acc * multiplier, shift), lo, hi)`` in int64, saturated to
    ``dtype`` (and to ``[lo, hi]`` where given)."""
    lo, hi = bounds(dtype, lo, hi)
    v = shift_round(acc.astype(np.int64) * np.asarray(multiplier, np.int64), shift, rounding)
    return np.clip(v, lo, hi).astype(DTYPES[dtype])


def sat32(v: np.ndarray) -> np.ndarray:
    """int32 saturation of int64 values."""
    return np.clip(v, -(1 << 31), (1 << 31) - 1)


def exact_dot(a: np.ndarray, b: np.ndarray, bound: int, spec: str) -> np.ndarray:
    """``einsum(spec, a, b)`` of int64 operands, exact: float64 (BLAS) when ``bound``
    (a bound on every partial sum) is below 2**53, else int64."""
    if bound < F64_EXACT:
        out = np.einsum(spec, a.astype(np.float64), b.astype(np.float64), optimize=True)
        return out.astype(np.int64)
    return np.einsum(spec, a.astype(np.int64), b.astype(np.int64), optimize=True)


def dot_bound(x: np.ndarray, w: np.ndarray, k: int) -> int:
    """``max |x| * max |w| * k``: a bound on every partial sum of ``k`` products."""
    mx = int(np.abs(x.astype(np.int64)).max()) if x.size else 0
    mw = int(np.abs(w.astype(np.int64)).max()) if w.size else 0
    return mx * mw * max(k, 1)


def _round_float(v: np.ndarray, rounding: str) -> np.ndarray:
    """``half_up``: floor(v + 1/2) of the exact value of ``v``; ``half_even``: ties to even."""
    if rounding == "half_up":
        low = np.floor(v)
        with np.errstate(invalid="ignore"):  # +-inf - +-inf: the sum stays +-inf
            return low + ((v - low) >= 0.5)
    if rounding == "half_even":
        return np.round(v)
    raise ValueError(f"unknown rounding {rounding!r}")


def quantize(x: np.ndarray, scale: float, dtype: str, rounding: str = "half_up") -> np.ndarray:
    """``clamp(round(x / scale))``: the IEEE division in float32 (float64 for float64 and
    integers wider than 16 bits), as ``fxq.quantized.functional.quantize``."""
    x = np.asarray(x)
    wide = x.dtype == np.float64 or (x.dtype.kind in "iu" and x.dtype.itemsize > 2)
    ft = np.float64 if wide else np.float32
    v = x.astype(ft) / ft(scale)
    if dtype == "int32":
        v = v.astype(np.float64)
    lo, hi = RANGES[dtype]
    return np.clip(_round_float(v, rounding), lo, hi).astype(DTYPES[dtype])
