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

import torch
from torch import Tensor

from fxq.dtypes import QDType
from fxq.march.spec import MarchSpec, Rounding, ScaleConstraint

__all__ = [
    "broadcast_scale",
    "round_float",
    "quantize",
    "dequantize",
    "fake_quantize",
    "constrain_scale",
    "shift_round",
    "quantize_multiplier",
    "requantize",
    "MultiplierRangeError",
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


def round_float(x: Tensor, rounding: Rounding, inplace: bool = False) -> Tensor:
    """Round a float tensor to integral values with the march's rounding.

    ``HALF_UP`` is ``floor(x + 0.5)``; ``HALF_EVEN`` is ``torch.round``.
    The result keeps the float dtype.
    """
    if rounding is Rounding.HALF_UP:
        if inplace:
            return x.add_(0.5).floor_()
        return torch.floor(x + 0.5)
    if rounding is Rounding.HALF_EVEN:
        return x.round_() if inplace else torch.round(x)
    raise ValueError(f"unknown rounding {rounding!r}")


def quantize(
    x: Tensor,
    scale: Tensor,
    dtype: QDType,
    rounding: Rounding,
    ch_axis: int | None = None,
) -> Tensor:
    """Quantize a float tensor: ``clamp(round(x / scale), qmin, qmax)``.

    The division is an IEEE division in ``x``'s dtype, so the result is the
    same on every device. This is the one formula used by fake quantization,
    by the VALIDATION simulation and by the converted model's quantize stub.

    Returns:
        an integer tensor of ``dtype.storage`` with ``x``'s shape.
    """
    s = broadcast_scale(scale.to(x.dtype), x.dim(), ch_axis)
    v = round_float(x / s, rounding, inplace=True)
    return v.clamp_(dtype.qmin, dtype.qmax).to(dtype.storage)


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
) -> tuple[Tensor, Tensor]:
    """Quantize and dequantize in float, without autograd.

    Returns:
        ``(out, mask)``: ``out = clamp(round(x / s), qmin, qmax) * s`` and a bool
        mask that is True where ``round(x / s)`` lay inside ``[qmin, qmax]``
        (the straight-through estimator passes gradients there).
    """
    s = broadcast_scale(scale.to(x.dtype), x.dim(), ch_axis)
    v = round_float(x / s, rounding, inplace=True)
    clamped = v.clamp(qmin, qmax)
    mask = clamped == v
    return clamped.mul_(s), mask


def constrain_scale(scale: Tensor, constraint: ScaleConstraint) -> Tensor:
    """Round a scale up to what the march can represent.

    ``POWER_OF_TWO`` returns ``2 ** ceil(log2(scale))`` so that the quantized
    range still covers the observed range.
    """
    if constraint is ScaleConstraint.ANY:
        return scale
    if constraint is ScaleConstraint.POWER_OF_TWO:
        return torch.exp2(torch.ceil(torch.log2(scale)))
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


class MultiplierRangeError(ValueError):
    """A requantization factor cannot be represented by the march's multiplier."""


def quantize_multiplier(real: Tensor, spec: MarchSpec) -> tuple[Tensor, Tensor]:
    """Represent positive real factors as ``m * 2**-shift`` with integer ``m``.

    ``m`` is the largest-precision multiplier that fits ``spec.multiplier_bits``
    (signed, so ``m <= 2**(bits-1) - 1``) and ``shift`` lies in
    ``spec.shift_range``. ``m`` is rounded half up from the exact float64 value
    ``real * 2**shift``.

    Args:
        real: float64 tensor of factors ``>= 0`` (computed on any device; the
            computation is exact float64 arithmetic, so it is device independent).
        spec: the march.

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
    _, exp = torch.frexp(real)  # real = mant * 2**exp, mant in [0.5, 1)
    shift = (bits - 1) - exp.to(torch.int64)
    shift = shift.clamp(lo, hi)
    m = torch.floor(torch.ldexp(real, shift) + 0.5).to(torch.int64)
    # rounding can carry to 2**(bits-1): drop one bit of precision there
    carry = (m > spec.max_multiplier) & (shift > lo)
    shift = torch.where(carry, shift - 1, shift)
    m = torch.floor(torch.ldexp(real, shift) + 0.5).to(torch.int64)
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
