"""fxq's integer arithmetic, in one place.

Every formula in ``docs/arithmetic.md`` is implemented here once; the QAT
modules (fake quantization), the VALIDATION simulation and the converted
integer modules all call these functions, so they cannot drift apart.

Conventions:

* A quantized value is ``q * scale`` with integer ``q`` and zero point 0.
* ``scale`` is a float32 tensor of shape ``[1]`` (per tensor) or ``[C]``
  (per channel along ``ch_axis``).
* Integer tensors that may overflow their storage type are computed in
  int64; results are saturated to the target dtype explicitly.
* Rounding is a ``fxq.march.Rounding``: ``HALF_UP`` is ``floor(x + 1/2)``,
  which for an integer ``v`` shifted right by ``n`` is
  ``(v + (1 << (n - 1))) >> n`` (arithmetic shift).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

from fxq.dtypes import QDType
from fxq.march.spec import MarchSpec, Rounding, ScaleConstraint

_T = TypeVar("_T")

__all__ = [
    "broadcast_scale",
    "round_float",
    "quantize",
    "division_dtype",
    "dequantize",
    "fake_quantize",
    "constrain_scale",
    "shift_round",
    "quantize_multiplier",
    "requantize",
    "MultiplierRangeError",
    "swap_group_axes",
]


def broadcast_scale(scale: Tensor, ndim: int, ch_axis: int | None) -> Tensor:
    """Reshape a ``[1]`` or ``[C]`` scale so it broadcasts against an ``ndim`` tensor.

    Args:
        scale: per-tensor (numel 1) or per-channel scale.
        ndim: rank of the tensor the scale applies to.
        ch_axis: channel axis for a per-channel scale (negative allowed); ignored
            when the scale has one element.
    """
    if ch_axis is None or scale.numel() == 1:
        return scale.reshape(()) if scale.dim() else scale
    axis = ch_axis % ndim
    shape = [1] * ndim
    shape[axis] = scale.numel()
    return scale.reshape(shape)


def round_float(x: Tensor, rounding: Rounding, inplace: bool = False, exact: bool = True) -> Tensor:
    """Round a float tensor to integral values with the march's rounding.

    ``HALF_UP`` is ``floor(x + 1/2)`` of the exact value of ``x``, computed as
    ``floor(x) + (x - floor(x) >= 1/2)`` (exact: ``x - floor(x)`` is exact).
    With ``exact=False`` it is ``floor(x + 0.5)`` in floating point: fewer
    passes, and equal whenever ``x + 0.5`` is exact, as in requantization
    where ``x`` has at most 47 significant bits in float64; it differs only
    for the largest float below 1/2 (``0.5 - 2**-25`` in float32 rounds to 1).
    ``HALF_EVEN`` is ``torch.round``, which is exact. The result keeps the
    float dtype.
    """
    if rounding is Rounding.HALF_UP:
        if not exact:
            return x.add_(0.5).floor_() if inplace else torch.floor(x + 0.5)
        low = torch.floor(x)
        # ``ge_`` writes 1.0 / 0.0 into the fraction: adding a bool tensor is several times
        # slower; in place the result ends in ``x``'s memory (low + 0 or 1 is exact)
        if inplace:
            return x.sub_(low).ge_(0.5).add_(low)
        if torch.compiler.is_compiling():  # out of place: see ``fake_quantize``
            return low + (x - low).ge(0.5).to(low.dtype)
        return low.add_((x - low).ge_(0.5))
    if rounding is Rounding.HALF_EVEN:
        return x.round_() if inplace else torch.round(x)
    raise ValueError(f"unknown rounding {rounding!r}")


def quantize(
    x: Tensor,
    scale: Tensor,
    dtype: QDType,
    rounding: Rounding,
    ch_axis: int | None = None,
    as_float: bool = False,
    offset: int = 0,
) -> Tensor:
    """Quantize a tensor: ``clamp(round(x / scale), qmin, qmax)``.

    With an ``offset`` (an unsigned range stored shifted, ``FakeQuantize.offset``):
    ``clamp(round(x / scale), qmin + offset, qmax + offset) - offset``.

    The division is an IEEE division in float32 or float64, so the result is
    the same on every device. This is the one formula used by fake
    quantization, by the VALIDATION simulation and by the converted model's
    quantize stub.

    ``x`` of any dtype is first converted *exactly* to the dtype the division
    runs in (``division_dtype``): float16 / bfloat16 and integers of up to
    16 bits (uint8 camera frames) to float32, so they quantize exactly like the
    same values given in float32; wider integers to float64. float32 and
    float64 inputs divide in their own dtype. The scale is never cast to an
    integer or half-precision dtype.

    Returns:
        an integer tensor of ``dtype.storage`` with ``x``'s shape (float32
        holding the same integers when ``as_float``).
    """
    x = x.to(division_dtype(x.dtype))
    s = broadcast_scale(scale.to(x.dtype), x.dim(), ch_axis)
    v = x / s
    if dtype.bits > 24 and v.dtype is not torch.float64:
        # int32 bounds are not float32 numbers (2**31 - 1 rounds to 2**31): round and clamp the
        # quotient in float64 (the division itself stays in x's dtype)
        v = v.to(torch.float64)
    v = round_float(v, rounding, inplace=True).clamp_(dtype.qmin + offset, dtype.qmax + offset)
    if offset:
        v = v.sub_(offset)
    return v.to(torch.float32) if as_float else v.to(dtype.storage)


def division_dtype(dtype: torch.dtype) -> torch.dtype:
    """The float dtype ``quantize`` divides in for inputs of ``dtype``.

    float32 for every dtype whose values float32 holds exactly (floats of up
    to 32 bits, bool, integers of up to 16 bits), else float64.

    Raises:
        TypeError: for a complex dtype.
    """
    if dtype.is_complex:
        raise TypeError(f"cannot quantize a complex tensor ({dtype})")
    if dtype.is_floating_point:
        exact = torch.finfo(dtype).bits <= 32
    else:  # float32 holds every integer of up to 24 bits
        exact = dtype is torch.bool or torch.iinfo(dtype).bits <= 16
    return torch.float32 if exact else torch.float64


def dequantize(q: Tensor, scale: Tensor, ch_axis: int | None = None) -> Tensor:
    """``q * scale`` in float32 (float64 when ``scale`` is float64)."""
    dt = scale.dtype if scale.dtype.is_floating_point else torch.float32
    s = broadcast_scale(scale, q.dim(), ch_axis)
    return q.to(dt) * s


def fake_quantize(
    x: Tensor,
    scale: Tensor,
    qmin: int,
    qmax: int,
    rounding: Rounding,
    ch_axis: int | None = None,
    exact: bool = True,
    with_mask: bool = True,
    inplace: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Quantize and dequantize in float, without autograd.

    ``exact=False`` (QAT training) multiplies by ``1 / s`` and rounds with the
    faster ``floor(v + 0.5)`` (see ``round_float``); VALIDATION uses the exact
    division and rounding of ``quantize``. ``inplace`` (without the mask only) writes
    the result into ``x``, which must have the result's dtype.

    Returns:
        ``(out, mask)``: ``out = clamp(round(x / s), qmin, qmax) * s`` and a bool
        mask that is True where ``round(x / s)`` lay inside ``[qmin, qmax]``
        (the straight-through estimator passes gradients there); ``None`` when
        not ``with_mask`` (no gradient wanted: one pass less).
    """
    if not exact and rounding is Rounding.HALF_UP and x.device.type == "cpu":
        from fxq.quantized import native  # the same numbers in one pass (eager CPU float32)

        done = native.fake_quantize(
            x, scale, ch_axis, qmin, qmax, with_mask, inplace and not with_mask
        )
        if done is not None:
            return done
    s = broadcast_scale(scale.to(x.dtype), x.dim(), ch_axis)
    # In eager the steps write into the tensors they made (fewer allocations). A compiled
    # graph computes out of place: the compiler fuses the steps into one kernel anyway, and
    # torch 2.11's dynamo gave an ``autograd.Function`` whose result an in-place op wrote a
    # zero gradient (every parameter of a compiled QAT step; fine in 2.13 and 2.14).
    in_place = not torch.compiler.is_compiling()
    # exact: the IEEE division of ``quantize``; training: multiply by the reciprocal (cheaper)
    if inplace and not with_mask and in_place:
        v = x.div_(s) if exact else x.mul_(s.reciprocal())
    else:
        v = x / s if exact else x * s.reciprocal()
    v = round_float(v, rounding, inplace=in_place, exact=exact)
    if not with_mask:
        return (v.clamp_(qmin, qmax).mul_(s) if in_place else v.clamp(qmin, qmax) * s), None
    clamped = v.clamp(qmin, qmax)
    mask = clamped == v
    return (clamped.mul_(s) if in_place else clamped * s), mask


def constrain_scale(scale: Tensor, constraint: ScaleConstraint) -> Tensor:
    """Round a scale up to what the march can represent.

    ``POWER_OF_TWO`` returns ``2 ** ceil(log2(scale))`` so that the quantized
    range still covers the observed range.
    """
    if constraint is ScaleConstraint.ANY:
        return scale
    if constraint is ScaleConstraint.POWER_OF_TWO:
        # from frexp, exactly (exp2 / log2 are not exact on every device)
        mant, exp = torch.frexp(scale)
        one = torch.ones(scale.shape, dtype=torch.float64, device=scale.device)
        up = ldexp(one, exp.to(torch.int64) - (mant == 0.5).to(torch.int64)).to(scale.dtype)
        return torch.where(torch.isfinite(scale) & (scale > 0), up, scale)
    raise ValueError(f"unknown scale constraint {constraint!r}")


def shift_round(v: Tensor, shift: Tensor | int, rounding: Rounding) -> Tensor:
    """Arithmetic right shift of an int64 tensor with rounding.

    ``HALF_UP``: ``(v + (1 << shift) // 2) >> shift``; a shift of 0 is the identity.
    ``HALF_EVEN``: the same, then ties (remainder exactly half) go to the even result.

    Args:
        v: int64 tensor.
        shift: non-negative int or int64 tensor broadcastable against ``v``.
    """
    shift_t = torch.as_tensor(shift, dtype=torch.int64, device=v.device)
    one = torch.ones((), dtype=torch.int64, device=v.device)
    half = torch.bitwise_left_shift(one, shift_t) >> 1
    out = (v + half) >> shift_t
    if rounding is Rounding.HALF_UP:
        return out
    if rounding is Rounding.HALF_EVEN:
        mask = torch.bitwise_left_shift(one, shift_t) - 1
        tie = ((v & mask) == half) & (shift_t > 0)
        return out - (tie & ((out & 1) == 1)).to(torch.int64)
    raise ValueError(f"unknown rounding {rounding!r}")


def pow2(exponent: Tensor) -> Tensor:
    """``2**exponent`` for integer exponents as float64, exact on every device.

    A product of exact powers of two (one factor per bit of ``|exponent|``), so only
    exact multiplications: ``torch.ldexp`` multiplies by ``torch.pow(2, e)``, whose CUDA
    kernel is not exact for every integer ``e`` (it made one requantized value in 65536
    of a ResNet-18 differ by one step between CUDA and the CPU). Exact for
    ``|exponent| <= 1023``; beyond, inf above and 0 below (subnormals are not formed).
    """
    e = exponent.to(torch.int64)
    magnitude = e.abs().clamp(max=2047)
    out = torch.ones(e.shape, dtype=torch.float64, device=e.device)
    for bit in range(10):
        out = torch.where((magnitude >> bit) & 1 == 1, out * 2.0 ** (1 << bit), out)
    out = torch.where(magnitude >= 1024, out * 2.0**512 * 2.0**512, out)  # overflows to inf
    return torch.where(e < 0, 1.0 / out, out)


def ldexp(x: Tensor, exponent: Tensor) -> Tensor:
    """``x * 2**exponent`` in float64, exact (no overflow or underflow) on every device.

    On the CPU this is ``torch.ldexp`` (exact there: the property tests compare it with
    exact fractions), elsewhere a multiplication by ``pow2(exponent)``. The result is on
    ``x``'s device.
    """
    x = x.to(torch.float64)
    if x.device.type == "cpu" and exponent.device.type == "cpu":
        return torch.ldexp(x, exponent.to(torch.float64))
    return x * pow2(exponent.to(x.device))


#: results of ``memo_by_identity``, oldest first
_MEMO: OrderedDict[tuple, tuple] = OrderedDict()
_MEMO_SIZE = 1024


def memo_by_identity(tag: str, tensors: Sequence[Tensor], build: Callable[[], _T]) -> _T:
    """``build()``, remembered while the same ``tensors`` (the objects themselves) keep
    their contents (their version counters).

    For values an integer module recomputes on every call from its own buffers, where
    recomputing costs kernel launches or a host sync on a GPU (``requant_factor``,
    ``base.same_scale``). The entry holds the tensors, so an id cannot be reused while it
    is remembered. Graph captures, tensor subclasses (fake tensors) and tensors without a
    version counter (made in inference mode) are not remembered.
    """
    if (
        torch.compiler.is_compiling()
        or torch._C._get_tracing_state() is not None
        or any(type(t) is not Tensor for t in tensors)
    ):
        return build()
    try:
        key = (tag,) + tuple((id(t), t._version) for t in tensors)
    except RuntimeError:  # inference tensors track no version
        return build()
    hit = _MEMO.get(key)
    if hit is not None:
        _MEMO.move_to_end(key)
        return hit[1]
    value = build()
    _MEMO[key] = (tuple(tensors), value)
    if len(_MEMO) > _MEMO_SIZE:
        _MEMO.popitem(last=False)
    return value


def host_float(t: Tensor) -> float:
    """``float(t)`` of a one-element tensor. Off the CPU, reading a value waits for the
    device, so it is remembered while ``t`` keeps its contents (``memo_by_identity``)."""
    if t.device.type == "cpu":
        return float(t)
    return memo_by_identity("float", (t,), lambda: float(t))


def requant_factor(multiplier: Tensor, shift: Tensor, device: torch.device) -> Tensor:
    """``multiplier * 2**-shift`` as exact float64 on ``device`` (``ldexp``).

    Off the CPU ``ldexp`` is some 30 small kernels (``pow2``), so the factor is
    remembered for the same multiplier and shift tensors (``memo_by_identity``).
    """
    if device.type == "cpu":
        return ldexp(multiplier.to(device), -shift)
    return memo_by_identity(
        f"factor:{device}", (multiplier, shift), lambda: ldexp(multiplier.to(device), -shift)
    )


class MultiplierRangeError(ValueError):
    """A requantization factor cannot be represented by the march's multiplier."""


def quantize_multiplier(
    real: Tensor, spec: MarchSpec, left_shift: bool = False
) -> tuple[Tensor, Tensor]:
    """Represent positive real factors as ``m * 2**-shift`` with integer ``m``.

    ``m`` is the largest-precision multiplier that fits ``spec.multiplier_bits``
    (signed, so ``m <= 2**(bits-1) - 1``) and ``shift`` lies in
    ``spec.shift_range``. ``m`` is rounded half up from the exact float64 value
    ``real * 2**shift``.

    Args:
        real: float64 tensor of factors ``>= 0`` (computed on any device; the
            computation is exact float64 arithmetic, so it is device independent).
        spec: the march.
        left_shift: allow negative shifts (a left shift, for factors above the
            largest multiplier, such as a residual brought into the accumulator's
            much finer scale).

    Returns:
        ``(m, shift)`` as int64 tensors shaped like ``real``.

    Raises:
        MultiplierRangeError: when a factor is too large for the smallest shift.
    """
    real = real.to(torch.float64)
    if (real < 0).any() or not torch.isfinite(real).all():
        raise MultiplierRangeError(f"requantization factors must be finite and >= 0, got {real}")
    bits = spec.multiplier_bits
    lo, hi = spec.shift_range
    if left_shift:
        lo = -31
    _, exp = torch.frexp(real)  # real = mant * 2**exp, mant in [0.5, 1)
    shift = (bits - 1) - exp.to(torch.int64)
    shift = shift.clamp(lo, hi)
    # half up of the exact value: floor(x + 0.5) would round the largest float below 1/2
    # up, which a factor clamped at the largest shift can be
    m = round_float(ldexp(real, shift), Rounding.HALF_UP).to(torch.int64)
    # rounding can carry to 2**(bits-1): drop one bit of precision there
    carry = (m > spec.max_multiplier) & (shift > lo)
    shift = torch.where(carry, shift - 1, shift)
    m = round_float(ldexp(real, shift), Rounding.HALF_UP).to(torch.int64)
    if (m > spec.max_multiplier).any():
        worst = real.max().item()
        raise MultiplierRangeError(
            f"requantization factor {worst:.6g} exceeds what march "
            f"{spec.march.value} can represent ({spec.max_multiplier} * 2**-{lo}); "
            "the output scale is too small relative to the input scales"
        )
    zero = real == 0
    m = torch.where(zero, torch.zeros_like(m), m)
    shift = torch.where(zero, torch.full_like(shift, lo), shift)
    return m, shift


def requantize(
    acc: Tensor,
    multiplier: Tensor,
    shift: Tensor,
    qmin: int,
    qmax: int,
    rounding: Rounding,
) -> Tensor:
    """``clamp(shift_round(acc * multiplier, shift), qmin, qmax)`` in int64.

    Args:
        acc: int64 accumulator.
        multiplier, shift: int64, broadcastable against ``acc`` (per channel
            reshaped by the caller).
    """
    return shift_round(acc * multiplier, shift, rounding).clamp_(qmin, qmax)


def swap_group_axes(w: Tensor, groups: int) -> Tensor:
    """Swap a grouped weight's first two axes within each group.

    A transposed conv's weight is ``[in, out / groups, *k]`` with output
    channel ``o = g * (out / groups) + j``; this gives the out-major
    ``[out, in / groups, *k]`` layout (per-output-channel scales on axis 0),
    and applied again gives it back.
    """
    k = w.shape[2:]
    w = w.reshape(groups, w.shape[0] // groups, w.shape[1], *k).transpose(1, 2)
    return w.reshape(groups * w.shape[1], w.shape[2], *k)


# =============================================================================
# Exact accumulation with float kernels
# =============================================================================
#
# Conv, linear and matmul accumulate integer products. Float kernels compute
# them exactly when every partial sum is an integer below 2**24 (float32) or
# 2**53 (float64): then every rounding step of the kernel is exact, whatever
# the summation order. The bound on every partial sum is
# max|input| * max_c sum_k |W[c, k]| (plus |bias| when the kernel adds it), so
# it is proven per layer from the integer weights. When the bound is too large
# the input is split into limbs, q = sum_i limb_i * 2**(i * width), and each
# limb is accumulated separately; the limb results are combined in float64,
# exact below 2**53. Limbs are at most 8 bits wide in float32 so that even
# reduced-precision float modes (TF32, bf16 inputs) represent them exactly.
# On CUDA, cuDNN is switched off for these kernels (its Winograd / FFT
# algorithms are not exact); on the CPU, mkldnn runs direct convolution.

_F32_EXACT = 1 << 24
_F64_EXACT = 1 << 53
_F32_SAFE_OPERAND = 256  # bf16 / TF32 represent every integer up to 256 exactly


@dataclass(frozen=True)
class AccumulationPlan:
    """How an exact integer product-sum is computed with float kernels.

    Attributes:
        dtype: float32 or float64.
        limbs: number of limbs the first operand is split into (1: no split).
        width: bits per limb (unused when ``limbs == 1``).
        bound: proven bound on every partial sum of one limb's accumulation.
        bias_in_kernel: whether the bias can be added by the float kernel.
    """

    dtype: torch.dtype
    limbs: int
    width: int
    bound: int
    bias_in_kernel: bool

    def describe(self) -> str:
        kind = "float32" if self.dtype is torch.float32 else "float64"
        split = "" if self.limbs == 1 else f", {self.limbs} limbs of {self.width} bits"
        return f"{kind}{split} (partial sums <= {self.bound})"


def _limb_magnitude(bits: int, limbs: int, width: int) -> int:
    """Largest |limb| when a signed ``bits``-bit integer is split into ``limbs``."""
    if limbs == 1:
        return 1 << (bits - 1)
    top_bits = bits - width * (limbs - 1)  # signed top limb
    return max((1 << width) - 1, 1 << (top_bits - 1))


def plan_accumulation(
    input_bits: int, weight_abs_sum: int, bias_abs_max: int = 0, other_bits: int = 8
) -> AccumulationPlan:
    """Choose the cheapest exact way to accumulate a layer.

    Args:
        input_bits: bit width of the (signed) input, 8 or 16.
        weight_abs_sum: ``max_c sum_k |W[c, k]|`` of the integer weights (or,
            for a product of two activations, ``K * max|b|``).
        bias_abs_max: ``max |bias|`` (added by the kernel when it stays exact).
        other_bits: bit width of the second operand (weights: 8). Above 8 bits it
            is not exact in reduced-precision float32 modes, so float64 is used.

    Returns:
        float32 without a split when it is exact, else float32 with the fewest
        limbs up to four, else float64 with the fewest limbs.
    """
    for dtype, limit, max_limbs in (
        (torch.float32, _F32_EXACT, 4),
        (torch.float64, _F64_EXACT, input_bits),
    ):
        for limbs in range(1, max_limbs + 1):
            width = -(-input_bits // limbs)
            if limbs > 1 and width * (limbs - 1) >= input_bits:
                continue  # the top limb would be empty: the same split as fewer limbs
            magnitude = _limb_magnitude(input_bits, limbs, width)
            if dtype is torch.float32 and (magnitude > _F32_SAFE_OPERAND or other_bits > 8):
                continue
            bound = magnitude * weight_abs_sum
            if bound < limit:
                bias_ok = limbs == 1 and bound + bias_abs_max < limit
                return AccumulationPlan(dtype, limbs, width, bound, bias_ok)
    raise ValueError(
        f"no exact accumulation plan for sum |W| = {weight_abs_sum}"
    )  # pragma: no cover


def split_limbs(q: Tensor, limbs: int, width: int) -> list[Tensor]:
    """``q = sum_i limb_i * 2**(i*width)``: low limbs unsigned, the top limb signed."""
    if limbs == 1:
        return [q]
    v = q.to(torch.int32)
    mask = (1 << width) - 1
    out = []
    for i in range(limbs - 1):
        out.append((v >> (i * width)) & mask)
    out.append(v >> ((limbs - 1) * width))
    return out


def accumulate(
    op: Callable[[Tensor, Tensor, Tensor | None], Tensor],
    q: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    plan: AccumulationPlan,
    channel_axis: int = 1,
) -> Tensor:
    """Exact ``op(q, weight) + bias`` for integer operands, as a float tensor of integers.

    Args:
        op: the float kernel, called as ``op(input, weight, bias)`` (e.g. a conv
            with its hyperparameters bound).
        q: integer input; weight: integer weight; bias: integer bias or None.
        plan: from ``plan_accumulation``.
        channel_axis: output axis the bias runs along.

    Returns:
        float32 (single float32 limb) or float64 tensor holding exact integers.
    """
    if q.device.type == "cuda" and torch.backends.cudnn.enabled:
        # cuDNN may pick Winograd or FFT algorithms, which are not exact on integers; without
        # it torch runs im2col + GEMM (``conv_as_gemm``), exact under the same bounds
        with torch.backends.cudnn.flags(enabled=False), _tensor_core_gemms(plan):
            return accumulate(op, q, weight, bias, plan, channel_axis)
    dt = plan.dtype
    w = weight.to(dt)
    if plan.limbs == 1:
        # on CUDA a kernel may add the bias through a GEMM that TF32 would round (transposed
        # convolutions do): there it is added after the kernel
        if bias is not None and plan.bias_in_kernel:
            if q.device.type == "cpu":
                return op(q.to(dt), w, bias.to(dt))
            # added here, exact in ``dt`` as in the kernel, in one pass
            out = op(q.to(dt), w, None)
            return out.add_(broadcast_scale(bias.to(dt), out.dim(), channel_axis))
        out = op(q.to(dt), w, None)
        if bias is None:
            return out
        return out.to(torch.float64) + broadcast_scale(
            bias.to(torch.float64), out.dim(), channel_axis
        )
    total = None
    for i, limb in enumerate(split_limbs(q, plan.limbs, plan.width)):
        part = op(limb.to(dt), w, None).to(torch.float64)
        total = (
            part * float(1 << (i * plan.width))
            if total is None
            else total.add_(part, alpha=float(1 << (i * plan.width)))
        )
    if bias is not None:
        total = total + broadcast_scale(bias.to(torch.float64), total.dim(), channel_axis)
    return total


@contextlib.contextmanager
def _tensor_core_gemms(plan: AccumulationPlan) -> Iterator[None]:
    """cuBLAS float32 GEMMs on TF32 tensor cores for a float32 plan.

    Exact: a float32 plan's operands are integers of at most 256 in magnitude (limbs of
    at most 8 bits, int8 weights), which TF32's 11 significant bits hold, so every
    product is exact, and the tensor cores accumulate in float32, where the plan proves
    every partial sum an integer below ``2**24``. Several times faster than float32 FMA
    GEMMs. Float64 plans are left as they are.
    """
    matmul = torch.backends.cuda.matmul
    if plan.dtype is not torch.float32 or matmul.allow_tf32:
        yield
        return
    matmul.allow_tf32 = True
    try:
        yield
    finally:
        matmul.allow_tf32 = False


#: elements of one im2col block of ``conv_as_gemm`` (a batch is split above it): 1 GiB
_GEMM_BLOCK_ELEMENTS = 1 << 28


def conv_as_gemm(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    stride: Sequence[int],
    pads: Sequence[Sequence[int]],
    dilation: Sequence[int],
    groups: int,
) -> Tensor:
    """A batched convolution of exact integers as one im2col copy and one matrix product.

    The result is ``F.conv{1,2,3}d``'s, bit for bit whenever ``accumulate``'s plan holds
    (every product and partial sum exact, so any summation order gives the same). On
    CUDA with cuDNN off (``accumulate``: its Winograd / FFT algorithms are not exact)
    torch convolves one image at a time, one im2col and one GEMM each; here the whole
    batch is one im2col copy and one batched GEMM (fewer kernels by the batch size).

    The columns are a strided view of the padded input, copied by the GEMM ("strided"), or
    for 1-d and 2-d convolutions on CUDA one of the Triton kernels of ``_im2col_triton``
    ("rows", "tiles"; they pad as they read). Which is fastest depends on the shape and the
    GPU (each lost by up to 40 % on some of ResNet-18's convolutions, and an H100 and an H200
    ranked them differently: ``benchmarks/im2col_speed.py``), so the first convolution of
    each geometry times them and keeps the fastest (``_fastest_im2col``), as cuDNN's
    benchmark mode picks algorithms: the same values whichever runs.

    Args:
        x: ``[N, C, *spatial]``; weight: ``[O, C / groups, *kernel]``; bias: ``[O]`` or None.
        stride, dilation: per spatial axis.
        pads: ``[before, after]`` zero padding per spatial axis (first axis first).
        groups: the convolution's groups.
    """
    d = weight.dim() - 2
    c = x.shape[1]
    o = weight.shape[0]
    kernel = weight.shape[2:]
    padded = [x.shape[2 + i] + pads[i][0] + pads[i][1] for i in range(d)]
    out = [(padded[i] - dilation[i] * (kernel[i] - 1) - 1) // stride[i] + 1 for i in range(d)]
    w = weight.reshape(groups, o // groups, c // groups * math.prod(kernel))

    def strided() -> Tensor:
        flat = [p for pair in reversed(pads) for p in pair]
        source = (F.pad(x, flat) if any(flat) else x).contiguous()
        sx = source.stride()
        strides = (
            sx[0],
            sx[1],
            *(sx[2 + i] * dilation[i] for i in range(d)),
            *(sx[2 + i] * stride[i] for i in range(d)),
        )
        return _gemm_blocks(
            source,
            w,
            bias,
            out,
            lambda block: block.as_strided((block.shape[0], c, *kernel, *out), strides),
        )

    ways: dict[str, Callable[[], Tensor]] = {"strided": strided}
    kernels = _triton_im2col(x, d, kernel, stride, out)
    if kernels is not None:
        geometry = _as_2d(kernel, out, stride, dilation, pads)
        as_2d = (lambda block: block) if d == 2 else (lambda block: block.unsqueeze(2))
        for method in kernels.METHODS:
            ways[method] = functools.partial(
                _gemm_blocks,
                x,
                w,
                bias,
                out,
                functools.partial(_triton_columns, kernels.im2col, as_2d, geometry, method),
            )
    if len(ways) == 1:
        return strided()
    key = (x.device, x.dtype, x.shape, x.stride(), w.shape, bias is None, *geometry)
    return _fastest_im2col(key, ways)


def _triton_columns(im2col, as_2d, geometry, method: str, block: Tensor) -> Tensor:
    return im2col(as_2d(block), *geometry, method=method)


def _gemm_blocks(
    x: Tensor,
    w: Tensor,
    bias: Tensor | None,
    out: Sequence[int],
    columns: Callable[[Tensor], Tensor],
) -> Tensor:
    """``conv_as_gemm``'s products: ``w`` ``[groups, O / groups, K]`` times the columns of
    each block of images (``columns(block)``, reshaped to ``[B, groups, K, L]``), blocks of at
    most ``_GEMM_BLOCK_ELEMENTS`` column elements, plus ``bias``."""
    groups, o_per_group, k_size = w.shape
    length = math.prod(out)
    step = max(1, _GEMM_BLOCK_ELEMENTS // max(1, groups * k_size * length))
    parts = []
    for first in range(0, x.shape[0], step):
        block = x[first : first + step]
        cols = columns(block).reshape(block.shape[0], groups, k_size, length)
        parts.append(torch.matmul(w, cols).reshape(block.shape[0], groups * o_per_group, *out))
    y = parts[0] if len(parts) == 1 else torch.cat(parts)
    if bias is not None:
        y = y + broadcast_scale(bias.to(y.dtype), y.dim(), 1)
    return y


def _as_2d(
    kernel: Sequence[int],
    out: Sequence[int],
    stride: Sequence[int],
    dilation: Sequence[int],
    pads: Sequence[Sequence[int]],
) -> tuple[tuple[int, int], ...]:
    """A 1-d or 2-d convolution's geometry as 2-d (a 1-d one has height 1): kernel, output
    size, stride, dilation and the padding before, each ``(h, w)``."""
    lead = (1,) * (2 - len(kernel))
    return (
        (*lead, *kernel),
        (*lead, *out),
        (*lead, *stride),
        (*lead, *dilation),
        (*(0,) * (2 - len(kernel)), *(p[0] for p in pads)),
    )


#: ``conv_as_gemm``'s im2col: None to time the ways and keep the fastest per geometry, or
#: one of "strided", "rows", "tiles" (where it can run: tests and benchmarks)
IM2COL_METHOD: str | None = None

#: the fastest im2col per convolution geometry (device, dtype, input shape and strides,
#: weight shape, bias, kernel / output / stride / dilation / padding), as timed
_IM2COL_CHOICES: dict[tuple, str] = {}

#: timed calls per way (after one untimed call, which compiles a Triton kernel); the fastest
#: call counts, as another kernel on the device can only slow a call down
_IM2COL_TIMED_CALLS = 5


def _fastest_im2col(key: tuple, ways: dict[str, Callable[[], Tensor]]) -> Tensor:
    """The convolution by the fastest of ``ways`` (each computes the same values): timed once
    per ``key`` on the device, then remembered. While a CUDA graph is being captured nothing
    can be timed: an unknown geometry then takes the strided copy (``graphed`` runs the model
    before capturing it, which times them)."""
    if IM2COL_METHOD is not None and IM2COL_METHOD in ways:
        return ways[IM2COL_METHOD]()
    chosen = _IM2COL_CHOICES.get(key)
    if chosen is not None:
        return ways[chosen]()
    if key[0].type == "cuda" and torch.cuda.is_current_stream_capturing():
        return ways["strided"]()
    result, best = None, None
    for name, way in ways.items():
        result = way()  # the first call also compiles the way's kernel
        seconds = _device_seconds(way, key[0], _IM2COL_TIMED_CALLS)
        if best is None or seconds < best[0]:
            best = (seconds, name)
    _IM2COL_CHOICES[key] = best[1]
    return result


def _device_seconds(fn: Callable[[], object], device: torch.device, calls: int) -> float:
    """The shortest of ``calls`` calls of ``fn`` on ``device`` (CUDA events on CUDA)."""
    if device.type != "cuda":
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(calls + 1)]
    events[0].record()
    for event in events[1:]:
        fn()
        event.record()
    events[-1].synchronize()
    return min(a.elapsed_time(b) for a, b in itertools.pairwise(events)) / 1e3


def _triton_im2col(
    x: Tensor, dims: int, kernel: Sequence[int], stride: Sequence[int], out: Sequence[int]
):
    """The module ``_im2col_triton`` where its kernels can make ``x``'s columns, else None:
    not a 1x1 kernel at stride 1 (whose columns are a view of the input, no copy), 1-d or
    2-d, within its launch grids and int32 indices, Triton to run on ``x``
    (``native.triton_runs_on``) and importable."""
    from fxq.quantized import native

    if dims > 2 or x.numel() >= 2**31 or not native.triton_runs_on(x):
        return None
    if all(k == 1 for k in kernel) and all(s == 1 for s in stride):
        return None
    kernels = _im2col_kernels()
    if kernels is None or not kernels.fits((1,) * (2 - dims) + tuple(out)):
        return None
    return kernels


@functools.cache
def _im2col_kernels():
    """The module ``_im2col_triton`` (None when Triton cannot be imported: asked once, not at
    every convolution)."""
    try:
        from fxq.quantized import _im2col_triton
    except ImportError:
        return None
    return _im2col_triton


# =============================================================================
# Requantization of exact float accumulators
# =============================================================================


def requantize_exact(
    acc: Tensor,
    multiplier: Tensor,
    shift: Tensor,
    dtype: QDType,
    rounding: Rounding,
    channel_axis: int | None = None,
    lo: int | None = None,
    hi: int | None = None,
    use_native: bool = True,
    as_float: bool = False,
) -> Tensor:
    """``clamp(shift_round(acc * m, shift), lo, hi)`` for an exact float accumulator.

    ``acc`` holds integers with ``|acc * m| < 2**53`` (callers saturate the
    accumulator to int32 first), so ``acc * m * 2**-shift`` is exact in float64
    and rounding it equals the integer shift with rounding.

    Args:
        acc: float32 / float64 tensor of integers.
        multiplier, shift: int64, one element or one per channel.
        dtype: output dtype (gives the default saturation bounds).
        channel_axis: axis of per-channel multipliers.
        lo, hi: tighter output bounds (fused ReLU / ReLU6).
        use_native: use the one-pass C kernel on the CPU when it is available
            (``fxq.quantized.native``; identical results).
        as_float: return the integers as exact float32 values (the form the
            next integer kernel reads) instead of in ``dtype.storage``.

    Returns:
        an integer tensor of ``dtype.storage``.
    """
    r = requant_factor(multiplier, shift, acc.device)
    lo = dtype.qmin if lo is None else max(lo, dtype.qmin)
    hi = dtype.qmax if hi is None else min(hi, dtype.qmax)
    if use_native and acc.is_floating_point():
        from fxq.quantized import native

        target = torch.float32 if as_float else dtype.storage
        out = native.requantize(
            acc, r, channel_axis, lo, hi, rounding is Rounding.HALF_EVEN, target
        )
        if out is not None:
            return out
    r = broadcast_scale(r, acc.dim(), channel_axis)
    v = round_float(acc.to(torch.float64) * r, rounding, inplace=True, exact=False)
    return v.clamp_(lo, hi).to(torch.float32 if as_float else dtype.storage)


def requantize_residual(
    acc: Tensor,
    residual: Tensor,
    residual_multiplier: Tensor,
    residual_shift: Tensor,
    multiplier: Tensor,
    shift: Tensor,
    dtype: QDType,
    rounding: Rounding,
    channel_axis: int,
    lo: int | None = None,
    hi: int | None = None,
    use_native: bool = True,
) -> Tensor:
    """Requantize ``sat32(acc + shift_round(residual * mr, kr))``; returns float32 integers.

    The residual term is rounded into the accumulator's scale first, so the
    sum is an exact integer (docs/arithmetic.md, fused add).
    """
    lo = dtype.qmin if lo is None else max(lo, dtype.qmin)
    hi = dtype.qmax if hi is None else min(hi, dtype.qmax)
    if use_native and acc.is_floating_point():
        from fxq.quantized import native

        r = requant_factor(multiplier, shift, acc.device)
        rr = requant_factor(residual_multiplier, residual_shift, acc.device)
        out = native.requantize_add(
            acc, residual, rr, r, channel_axis, lo, hi, rounding is Rounding.HALF_EVEN
        )
        if out is not None:
            return out
    term = rescale_term(residual, residual_multiplier, residual_shift, rounding, channel_axis)
    total = saturate_int32(acc.to(torch.float64) + term)
    return requantize_exact(
        total, multiplier, shift, dtype, rounding, channel_axis, lo, hi, use_native, True
    )


def saturate_int32(acc: Tensor) -> Tensor:
    """Clamp an exact accumulator to the int32 range (the accumulator saturates)."""
    return acc.clamp(-(1 << 31), (1 << 31) - 1)


def rescale_term(
    q: Tensor,
    multiplier: Tensor,
    shift: Tensor,
    rounding: Rounding,
    channel_axis: int | None = None,
) -> Tensor:
    """``shift_round(q * m, shift)`` as an exact float64 tensor (``|q * m| < 2**53``)."""
    r = requant_factor(multiplier, shift, q.device)
    r = broadcast_scale(r, q.dim(), channel_axis)
    return round_float(q.to(torch.float64) * r, rounding, inplace=True, exact=False)


def scale_ratio(numerator: Tensor, denominator: Tensor) -> Tensor:
    """``numerator / denominator`` in float64 (the real factor a multiplier approximates)."""
    return numerator.to(torch.float64) / denominator.to(torch.float64)


# =============================================================================
# Elementwise ops
# =============================================================================


def common_multipliers(ratios: list[Tensor], spec: MarchSpec) -> tuple[list[Tensor], Tensor]:
    """Multipliers ``m_i`` sharing one shift ``n`` with ``m_i * 2**-n ~ ratios[i]``.

    ``n`` is the shift that gives the largest ratio full multiplier precision;
    the others are rounded at the same shift (so they are exact to within
    ``2**-n``).
    """
    largest = torch.stack([r.to(torch.float64).abs().max() for r in ratios]).max()
    _, n = quantize_multiplier(largest.reshape(1), spec)
    ms = [torch.floor(ldexp(r, n) + 0.5).to(torch.int64) for r in ratios]
    return ms, n


def add_requant(
    terms: list[tuple[Tensor, Tensor]],
    constant: Tensor | None,
    shift: Tensor,
    dtype: QDType,
    rounding: Rounding,
) -> Tensor:
    """``clamp(shift_round(sum_i q_i * m_i + c, n))`` with exact float64 arithmetic.

    Args:
        terms: ``(q_i, m_i)`` pairs (integer tensors, broadcastable; m_i int64 scalars).
        constant: an int64 scalar added before the shift (a quantized scalar operand).
        shift: the common shift ``n``.
    """
    total = None
    for q, m in terms:
        t = q.to(torch.float64) * float(m)
        total = t if total is None else total + t
    if constant is not None:
        total = total + float(constant)
    v = round_float(ldexp(total, -shift), rounding, inplace=True, exact=False)
    return v.clamp_(dtype.qmin, dtype.qmax).to(dtype.storage)


# =============================================================================
# Resampling
# =============================================================================

INTERP_FRACTION_BITS = 8  # bilinear weights are multiples of 2**-8


def linear_weights(
    in_size: int, out_size: int, scale: float | None, align_corners: bool, device
) -> tuple[Tensor, Tensor, Tensor]:
    """Source indices and fixed-point weights of 1-D linear resampling.

    Coordinates follow ``torch.nn.functional.interpolate``; the weight of the
    right neighbour is ``round(lambda * 2**8)``, the left one gets the rest.

    Returns:
        ``(i0, i1, w1)``: int64 index tensors and the int64 right weights.
    """
    dst = torch.arange(out_size, dtype=torch.float64, device=device)
    if align_corners:
        ratio = (in_size - 1) / (out_size - 1) if out_size > 1 else 0.0
        src = dst * ratio
    else:
        ratio = (1.0 / scale) if scale is not None else in_size / out_size
        src = ((dst + 0.5) * ratio - 0.5).clamp(min=0.0)
    i0 = torch.floor(src).to(torch.int64).clamp(max=in_size - 1)
    i1 = (i0 + 1).clamp(max=in_size - 1)
    lam = src - i0.to(torch.float64)
    one = 1 << INTERP_FRACTION_BITS
    w1 = torch.floor(lam * one + 0.5).to(torch.int64).clamp(0, one)
    return i0, i1, w1


# =============================================================================
# Normalization and softmax (docs/arithmetic.md, sections 14 and 15)
# =============================================================================
#
# Every step is int64 arithmetic: sums, products, shifts with rounding, table
# lookups and one exact integer division. The tables are built once from exact
# rational arithmetic (Python integers), so every device and runtime gets the
# same entries.

#: rsqrt table: index bits ``T`` (mantissas in ``[2**(T-2), 2**T]``) and fraction bits ``F``
RSQRT_INDEX_BITS = 10
RSQRT_FRACTION_BITS = 19
#: exp2 table of softmax: ``2**EXP_FRACTION_BITS`` entries of ``round(2**15 * 2**(-f / 2**P))``
EXP_FRACTION_BITS = 8
EXP_ONE_BITS = 15
#: log table of log-softmax: mantissas in ``[2**(T-1), 2**T]``, values with ``LOG_FRACTION_BITS``
LOG_INDEX_BITS = 10
LOG_FRACTION_BITS = 16


def shift_round_signed(v: Tensor, shift: Tensor | int, rounding: Rounding) -> Tensor:
    """``shift_round`` for shifts of either sign: a negative shift is an exact left shift.

    Args:
        v: int64 tensor.
        shift: int or int64 tensor broadcastable against ``v``.
    """
    if isinstance(shift, int):
        if shift >= 0:
            return shift_round(v, shift, rounding)
        return torch.bitwise_left_shift(v, torch.tensor(-shift, device=v.device))
    s = shift.to(torch.int64)  # no branch on the values: torch.export traces it
    left = torch.bitwise_left_shift(v, (-s).clamp(min=0))
    return shift_round(left, s.clamp(min=0), rounding)


def bit_length(v: Tensor) -> Tensor:
    """``floor(log2(v)) + 1`` of a non-negative int64 tensor (0 for 0), exactly.

    ``frexp`` of the float64 value, corrected where float64 rounded ``v`` up
    to the next power of two.
    """
    b = torch.frexp(v.to(torch.float64)).exponent.to(torch.int64)
    one = torch.ones((), dtype=torch.int64, device=v.device)
    over = (b > 0) & (torch.bitwise_left_shift(one, (b - 1).clamp(min=0)) > v)
    return b - over.to(torch.int64)


def _round_half_up_fraction(num: int, den: int) -> int:
    return (2 * num + den) // (2 * den)


@functools.cache
def _rsqrt_table() -> tuple[int, ...]:
    """``R[m - 2**(T-2)] = round(2**F / sqrt(m))`` for ``m`` in ``[2**(T-2), 2**T]``, exact."""
    out = []
    lim = 1 << (2 * RSQRT_FRACTION_BITS + 2)  # (2 * 2**F)**2
    for m in range(1 << (RSQRT_INDEX_BITS - 2), (1 << RSQRT_INDEX_BITS) + 1):
        # the integer r with (2r - 1)**2 m <= 4**(F+1) < (2r + 1)**2 m: round half up of 2**F / sqrt(m)
        r = math.isqrt(lim // m)  # close; fix by the exact test below
        r = max(r // 2, 1)
        while (2 * r + 1) ** 2 * m <= lim:
            r += 1
        while (2 * r - 1) ** 2 * m > lim:
            r -= 1
        out.append(r)
    return tuple(out)


def rsqrt_table(device=None) -> Tensor:
    """The rsqrt table as an int64 tensor (``RSQRT_INDEX_BITS``, ``RSQRT_FRACTION_BITS``)."""
    return torch.tensor(_rsqrt_table(), dtype=torch.int64, device=device)


def integer_rsqrt(v: Tensor, rounding: Rounding) -> tuple[Tensor, Tensor]:
    """``1 / sqrt(v) ~ R * 2**-(F + e)`` for positive int64 ``v``, by table lookup.

    ``v = m * 4**e`` with the mantissa ``m = shift_round(v, 2e)`` (a left shift
    for ``e < 0``) in ``[2**(T-2), 2**T]``, ``e = floor((bit_length(v) - T + 1) / 2)``;
    ``R = rsqrt_table[m - 2**(T-2)]``.

    Returns:
        ``(R, e)`` as int64 tensors shaped like ``v``.
    """
    t = RSQRT_INDEX_BITS
    e = torch.div(bit_length(v) - t + 1, 2, rounding_mode="floor")
    m = shift_round_signed(v, 2 * e, rounding)
    table = rsqrt_table(v.device)
    return table[m - (1 << (t - 2))], e


def norm_fraction_bits(n: int, z_bits: int) -> int:
    """Fraction bits ``Q`` of the normalized values ``Z = round((x - mean) / std * 2**Q)``.

    With int16 intermediates ``|Z|`` never saturates (``|x - mean| / std <= sqrt(n - 1)``);
    with int8 ones (marches without int16) it saturates beyond 4 standard deviations.
    """
    h = 0
    while 4**h < n - 1:
        h += 1
    if z_bits <= 8:
        h = min(h, 2)
    return z_bits - 1 - h


def norm_eps_term(eps: float, n: int, in_scale: Tensor) -> int:
    """``E = round(eps * n**2 / s_x**2)`` (float64, at most 2**60): eps in the units of ``V``."""
    s = float(in_scale.reshape(-1)[0].to(torch.float64))
    value = eps * float(n) ** 2 / (s * s)
    return int(min(math.floor(value + 0.5), 1 << 60))


def normalize_rows(
    x: Tensor, eps_term: int, q_bits: int, z_dtype: QDType, rounding: Rounding
) -> Tensor:
    """Integer ``(x - mean) / sqrt(var + eps)`` over the last axis, with ``q_bits`` fraction bits.

    With ``n`` the row length, ``S1 = sum x``, ``S2 = sum x**2``, ``D = n x - S1`` and
    ``V = n S2 - S1**2 + E`` (``E = norm_eps_term``): ``(x - mean) / sqrt(var + eps) =
    D / sqrt(V)``, so ``Z = sat(shift_round(D * R, F + e - Q))`` with ``(R, e) =
    integer_rsqrt(max(V, 1))``.

    Args:
        x: integers (any dtype holding them exactly) ``[..., n]``.

    Returns:
        int64 ``Z`` in ``z_dtype``'s range, shaped like ``x``.

    Raises:
        ValueError: for rows too long for exact int64 sums (``n**2 * max|x|**2 >= 2**60``).
    """
    xi = x.to(torch.int64)
    n = xi.shape[-1]
    if n * n * (1 << 30) >= 1 << 61 and n * n * int(xi.abs().max()) ** 2 >= 1 << 60:
        raise ValueError(f"cannot normalize rows of {n} elements exactly in int64")
    s1 = xi.sum(-1, keepdim=True)
    s2 = (xi * xi).sum(-1, keepdim=True)
    d = n * xi - s1
    v = (n * s2 - s1 * s1 + eps_term).clamp(min=1)
    r, e = integer_rsqrt(v, rounding)
    z = shift_round_signed(d * r, RSQRT_FRACTION_BITS + e - q_bits, rounding)
    return z.clamp_(z_dtype.qmin, z_dtype.qmax)


def l2_fraction_bits(z_bits: int) -> int:
    """Fraction bits ``Q`` of the L2-normalized values ``Z ~ x / ||x|| * 2**Q``: ``|Z| <= 2**Q``
    fits ``z_bits`` (14 for int16, 6 for int8)."""
    return z_bits - 2


def l2_eps_term(eps: float, in_scale: Tensor) -> int:
    """``E = round(eps**2 / s_x**2)`` (float64, at most 2**60): ``eps**2`` in the units of
    ``sum X**2``."""
    s = float(in_scale.reshape(-1)[0].to(torch.float64))
    value = (eps / s) ** 2
    return int(min(math.floor(value + 0.5), 1 << 60))


def l2_normalize(
    x: Tensor,
    dims: tuple[int, ...],
    eps_term: int,
    q_bits: int,
    z_dtype: QDType,
    rounding: Rounding,
) -> Tensor:
    """Integer ``x / max(||x||_2, eps)`` over ``dims``, with ``q_bits`` fraction bits.

    ``S2 = sum X**2`` (exact int64), ``V = max(S2, E, 1)`` (``E = l2_eps_term``),
    ``(R, e) = integer_rsqrt(V)`` and ``Z = sat(shift_round(X * R, F + e - Q))``.

    Args:
        x: integers (any dtype holding them exactly).
        dims: the (non-negative) axes normalized over.

    Returns:
        int64 ``Z`` in ``z_dtype``'s range, shaped like ``x``.

    Raises:
        ValueError: for sums of squares that may not fit int64 (``n max|x|**2 >= 2**62``).
    """
    xi = x.to(torch.int64)
    n = math.prod(xi.shape[d] for d in dims) if dims else 1
    tracing = torch.compiler.is_exporting() or torch.compiler.is_compiling()
    # (a check on the data: skipped while torch.export traces, where it cannot be decided;
    # int16 inputs need n >= 2**32 elements to reach it)
    if not tracing and xi.numel() and n * int(xi.abs().max()) ** 2 >= 1 << 62:
        raise ValueError(f"cannot sum the squares of {n} elements exactly in int64")
    s2 = (xi * xi).sum(dims, keepdim=True) if dims else xi * xi
    v = s2.clamp(min=max(eps_term, 1))
    r, e = integer_rsqrt(v, rounding)
    z = shift_round_signed(xi * r, RSQRT_FRACTION_BITS + e - q_bits, rounding)
    return z.clamp_(z_dtype.qmin, z_dtype.qmax)


@functools.cache
def _exp2_table() -> tuple[int, ...]:
    """``T[f] = round(2**15 * 2**(-f / 2**P))`` for ``f`` in ``[0, 2**P)`` (float64, correctly
    rounded: the values are far from ties)."""
    p = 1 << EXP_FRACTION_BITS
    return tuple(int(math.floor(2.0 ** (EXP_ONE_BITS - f / p) + 0.5)) for f in range(p))


def exp2_table(device=None) -> Tensor:
    return torch.tensor(_exp2_table(), dtype=torch.int64, device=device)


def softmax_exp(u: Tensor, multiplier: int, shift: int, rounding: Rounding) -> Tensor:
    """``E = round(2**15 * exp(-u s_x))`` for integers ``u >= 0`` (the distance to the row max).

    ``t = shift_round(u * m, S)`` is ``u s_x / ln 2`` with ``P`` fraction bits
    (``m 2**-S ~ s_x / ln 2 * 2**P``); its integer part ``k`` shifts the exp2 table's
    entry for its fraction: ``E = shift_round(T[t mod 2**P], min(k, 40))``.
    """
    p = EXP_FRACTION_BITS
    t = shift_round_signed(u * multiplier, shift, rounding)
    k = (t >> p).clamp(max=40)
    f = t & ((1 << p) - 1)
    return shift_round(exp2_table(u.device)[f], k, rounding)


def divide_round(num: Tensor, den: Tensor) -> Tensor:
    """``floor(num / den + 1/2)`` of int64 tensors with ``num >= 0`` and ``den > 0``, exactly."""
    return torch.div(2 * num + den, 2 * den, rounding_mode="floor")


@functools.cache
def _log_table() -> tuple[int, ...]:
    """``L[m - 2**(T-1)] = round(ln(m / 2**T) * 2**P)`` for ``m`` in ``[2**(T-1), 2**T]``."""
    t, p = LOG_INDEX_BITS, LOG_FRACTION_BITS
    return tuple(
        int(math.floor(math.log(m / (1 << t)) * (1 << p) + 0.5))
        for m in range(1 << (t - 1), (1 << t) + 1)
    )


def log_table(device=None) -> Tensor:
    return torch.tensor(_log_table(), dtype=torch.int64, device=device)


LN2_FIXED = int(math.floor(math.log(2.0) * (1 << LOG_FRACTION_BITS) + 0.5))


def integer_log(v: Tensor, rounding: Rounding) -> Tensor:
    """``round(ln(v) * 2**P)`` (approximately) for positive int64 ``v``, by table lookup.

    ``v = m * 2**e`` with ``m = shift_round(v, e)`` in ``[2**(T-1), 2**T]``,
    ``e = bit_length(v) - T``: ``ln v = L[m - 2**(T-1)] + (e + T) ln 2``.
    """
    t = LOG_INDEX_BITS
    e = bit_length(v) - t
    m = shift_round_signed(v, e, rounding)
    return log_table(v.device)[m - (1 << (t - 1))] + (e + t) * LN2_FIXED
