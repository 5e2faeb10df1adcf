"""Property tests of fxq's integer arithmetic kernels (``docs/arithmetic.md``).

Every kernel is compared with an independent reference written in this file
with Python integers and ``fractions.Fraction`` (or exact int64 torch
arithmetic where tensors are large). No reference calls the kernel it checks.

Tests named ``test_bug_*`` reproduce disagreements between a kernel and the
specification; they are expected to FAIL until the kernel is fixed (see the
docstring of each).
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import fxq
from fxq.march import March, Rounding, spec_for
from fxq.primitives import table as tables
from fxq.qtensor import QTensor
from fxq.quantized import functional as qf
from fxq.quantized import native
from fxq.quantized.interpolate import Interpolate
from fxq.quantized.pooling import AvgPool, window_sums_adaptive

HALF_UP = Rounding.HALF_UP
HALF_EVEN = Rounding.HALF_EVEN
ROUNDINGS = st.sampled_from([HALF_UP, HALF_EVEN])
BAYES = spec_for("bayes")
HALF = Fraction(1, 2)
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
SEEDS = st.integers(0, 2**32 - 1)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Exactness does not depend on threads, and on a loaded 2-core machine tiny torch ops
    with two OpenMP threads cost milliseconds each; test_native_parallel_* uses several."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def fast(n: int):
    """Hypothesis settings sized so that the whole file runs in well under a minute."""
    return settings(
        max_examples=n,
        deadline=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.function_scoped_fixture,
            HealthCheck.data_too_large,
        ],
    )


# =============================================================================
# Independent references
# =============================================================================


def pow2(n: int) -> Fraction:
    """2**n as an exact Fraction (n may be negative)."""
    return Fraction(1 << n) if n >= 0 else Fraction(1, 1 << -n)


def ref_round(x: Fraction, rounding: Rounding) -> int:
    """The march rounding of an exact rational: half up is floor(x + 1/2)."""
    if rounding is HALF_UP:
        return math.floor(x + HALF)
    low = math.floor(x)
    frac = x - low
    if frac != HALF:
        return low + (frac > HALF)
    return low + (low % 2)  # a tie goes to the even neighbour


def ref_scale_round(v: int, m: int, shift: int, rounding: Rounding) -> int:
    """round(v * m * 2**-shift), exactly."""
    return ref_round(Fraction(v * m) * pow2(-shift), rounding)


def clamp(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, v))


def ref_multiplier(f: float, bits: int, lo: int, hi: int) -> tuple[int, int] | None:
    """docs/arithmetic.md section 4, in exact arithmetic; None when not representable.

    S gives m the full multiplier width (f * 2**S in [2**(bits-2), 2**(bits-1))),
    clamped to [lo, hi]; m = round_half_up(f * 2**S); a carry past the largest
    multiplier drops S by one.
    """
    fr = Fraction(f)
    max_m = (1 << (bits - 1)) - 1
    if fr == 0:
        return 0, lo
    e = fr.numerator.bit_length() - fr.denominator.bit_length()
    if fr >= pow2(e):
        e += 1  # now 2**(e-1) <= fr < 2**e
    s = min(max(bits - 1 - e, lo), hi)
    m = math.floor(fr * pow2(s) + HALF)
    if m > max_m and s > lo:
        s -= 1
        m = math.floor(fr * pow2(s) + HALF)
    if m > max_m:
        return None
    return m, s


def channel_index(shape: tuple[int, ...], axis: int | None) -> list[int]:
    """For every element (row-major), the index of its channel along ``axis`` (0 if None)."""
    numel = math.prod(shape)
    if axis is None:
        return [0] * numel
    axis %= len(shape)
    inner = math.prod(shape[axis + 1 :])
    return [(i // inner) % shape[axis] for i in range(numel)]


def ints(t: torch.Tensor) -> list[int]:
    """The elements of an integer-valued tensor as Python ints (checking they are integers)."""
    flat = t.detach().reshape(-1)
    if flat.is_floating_point():
        values = flat.tolist()
        assert all(float(v).is_integer() for v in values)
        return [int(v) for v in values]
    return [int(v) for v in flat.tolist()]


def trailing_zeros(m: int) -> int:
    return (m & -m).bit_length() - 1


def tie_value(
    m: int, shift: int, k: int, limit: int | None = None, out_max: int | None = None
) -> int | None:
    """An integer ``a`` with ``a * m * 2**-shift`` exactly halfway between two integers:
    ``a = o * 2**(shift - 1 - tz(m))`` with ``o = 2k + 1`` odd, so ``a * m * 2**-shift =
    o * odd(m) / 2``. ``|a| <= limit`` and, when given, ``|a * m * 2**-shift| <= out_max``
    (so that the tie is not hidden by saturation). None if impossible."""
    if m <= 0 or shift <= 0:
        return None
    t = trailing_zeros(m)
    if t >= shift:
        return None
    base = 1 << (shift - 1 - t)
    odd_max = None if limit is None else limit // base
    if out_max is not None:
        bound = (2 * out_max) // (m >> t)
        odd_max = bound if odd_max is None else min(odd_max, bound)
    if odd_max is not None:
        if odd_max < 1:
            return None
        count = (odd_max + 1) // 2  # odd multipliers 1, 3, ..., 2 * count - 1 allowed
        k = k % (2 * count) - count  # 2k + 1 in [-(2 count - 1), 2 count - 1]
    return (2 * k + 1) * base


# =============================================================================
# 1. shift_round
# =============================================================================

BIG = 1 << 62


@fast(200)
@given(
    values=st.lists(st.integers(-BIG, BIG), min_size=1, max_size=30),
    ties=st.lists(st.integers(-(1 << 20), 1 << 20), max_size=10),
    shift=st.integers(0, 40),
    rounding=ROUNDINGS,
)
@example(values=[5, 6, 7, -5, -6, -7], ties=[], shift=2, rounding=HALF_UP)
@example(values=[5, 6, 7, -5, -6, -7], ties=[], shift=2, rounding=HALF_EVEN)
def test_shift_round_matches_fraction(values, ties, shift, rounding):
    if shift > 0:  # exact ties: odd multiples of 2**(shift-1)
        values = values + [(2 * k + 1) << (shift - 1) for k in ties]
    v = torch.tensor(values, dtype=torch.int64)
    got = qf.shift_round(v, shift, rounding)
    assert got.dtype == torch.int64
    assert got.tolist() == [ref_round(Fraction(x, 1 << shift), rounding) for x in values]


@fast(100)
@given(
    pairs=st.lists(
        st.tuples(st.integers(-(1 << 50), 1 << 50), st.integers(0, 40)), min_size=1, max_size=30
    ),
    rounding=ROUNDINGS,
)
def test_shift_round_per_element_shift(pairs, rounding):
    """A tensor of shifts (one per element, as per-channel requantization uses)."""
    values = [v for v, _ in pairs]
    shifts = [s for _, s in pairs]
    got = qf.shift_round(torch.tensor(values), torch.tensor(shifts), rounding)
    want = [ref_round(Fraction(v, 1 << s), rounding) for v, s in pairs]
    assert got.tolist() == want


# =============================================================================
# 2. quantize_multiplier
# =============================================================================


def _near_carry(bits: int):
    """Factors whose rounding at full precision lands on or next to 2**(bits-1)."""
    top = 1 << (bits - 1)
    return st.builds(
        lambda d, s: math.ldexp(top + d, -s),
        st.sampled_from([-1.0, -0.5, -0.25, -0.5 - 2.0**-20, -0.5 + 2.0**-20, 0.0]),
        st.integers(-10, 30),
    )


def _factors(bits: int):
    return st.one_of(
        st.floats(min_value=0.0, max_value=2.0 ** (bits + 2), allow_nan=False),
        st.builds(
            math.ldexp,
            st.floats(min_value=0.5, max_value=1.0, exclude_max=True),
            st.integers(-45, bits + 2),
        ),
        _near_carry(bits),
        st.just(0.0),
    )


def _check_multipliers(real, m, s, spec, lo, hi):
    bits = spec.multiplier_bits
    assert m.dtype == torch.int64 and s.dtype == torch.int64
    assert m.shape == s.shape == (len(real),)
    for f, mi, si in zip(real, m.tolist(), s.tolist()):
        assert 0 <= mi <= spec.max_multiplier, (f, mi, si)
        assert lo <= si <= hi, (f, mi, si)
        err = abs(Fraction(mi) * pow2(-si) - Fraction(f))
        assert err <= pow2(-si) / 2, (f, mi, si)
        if f > 0 and si < hi:  # full precision unless the shift ran out
            assert mi >= 1 << (bits - 2), (f, mi, si)
        assert (mi, si) == ref_multiplier(f, bits, lo, hi), (f, mi, si)


@fast(150)
@given(data=st.data(), march=st.sampled_from(["bayes", "bernoulli2"]))
def test_quantize_multiplier_properties(data, march):
    spec = spec_for(march)
    lo, hi = spec.shift_range
    limit = spec.max_multiplier + 0.5  # at S = lo, m = round(f * 2**lo) must stay <= max
    real = data.draw(
        st.lists(
            _factors(spec.multiplier_bits).filter(lambda f: f < limit), min_size=1, max_size=16
        )
    )
    m, s = qf.quantize_multiplier(torch.tensor(real, dtype=torch.float64), spec)
    _check_multipliers(real, m, s, spec, lo, hi)


def test_a_factor_just_below_half_a_step_at_the_largest_shift_rounds_down():
    """``floor(x + 0.5)`` rounds the largest float below 1/2 up to 1 (the sum rounds to
    1.0); a factor that small, scaled at the largest shift, must round to 0 (found by
    the property test above, on bernoulli2)."""
    spec = spec_for("bernoulli2")
    lo, hi = spec.shift_range
    below = math.ldexp(1.0, -hi - 1) - math.ldexp(1.0, -hi - 54)  # 2**hi times: 1/2 - 2**-54
    real = [below, math.ldexp(1.0, -hi - 1)]
    m, s = qf.quantize_multiplier(torch.tensor(real, dtype=torch.float64), spec)
    assert m.tolist() == [0, 1] and s.tolist() == [hi, hi]
    _check_multipliers(real, m, s, spec, lo, hi)


@fast(60)
@given(
    march=st.sampled_from(["bayes", "bernoulli2"]),
    excess=st.floats(min_value=0.0, max_value=1e9, allow_nan=False),
    others=st.lists(st.floats(0.0, 1.0), max_size=4),
)
def test_quantize_multiplier_too_large_raises(march, excess, others):
    spec = spec_for(march)
    too_big = spec.max_multiplier + 0.5 + excess
    assert ref_multiplier(too_big, spec.multiplier_bits, *spec.shift_range) is None
    with pytest.raises(qf.MultiplierRangeError):
        qf.quantize_multiplier(torch.tensor([*others, too_big], dtype=torch.float64), spec)


@fast(100)
@given(
    real=st.lists(
        st.one_of(
            st.floats(min_value=0.0, max_value=2.0**40, allow_nan=False),
            _near_carry(16),
            st.builds(math.ldexp, st.floats(0.5, 1.0, exclude_max=True), st.integers(15, 45)),
        ),
        min_size=1,
        max_size=16,
    )
)
def test_quantize_multiplier_left_shift(real):
    """``left_shift=True``: factors above the largest multiplier get negative shifts."""
    lo, hi = -31, BAYES.shift_range[1]
    m, s = qf.quantize_multiplier(torch.tensor(real, dtype=torch.float64), BAYES, left_shift=True)
    _check_multipliers(real, m, s, BAYES, lo, hi)
    for f, si in zip(real, s.tolist()):
        if f >= BAYES.max_multiplier + 0.5:
            assert si < 0


def test_quantize_multiplier_doc_example():
    m, s = qf.quantize_multiplier(torch.tensor([0.0123456], dtype=torch.float64), BAYES)
    assert (m.item(), s.item()) == ref_multiplier(0.0123456, 16, 0, 31) == (25891, 21)


# =============================================================================
# 3. requantize_exact (torch path and native kernel)
# =============================================================================


def test_native_kernels_available():
    assert native.available(), "the one-pass C kernel must be built on this machine"


def _small_odd_part(o: int, j: int) -> int:
    m = (2 * o + 1) << j
    return m if m <= BAYES.max_multiplier else 2 * o + 1


# multipliers; those with a small odd part make exact output ties that do not saturate
MULTIPLIERS = st.one_of(
    st.integers(0, BAYES.max_multiplier),
    st.builds(_small_odd_part, st.integers(0, 40), st.integers(0, 14)),
)


@st.composite
def requant_cases(draw):
    acc_dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    bound_bits = 24 if acc_dtype is torch.float32 else 31
    shape = tuple(draw(st.integers(1, n)) for n in (2, 4, 3, 5))
    axis = draw(st.sampled_from([None, 1, -1]))
    channels = 1 if axis is None else shape[axis]
    regime = draw(st.sampled_from(["any", "small", "unit"]))
    ms, ss = [], []
    for _ in range(channels):
        if regime == "unit":  # m * 2**-S ~ 1: most outputs saturate
            s = draw(st.integers(0, 15))
            m = draw(st.integers(1 << 14, BAYES.max_multiplier)) >> (15 - s)
        else:
            s = draw(st.integers(0, 31) if regime == "any" else st.integers(16, 31))
            m = draw(MULTIPLIERS)
        ms.append(m)
        ss.append(s)
    seed = draw(SEEDS)
    tie_fraction = draw(st.sampled_from([0.0, 0.3, 1.0]))
    gen = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    limit = (1 << bound_bits) - 1
    mags = torch.randint(0, bound_bits + 1, (numel,), generator=gen)
    raw = (torch.rand(numel, generator=gen, dtype=torch.float64) * 2 - 1) * torch.exp2(
        mags.double()
    )
    acc = [clamp(int(v), -limit, limit) for v in raw.tolist()]
    chan = channel_index(shape, axis)
    ties = torch.rand(numel, generator=gen).tolist()
    ks = torch.randint(-(1 << 30), 1 << 30, (numel,), generator=gen).tolist()
    for i in range(numel):
        if ties[i] < tie_fraction:
            t = tie_value(ms[chan[i]], ss[chan[i]], ks[i], limit, out_max=127)
            if t is not None:
                acc[i] = t
    return acc_dtype, shape, axis, ms, ss, acc


@st.composite
def out_bounds(draw, dtype):
    """(lo, hi) passed to the kernel (None: the dtype's bound): none, ReLU, ReLU6-like, custom."""
    kind = draw(st.sampled_from(["none", "relu", "relu6", "custom"]))
    if kind == "none":
        return None, None
    if kind == "relu":
        return 0, None
    if kind == "relu6":
        return 0, draw(st.integers(0, dtype.qmax))
    lo = draw(st.integers(dtype.qmin - 50, dtype.qmax))
    hi = draw(st.integers(max(lo, dtype.qmin), dtype.qmax + 50))
    return lo, hi


@fast(400)
@given(
    case=requant_cases(),
    dtype=st.sampled_from([fxq.qint8, fxq.qint16]),
    rounding=ROUNDINGS,
    as_float=st.booleans(),
    data=st.data(),
)
def test_requantize_exact_matches_fraction(case, dtype, rounding, as_float, data):
    acc_dtype, shape, axis, ms, ss, acc = case
    lo, hi = data.draw(out_bounds(dtype))
    lo_eff = dtype.qmin if lo is None else max(lo, dtype.qmin)
    hi_eff = dtype.qmax if hi is None else min(hi, dtype.qmax)
    acc_t = torch.tensor(acc, dtype=acc_dtype).reshape(shape)
    assert ints(acc_t) == acc  # the accumulator holds the integers exactly
    m_t, s_t = torch.tensor(ms), torch.tensor(ss)
    kwargs = dict(channel_axis=axis, lo=lo, hi=hi, as_float=as_float)
    torch_path = qf.requantize_exact(acc_t, m_t, s_t, dtype, rounding, use_native=False, **kwargs)
    native_path = qf.requantize_exact(acc_t, m_t, s_t, dtype, rounding, use_native=True, **kwargs)
    chan = channel_index(shape, axis)
    want = [
        clamp(ref_scale_round(a, ms[c], ss[c], rounding), lo_eff, hi_eff) for a, c in zip(acc, chan)
    ]
    out_dtype = torch.float32 if as_float else dtype.storage
    assert torch_path.dtype == out_dtype and torch_path.shape == shape
    assert ints(torch_path) == want
    assert native.available()
    assert native_path.dtype == out_dtype and native_path.shape == shape
    assert torch.equal(native_path, torch_path), "native kernel differs from the torch path"


@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dtype", [fxq.qint8, fxq.qint16])
def test_requantize_exact_saturates_and_ties(acc_dtype, dtype):
    """Explicit saturation at the dtype bounds and half-up ties in both signs."""
    big = (1 << 24) - 1
    acc = torch.tensor([big, -big, 3, -3, 5, -5, 1, -1, 0], dtype=acc_dtype)
    m, s = torch.tensor([1]), torch.tensor([1])  # acc / 2: ties everywhere odd
    out = qf.requantize_exact(acc, m, s, dtype, HALF_UP, use_native=False)
    nat = qf.requantize_exact(acc, m, s, dtype, HALF_UP, use_native=True)
    want = [dtype.qmax, dtype.qmin, 2, -1, 3, -2, 1, 0, 0]
    assert out.tolist() == want
    assert torch.equal(nat, out)


def ref_requant_int64(acc: torch.Tensor, m: torch.Tensor, sh: torch.Tensor, lo, hi):
    """Vectorised half-up reference in int64: floor((2 a m + 2**S) / 2**(S + 1)) (no shifts)."""
    num = 2 * acc.to(torch.int64) * m + torch.pow(2, sh)
    return torch.div(num, torch.pow(2, sh + 1), rounding_mode="floor").clamp(lo, hi)


@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.float64])
def test_native_parallel_matches_torch(threads, acc_dtype):
    """The OpenMP-parallel C kernel on a larger per-channel tensor, against the torch path
    and an int64 reference."""
    gen = torch.Generator().manual_seed(threads)
    bound = (1 << 24) - 1 if acc_dtype is torch.float32 else (1 << 31) - 1
    acc = torch.randint(-bound, bound + 1, (4, 64, 8, 8), generator=gen, dtype=torch.int64)
    acc = acc >> torch.randint(0, 24, acc.shape, generator=gen)  # many magnitudes
    m = torch.randint(0, BAYES.max_multiplier + 1, (64,), generator=gen)
    sh = torch.randint(10, 32, (64,), generator=gen)
    ref = ref_requant_int64(acc, m.reshape(1, -1, 1, 1), sh.reshape(1, -1, 1, 1), -128, 127)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for as_float in (False, True):
            a = acc.to(acc_dtype)
            nat = qf.requantize_exact(a, m, sh, fxq.qint8, HALF_UP, 1, as_float=as_float)
            tor = qf.requantize_exact(
                a, m, sh, fxq.qint8, HALF_UP, 1, use_native=False, as_float=as_float
            )
            assert torch.equal(nat, tor)
            assert torch.equal(tor.to(torch.int64), ref)
    finally:
        torch.set_num_threads(saved)


# =============================================================================
# 4. requantize_residual
# =============================================================================


@st.composite
def residual_cases(draw):
    acc_dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    bound_bits = 24 if acc_dtype is torch.float32 else 31
    shape = tuple(draw(st.integers(1, n)) for n in (2, 4, 3, 4))
    axis = draw(st.sampled_from([1, -1]))
    channels = shape[axis]
    res_dtype = draw(st.sampled_from([fxq.qint8, fxq.qint16]))
    n_r = draw(st.sampled_from([1, channels]))
    n_m = draw(st.sampled_from([1, channels]))
    if draw(st.booleans()):
        mr = draw(st.lists(st.integers(0, BAYES.max_multiplier), min_size=n_r, max_size=n_r))
        kr_values = st.one_of(st.integers(-31, 31), st.integers(1, 12))  # 1..12: residual ties
        kr = draw(st.lists(kr_values, min_size=n_r, max_size=n_r))
        m = draw(st.lists(MULTIPLIERS, min_size=n_m, max_size=n_m))
        s = draw(st.lists(st.integers(0, 31), min_size=n_m, max_size=n_m))
    else:  # the residual term overflows int32 and the output still sees the saturated sum
        mr = draw(st.lists(st.integers(1 << 12, BAYES.max_multiplier), min_size=n_r, max_size=n_r))
        kr = draw(st.lists(st.integers(-31, -8), min_size=n_r, max_size=n_r))
        m = draw(st.lists(st.integers(1, 1 << 12), min_size=n_m, max_size=n_m))
        s = draw(st.lists(st.integers(26, 31), min_size=n_m, max_size=n_m))
    seed = draw(SEEDS)
    tie_fraction = draw(st.sampled_from([0.0, 0.5, 1.0]))
    return acc_dtype, bound_bits, shape, axis, res_dtype, mr, kr, m, s, seed, tie_fraction


@fast(300)
@given(
    case=residual_cases(),
    dtype=st.sampled_from([fxq.qint8, fxq.qint16]),
    rounding=ROUNDINGS,
    relu=st.booleans(),
)
def test_requantize_residual_matches_fraction(case, dtype, rounding, relu):
    acc_dtype, bound_bits, shape, axis, res_dtype, mr, kr, m, s, seed, tie_fraction = case
    gen = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    chan = channel_index(shape, axis)
    limit = (1 << bound_bits) - 1
    res = torch.randint(res_dtype.qmin, res_dtype.qmax + 1, (numel,), generator=gen).tolist()
    mags = torch.randint(0, bound_bits + 1, (numel,), generator=gen)
    raw = (torch.rand(numel, generator=gen, dtype=torch.float64) * 2 - 1) * torch.exp2(
        mags.double()
    )
    acc = [clamp(int(v), -limit, limit) for v in raw.tolist()]
    coins = torch.rand(2, numel, generator=gen).tolist()
    ks = torch.randint(-100, 100, (2, numel), generator=gen).tolist()

    def pick(values, c):
        return values[c if len(values) > 1 else 0]

    want = []
    lo_eff, hi_eff = (0 if relu else dtype.qmin), dtype.qmax
    for i, c in enumerate(chan):
        mri, kri, mi, si = pick(mr, c), pick(kr, c), pick(m, c), pick(s, c)
        if coins[0][i] < tie_fraction:  # a residual exactly halfway between two accumulator steps
            t = tie_value(mri, kri, ks[0][i], res_dtype.qmax)
            if t is not None:
                res[i] = t
        term = ref_scale_round(res[i], mri, kri, rounding)
        if coins[1][i] < tie_fraction:  # a sum exactly halfway between two output steps
            t = tie_value(mi, si, ks[1][i], limit, out_max=127)
            if t is not None and abs(t - term) <= limit:
                acc[i] = t - term
        total = clamp(acc[i] + term, INT32_MIN, INT32_MAX)
        want.append(clamp(ref_scale_round(total, mi, si, rounding), lo_eff, hi_eff))
    acc_t = torch.tensor(acc, dtype=acc_dtype).reshape(shape)
    res_t = torch.tensor(res, dtype=torch.float32).reshape(shape)
    args = (acc_t, res_t, torch.tensor(mr), torch.tensor(kr), torch.tensor(m), torch.tensor(s))
    lo = 0 if relu else None
    kwargs = dict(channel_axis=axis, lo=lo)
    torch_path = qf.requantize_residual(*args, dtype, rounding, use_native=False, **kwargs)
    native_path = qf.requantize_residual(*args, dtype, rounding, use_native=True, **kwargs)
    assert torch_path.dtype == torch.float32 and torch_path.shape == shape
    assert ints(torch_path) == want
    assert native.available()
    assert torch.equal(native_path, torch_path), "native kernel differs from the torch path"


def test_rescale_term_left_shift():
    """A negative residual shift is a left shift: exact, no rounding."""
    q = torch.tensor([3.0, -7.0, 127.0, -128.0])
    got = qf.rescale_term(q, torch.tensor([12345]), torch.tensor([-20]), HALF_UP)
    assert ints(got) == [int(v) * 12345 * (1 << 20) for v in q.tolist()]


# =============================================================================
# 5. accumulate (conv2d / linear) and split_limbs
# =============================================================================


def _rand_ints(gen, lo, hi, shape, dtype=torch.int64):
    return torch.randint(lo, hi + 1, shape, generator=gen).to(dtype)


def _heavy_weights(gen, shape):
    """int8 weights with |w| >= 100 (large L1 norm)."""
    mag = _rand_ints(gen, 100, 127, shape)
    sign = _rand_ints(gen, 0, 1, shape) * 2 - 1
    return (mag * sign).to(torch.int8)


def _input(gen, bits, shape, as_float):
    dt = fxq.qint8 if bits == 8 else fxq.qint16
    q = _rand_ints(gen, dt.qmin, dt.qmax, shape)
    # hit the extremes of the range, where limb splits are most delicate
    q.view(-1)[0] = dt.qmin
    if q.numel() > 1:
        q.view(-1)[1] = dt.qmax
    return q.to(torch.float32) if as_float else q.to(dt.storage)


def ref_linear(q: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = q.to(torch.int64) @ w.to(torch.int64).T
    return out if b is None else out + b.to(torch.int64)


def ref_conv2d(q, w, b, stride, padding, dilation, groups):
    """int64 conv2d from float64 ``unfold`` (a pure gather) and integer products."""
    n = q.shape[0]
    cout, cin_g, kh, kw = w.shape
    cols = F.unfold(q.to(torch.float64), (kh, kw), dilation, padding, stride)
    cols = cols.round().to(torch.int64)  # (n, cin * kh * kw, L)
    per_group = cin_g * kh * kw
    cout_g = cout // groups
    outs = []
    for g in range(groups):
        wg = w[g * cout_g : (g + 1) * cout_g].reshape(cout_g, per_group).to(torch.int64)
        outs.append(wg @ cols[:, g * per_group : (g + 1) * per_group])
    out = torch.cat(outs, 1)
    if b is not None:
        out = out + b.to(torch.int64).reshape(1, -1, 1)
    h = (q.shape[2] + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    wd = (q.shape[3] + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    return out.reshape(n, cout, h, wd)


def _bias(gen, kind, n):
    if kind == "none":
        return None
    bound = 1000 if kind == "small" else INT32_MAX
    return _rand_ints(gen, -bound, bound, (n,), torch.int32)


PLAN_SCALE = st.sampled_from([1, 1, 1, 300, 3000, 100_000, 1 << 30])


@fast(150)
@given(
    seed=SEEDS,
    bits=st.sampled_from([8, 16]),
    batch=st.integers(1, 3),
    k=st.integers(1, 40),
    n=st.integers(1, 5),
    bias_kind=st.sampled_from(["none", "small", "large"]),
    inflate=PLAN_SCALE,
    as_float=st.booleans(),
)
def test_accumulate_linear_exact(seed, bits, batch, k, n, bias_kind, inflate, as_float):
    gen = torch.Generator().manual_seed(seed)
    q = _input(gen, bits, (batch, k), as_float)
    w = _rand_ints(gen, -128, 127, (n, k), torch.int8)
    b = _bias(gen, bias_kind, n)
    # a plan for a larger |W| bound is still a valid (looser) plan: covers every plan kind
    w_sum = int(w.to(torch.int64).abs().sum(1).max()) * inflate
    plan = qf.plan_accumulation(bits, w_sum, 0 if b is None else int(b.abs().max()))
    got = qf.accumulate(lambda x, wt, bs: F.linear(x, wt, bs), q, w, b, plan, channel_axis=-1)
    assert got.is_floating_point()
    g64 = got.to(torch.float64)
    assert torch.equal(g64.round(), g64)
    assert torch.equal(got.to(torch.int64), ref_linear(q, w, b))


@fast(100)
@given(
    seed=SEEDS,
    bits=st.sampled_from([8, 16]),
    groups=st.sampled_from([1, 2]),
    cin_g=st.integers(1, 3),
    cout_g=st.integers(1, 3),
    kernel=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    stride=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    padding=st.tuples(st.integers(0, 1), st.integers(0, 1)),
    dilation=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    bias_kind=st.sampled_from(["none", "small", "large"]),
    inflate=PLAN_SCALE,
)
def test_accumulate_conv2d_exact(
    seed, bits, groups, cin_g, cout_g, kernel, stride, padding, dilation, bias_kind, inflate
):
    gen = torch.Generator().manual_seed(seed)
    cin, cout = cin_g * groups, cout_g * groups
    size = (dilation[0] * (kernel[0] - 1) + 1 + 2, dilation[1] * (kernel[1] - 1) + 1 + 3)
    q = _input(gen, bits, (2, cin, *size), as_float=bool(seed % 2))
    w = _rand_ints(gen, -128, 127, (cout, cin_g, *kernel), torch.int8)
    b = _bias(gen, bias_kind, cout)
    w_sum = int(w.to(torch.int64).abs().reshape(cout, -1).sum(1).max()) * inflate
    plan = qf.plan_accumulation(bits, w_sum, 0 if b is None else int(b.abs().max()))

    def op(x, wt, bs):
        return F.conv2d(x, wt, bs, stride, padding, dilation, groups)

    got = qf.accumulate(op, q, w, b, plan, channel_axis=1)
    want = ref_conv2d(q, w, b, stride, padding, dilation, groups)
    assert got.shape == want.shape
    assert torch.equal(got.to(torch.int64), want)


@pytest.mark.parametrize(
    "bits, k, want_dtype, want_limbs",
    [
        (8, 64, torch.float32, 1),  # 128 * 64 * 127 < 2**24
        (8, 2048, torch.float32, 2),  # 128 * 2048 * ~113 > 2**24: 4-bit limbs
        (16, 32, torch.float32, 2),  # int16: 8-bit limbs
        (16, 2048, torch.float32, 3),
        (8, 60_000, torch.float64, 1),  # even 2-bit limbs overflow float32
        (16, 12_000, torch.float64, 1),
    ],
)
def test_accumulate_large_weights_pick_limb_and_float64_plans(bits, k, want_dtype, want_limbs):
    """Real large-L1 weights (not an inflated bound): limb plans and float64 plans happen."""
    gen = torch.Generator().manual_seed(bits * 100_003 + k)
    q = _input(gen, bits, (2, k), as_float=True)
    w = _heavy_weights(gen, (3, k))
    b = _rand_ints(gen, -(10**6), 10**6, (3,), torch.int32)
    plan = qf.plan_accumulation(bits, int(w.to(torch.int64).abs().sum(1).max()), int(b.abs().max()))
    assert (plan.dtype, plan.limbs) == (want_dtype, want_limbs), plan.describe()
    got = qf.accumulate(lambda x, wt, bs: F.linear(x, wt, bs), q, w, b, plan, channel_axis=-1)
    assert torch.equal(got.to(torch.int64), ref_linear(q, w, b))


def test_accumulate_conv_with_limbs():
    gen = torch.Generator().manual_seed(7)
    q = _input(gen, 8, (1, 192, 4, 4), as_float=True)
    w = _heavy_weights(gen, (2, 192, 3, 3))
    plan = qf.plan_accumulation(8, int(w.to(torch.int64).abs().reshape(2, -1).sum(1).max()))
    assert plan.limbs > 1 and plan.dtype is torch.float32, plan.describe()

    def op(x, wt, bs):
        return F.conv2d(x, wt, bs, 1, 1)

    got = qf.accumulate(op, q, w, None, plan)
    assert torch.equal(got.to(torch.int64), ref_conv2d(q, w, None, (1, 1), (1, 1), (1, 1), 1))


@functools.cache
def _all_values(bits: int) -> torch.Tensor:
    return torch.arange(-(1 << (bits - 1)), 1 << (bits - 1), dtype=torch.int64)


@fast(40)
@given(
    bits=st.sampled_from([8, 16]),
    width=st.integers(1, 16),
    extra=st.integers(0, 2),
    storage=st.sampled_from(["int", "float32"]),
)
def test_split_limbs_recombine(bits, width, extra, storage):
    limbs = -(-bits // width) + extra
    while limbs > -(-bits // width) and (limbs - 1) * width > 24:
        limbs -= 1  # keep every shift below the 32-bit width of the split
    q = _all_values(bits)
    x = (
        q.to(torch.float32)
        if storage == "float32"
        else q.to(torch.int16 if bits == 16 else torch.int8)
    )
    parts = qf.split_limbs(x, limbs, width)
    assert len(parts) == limbs
    if limbs == 1:
        assert torch.equal(parts[0].to(torch.int64), q)
        return
    total = torch.zeros_like(q)
    for i, p in enumerate(parts):
        p = p.to(torch.int64)
        if i < limbs - 1:  # low limbs unsigned, width bits
            assert int(p.min()) >= 0 and int(p.max()) < 1 << width
        total += p * (1 << (i * width))
    assert torch.equal(total, q)
    # the top limb is floor(q / 2**((limbs-1) * width)) (floor division, no shifts)
    top = torch.div(q, 1 << ((limbs - 1) * width), rounding_mode="floor")
    assert torch.equal(parts[-1].to(torch.int64), top)


# =============================================================================
# 6. plan_accumulation
# =============================================================================


@functools.cache
def ref_limb_magnitude(bits: int, limbs: int, width: int) -> int:
    """Largest |limb| over every signed ``bits``-bit input, by brute force."""
    q = _all_values(bits)
    if limbs == 1:
        return int(q.abs().max())
    mags = []
    for i in range(limbs - 1):
        mags.append(
            int(
                torch.remainder(
                    torch.div(q, 1 << (i * width), rounding_mode="floor"), 1 << width
                ).max()
            )
        )
    top = torch.div(q, 1 << ((limbs - 1) * width), rounding_mode="floor")
    mags.append(int(top.abs().max()))
    return max(mags)


def ref_plan(bits: int, w_sum: int, other_bits: int) -> tuple[torch.dtype, int]:
    """docs section 10: float32 with the fewest limbs (<= 4, operands <= 256, other
    operand <= 8 bits), else float64 with the fewest limbs."""
    for dtype, limit, max_limbs in ((torch.float32, 1 << 24, 4), (torch.float64, 1 << 53, bits)):
        for limbs in range(1, max_limbs + 1):
            width = -(-bits // limbs)
            mag = ref_limb_magnitude(bits, limbs, width)
            if dtype is torch.float32 and (mag > 256 or other_bits > 8):
                continue
            if mag * w_sum < limit:
                return dtype, limbs
    raise AssertionError("no plan")


W_SUMS = st.one_of(
    st.integers(0, 1 << 45),
    st.integers(0, (1 << 53) - 1),
    st.integers(0, 1 << 24),
    st.sampled_from([100_000, 131_071, 131_072, 200_000, 50_000, 65_793, 65_794, 5_592_405]),
)


@fast(200)
@given(
    bits=st.sampled_from([8, 16]),
    w_sum=W_SUMS,
    bias=st.one_of(st.just(0), st.integers(0, INT32_MAX)),
    other_bits=st.sampled_from([8, 8, 16]),
)
@example(bits=8, w_sum=100_000, bias=0, other_bits=8)
@example(bits=8, w_sum=200_000, bias=0, other_bits=8)
@example(bits=16, w_sum=50_000, bias=0, other_bits=8)
@example(bits=16, w_sum=100_000, bias=0, other_bits=8)
def test_plan_accumulation_bound_is_a_proof(bits, w_sum, bias, other_bits):
    plan = qf.plan_accumulation(bits, w_sum, bias, other_bits)
    limit = 1 << 24 if plan.dtype is torch.float32 else 1 << 53
    assert plan.dtype in (torch.float32, torch.float64)
    assert plan.limbs >= 1
    if plan.limbs > 1:
        assert plan.limbs * plan.width >= bits  # the limbs cover the input
    mag = ref_limb_magnitude(bits, plan.limbs, plan.width if plan.limbs > 1 else bits)
    assert mag * w_sum <= plan.bound < limit, plan.describe()
    if plan.dtype is torch.float32:
        assert mag <= 256 and other_bits <= 8, plan.describe()
        assert plan.limbs <= 4
    if plan.bias_in_kernel:
        assert plan.limbs == 1 and plan.bound + bias < limit
    elif plan.limbs == 1:
        assert plan.bound + bias >= limit
    assert (plan.dtype, plan.limbs) == ref_plan(bits, w_sum, other_bits), plan.describe()


@pytest.mark.parametrize("bits, w_sum", [(8, 2**52), (16, 2**50), (8, 2**53 - 1), (16, 2**49)])
def test_plan_accumulation_huge_weight_sum_succeeds(bits, w_sum):
    """docs section 10: the float64 fallback "with limbs if needed ... always succeeds".
    (Regression: these raised ``ValueError('negative shift count')`` when a split with an
    empty top limb, ``width * (limbs - 1) >= bits``, was considered.)"""
    plan = qf.plan_accumulation(bits, w_sum)
    assert plan.dtype is torch.float64
    assert ref_limb_magnitude(bits, plan.limbs, plan.width) * w_sum <= plan.bound < 1 << 53
    assert (plan.dtype, plan.limbs) == ref_plan(bits, w_sum, 8)


# =============================================================================
# 7. add / sub: common_multipliers and add_requant
# =============================================================================

SCALES = st.floats(min_value=2.0**-12, max_value=2.0**-2)


@fast(300)
@given(
    s_a=SCALES,
    s_b=SCALES,
    ratio_y=st.floats(min_value=2.0**-6, max_value=2.0**5),
    sub=st.booleans(),
    alpha=st.sampled_from([1.0, 1.0, 0.5, 2.0, 3.0]),
    scalar=st.one_of(st.none(), st.floats(-2.0, 2.0)),
    seed=SEEDS,
    dtype=st.sampled_from([fxq.qint8, fxq.qint16]),
    march=st.sampled_from(["bayes", "bernoulli2"]),
)
def test_add_requant_matches_fraction(s_a, s_b, ratio_y, sub, alpha, scalar, seed, dtype, march):
    spec = spec_for(march)
    f32 = np.float32
    if march == "bernoulli2":  # power-of-two scales
        s_a, s_b = 2.0 ** math.ceil(math.log2(s_a)), 2.0 ** math.ceil(math.log2(s_b))
        ratio_y = 2.0 ** math.ceil(math.log2(ratio_y))
    s_a, s_b = float(f32(s_a)), float(f32(s_b))
    s_y = float(f32(max(s_a, s_b) * ratio_y))
    ra = s_a / s_y  # float64 ratios of float32 scales, as the Add module forms them
    rb = (-1.0 if sub else 1.0) * alpha * (s_b / s_y)
    lo, hi = spec.shift_range
    ref = ref_multiplier(max(abs(ra), abs(rb)), spec.multiplier_bits, lo, hi)
    if ref is None:
        with pytest.raises(qf.MultiplierRangeError):
            qf.common_multipliers([torch.tensor([ra]), torch.tensor([rb])], spec)
        return
    n = ref[1]
    ma_ref = math.floor(Fraction(ra) * pow2(n) + HALF)
    mb_ref = math.floor(Fraction(rb) * pow2(n) + HALF)
    (ma, mb), n_t = qf.common_multipliers(
        [torch.tensor([ra], dtype=torch.float64), torch.tensor([rb], dtype=torch.float64)], spec
    )
    assert (int(ma.reshape(-1)[0]), int(mb.reshape(-1)[0]), int(n_t.reshape(-1)[0])) == (
        ma_ref,
        mb_ref,
        n,
    )
    assert max(abs(ma_ref), abs(mb_ref)) <= spec.max_multiplier
    gen = torch.Generator().manual_seed(seed)
    a = _rand_ints(gen, dtype.qmin, dtype.qmax, (3, 7))
    b = _rand_ints(gen, dtype.qmin, dtype.qmax, (1, 7))  # broadcasts
    const = None
    c_ref = 0
    if scalar is not None:
        c_ref = math.floor(Fraction(scalar) / Fraction(s_y) * pow2(n) + HALF)
        const = torch.tensor(c_ref, dtype=torch.int64)
    got = qf.add_requant(
        [(a.to(torch.float32), ma_ref), (b.to(dtype.storage), mb_ref)], const, n_t, dtype, HALF_UP
    )
    assert got.dtype == dtype.storage and got.shape == (3, 7)
    want = [
        [
            clamp(
                ref_round(Fraction(x * ma_ref + y * mb_ref + c_ref) * pow2(-n), HALF_UP),
                dtype.qmin,
                dtype.qmax,
            )
            for x, y in zip(row, b[0].tolist())
        ]
        for row in a.tolist()
    ]
    assert got.tolist() == want


def test_add_requant_doc_example():
    (ma, mb), n = qf.common_multipliers(
        [torch.tensor([0.5], dtype=torch.float64), torch.tensor([0.25], dtype=torch.float64)], BAYES
    )
    assert (ma.item(), mb.item(), n.item()) == (16384, 8192, 15)
    got = qf.add_requant(
        [(torch.tensor([10, -3]), 16384), (torch.tensor([1, 2]), 8192)], None, n, fxq.qint8, HALF_UP
    )
    assert got.tolist() == [5, -1]


# =============================================================================
# 8. int8 lookup tables
# =============================================================================


def _math_sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


MATH_FNS = {
    "sigmoid": (torch.sigmoid, _math_sigmoid),
    "tanh": (torch.tanh, math.tanh),
    "silu": (F.silu, lambda x: x * _math_sigmoid(x)),
}


def _round_tolerant(y: float, rounding: Rounding, lo: int, hi: int) -> set[int]:
    """Acceptable round(y): y comes from libm in float64, so within 1e-9 of a tie
    either neighbour is accepted (torch's and Python's libm may differ by an ulp)."""
    base = ref_round(Fraction(y), rounding)
    frac = y - math.floor(y)
    if abs(frac - 0.5) < 1e-9 * max(1.0, abs(y)):
        return {clamp(math.floor(y), lo, hi), clamp(math.floor(y) + 1, lo, hi)}
    return {clamp(base, lo, hi)}


@fast(100)
@given(
    fn=st.sampled_from(["sigmoid", "tanh"]),
    s_in=st.floats(min_value=1e-3, max_value=0.2),
    s_out_mult=st.floats(min_value=0.25, max_value=4.0),
    out_dtype=st.sampled_from([fxq.qint8, fxq.qint16]),
    rounding=ROUNDINGS,
)
def test_lut_int8_matches_math(fn, s_in, s_out_mult, out_dtype, rounding):
    torch_fn, math_fn = MATH_FNS[fn]
    s_in_t = torch.tensor([s_in], dtype=torch.float32)
    s_out_t = torch.tensor([s_out_mult / out_dtype.qmax], dtype=torch.float32)
    table = tables.lut_int8(torch_fn, s_in_t, s_out_t, out_dtype, rounding)
    assert table.shape == (256,) and table.dtype == out_dtype.storage
    si, so = float(s_in_t), float(s_out_t)
    for q in range(-128, 128):
        y = math_fn(q * si) / so
        got = int(table[q + 128])
        assert got in _round_tolerant(y, rounding, out_dtype.qmin, out_dtype.qmax), (q, y, got)


def test_lut_int8_doc_example():
    table = tables.lut_int8(
        torch.sigmoid, torch.tensor([0.05]), torch.tensor([1 / 127]), fxq.qint8, HALF_UP
    )
    assert table[[0, 128, 255]].tolist() == [0, 64, 127]


@fast(40)
@given(seed=SEEDS, shape=st.lists(st.integers(1, 5), min_size=1, max_size=3))
def test_apply_lut_int8_indexes(seed, shape):
    gen = torch.Generator().manual_seed(seed)
    table = _rand_ints(gen, -32768, 32767, (256,), torch.int16)
    q = _rand_ints(gen, -128, 127, tuple(shape), torch.int8)
    q.view(-1)[0] = -128
    got = tables.lut(q, table)
    assert got.shape == q.shape
    tab = table.tolist()
    assert ints(got) == [tab[v + 128] for v in ints(q)]


# =============================================================================
# 9. int16 segmented lookup tables
# =============================================================================

INT16_ALL = torch.arange(-32768, 32768, dtype=torch.int64)


def ref_segment_eval_int64(q, dense, sparse, bits, rounding, lo, hi):
    """The doc's interpolation over all inputs, in int64 with floor division (no shifts).

    Dense segments of 2**bits steps cover [-32 * 2**bits, 32 * 2**bits); the sparse
    table (2**10 steps from -32768) covers everything else.
    """
    half = 32 * 2**bits

    def interp(knots, start, step):
        offset = q - start
        j = torch.div(offset, step, rounding_mode="floor").clamp(0, 63)
        r = offset - j * step
        y0 = knots[j]
        num = (knots[j + 1] - y0) * r
        # round(num / step) = floor((2 num + step) / (2 step)) for half up
        up = torch.div(2 * num + step, 2 * step, rounding_mode="floor")
        if rounding is HALF_EVEN:
            tie = torch.remainder(2 * num + step, 2 * step) == 0
            up = torch.where(tie & (torch.remainder(up, 2) == 1), up - 1, up)
        return y0 + up

    in_dense = (q >= -half) & (q < half)
    y = torch.where(in_dense, interp(dense, -half, 2**bits), interp(sparse, -32768, 2**10))
    return y.clamp(lo, hi)


def ref_segment_eval_fraction(q: int, dense, sparse, bits, rounding, lo, hi) -> int:
    half = 32 * 2**bits
    knots, start, step = (dense, -half, 2**bits) if -half <= q < half else (sparse, -32768, 2**10)
    j = min((q - start) // step, 63)
    r = q - start - j * step
    y = knots[j] + ref_round(Fraction((knots[j + 1] - knots[j]) * r, step), rounding)
    return clamp(y, lo, hi)


@fast(40)
@given(
    seed=SEEDS,
    bits=st.integers(0, 9),
    spread=st.sampled_from([10, 1000, 40_000, 1 << 20]),
    out_dtype=st.sampled_from([fxq.qint8, fxq.qint16]),
    rounding=ROUNDINGS,
)
def test_apply_segment_lut_interpolation_formula(seed, bits, spread, out_dtype, rounding):
    """Arbitrary knots (not from a function): the fixed-point interpolation rule, incl.
    negative slopes, exact ties of the rounding shift and saturation."""
    gen = torch.Generator().manual_seed(seed)
    dense = _rand_ints(gen, -spread, spread, (65,))
    sparse = _rand_ints(gen, -spread, spread, (65,))
    lut = tables.SegmentLUT(dense, sparse, bits, out_dtype)
    got = tables.segment_lut(INT16_ALL, lut, rounding)
    assert got.dtype == out_dtype.storage
    want = ref_segment_eval_int64(
        INT16_ALL, dense, sparse, bits, rounding, out_dtype.qmin, out_dtype.qmax
    )
    assert torch.equal(got.to(torch.int64), want)
    # and a sample against the Fraction reference, including every segment boundary
    dl, sl = dense.tolist(), sparse.tolist()
    half = 32 * 2**bits
    picks = set(torch.randint(-32768, 32768, (150,), generator=gen).tolist())
    picks |= {-half, half - 1, half, -half - 1, -32768, 32767, 0, -1}
    picks |= {-half + j * 2**bits + d for j in range(0, 65, 7) for d in (-1, 0, 1)}
    picks = {p for p in picks if -32768 <= p <= 32767}
    g = got.to(torch.int64)
    for p in sorted(picks):
        assert int(g[p + 32768]) == ref_segment_eval_fraction(
            p, dl, sl, bits, rounding, out_dtype.qmin, out_dtype.qmax
        ), p


@fast(30)
@given(
    fn=st.sampled_from(["sigmoid", "tanh", "silu"]),
    in_range=st.floats(min_value=1.0, max_value=16.0),
    out_kind=st.sampled_from(["int16", "int8"]),
    rounding=ROUNDINGS,
)
def test_build_segment_lut_knots_and_formula(fn, in_range, out_kind, rounding):
    """Knots are round(f(x) / s_out) at the segment ends (computed with ``math``), and the
    table evaluates as the doc's interpolation rule on those knots."""
    torch_fn, math_fn = MATH_FNS[fn]
    out_dtype = fxq.qint16 if out_kind == "int16" else fxq.qint8
    s_in_t = torch.tensor([in_range / 32768], dtype=torch.float32)
    peak = 1.0 if fn != "silu" else in_range
    s_out_t = torch.tensor([peak / out_dtype.qmax], dtype=torch.float32)
    lut = tables.build_segment_lut(torch_fn, s_in_t, s_out_t, out_dtype, rounding)
    assert lut.dense.shape == lut.sparse.shape == (65,)
    assert 0 <= lut.dense_bits < tables.SegmentLUT.SPARSE_BITS
    si, so = float(s_in_t), float(s_out_t)
    step = 2**lut.dense_bits
    for j in range(65):
        for knots, x in ((lut.dense, -32 * step + j * step), (lut.sparse, -32768 + j * 1024)):
            y = math_fn(x * si) / so
            assert int(knots[j]) in _round_tolerant(y, rounding, -(1 << 40), 1 << 40), (j, x)
    got = tables.segment_lut(INT16_ALL, lut, rounding)
    want = ref_segment_eval_int64(
        INT16_ALL, lut.dense, lut.sparse, lut.dense_bits, rounding, out_dtype.qmin, out_dtype.qmax
    )
    assert torch.equal(got.to(torch.int64), want)


def _max_error_lsb(values: torch.Tensor, exact: torch.Tensor) -> float:
    return float((values.to(torch.float64) - exact).abs().max())


@pytest.mark.parametrize(
    "fn, s_in, s_out, out_dtype, bound",
    [
        # measured 6.94 LSB: the interpolation error of 2**9-step segments (h^2/8 * max|f''|)
        ("sigmoid", 8 / 32768, 1 / 32767, fxq.qint16, 8.0),
        ("sigmoid", 16 / 32768, 1 / 32767, fxq.qint16, 16.0),  # measured 14.2
        ("sigmoid", 8 / 32768, 1 / 127, fxq.qint8, 1.0),  # measured 0.91
        ("tanh", 8 / 32768, 1 / 127, fxq.qint8, 1.0),  # measured 0.96
    ],
)
def test_segment_lut_accuracy(fn, s_in, s_out, out_dtype, bound):
    """Error of the int16 table against the true function, in output LSB; and the
    chosen dense width minimises it (recomputed here with math-built knots)."""
    torch_fn = {"sigmoid": torch.sigmoid, "tanh": torch.tanh}[fn]
    math_fn = MATH_FNS[fn][1]

    def vec(x: torch.Tensor) -> torch.Tensor:
        return torch.tensor([math_fn(v) for v in x.tolist()], dtype=torch.float64)

    s_in_t, s_out_t = torch.tensor([s_in]), torch.tensor([s_out])
    si, so = float(s_in_t), float(s_out_t)
    lut = tables.build_segment_lut(torch_fn, s_in_t, s_out_t, out_dtype, HALF_UP)
    got = tables.segment_lut(INT16_ALL, lut, HALF_UP)
    # the true function in output steps (float64, Python math), saturated like the output
    exact = (vec(INT16_ALL.to(torch.float64) * si) / so).clamp(out_dtype.qmin, out_dtype.qmax)
    err = _max_error_lsb(got, exact)
    assert err < bound, f"max error {err:.3f} LSB"

    # independent search over the dense width, with knots computed from math
    def knots(start: int, step: int) -> torch.Tensor:
        ys = vec(torch.tensor([float(start + j * step) for j in range(65)]) * si) / so
        return torch.tensor([ref_round(Fraction(v), HALF_UP) for v in ys.tolist()])

    sparse = knots(-32768, 1024)
    errs = []
    for bits in range(10):
        dense = knots(-32 * 2**bits, 2**bits)
        y = ref_segment_eval_int64(
            INT16_ALL, dense, sparse, bits, HALF_UP, out_dtype.qmin, out_dtype.qmax
        )
        errs.append(_max_error_lsb(y, exact))
    assert err <= min(errs) + 1e-9, (lut.dense_bits, err, errs)


# =============================================================================
# 10. bilinear resampling
# =============================================================================


def ref_linear_weights(in_size, out_size, scale, align_corners):
    """Torch's source coordinate rule in exact rationals; returns, per output, the
    fixed-point weights {source index: weight} (zero weights dropped)."""
    one = 1 << qf.INTERP_FRACTION_BITS
    rows = []
    for d in range(out_size):
        if align_corners:
            ratio = Fraction(in_size - 1, out_size - 1) if out_size > 1 else Fraction(0)
            src = d * ratio
        else:
            ratio = 1 / Fraction(scale) if scale is not None else Fraction(in_size, out_size)
            src = max((d + HALF) * ratio - HALF, Fraction(0))
        i0 = min(math.floor(src), in_size - 1)
        i1 = min(i0 + 1, in_size - 1)
        lam = min(max(src - i0, Fraction(0)), Fraction(1))
        w1 = math.floor(lam * one + HALF)
        row: dict[int, int] = {}
        for idx, w in ((i0, one - w1), (i1, w1)):
            row[idx] = row.get(idx, 0) + w
        rows.append({k: v for k, v in row.items() if v})
    return rows


def _kernel_rows(i0, i1, w1):
    one = 1 << qf.INTERP_FRACTION_BITS
    rows = []
    for a, b, w in zip(i0.tolist(), i1.tolist(), w1.tolist()):
        row: dict[int, int] = {}
        for idx, wt in ((a, one - w), (b, w)):
            row[idx] = row.get(idx, 0) + wt
        rows.append({k: v for k, v in row.items() if v})
    return rows


@fast(200)
@given(
    in_size=st.integers(1, 40),
    out_size=st.integers(1, 90),
    align_corners=st.booleans(),
)
@example(in_size=2, out_size=4, align_corners=False)
@example(in_size=3, out_size=256, align_corners=False)  # exact ties of lambda * 2**8
@example(in_size=5, out_size=257, align_corners=True)
def test_linear_weights_match_fraction(in_size, out_size, align_corners):
    i0, i1, w1 = qf.linear_weights(in_size, out_size, None, align_corners, "cpu")
    assert i0.dtype == i1.dtype == w1.dtype == torch.int64
    assert int(i0.min()) >= 0 and int(i1.max()) <= in_size - 1
    assert int(w1.min()) >= 0 and int(w1.max()) <= 256
    assert _kernel_rows(i0, i1, w1) == ref_linear_weights(in_size, out_size, None, align_corners)


@fast(80)
@given(
    in_size=st.integers(1, 30),
    scale=st.sampled_from([0.5, 0.75, 1.25, 1.5, 1.6, 2.0, 2.5, 3.0, 4.0]),
)
def test_linear_weights_with_scale_factor(in_size, scale):
    out_size = math.floor(in_size * scale)
    if out_size < 1:
        return
    i0, i1, w1 = qf.linear_weights(in_size, out_size, scale, False, "cpu")
    assert _kernel_rows(i0, i1, w1) == ref_linear_weights(in_size, out_size, scale, False)


def test_linear_weights_doc_example():
    i0, i1, w1 = qf.linear_weights(2, 4, 2.0, False, "cpu")
    assert (i0.tolist(), i1.tolist(), w1.tolist()) == ([0, 0, 0, 1], [1, 1, 1, 1], [0, 64, 192, 64])


def _functional_module(cls, fn, out_scale: float, out_dtype, march=March.BAYES):
    """A FunctionalQuantized module built from a stand-in for its QAT twin."""
    qat = SimpleNamespace(
        march=march,
        activation_post_process=SimpleNamespace(
            scale=torch.tensor([out_scale], dtype=torch.float32), dtype=out_dtype
        ),
        fn=fn,
        op=None,
        input_quants=[],
    )
    return cls(qat)


@fast(120)
@given(
    seed=SEEDS,
    dims=st.sampled_from([1, 2]),
    in_hw=st.tuples(st.integers(1, 7), st.integers(1, 7)),
    sizing=st.sampled_from(["size", "scale"]),
    out_hw=st.tuples(st.integers(1, 15), st.integers(1, 15)),
    scale=st.sampled_from([0.5, 1.5, 2.0, 2.5, 3.0]),
    align_corners=st.booleans(),
    s_x=st.floats(min_value=1e-3, max_value=1.0),
    ratio=st.floats(min_value=1.0, max_value=3.0),
)
def test_interpolate_bilinear_close_to_torch(
    seed, dims, in_hw, sizing, out_hw, scale, align_corners, s_x, ratio
):
    """Integer bilinear (8-bit weights) is within 1 output LSB of torch's float bilinear."""
    gen = torch.Generator().manual_seed(seed)
    spatial = in_hw[:dims]
    x = _rand_ints(gen, -128, 127, (2, 2, *spatial), torch.int8)
    s_x = float(np.float32(s_x))
    s_y = float(np.float32(s_x * ratio))
    mode = "linear" if dims == 1 else "bilinear"
    if sizing == "size":
        kwargs = dict(size=tuple(out_hw[:dims]))
    else:
        if any(math.floor(n * scale) < 1 for n in spatial):
            return
        kwargs = dict(scale_factor=scale)
    mod = _functional_module(Interpolate, F.interpolate, s_y, fxq.qint8)
    got = mod(
        QTensor(x, torch.tensor([s_x]), fxq.qint8), mode=mode, align_corners=align_corners, **kwargs
    )
    y = got.int_repr().to(torch.int64)
    ref = F.interpolate(x.to(torch.float64), mode=mode, align_corners=align_corners, **kwargs)
    t = (ref * (float(torch.tensor([s_x])) / float(torch.tensor([s_y])))).clamp(-128, 127)
    assert y.shape == t.shape
    assert float((y - t).abs().max()) < 1.5
    want = torch.floor(t + 0.5).clamp(-128, 127)
    assert float((y - want).abs().max()) <= 1


# =============================================================================
# 11. pooling windows and counts
# =============================================================================


def ref_adaptive(x: torch.Tensor, out_size: tuple) -> tuple[list, list]:
    """Python loops over torch's adaptive windows [floor(i n / o), ceil((i + 1) n / o))."""
    dims = len(out_size)
    spatial = tuple(x.shape[x.dim() - dims :])
    sizes = [n if o is None else o for n, o in zip(spatial, out_size)]
    windows = [
        [((i * n) // o, -((-(i + 1) * n) // o)) for i in range(o)] for n, o in zip(spatial, sizes)
    ]
    xl = x.to(torch.int64).numpy().reshape(-1, *spatial)
    sums, counts = [], []
    for b in range(xl.shape[0]):
        for idx in np.ndindex(*sizes):
            win = [windows[d][i] for d, i in enumerate(idx)]
            block = xl[(b, *[slice(a, e) for a, e in win])]
            sums.append(int(block.sum()))
            counts.append(math.prod(e - a for a, e in win))
    return sums, counts


def test_window_sums_adaptive_doc_example():
    sums, counts = window_sums_adaptive(torch.arange(5.0).reshape(1, 1, 5), (2,))
    assert ref_adaptive(torch.arange(5.0).reshape(1, 1, 5), (2,)) == ([3, 9], [3, 3])
    assert (ints(sums), ints(counts)) == ([3, 9], [3, 3])


@fast(120)
@given(seed=SEEDS, spatial=st.lists(st.integers(1, 9), min_size=1, max_size=3), data=st.data())
def test_window_sums_adaptive(seed, spatial, data):
    out_size = tuple(data.draw(st.one_of(st.none(), st.integers(1, n + 3))) for n in spatial)
    gen = torch.Generator().manual_seed(seed)
    x = _rand_ints(gen, -128, 127, (2, 2, *spatial)).to(torch.float32)
    sums, counts = window_sums_adaptive(x, out_size)
    ref_sums, ref_counts = ref_adaptive(x, out_size)
    assert sums.shape == counts.shape
    assert ints(sums) == ref_sums
    assert ints(counts) == ref_counts
    # the reference windows are torch's: adaptive_avg_pool == sums / counts
    pool = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}
    size = tuple(n if o is None else o for n, o in zip(spatial, out_size))
    avg = pool[len(spatial)](x.to(torch.float64), size)
    expect = torch.tensor(ref_sums, dtype=torch.float64) / torch.tensor(
        ref_counts, dtype=torch.float64
    )
    assert torch.allclose(avg.reshape(-1), expect, rtol=0, atol=1e-9)


def _pool_out(n, k, s, p, ceil_mode):
    num = n + 2 * p - k
    out = (-(-num // s) if ceil_mode else num // s) + 1
    if ceil_mode and (out - 1) * s >= n + p:
        out -= 1
    return out


def ref_avg_pool_counts(shape, k, s, p, ceil_mode, count_include_pad, divisor_override):
    """torch's avg_pool divisor per output (aten AvgPool kernels), reimplemented."""
    outs = [_pool_out(n, kk, ss, pp, ceil_mode) for n, kk, ss, pp in zip(shape, k, s, p)]
    counts, windows = [], []
    for idx in np.ndindex(*outs):
        pool_size, real, clipped = 1, 1, []
        for o, n, kk, ss, pp in zip(idx, shape, k, s, p):
            start = o * ss - pp
            end = min(start + kk, n + pp)
            pool_size *= end - start
            start, end = max(start, 0), min(end, n)
            real *= end - start
            clipped.append((start, end))
        if divisor_override:
            counts.append(divisor_override)
        else:
            counts.append(pool_size if count_include_pad else real)
        windows.append(clipped)
    return outs, counts, windows


@fast(150)
@given(
    seed=SEEDS,
    dims=st.sampled_from([1, 2]),
    data=st.data(),
    ceil_mode=st.booleans(),
    count_include_pad=st.booleans(),
    divisor_override=st.one_of(st.none(), st.integers(1, 7)),
    march=st.sampled_from(["bayes", "bernoulli2"]),
    s_x=st.floats(min_value=2.0**-8, max_value=0.25),
    ratio=st.floats(min_value=0.3, max_value=3.0),
)
def test_avg_pool_counts_and_output(
    seed, dims, data, ceil_mode, count_include_pad, divisor_override, march, s_x, ratio
):
    k = tuple(data.draw(st.integers(1, 4)) for _ in range(dims))
    s = tuple(data.draw(st.integers(1, 3)) for _ in range(dims))
    p = tuple(data.draw(st.integers(0, kk // 2)) for kk in k)
    shape = tuple(data.draw(st.integers(max(1, kk - 2 * pp), 8)) for kk, pp in zip(k, p))
    if dims == 1:
        divisor_override = None  # avg_pool1d has no divisor_override
    if march == "bernoulli2":
        s_x, ratio = 2.0 ** round(math.log2(s_x)), 2.0 ** round(math.log2(ratio))
    s_x = float(np.float32(s_x))
    s_y = float(np.float32(s_x * ratio))
    gen = torch.Generator().manual_seed(seed)
    x = _rand_ints(gen, -128, 127, (2, 3, *shape), torch.int8)
    outs, counts, windows = ref_avg_pool_counts(
        shape, k, s, p, ceil_mode, count_include_pad, divisor_override
    )
    # reference window sums by loops
    xl = x.to(torch.int64)
    sums = torch.zeros((2, 3, *outs), dtype=torch.int64)
    for flat, win in enumerate(windows):
        idx = tuple(int(i) for i in np.unravel_index(flat, outs))
        sl = tuple(slice(a, b) for a, b in win)
        sums[(slice(None), slice(None), *idx)] = xl[(slice(None), slice(None), *sl)].sum(
            tuple(range(2, 2 + dims))
        )
    args = (k, s, p, ceil_mode, count_include_pad)
    fn = F.avg_pool1d if dims == 1 else F.avg_pool2d
    # the reimplemented counts are torch's: avg_pool(x) * count == window sum
    extra = () if dims == 1 else (divisor_override,)
    torch_avg = fn(x.to(torch.float64), *args, *extra)
    assert torch_avg.shape == sums.shape
    count_t = torch.tensor(counts, dtype=torch.float64).reshape(outs)
    assert torch.allclose(torch_avg * count_t, sums.to(torch.float64), rtol=0, atol=1e-9)
    # the integer module: Y = sat(shift_round(sum * M_d, S_d)), M_d 2**-S_d ~ s_x / (d s_y)
    spec = spec_for(march)
    mod = _functional_module(AvgPool, fn, s_y, fxq.qint8, march=spec.march)
    sx32, sy32 = float(np.float32(s_x)), float(np.float32(s_y))
    got = mod(QTensor(x, torch.tensor([s_x]), fxq.qint8), *args, *extra)
    got = got.int_repr().to(torch.int64)
    mults = {}
    for d in set(counts):
        mults[d] = ref_multiplier(sx32 / (d * sy32), spec.multiplier_bits, *spec.shift_range)
    assert all(v is not None for v in mults.values())
    for flat, d in enumerate(counts):
        idx = tuple(int(i) for i in np.unravel_index(flat, outs))
        m, sh = mults[d]
        for b in range(2):
            for c in range(3):
                v = int(sums[(b, c, *idx)])
                want = clamp(ref_scale_round(v, m, sh, HALF_UP), -128, 127)
                assert int(got[(b, c, *idx)]) == want, (idx, d, v)


# =============================================================================
# 12. quantize
# =============================================================================


@fast(100)
@given(
    ks=st.lists(st.integers(-(1 << 20), 1 << 20), min_size=1, max_size=20),
    e=st.integers(-12, 4),
    dtype=st.sampled_from([fxq.qint8, fxq.qint16, fxq.qint32]),
    rounding=ROUNDINGS,
    x_dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_quantize_ties_with_power_of_two_scales(ks, e, dtype, rounding, x_dtype):
    """x / s = k + 1/2 exactly: half up goes to k + 1 (also for negative k)."""
    s = 2.0**e
    x = torch.tensor([(k + 0.5) * s for k in ks], dtype=x_dtype)
    got = qf.quantize(x, torch.tensor([s]), dtype, rounding)
    assert got.dtype == dtype.storage
    want = [clamp(ref_round(Fraction(2 * k + 1, 2), rounding), dtype.qmin, dtype.qmax) for k in ks]
    assert got.tolist() == want
    if rounding is HALF_UP:
        assert all(w == clamp(k + 1, dtype.qmin, dtype.qmax) for w, k in zip(want, ks))


def _divides_in_float64_differs(x: float, scale: float, x_dtype, dtype, rounding) -> bool:
    """Whether a float32 input quantized to qint32 hits the spec disagreement of
    test_bug_quantize_float32_to_qint32_divides_in_float64 (excluded from the random
    tests so that they check everything else)."""
    if not (dtype is fxq.qint32 and x_dtype is torch.float32):
        return False
    d32 = float(np.float32(x) / np.float32(scale))
    d64 = float(np.float64(np.float32(x)) / np.float64(np.float32(scale)))
    return ref_round(Fraction(d32), rounding) != ref_round(Fraction(d64), rounding)


@fast(150)
@given(
    values=st.lists(
        st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32), min_size=1, max_size=12
    ),
    scales=st.lists(
        st.floats(min_value=2.0**-13, max_value=10.0, width=32), min_size=1, max_size=3
    ),
    dtype=st.sampled_from([fxq.qint8, fxq.qint16, fxq.qint32]),
    rounding=ROUNDINGS,
    x_dtype=st.sampled_from([torch.float32, torch.float64]),
    as_float=st.booleans(),
)
def test_quantize_matches_fraction(values, scales, dtype, rounding, x_dtype, as_float):
    """sat(round(x / s)) with x / s an IEEE division in x's dtype (per tensor and per channel)."""
    channels = len(scales)
    x = torch.tensor([values] * channels, dtype=x_dtype)  # (C, n), channel axis 0
    s = torch.tensor(scales, dtype=torch.float32)
    np_dt = np.float32 if x_dtype is torch.float32 else np.float64
    want = []
    for c in range(channels):
        row = []
        for v in values:
            d = float(np_dt(v) / np_dt(scales[c]))  # the IEEE division the spec prescribes
            if _divides_in_float64_differs(v, scales[c], x_dtype, dtype, rounding):
                return
            row.append(clamp(ref_round(Fraction(d), rounding), dtype.qmin, dtype.qmax))
        want.append(row)
    got = qf.quantize(x, s, dtype, rounding, ch_axis=0, as_float=as_float)
    assert got.dtype == (torch.float32 if as_float else dtype.storage)
    if as_float and dtype is fxq.qint32:
        want = [[float(np.float32(v)) for v in row] for row in want]
    assert got.tolist() == want


@fast(200)
@given(
    ks=st.lists(st.integers(-40_000, 40_000), min_size=1, max_size=16),
    scale=st.floats(min_value=2.0**-13, max_value=10.0, width=32),
    dtype=st.sampled_from([fxq.qint8, fxq.qint16, fxq.qint32]),
    x_dtype=st.sampled_from([torch.float32, torch.float64]),
    rounding=ROUNDINGS,
)
def test_quantize_near_ties_any_scale(ks, scale, dtype, x_dtype, rounding):
    """x = (k + 1/2) * s rounded to x's dtype, and its two float neighbours: whether x / s
    lands on, above or below the tie is decided by the IEEE division in x's dtype."""
    np_dt = np.float32 if x_dtype is torch.float32 else np.float64
    s = np_dt(scale)
    xs = []
    for k in ks:
        x = np_dt((k + 0.5) * float(s))
        xs += [x, np.nextafter(x, np_dt(np.inf)), np.nextafter(x, np_dt(-np.inf))]
    want = []
    for x in xs:
        if _divides_in_float64_differs(float(x), float(s), x_dtype, dtype, rounding):
            return
        d = float(x / s)  # numpy: the IEEE division in x's dtype
        want.append(clamp(ref_round(Fraction(d), rounding), dtype.qmin, dtype.qmax))
    got = qf.quantize(
        torch.tensor([float(x) for x in xs], dtype=x_dtype), torch.tensor([scale]), dtype, rounding
    )
    assert got.tolist() == want


def test_bug_quantize_float32_to_qint32_divides_in_float64():
    """KNOWN SPEC DISAGREEMENT (expected to fail with the current kernel): docs section 3
    says ``x / s`` is "an IEEE division in x's dtype". For ``dtype.bits > 24``
    ``quantize`` now converts a float32 ``x`` to float64 *before* dividing (to clamp at
    ``2**31 - 1`` exactly), so the division is done in float64. Example: float32
    ``x = 464259.625``, ``s = float32(0.5666308...)``: in float32 ``x / s = 819333.5``
    exactly, which rounds half up to 819334; in float64 ``x / s = 819333.49999...``, so
    the kernel returns 819333. Either divide in x's dtype and convert the quotient to
    float64 for the rounding and clamp, or change the doc.
    """
    x = np.float32(464259.625)
    s = np.float32(0.5666308403015137)
    assert float(x / s) == 819333.5  # the float32 quotient is an exact tie
    got = qf.quantize(torch.tensor([float(x)]), torch.tensor([float(s)]), fxq.qint32, HALF_UP)
    assert got.tolist() == [819334]


def test_quantize_doc_example_and_saturation():
    got = qf.quantize(
        torch.tensor([0.125, -0.125, 0.375, -0.375, 100.0, -100.0]),
        torch.tensor([0.25]),
        fxq.qint8,
        HALF_UP,
    )
    assert got.tolist() == [1, 0, 2, -1, 127, -128]
    big = torch.tensor([1e30, -1e30, 40000.0, -40000.0], dtype=torch.float64)
    assert qf.quantize(big, torch.tensor([1.0]), fxq.qint16, HALF_UP).tolist() == [
        32767,
        -32768,
        32767,
        -32768,
    ]
    assert qf.quantize(big, torch.tensor([1.0]), fxq.qint32, HALF_UP).tolist() == [
        INT32_MAX,
        INT32_MIN,
        40000,
        -40000,
    ]


@pytest.mark.parametrize(
    "x, x_dtype, dtype, want",
    [
        (0.5 - 2.0**-25, torch.float32, fxq.qint8, 0),
        (0.5 - 2.0**-54, torch.float64, fxq.qint32, 0),
        (-(0.5 + 2.0**-24), torch.float32, fxq.qint8, -1),
        (2.0**23 + 1, torch.float32, fxq.qint32, 2**23 + 1),
        (-(2.0**23) - 1, torch.float32, fxq.qint32, -(2**23) - 1),
        (2.0**52 + 1, torch.float64, fxq.qint32, INT32_MAX),
    ],
)
def test_quantize_rounds_exactly_where_x_plus_half_is_inexact(x, x_dtype, dtype, want):
    """round(x) = floor(x + 1/2) of the exact x (docs section 1). Regression: computed as
    ``floor(x + 0.5)`` in x's precision, ``0.49999997 + 0.5`` rounded to 1.0 (giving 1),
    and odd integers in [2**23, 2**24) became the next even integer."""
    assert clamp(ref_round(Fraction(x), HALF_UP), dtype.qmin, dtype.qmax) == want
    got = qf.quantize(torch.tensor([x], dtype=x_dtype), torch.tensor([1.0]), dtype, HALF_UP)
    assert got.tolist() == [want]


@fast(100)
@given(
    x=st.one_of(
        st.floats(allow_nan=False, allow_infinity=False, width=32),
        st.floats(min_value=-(2.0**25), max_value=2.0**25, width=32),
        st.integers(-(2**24), 2**24).map(lambda k: k / 2),
        st.just(0.5 - 2.0**-25),
    ),
    x_dtype=st.sampled_from([torch.float32, torch.float64]),
    rounding=ROUNDINGS,
)
def test_round_float_matches_fraction(x, x_dtype, rounding):
    v = float(np.float32(x)) if x_dtype is torch.float32 else x
    got = qf.round_float(torch.tensor([v], dtype=x_dtype), rounding)
    assert got.dtype == x_dtype
    assert got.item() == ref_round(Fraction(v), rounding)


@pytest.mark.parametrize("as_float", [False, True])
def test_quantize_qint32_saturates_float32_input(as_float):
    """sat32 of a float32 input (regression: ``2**31 - 1`` rounded to ``2**31`` in float32
    and ``.to(torch.int32)`` wrapped, so ``quantize(3e9, 1.0, qint32)`` gave -2**31).
    With ``as_float=True`` the result ``2**31`` is the nearest float32 to ``2**31 - 1``."""
    x = torch.tensor([3e9, 262144.0, -3e9, 2.0**31])
    got = qf.quantize(x, torch.tensor([1.0]), fxq.qint32, HALF_UP, as_float=as_float)
    want = [INT32_MAX, 262144, INT32_MIN, INT32_MAX]
    if as_float:
        assert got.tolist() == [float(np.float32(v)) for v in want]
    else:
        assert got.tolist() == want


def test_pow2_and_ldexp_are_exact_powers_of_two():
    """Built from bits, not ``torch.pow`` (whose CUDA kernel is not exact for every exponent)."""
    e = torch.arange(-1023, 1024)
    assert qf.pow2(e).dtype is torch.float64
    assert qf.pow2(e).tolist() == [math.ldexp(1.0, int(k)) for k in e]
    m = torch.tensor([1, 255, 32767, -12345], dtype=torch.int64)
    shifts = torch.tensor([0, 31, -7, 60])
    expected = [math.ldexp(float(a), -int(b)) for a, b in zip(m, shifts)]
    assert qf.ldexp(m, -shifts).tolist() == expected
    beyond = qf.pow2(torch.tensor([1024, 5000, -1100, -5000])).tolist()
    assert beyond == [math.inf, math.inf, 0.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_power_of_two_scales_round_up_exactly(dtype):
    scale = torch.tensor([0.25, 0.2500001, 0.3, 1.0, 1.5, 3e-30, 0.0], dtype=dtype)
    got = qf.constrain_scale(scale, qf.ScaleConstraint.POWER_OF_TWO)
    assert got.dtype is dtype
    assert got.tolist() == [0.25, 0.5, 0.5, 1.0, 2.0, 2.0**-98, 0.0]
