"""Triton kernels of ``fxq::observe_fake_quantize`` (see ``fxq.quantized.fake_quant_ops``).

Imported only when the op runs on CUDA (or under ``TRITON_INTERPRET=1``): ``import fxq``
does not import Triton. Every float operation here is the one the torch definition does,
in float32 and in the same order: divisions with ``div_rn`` (correctly rounded, as torch's
CUDA division; Triton's ``/`` is not), and launches with ``enable_fp_fusion=False`` so that
no product and sum become one fused multiply-add (torch rounds the product first).
NaN is carried as torch carries it: a NaN in the input makes the batch's min and max NaN,
``clamp`` keeps a NaN, ``minimum`` / ``maximum`` propagate one.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from fxq.quantized._triton_launch import Launcher, cdiv, raw_stream

__all__ = ["observe_fake_quantize", "fold_observe_fake_quantize"]

_BLOCK = 1024
#: programs of the per-tensor reduction (each strides over the tensor)
_MAX_PROGRAMS = 1024
_OPTIONS = {"enable_fp_fusion": False}
#: the smallest scale, ``2**-23`` (``fake_quant_ops.EPS``)
_EPS = float(torch.finfo(torch.float32).eps)


@triton.jit
def _nan_min(a, b):
    return tl.where(a != a, a, tl.where(b != b, b, tl.minimum(a, b)))


@triton.jit
def _nan_max(a, b):
    return tl.where(a != a, a, tl.where(b != b, b, tl.maximum(a, b)))


@triton.jit
def _block_minmax(x, valid):
    """min, max over the valid elements, NaN excluded; and whether a NaN was among them."""
    nan = (x != x) & valid
    mn = tl.min(tl.where(valid & (x == x), x, float("inf")), axis=0)
    mx = tl.max(tl.where(valid & (x == x), x, float("-inf")), axis=0)
    return mn, mx, tl.max(nan.to(tl.int32), axis=0)


@triton.jit
def _strided_minmax(ptr, first, end, step, factor, BLOCK: tl.constexpr):
    """min, max (NaN excluded) and whether a NaN was seen, over the blocks of ``BLOCK``
    elements starting at ``first``, ``first + step``, ... below ``end``, each value
    multiplied by ``factor`` (a literal 1.0 where there is none: the compiler drops it)."""
    mn = float("inf")
    mx = float("-inf")
    nans = 0
    for start in range(first, end, step):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < end
        x = tl.load(ptr + offs, mask=valid, other=0.0) * factor
        bmn, bmx, bnan = _block_minmax(x, valid)
        mn = tl.minimum(mn, bmn)
        mx = tl.maximum(mx, bmx)
        nans = tl.maximum(nans, bnan)
    return mn, mx, nans


@triton.jit
def _new_statistics(bmin, bmax, mv, xv, c, MODE: tl.constexpr):
    """The observer's update (``Statistics``): MOVING 0, RUNNING 1, LATEST 2."""
    if MODE == 0:
        fresh = (mv == float("inf")) | (mv == float("-inf"))
        frozen = c == 0.0  # the statistics as they are (not ``mv + (inf - mv) * 0``)
        new_min = tl.where(fresh, bmin, tl.where(frozen, mv, mv + (bmin - mv) * c))
        new_max = tl.where(fresh, bmax, tl.where(frozen, xv, xv + (bmax - xv) * c))
    elif MODE == 1:
        new_min = _nan_min(mv, bmin)
        new_max = _nan_max(xv, bmax)
    else:
        new_min = bmin
        new_max = bmax
    return new_min, new_max


@triton.jit
def _scale_of(new_min, new_max, levels, eps, fallback, HAS_FALLBACK: tl.constexpr):
    amax = _nan_max(-new_min, new_max)
    scale = tl.math.div_rn(amax, levels)
    scale = tl.where(scale < eps, eps, scale)  # clamp(min=eps): a NaN stays
    if HAS_FALLBACK:
        scale = tl.where(amax > 0, scale, _nan_max(scale, fallback))
    return scale


@triton.jit
def _observe_kernel(
    x_ptr, scratch_ptr, min_ptr, max_ptr, scale_ptr, flag_ptr, fallback_ptr, n, c, levels, eps,
    MODE: tl.constexpr, HAS_FALLBACK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Per tensor: the min / max of ``x`` gathered in ``scratch[0:2]`` with atomics (the
    result does not depend on their order), NaNs counted in ``scratch[2]``; the last program
    to finish (``scratch[3]`` counts them) updates the statistics, the NaN flag and the scale,
    and resets the scratch to ``[inf, -inf, 0, 0]`` for the next call."""
    first = tl.program_id(0) * BLOCK
    mn, mx, nans = _strided_minmax(x_ptr, first, n, tl.num_programs(0) * BLOCK, 1.0, BLOCK)
    tl.atomic_min(scratch_ptr, mn)
    tl.atomic_max(scratch_ptr + 1, mx)
    tl.atomic_add(scratch_ptr + 2, nans.to(tl.float32), mask=nans > 0)
    # the barrier orders this program's atomics before its ticket (another thread may draw
    # it); acquire-release: the program with the last ticket sees every other one's atomics
    tl.debug_barrier()
    ticket = tl.atomic_add(scratch_ptr + 3, 1.0)
    if ticket.to(tl.int32) == tl.num_programs(0) - 1:
        # read through the atomics' cache level (adding 0), then reset: no program is left
        bmin = tl.atomic_add(scratch_ptr, 0.0)
        bmax = tl.atomic_add(scratch_ptr + 1, 0.0)
        had_nan = tl.atomic_add(scratch_ptr + 2, 0.0) > 0
        tl.store(scratch_ptr, float("inf"))
        tl.store(scratch_ptr + 1, float("-inf"))
        tl.store(scratch_ptr + 2, 0.0)
        tl.store(scratch_ptr + 3, 0.0)
        bmin = tl.where(had_nan, float("nan"), bmin)
        bmax = tl.where(had_nan, float("nan"), bmax)
        tl.store(flag_ptr, tl.load(flag_ptr) + (bmin * 0.0 + bmax * 0.0))
        new_min, new_max = _new_statistics(bmin, bmax, tl.load(min_ptr), tl.load(max_ptr), c, MODE)
        tl.store(min_ptr, new_min)
        tl.store(max_ptr, new_max)
        fallback = 0.0
        if HAS_FALLBACK:
            fallback = tl.load(fallback_ptr)
        tl.store(scale_ptr, _scale_of(new_min, new_max, levels, eps, fallback, HAS_FALLBACK))


@triton.jit
def _round(x, s, qmin, qmax):
    """``clamp(floor(x * (1 / s) + 1/2), qmin, qmax) * s`` and the in-range mask."""
    v = tl.floor(x * tl.math.div_rn(1.0, s) + 0.5)
    clamped = tl.where(v < qmin, qmin, tl.where(v > qmax, qmax, v))
    return clamped * s, clamped == v


@triton.jit
def _fold_factor(gamma_ptr, var_ptr, factor_ptr, inverse_ptr, row, eps, HAS_GAMMA: tl.constexpr):
    """A BatchNorm's folding factor for ``row``, ``gamma / sqrt(running_var + eps)`` (``1 /
    sqrt(...)`` without ``gamma``), and its inverse, both 1 where the inverse is not finite;
    stored, and the factor returned (``WeightedQAT``'s fold in QAT training)."""
    std = tl.sqrt_rn(tl.load(var_ptr + row) + eps)
    if HAS_GAMMA:
        factor = tl.math.div_rn(tl.load(gamma_ptr + row), std)
    else:
        factor = tl.math.div_rn(1.0, std)
    inverse = tl.math.div_rn(1.0, factor)
    singular = (inverse - inverse) != 0.0
    factor = tl.where(singular, 1.0, factor)
    tl.store(factor_ptr + row, factor)
    tl.store(inverse_ptr + row, tl.where(singular, 1.0, inverse))
    return factor


@triton.jit
def _rows_kernel(
    x_ptr, min_ptr, max_ptr, scale_ptr, flag_ptr, out_ptr, mask_ptr, row_length, c, levels,
    eps, qmin, qmax, gamma_ptr, var_ptr, factor_ptr, inverse_ptr, bn_eps,
    MODE: tl.constexpr, FOLD: tl.constexpr, HAS_GAMMA: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Per channel (rows of a contiguous tensor, channel axis 0), one program a row: the
    row's min / max, its statistics and its scale, then the row rounded with that scale (a
    weight's whole step in one launch: a row is a few thousand values, read twice). With
    ``FOLD`` the row is first multiplied by its BatchNorm folding factor (``_fold_factor``)."""
    row = tl.program_id(0)
    offset = row.to(tl.int64) * row_length
    factor = 1.0
    if FOLD:
        factor = _fold_factor(gamma_ptr, var_ptr, factor_ptr, inverse_ptr, row, bn_eps, HAS_GAMMA)
    mn, mx, nans = _strided_minmax(x_ptr + offset, 0, row_length, BLOCK, factor, BLOCK)
    mn = tl.where(nans > 0, float("nan"), mn)
    mx = tl.where(nans > 0, float("nan"), mx)
    poison = mn * 0.0 + mx * 0.0
    tl.atomic_add(flag_ptr, poison, mask=poison != 0.0)  # only a NaN is added
    new_min, new_max = _new_statistics(
        mn, mx, tl.load(min_ptr + row), tl.load(max_ptr + row), c, MODE
    )
    tl.store(min_ptr + row, new_min)
    tl.store(max_ptr + row, new_max)
    s = _scale_of(new_min, new_max, levels, eps, 0.0, False)
    tl.store(scale_ptr + row, s)
    for start in range(0, row_length, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < row_length
        x = tl.load(x_ptr + offset + offs, mask=valid, other=0.0) * factor
        out, inside = _round(x, s, qmin, qmax)
        tl.store(out_ptr + offset + offs, out, mask=valid)
        tl.store(mask_ptr + offset + offs, inside, mask=valid)


@triton.jit
def _fake_quant_kernel(x_ptr, scale_ptr, out_ptr, mask_ptr, n, qmin, qmax, BLOCK: tl.constexpr):
    """Per tensor: ``x`` rounded with ``scale[0]`` (``_round``) and the in-range mask."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    x = tl.load(x_ptr + offs, mask=valid, other=0.0)
    out, inside = _round(x, tl.load(scale_ptr), qmin, qmax)
    tl.store(out_ptr + offs, out, mask=valid)
    tl.store(mask_ptr + offs, inside, mask=valid)


def _scratch(x: Tensor) -> Tensor:
    """The per-device scratch of the per-tensor reduction: ``[inf, -inf, 0, 0]`` between calls
    (the kernel's last program resets it), so no kernel fills it per call. One per device and
    stream: kernels on one stream run one after another."""
    device = x.device
    key = (device, raw_stream(device.index) if x.is_cuda else 0)
    cache = _SCRATCH.get(key)
    if cache is None:
        cache = torch.tensor([float("inf"), float("-inf"), 0.0, 0.0], device=device)
        _SCRATCH[key] = cache
    return cache


_SCRATCH: dict[tuple[torch.device, int], Tensor] = {}


def observe_fake_quantize(
    x: Tensor,
    min_val: Tensor,
    max_val: Tensor,
    scale: Tensor,
    non_finite: Tensor,
    fallback: Tensor | None,
    c: float,
    mode: int,
    levels: int,
    qmin: int,
    qmax: int,
    ch_axis: int | None,
) -> tuple[Tensor, Tensor]:
    """``fxq::observe_fake_quantize`` in Triton; the caller checked the layout
    (``fake_quant_ops.kernels_take``): dense per tensor, contiguous per channel."""
    n = x.numel()
    if ch_axis is not None:  # axis 0, contiguous: one program per channel does it all
        return _rows(x, min_val, max_val, scale, non_finite, c, mode, levels, qmin, qmax)[:2]
    out = torch.empty_like(x)
    mask = torch.empty_like(x, dtype=torch.bool)
    scratch = _scratch(x)
    has_fallback = fallback is not None
    _launch_observe(
        (min(cdiv(n, _BLOCK), _MAX_PROGRAMS),), x, scratch, min_val, max_val, scale,
        non_finite, fallback if has_fallback else scale, n, c, float(levels), _EPS,
        MODE=mode, HAS_FALLBACK=has_fallback, BLOCK=_BLOCK,
    )  # fmt: skip
    _launch_fake_quant(
        (cdiv(n, _BLOCK),), x, scale, out, mask, n, float(qmin), float(qmax), BLOCK=_BLOCK
    )
    return out, mask


def fold_observe_fake_quantize(
    w: Tensor, gamma: Tensor | None, running_var: Tensor, bn_eps: float, *step: Any
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``observe_fake_quantize`` per output channel (axis 0, contiguous) of ``w`` multiplied
    by its BatchNorm folding factor (``_fold_factor``), in one launch; ``step``: from
    ``min_val`` to ``qmax`` as there. Returns the rounded folded weight, its in-range mask,
    the factor and its inverse."""
    return _rows(w, *step, fold=(gamma, running_var, bn_eps))


def _rows(
    x: Tensor,
    min_val: Tensor,
    max_val: Tensor,
    scale: Tensor,
    non_finite: Tensor,
    c: float,
    mode: int,
    levels: int,
    qmin: int,
    qmax: int,
    fold: tuple[Tensor | None, Tensor, float] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The per-channel step (``_rows_kernel``): the rounded rows and their mask; with ``fold``
    (``gamma`` or None, ``running_var``, ``eps``) the rows folded first, and the folding
    factor and its inverse (without, ``x`` stands in for them, unread by the kernel)."""
    out = torch.empty_like(x)
    mask = torch.empty_like(x, dtype=torch.bool)
    has_gamma = False
    if fold is None:
        gamma = running_var = factor = inverse = x
        bn_eps = 0.0
    else:
        gamma, running_var, bn_eps = fold
        has_gamma = gamma is not None
        gamma = gamma if has_gamma else running_var
        factor = torch.empty_like(running_var)
        inverse = torch.empty_like(running_var)
    _launch_rows(
        (x.shape[0],), x, min_val, max_val, scale, non_finite, out, mask,
        x.numel() // x.shape[0], c, float(levels), _EPS, float(qmin), float(qmax), gamma,
        running_var, factor, inverse, float(bn_eps), MODE=mode, FOLD=fold is not None,
        HAS_GAMMA=has_gamma, BLOCK=_BLOCK,
    )  # fmt: skip
    return out, mask, factor, inverse


_launch_rows = Launcher(_rows_kernel, **_OPTIONS)
_launch_observe = Launcher(_observe_kernel, **_OPTIONS)
_launch_fake_quant = Launcher(_fake_quant_kernel, **_OPTIONS)
