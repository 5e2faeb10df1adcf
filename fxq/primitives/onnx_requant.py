"""Exact requantization in float32 for the integer ONNX writer (``docs/integer_graph.md``, 4).

The integer model requantizes an int32 accumulator ``acc`` per channel ``c`` as

    y = clamp(floor((acc * m + h) / 2**s), lo, hi)     (h = 2**(s - 1) for s >= 1, else 0)

with ``|m| < 2**22`` (a left shift folded in), so ``acc * m`` needs up to 46 bits: more than
float32 holds. Where ``|acc| <= V < 2**24`` is proven (a float32 ``Conv`` / ``MatMul``
result), the same ``y`` comes out of float32 operations that are all exact, with a split
``k`` (``0 <= k < s``, or ``k = 0``) and ``j = s - k`` per channel:

1. ``w = acc 2**-k``: exact (a power of two; the writer may fold it into the conv's
   weights and bias, whose partial sums are then multiples of ``2**-k`` below
   ``2**(24 - k)``, exact as well);
2. clamp ``w`` to ``[L 2**-k, H 2**-k]``, where ``[L, H]`` holds every ``acc`` whose
   ``y`` is not saturated and the first saturated one on each side (per channel; one
   ``Clip`` when common bounds keep every channel exact): ``y`` is monotone in ``acc``,
   so the clamp leaves it as it is;
3. ``A = floor(w)``, ``f = w - A`` (exact: a multiple of ``2**-k`` in ``[0, 1)``), so
   ``acc = A 2**k + f 2**k`` and ``floor(acc m / 2**k) = A m + floor(f m) = Z`` (``A m``
   is an integer); ``f m = (f 2**k) m`` is exact when ``(2**k - 1) |m| < 2**24``, and
   ``A m``, ``Z`` are integers below ``2**24``;
4. ``floor((acc m + h) / 2**s) = floor((Z + 2**(j-1)) / 2**j)`` for ``j >= 1`` (nested
   floors), which is ``QuantizeLinear(Z + 1/2)`` at the power-of-two scale ``2**j``:
   ``(Z + 1/2) / 2**j`` is exact (``|Z| < 2**23``) and never a tie, so its
   round-half-to-even is the half-up rounding of ``Z / 2**j``; ``QuantizeLinear`` also
   saturates to int8. Other output types take ``Floor((Z + 2**(j-1)) 2**-j)`` (exact when
   ``|Z| + 2**(j-1) < 2**24``), ``Clip`` and ``Cast``. ``k = 0`` skips step 3 (``Z = w m``).

``plan_f32_requant`` computes ``[L, H]`` and the smallest ``k`` per channel that keeps every
bound above (evaluated exactly on the clamp's end points, ``Z`` being monotone in ``acc``),
and returns None where no ``k`` does (the writer then requantizes in int64).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["F32Plan", "MulPlan", "plan_f32_requant", "plan_mul_requant", "write_f32_requant"]

_EXACT = 1 << 24  # float32 holds every integer below 2**24


@dataclass(frozen=True)
class F32Plan:
    """How ``write_f32_requant`` requantizes one accumulator (arrays per channel).

    Attributes:
        multiplier: ``m`` with a left shift (``s < 0``) folded in.
        split: ``k``, the low bits taken apart from the accumulator (all 0: no split).
        shift: ``j = s - k``, the shift left to ``QuantizeLinear`` / ``Floor``.
        low, high: the clamp of ``w = acc 2**-k`` (exact float32 values; one element: a
            common bound, a ``Clip``); None: that side needs no clamp.
        in_range: ``y`` before the output clamp stays in ``[lo, hi]`` on the clamped range
            (no output ``Clip``).
    """

    multiplier: np.ndarray
    split: np.ndarray
    shift: np.ndarray
    low: np.ndarray | None
    high: np.ndarray | None
    in_range: bool


@dataclass(frozen=True)
class MulPlan:
    """The two-op requantization ``QuantizeLinear(acc c + e, 1)`` of ``plan_mul_requant``
    (arrays per channel).

    Attributes:
        scale: ``c``, float32.
        tie: ``e``, float32, or None (no ``Add``).
        split: all 0 (nothing folded into the conv's weights; as ``F32Plan.split``).
    """

    scale: np.ndarray
    tie: np.ndarray | None
    split: np.ndarray


def _folded(
    multiplier: Any, shift: Any, bound: int, max_shift: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """Per channel (1-d), ``m`` and ``s >= 0`` with a left shift (``s < 0``) folded into
    ``m``; None where a planner cannot be exact: ``bound`` not below ``2**24``, a shift
    outside ``[-16, max_shift]`` or ``|m| >= 2**22``."""
    if bound >= _EXACT:
        return None
    m = np.atleast_1d(np.asarray(multiplier, np.int64))
    s = np.atleast_1d(np.asarray(shift, np.int64))
    m, s = (np.array(v).ravel() for v in np.broadcast_arrays(m, s))
    if (s < -16).any() or (s > max_shift).any():
        return None
    m = m * (np.int64(1) << np.maximum(-s, 0))
    s = np.maximum(s, 0)
    if (np.abs(m) >= 1 << 22).any():
        return None
    return m, s


def _half(s: np.ndarray) -> np.ndarray:
    """The rounding term ``h = 2**(s - 1)`` (0 for ``s = 0``), a column per channel."""
    return np.where(s > 0, np.int64(1) << np.maximum(s - 1, 0), 0)[:, None]


def _mul_checks(m: np.ndarray, s: np.ndarray, lo: int, hi: int, v: int) -> np.ndarray:
    """Per channel (rows), the accumulators in ``[-v, v]`` on both sides of every step of
    ``clamp(floor((acc m + h) / 2**s), lo, hi)`` and the two ends."""
    n = np.arange(lo + 1, hi + 1, dtype=np.int64)[None, :]
    mm = np.where(m == 0, 1, m)[:, None]
    q = ((n << s[:, None]) - _half(s)) // mm  # floor of the step's real position
    cand = np.concatenate([q - 1, q, q + 1, q + 2], 1)
    ends = np.broadcast_to(np.array([-v, 0, v], np.int64), (m.size, 3))
    return np.clip(np.concatenate([cand, ends], 1), -v, v)


def _mul_ok(
    acc: np.ndarray, exact: np.ndarray, c: np.ndarray, e: np.ndarray | None, lo: int, hi: int
) -> np.ndarray:
    """Which rows give ``exact`` as onnxruntime computes ``QuantizeLinear(acc c + e, 1)``
    (IEEE float32 products and sums, round half to even, int8 saturation), then the
    clamp."""
    x = acc.astype(np.float32) * c[:, None]
    if e is not None:
        x = x + e[:, None]
    y = np.clip(np.clip(np.rint(x), -128, 127), lo, hi).astype(np.int64)
    return (y == exact).all(1)


def plan_mul_requant(multiplier: Any, shift: Any, bound: int, lo: int, hi: int) -> MulPlan | None:
    """A float32 multiplier ``c`` (and tie offset ``e``) per channel with
    ``clamp(QuantizeLinear(acc c + e, 1), lo, hi) == clamp(shift_round(acc m, s), lo, hi)``
    (half up, int8) for every ``|acc| <= bound < 2**24``, or None.

    Both sides are monotone in ``acc`` (float32 rounding is monotone), so they agree on
    every accumulator when they agree on both sides of each step of the integer result and
    at the ends: that is what is checked, for ``c = m 2**-s`` and its float32 neighbours
    (up to 16 units in the last place either way), first without ``e``, then (a tie
    ``acc m = (q + 1/2) 2**s`` needs it: ``c`` alone would round it to even) with
    ``e = 2**-(s' + 1)``, ``s'`` the shift of ``m`` with its trailing zero bits taken out."""
    folded = _folded(multiplier, shift, bound, max_shift=40)
    if folded is None:
        return None
    m, s = folded
    acc = _mul_checks(m, s, lo, hi, bound)
    exact = np.clip((acc * m[:, None] + _half(s)) >> s[:, None], lo, hi)
    base = np.ldexp(m.astype(np.float64), -s).astype(np.float32)  # exact: |m| < 2**22
    tz = np.zeros_like(m)
    odd = m.copy()
    while ((odd % 2 == 0) & (odd != 0)).any():
        even = (odd % 2 == 0) & (odd != 0)
        tz += even
        odd = np.where(even, odd // 2, odd)
    ties = np.ldexp(1.0, -(np.maximum(s - tz, 0) + 1)).astype(np.float32)
    c = np.full(m.size, np.nan, np.float32)
    e = np.zeros(m.size, np.float32)
    for tie in (None, ties):
        left = np.isnan(c)
        if not left.any():
            break
        up = down = base
        for i in range(33):
            if not left.any():
                break
            if i == 0:
                trial = base
            elif i % 2:
                up = np.nextafter(up, np.float32(np.inf))
                trial = up
            else:
                down = np.nextafter(down, np.float32(-np.inf))
                trial = down
            rows = np.flatnonzero(left)
            ok = _mul_ok(
                acc[rows], exact[rows], trial[rows], None if tie is None else tie[rows], lo, hi
            )
            c[rows[ok]] = trial[rows[ok]]
            if tie is not None:
                e[rows[ok]] = tie[rows[ok]]
            left[rows[ok]] = False
    if np.isnan(c).any():
        return None
    return MulPlan(c, e if e.any() else None, np.zeros(m.size, np.int64))


def _saturation(m: int, s: int, lo: int, hi: int, v: int) -> tuple[int, int]:
    """``[L, H]`` within ``[-v, v]``: ``y`` is ``lo`` / ``hi`` (after the clamp) at and
    beyond each end (``m > 0``; mirrored for ``m < 0``; ``[0, 0]`` for ``m = 0``)."""
    if m == 0:
        return 0, 0
    h = 1 << (s - 1) if s > 0 else 0
    mag = abs(m)
    up = -((h - (hi << s)) // mag)  # smallest a with a |m| + h >= hi 2**s
    down = (((lo + 1) << s) - h - 1) // mag  # largest a with a |m| + h < (lo + 1) 2**s
    low, high = (down, up) if m > 0 else (-up, -down)
    low, high = max(low, -v), min(high, v)
    return min(low, high), high


def _fits(m: int, s: int, k: int, low: int, high: int, int8_out: bool) -> bool:
    """Steps 3-4 of the proof for ``acc`` in ``[low, high]`` with split ``k``."""
    if k and (k >= s or ((1 << k) - 1) * abs(m) >= _EXACT):
        return False
    j = s - k
    a_max = max(abs(low >> k), abs(high >> k))
    z_max = max(abs((low * m) >> k), abs((high * m) >> k))
    if a_max * abs(m) >= _EXACT:
        return False
    if j == 0:
        return z_max < _EXACT
    return z_max < (1 << 23) if int8_out else z_max + (1 << (j - 1)) < _EXACT


def _shifted(v: int, e: int, up: bool) -> int:
    """``v 2**e`` rounded up (``up``) or down to an integer."""
    if e >= 0:
        return v << e
    return -((-v) >> -e) if up else v >> -e


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
        int8_out: finished by ``QuantizeLinear`` (``|Z| < 2**23``); else by ``Floor``
            (``|Z| + 2**(j-1) < 2**24``).
    """
    folded = _folded(multiplier, shift, bound, max_shift=62)
    if folded is None:
        return None
    m, s = folded
    ms, ss = m.tolist(), s.tolist()
    ranges = [_saturation(mc, sc, lo, hi, bound) for mc, sc in zip(ms, ss)]
    ks = []
    for mc, sc, (low, high) in zip(ms, ss, ranges):
        k = next((k for k in range(25) if _fits(mc, sc, k, low, high, int8_out)), None)
        if k is None:
            return None
        ks.append(k)
    sides = [_side(ranges, ks, 0, -bound), _side(ranges, ks, 1, bound)]
    # a common bound per side where every channel stays exact with its range widened to
    # it (a Clip, which onnxruntime fuses into the conv), else per-channel Max / Min
    for common in ((True, True), (True, False), (False, True), (False, False)):
        ends = [
            [edge] * len(ks) if side is None else side[1] if c else side[0]
            for side, c, edge in zip(sides, common, (-bound, bound))
        ]
        if all(
            _fits(mc, sc, kc, lw, hg, int8_out)
            for mc, sc, kc, lw, hg in zip(ms, ss, ks, ends[0], ends[1])
        ):
            break
    in_range = all(
        lo <= _y(mc, sc, a) <= hi
        for mc, sc, lw, hg in zip(ms, ss, ends[0], ends[1])
        for a in (lw, hg)
    )
    k = np.array(ks, np.int64)
    clamps = []
    for side, c, i in zip(sides, common, (0, 1)):
        if side is None:
            clamps.append(None)
            continue
        w = np.array([r[i] * 2.0**-kc for r, kc in zip(ranges, ks)])
        clamps.append((w.min(keepdims=True) if i == 0 else w.max(keepdims=True)) if c else w)
    return F32Plan(m, k, s - k, clamps[0], clamps[1], in_range)


def _y(m: int, s: int, acc: int) -> int:
    """``floor((acc m + h) / 2**s)``, before the output clamp."""
    return (acc * m + (1 << (s - 1) if s > 0 else 0)) >> s


def _side(
    ranges: list[tuple[int, int]], ks: list[int], i: int, edge: int
) -> tuple[list[int], list[int]] | None:
    """One side (``i``: 0 low, 1 high) of the clamp: each channel's own end and the end of
    its ``acc`` range under the common bound (``min`` / ``max`` of ``end 2**-k`` over the
    channels); None where no channel needs that side clamped."""
    own = [r[i] for r in ranges]
    if all(e == edge for e in own):
        return None
    pick = min if i == 0 else max
    c = pick(range(len(own)), key=lambda c: own[c] * 2.0 ** -ks[c])
    widened = [_shifted(own[c], kc - ks[c], i == 0) for kc in ks]
    widened = [max(v, edge) if i == 0 else min(v, edge) for v in widened]
    return own, widened


def _write_mul(
    w: Any, acc: str, plan: MulPlan, rank: int, axis: int, lo: int, hi: int, out: str
) -> str:
    def ch(v: np.ndarray) -> np.ndarray:
        v = np.asarray(v, np.float32)
        return v.reshape(()) if v.size == 1 else w.channel(v, rank, axis)

    # the constant first: onnxruntime folds a Conv's Mul by a constant second input into
    # the conv's weights, which would lose the exact integer accumulator
    v = w.op("Mul", [w.const(ch(plan.scale)), acc])
    if plan.tie is not None:
        v = w.op("Add", [v, w.const(ch(plan.tie))])
    inputs = [v, w.const(np.float32(1.0)), w.const(np.int8(0))]
    if (lo, hi) == (-128, 127):
        return w.op("QuantizeLinear", inputs, out)
    y = w.op("QuantizeLinear", inputs)
    return w.op("Clip", [y, w.const(np.int8(lo)), w.const(np.int8(hi))], out)


def write_f32_requant(
    w: Any,
    acc: str,
    plan: F32Plan | MulPlan,
    rank: int,
    axis: int,
    dtype: str,
    lo: int,
    hi: int,
    out: str,
    scaled: bool = False,
) -> str:
    """Write the plan's ops for the float32 accumulator ``acc`` (exact integers; with
    ``scaled``, ``acc 2**-k`` already, as a conv with its weights scaled gives it) into the
    ``IntegerWriter`` ``w``; the result (``dtype``) is named ``out``."""
    f32 = np.float32
    if isinstance(plan, MulPlan):
        return _write_mul(w, acc, plan, rank, axis, lo, hi, out)
    size = plan.multiplier.size

    def ch(v: np.ndarray) -> np.ndarray:
        v = np.asarray(v, f32)
        return v.reshape(()) if v.size == 1 else w.channel(v, rank, axis)

    m, k, j = plan.multiplier, plan.split, plan.shift
    v = acc
    if k.any() and not scaled:
        v = w.op("Mul", [v, w.const(ch(np.ldexp(1.0, -k)))])
    common = [c is not None and c.size == 1 < size for c in (plan.low, plan.high)]
    if size == 1:
        common = [c is not None for c in (plan.low, plan.high)]
    if any(common):
        ends = [
            c if ok else np.array([sign * np.inf])
            for c, ok, sign in zip((plan.low, plan.high), common, (-1, 1))
        ]
        v = w.op("Clip", [v, w.const(ch(ends[0])), w.const(ch(ends[1]))])
    for c, ok, op in zip((plan.low, plan.high), common, ("Max", "Min")):
        if c is not None and not ok:
            v = w.op(op, [v, w.const(ch(c))])
    if k.any():
        a_hi = w.op("Floor", [v])
        frac = w.op("Sub", [v, a_hi])
        u = w.op("Floor", [w.op("Mul", [frac, w.const(ch(m))])])
        z = w.op("Add", [w.op("Mul", [a_hi, w.const(ch(m))]), u])
    else:
        z = w.op("Mul", [v, w.const(ch(m))])
    int8 = dtype == "int8"
    half = np.where(j > 0, 0.5 if int8 else np.ldexp(1.0, np.maximum(j - 1, 0)), 0.0)
    if half.any():
        z = w.op("Add", [z, w.const(ch(half[:1] if (half == half[0]).all() else half))])
    if int8:
        same = (j == j[0]).all()
        scale = np.ldexp(1.0, j[:1] if same else j).astype(f32)
        zero = np.zeros(scale.shape, np.int8)
        if same:
            scale, zero = scale.reshape(()), zero.reshape(())
        attrs = {} if same else {"axis": axis}
        inputs = [z, w.const(scale), w.const(zero)]
        if (lo, hi) == (-128, 127) or plan.in_range:
            return w.op("QuantizeLinear", inputs, out, **attrs)
        y = w.op("QuantizeLinear", inputs, None, **attrs)
        return w.op("Clip", [y, w.const(np.int8(lo)), w.const(np.int8(hi))], out)
    y = w.op("Floor", [w.op("Mul", [z, w.const(ch(np.ldexp(1.0, -j)))])])
    if not plan.in_range:
        y = w.op("Clip", [y, w.const(float(lo), f32), w.const(float(hi), f32)])
    return w.cast(y, dtype, out)
