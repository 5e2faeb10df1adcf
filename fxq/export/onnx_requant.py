"""Exact requantization in float32 for the integer ONNX writer (``docs/integer_graph.md``, 4).

The integer model requantizes an int32 accumulator ``acc`` per channel ``c`` as

    y = clamp(floor((acc * m + 2**(s - 1)) / 2**s), lo, hi)          (half up, s >= 1)

with ``|m| < 2**15``, so ``acc * m`` needs up to 46 bits: more than float32 holds. Where
``|acc|`` is proven below ``2**24`` (a float32 ``Conv`` / ``MatMul`` result), the same ``y``
comes out of float32 operations that are all exact:

1. clamp ``acc`` to ``[-B, B]`` (``[0, B]`` after a ReLU), ``B`` beyond every channel's
   saturation point, so ``y`` does not change and ``|acc * m| < 2**(s + 8)``;
2. split ``v = A 2**k + a`` (``A = floor(v 2**-k)``, ``0 <= a < 2**k``): then
   ``floor(v m / 2**k) = A m + floor(a m 2**-k) = Z`` with every product below ``2**24``;
3. ``floor((acc m + 2**(s-1)) / 2**s) = floor((Z + 2**(j-1)) / 2**j)`` with ``j = s - k``
   (nested floors), which is ``QuantizeLinear(Z + 1/2)`` at the power-of-two scale ``2**j``:
   ``(Z + 1/2) / 2**j`` is exact and never a tie, so its round-half-to-even is the half-up
   rounding of ``Z / 2**j``; ``QuantizeLinear`` also saturates to int8. Other output types
   take ``Floor((Z + 2**(j-1)) 2**-j)``, ``Clip`` and ``Cast``.

``plan_f32_requant`` picks the clamp and ``k`` per channel and returns None where no choice
keeps every step below ``2**24`` (the writer then requantizes in int64).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["F32Plan", "plan_f32_requant", "write_f32_requant"]

_EXACT = 1 << 24  # float32 holds every integer below 2**24


@dataclass(frozen=True)
class F32Plan:
    """How ``write_f32_requant`` requantizes one accumulator (arrays per channel).

    Attributes:
        multiplier: ``m`` with a left shift (``s < 0``) folded in.
        split: ``k``, the low bits taken apart from the accumulator (all 0: no split).
        shift: ``j = s - k``, the shift left to ``QuantizeLinear`` / ``Floor``.
        clamp: ``B``, where ``acc`` is clamped to ``[-B, B]`` first (None: not needed).
        relu: ``acc`` is clamped at 0 first (``lo >= 0`` and ``m >= 0``).
    """

    multiplier: np.ndarray
    split: np.ndarray
    shift: np.ndarray
    clamp: int | None
    relu: bool


def plan_f32_requant(
    multiplier: Any, shift: Any, bound: int, lo: int, hi: int, int8_out: bool
) -> F32Plan | None:
    """The float32 plan for ``clamp(shift_round(acc * multiplier, shift), lo, hi)`` (half up)
    of an accumulator with ``|acc| <= bound < 2**24``, or None where float32 cannot do it
    exactly.

    Args:
        multiplier, shift: per-channel (or scalar) integer arrays, ``shift`` of either sign.
        bound: a proven bound on ``|acc|``.
        lo, hi: the output's clamp (the dtype's range included).
        int8_out: finished by ``QuantizeLinear`` (any ``j``); else by ``Floor``, which needs
            ``2**(j-1)`` below ``2**23``.
    """
    if bound >= _EXACT:
        return None
    m = np.atleast_1d(np.asarray(multiplier, np.int64))
    s = np.atleast_1d(np.asarray(shift, np.int64))
    m, s = (np.array(v) for v in np.broadcast_arrays(m, s))
    if (s < -16).any() or (s > 62).any():
        return None
    m = m * (np.int64(1) << np.maximum(-s, 0))
    s = np.maximum(s, 0)
    mag = np.abs(m)
    if (mag >= 1 << 22).any():
        return None
    relu = lo >= 0 and bool((m >= 0).all())
    # |acc| >= saturate[c] gives max(|lo|, |hi|) + 1 or more in magnitude: clamping there
    # leaves y as it is
    top = max(abs(lo), abs(hi)) + 1
    nonzero = mag > 0
    saturate = [-(-(top << int(sc)) // int(mc)) + 1 for mc, sc in zip(mag[nonzero], s[nonzero])]
    clamp = max(saturate, default=0)
    for v, clamped in ((bound, False), (min(bound, clamp), True)):
        k = _splits(v, mag, s, int8_out)
        if k is not None:
            return F32Plan(m, k, s - k, clamp if clamped and clamp < bound else None, relu)
    return None


def _splits(v: int, mag: np.ndarray, s: np.ndarray, int8_out: bool) -> np.ndarray | None:
    """The smallest split ``k`` per channel keeping every step exact for ``|acc| <= v``."""
    ks = []
    for mc, sc in zip(mag.tolist(), s.tolist()):
        k = 0
        # |Z| <= (v / 2**k + 1) m + m  below 2**23, so that Z + 1/2 is exact
        while (v + (2 << k)) * mc >= (1 << (23 + k)):
            k += 1
            if k > 24:
                return None
        if ((1 << k) - 1) * mc >= _EXACT or (k and k >= sc):  # a m exact; j >= 1
            return None
        if not int8_out and sc - k > 23:  # Z + 2**(j-1) exact
            return None
        ks.append(k)
    return np.array(ks, np.int64)


def write_f32_requant(
    w: Any, acc: str, plan: F32Plan, rank: int, axis: int, dtype: str, lo: int, hi: int, out: str
) -> str:
    """Write the plan's ops for the float32 accumulator ``acc`` (exact integers) into the
    ``IntegerWriter`` ``w``; the result (``dtype``) is named ``out``."""
    f32 = np.float32
    size = plan.multiplier.size

    def ch(v: np.ndarray) -> np.ndarray:
        v = np.asarray(v, f32)
        return v.reshape(()) if size == 1 else w.channel(v, rank, axis)

    v = acc
    if plan.relu or plan.clamp is not None:
        low = 0.0 if plan.relu else -float(plan.clamp)
        high = np.inf if plan.clamp is None else float(plan.clamp)
        v = w.op("Clip", [v, w.const(low, f32), w.const(high, f32)])
    m, k, j = plan.multiplier, plan.split, plan.shift
    int8 = dtype == "int8"
    half = np.where(j > 0, 0.5 if int8 else np.ldexp(1.0, np.maximum(j - 1, 0)), 0.0)
    if k.any():
        a_hi = w.op("Floor", [w.op("Mul", [v, w.const(ch(np.ldexp(1.0, -k)))])])
        low_bits = w.op("Sub", [v, w.op("Mul", [a_hi, w.const(ch(np.ldexp(1.0, k)))])])
        u = w.op("Floor", [w.op("Mul", [low_bits, w.const(ch(np.ldexp(m.astype(f32), -k)))])])
        terms = [w.op("Mul", [a_hi, w.const(ch(m))]), u]
    else:
        terms = [w.op("Mul", [v, w.const(ch(m))])]
    z = terms[0] if len(terms) == 1 else w.op("Add", terms)
    if half.any():
        same_half = (half == half[0]).all()
        z = w.op("Add", [z, w.const(f32(half[0]) if same_half else ch(half))])
    if int8:
        same = (j == j[0]).all()
        scale = np.ldexp(1.0, j[:1] if same else j).astype(f32)
        zero = np.zeros(scale.shape, np.int8)
        if same:
            scale, zero = scale.reshape(()), zero.reshape(())
        attrs = {} if same else {"axis": axis}
        saturated = (lo, hi) == (-128, 127) or (plan.relu and (lo, hi) == (0, 127))
        inputs = [z, w.const(scale), w.const(zero)]
        y = w.op("QuantizeLinear", inputs, out if saturated else None, **attrs)
        if saturated:
            return y
        return w.op("Clip", [y, w.const(np.int8(lo)), w.const(np.int8(hi))], out)
    y = w.op("Floor", [w.op("Mul", [z, w.const(ch(np.ldexp(1.0, -j)))])])
    y = w.op("Clip", [y, w.const(float(lo), f32), w.const(float(hi), f32)])
    return w.cast(y, dtype, out)
