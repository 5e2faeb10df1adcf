"""Triton kernels of the one-pass requantizations (``fxq.quantized.native``) on CUDA.

The CPU runs the C kernels of ``native_kernels.c``; these compute the same on CUDA, in
one pass over the accumulator instead of torch's five (convert, multiply, round,
clamp, convert). Imported only when a requantization runs on CUDA (or under
``TRITON_INTERPRET=1``, where the tests compare them with the C kernels on the CPU):
``import fxq`` does not import Triton.

Every value is computed as the C kernel computes it: ``acc * r`` in float64 is exact
(``|acc * m| < 2**53`` and ``r = m * 2**-shift``), and so is ``v + 0.5`` (at most 47
significant bits), so ``floor(v + 0.5)`` is the half-up rounding, and a tie (``v + 0.5``
an integer that is ``v``'s floor plus one half away) goes to the even neighbour for
half-even. Launches use ``enable_fp_fusion=False`` all the same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fxq.quantized._triton_launch import Launcher, cdiv

__all__ = ["requantize", "requantize_add"]

_BLOCK = 1024
_OPTIONS = {"enable_fp_fusion": False}


@triton.jit
def _round(v, HALF_EVEN: tl.constexpr):
    """``floor(v + 0.5)``; ties to even with ``HALF_EVEN`` (``v`` float64, exact)."""
    up = tl.floor(v + 0.5)
    if HALF_EVEN:
        tie = (up - v) == 0.5
        odd = (up - 2.0 * tl.floor(up * 0.5)) != 0.0
        up = tl.where(tie & odd, up - 1.0, up)
    return up


@triton.jit
def _requantize_kernel(
    acc_ptr,
    res_ptr,
    r_ptr,
    rr_ptr,
    out_ptr,
    n,
    channels,
    inner,
    lo,
    hi,
    PER_CHANNEL: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HALF_EVEN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    if PER_CHANNEL:
        c = (offs // inner) % channels
        rc = tl.load(r_ptr + c, mask=valid, other=0.0)
    else:
        rc = tl.load(r_ptr)
    a = tl.load(acc_ptr + offs, mask=valid, other=0.0).to(tl.float64)
    if HAS_RESIDUAL:
        if PER_CHANNEL:
            rrc = tl.load(rr_ptr + c, mask=valid, other=0.0)
        else:
            rrc = tl.load(rr_ptr)
        s = tl.load(res_ptr + offs, mask=valid, other=0.0).to(tl.float64)
        a = a + _round(s * rrc, HALF_EVEN)
        a = tl.minimum(tl.maximum(a, -2147483648.0), 2147483647.0)
    v = _round(a * rc, HALF_EVEN)
    v = tl.minimum(tl.maximum(v, lo), hi)
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=valid)


def _launch(acc, residual, r, rr, out, blocks, lo, hi, half_even) -> None:
    n = acc.numel()
    if n == 0:
        return
    _, channels, inner = blocks
    _launch_requantize(
        (cdiv(n, _BLOCK),), acc, acc if residual is None else residual, r,
        r if rr is None else rr, out, n, channels, inner, float(lo), float(hi),
        PER_CHANNEL=r.numel() > 1, HAS_RESIDUAL=residual is not None, HALF_EVEN=bool(half_even),
        BLOCK=_BLOCK,
    )  # fmt: skip


_launch_requantize = Launcher(_requantize_kernel, **_OPTIONS)


def requantize(
    acc: Tensor,
    r: Tensor,
    blocks: tuple[int, int, int],
    lo: int,
    hi: int,
    half_even: bool,
    out_dtype: torch.dtype,
) -> Tensor:
    """``clamp(round(acc * r), lo, hi)`` as ``out_dtype`` (``native.requantize``): ``acc``
    contiguous, ``r`` one float64 factor per channel of ``blocks`` ((outer, channels, inner),
    ``native._layout``), on ``acc``'s device."""
    out = torch.empty(acc.shape, dtype=out_dtype, device=acc.device)
    _launch(acc, None, r, None, out, blocks, lo, hi, half_even)
    return out


def requantize_add(
    acc: Tensor,
    residual: Tensor,
    rr: Tensor,
    r: Tensor,
    blocks: tuple[int, int, int],
    lo: int,
    hi: int,
    half_even: bool,
) -> Tensor:
    """``clamp(round(sat32(acc + round(residual * rr)) * r), lo, hi)`` as float32
    (``native.requantize_add``), laid out as ``requantize``'s."""
    out = torch.empty(acc.shape, dtype=torch.float32, device=acc.device)
    _launch(acc, residual, r, rr, out, blocks, lo, hi, half_even)
    return out
