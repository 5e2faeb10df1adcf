"""One fused op for a QAT fake quant: observe, update the scale, round (``fxq::observe_fake_quantize``).

A training step of a fake quant is, in torch ops, about twenty small kernels (the batch's
min / max, the NaN / Inf flag, the moving average, the scale, the rounding, the clamp, the
gradient mask). On a GPU each is a launch, and a QAT step is bound by launches, not by
arithmetic (``benchmarks/qat_speed.py --profile``). ``fxq::observe_fake_quantize`` does the
same step as one ``torch.library`` op:

* on CUDA with Triton, per tensor: two kernels (a reduction whose last program updates the
  statistics and the scale, then the elementwise rounding with its mask); per channel (a
  weight): one, a program per output channel that takes its row's range, updates its
  statistics and scale and rounds the row (each launch costs the host more than a weight's
  arithmetic costs the GPU); while a BatchNorm folded into the weight trains, the same
  launch also computes the folding factor and multiplies the rows by it
  (``fold_observe_fake_quantize``, about ten torch ops fewer per convolution);
* elsewhere (CPU, or without Triton): the definition, made of the unfused modules' own
  functions (``fxq.observer``'s updates, ``scale_from_amax``, QAT training's rounding).

The kernels compute exactly what the modules compute for the observers they cover
(``Statistics``): the same IEEE float32 operations in the same order (divisions correctly
rounded, no fused multiply-add), so the result is bit for bit the unfused modules'; the
tests check them against the modules on the CPU with Triton's interpreter
(``TRITON_INTERPRET=1``) and on CUDA when present.

The rounding is QAT training's (``fxq.quantized.functional.fake_quantize`` with
``exact=False``): ``clamp(floor(x * (1 / s) + 1/2), qmin, qmax) * s``, the march's
``HALF_UP``; the gradient passes where ``floor(x / s + 1/2)`` lies inside ``[qmin, qmax]``
(the clipped straight-through estimator).

Statistics (``mode``):

* ``MOVING``: ``stat + c * (batch - stat)``, the batch's own where ``stat`` was never set
  (``MovingAverageMinMaxObserver``, per tensor or per channel); ``c = 0`` freezes it;
* ``RUNNING``: the running min / max (``MinMaxObserver``);
* ``LATEST``: the batch's (``PerChannelMinMaxObserver``, weights).

``non_finite`` (a 0-dim float32 tensor) becomes NaN, and stays so, once a NaN or Inf was
observed (the observer reads it on the host when the state changes: no sync per step).
"""

from __future__ import annotations

import enum
import functools
from typing import Optional

import torch
from torch import Tensor

from fxq.observer import (
    batch_minmax,
    latest_minmax_,
    moving_average_,
    non_finite_poison,
    running_minmax_,
)
from fxq.quantized import functional as qf
from fxq.quantized import native
from fxq.utils.grad_mask import pass_gradient

__all__ = [
    "Statistics",
    "observe_fake_quantize",
    "fold_observe_fake_quantize",
    "scale_from_amax",
    "triton_usable",
    "kernels_take",
    "torch_ops_only",
    "EPS",
]

#: the smallest scale (``fxq.fake_quantize``'s floor, ``2**-23``)
EPS = float(torch.finfo(torch.float32).eps)


class Statistics(enum.IntEnum):
    """How the op updates ``min_val`` / ``max_val`` (see the module docstring)."""

    MOVING = 0
    RUNNING = 1
    LATEST = 2


# -- the definition: torch ops ---------------------------------------------------------------


def scale_from_amax(
    amax: Tensor, divisor: Tensor, fallback: Tensor | None = None, out: Tensor | None = None
) -> Tensor:
    """``max(amax / divisor, 2**-23)``; where ``amax`` is not positive and ``fallback`` is
    given, at least ``fallback``. Written into ``out`` when given (no host sync, few ops:
    ``FakeQuantize`` computes its scale with it at every QAT step)."""
    last = out if fallback is None else None
    scale = torch.div(amax, divisor, out=last).clamp_(min=EPS)
    if fallback is not None:
        if fallback.dtype != scale.dtype:
            fallback = fallback.to(scale.dtype)
        fallback = torch.maximum(scale, fallback)
        scale = torch.where(amax > 0, scale, fallback, out=out)
    return scale


def _observe_fake_quantize_torch(
    x, min_val, max_val, scale, non_finite, fallback, c, mode, levels, qmin, qmax, ch_axis
):  # fmt: skip
    """The definition: the observers' own updates (``fxq.observer``) and the scale
    ``FakeQuantize`` computes, then QAT training's rounding."""
    if x.numel():
        mn, mx = batch_minmax(x, ch_axis)
        non_finite.add_(non_finite_poison(mn, mx).sum())
        if mode == Statistics.MOVING:
            moving_average_(min_val, max_val, mn, mx, c)
        elif mode == Statistics.RUNNING:
            running_minmax_(min_val, max_val, mn, mx)
        else:
            latest_minmax_(min_val, max_val, mn, mx)
        divisor = torch.full((), float(levels), device=min_val.device)
        scale_from_amax(torch.maximum(-min_val, max_val), divisor, fallback, out=scale)
    return qf.fake_quantize(x, scale, qmin, qmax, qf.Rounding.HALF_UP, ch_axis, exact=False)


# -- the CUDA implementation: Triton ---------------------------------------------------------


@functools.cache
def _triton():
    """The Triton kernels (None when Triton cannot be imported)."""
    try:
        from fxq.quantized import _fake_quant_triton
    except ImportError:
        return None
    return _fake_quant_triton


#: within the block fxq's Triton kernels are off (``native.torch_ops_only``)
torch_ops_only = native.torch_ops_only


def triton_usable(x: Tensor) -> bool:
    """Whether the Triton kernels run for ``x``: a float32 tensor on CUDA (or on the CPU under
    ``TRITON_INTERPRET=1``, Triton's interpreter, which the tests use), Triton importable and
    not switched off (``FXQ_TRITON=0``, ``torch_ops_only``)."""
    if x.dtype is not torch.float32 or not native.triton_runs_on(x):
        return False
    return _triton() is not None


def _dense(x: Tensor) -> bool:
    """Whether ``x``'s elements fill its storage in some order (contiguous or channels_last):
    a per-tensor op may then run over the memory as it lies."""
    return x.is_contiguous() or (
        x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)
    )


def kernels_take(x: Tensor, ch_axis: int | None) -> bool:
    """Whether the kernels take ``x``'s layout: dense per tensor, contiguous with the channel
    axis first per channel (weights)."""
    if x.numel() >= 2**31:  # the kernels index with int32 in places
        return False
    if ch_axis is None:
        return _dense(x)
    return x.is_contiguous() and x.dim() >= 1 and ch_axis % x.dim() == 0


# -- the op ------------------------------------------------------------------------------------


@torch.library.custom_op(
    "fxq::observe_fake_quantize",
    mutates_args=("min_val", "max_val", "scale", "non_finite"),
)
def _observe_fake_quantize_op(
    x: Tensor,
    min_val: Tensor,
    max_val: Tensor,
    scale: Tensor,
    non_finite: Tensor,
    fallback: Optional[Tensor],  # noqa: UP045 (torch.library reads the annotation)
    averaging_constant: float,
    mode: int,
    levels: int,
    qmin: int,
    qmax: int,
    ch_axis: Optional[int],  # noqa: UP045
) -> tuple[Tensor, Tensor]:
    """See ``observe_fake_quantize``."""
    return _observe_fake_quantize_impl(
        x, min_val, max_val, scale, non_finite, fallback, averaging_constant, mode, levels,
        qmin, qmax, ch_axis,
    )  # fmt: skip


def _observe_fake_quantize_impl(
    x, min_val, max_val, scale, non_finite, fallback, c, mode, levels, qmin, qmax, ch_axis
):  # fmt: skip
    """The op's implementation: the Triton kernels where they run, else the torch definition."""
    args = (x, min_val, max_val, scale, non_finite, fallback, c, mode, levels, qmin, qmax, ch_axis)
    if x.numel() and triton_usable(x) and kernels_take(x, ch_axis):
        return _triton().observe_fake_quantize(*args)
    return _observe_fake_quantize_torch(*args)


@_observe_fake_quantize_op.register_fake
def _(x, min_val, max_val, scale, non_finite, fallback, c, mode, levels, qmin, qmax, ch_axis):
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)


class _ObserveFakeQuantizeSTE(torch.autograd.Function):
    """The op with the clipped straight-through estimator (an op that writes its statistics
    in place cannot carry its own autograd formula in ``torch.library``)."""

    @staticmethod
    def forward(ctx, clip, run, x, *args):  # type: ignore[override]
        out, mask = run(x, *args)
        if clip:
            ctx.save_for_backward(mask)
        ctx.mark_non_differentiable(mask)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if not ctx.saved_tensors:  # nothing was clipped (``clip_gradient=False``)
            return (None, None, grad) + (None,) * 11
        (mask,) = ctx.saved_tensors
        return (None, None, pass_gradient(grad, mask)) + (None,) * 11


def observe_fake_quantize(
    x: Tensor,
    min_val: Tensor,
    max_val: Tensor,
    scale: Tensor,
    non_finite: Tensor,
    fallback: Tensor | None,
    averaging_constant: float,
    mode: Statistics,
    levels: int,
    qmin: int,
    qmax: int,
    ch_axis: int | None,
    clip_gradient: bool = True,
    kernels_take_x: bool = False,
) -> Tensor:
    """Observe ``x``, update the statistics and the scale in place, and fake-quantize ``x``.

    Args:
        x: float32 input (any shape; per channel: ``ch_axis`` is its channel axis).
        min_val, max_val: the observer's float32 statistics, ``[1]`` or ``[C]``, updated in place.
        scale: float32 ``[1]`` or ``[C]``, written with ``max(max(-min, max) / levels, 2**-23)``
            (where that ``max(-min, max)`` is not positive and ``fallback`` is given: at least
            ``fallback``).
        non_finite: 0-dim float32 flag, NaN once a NaN or Inf was observed.
        fallback: one-element float32 scale for an all-zero value, or None.
        averaging_constant: ``c`` of ``Statistics.MOVING``.
        mode: how the statistics are updated.
        levels: ``qmax + offset`` of the fake quant (the grid step is ``amax / levels``).
        qmin, qmax: the clamp, offset included.
        ch_axis: None (per tensor) or the channel axis.
        clip_gradient: False where the caller knows that no value is clamped
            (``FakeQuantize._clips_gradient``): the gradient then passes everywhere and
            the mask is not kept.
        kernels_take_x: True where the caller checked that the Triton kernels run for ``x``
            and take its layout (``triton_usable``, ``kernels_take``; ``FakeQuantize`` does,
            at every QAT step): they are then not checked again.

    Returns:
        ``clamp(floor(x * (1 / scale) + 1/2), qmin, qmax) * scale``, differentiable in ``x``
        with the clipped straight-through estimator.
    """
    args = (
        x, min_val, max_val, scale, non_finite, fallback, float(averaging_constant), int(mode),
        int(levels), int(qmin), int(qmax), ch_axis,
    )  # fmt: skip
    run = _call_kernels if kernels_take_x else _call
    if torch.is_grad_enabled() and x.requires_grad:
        return _ObserveFakeQuantizeSTE.apply(clip_gradient, run, *args)
    return run(*args)[0]


class _FoldObserveFakeQuantizeSTE(torch.autograd.Function):
    """``fold_observe_fake_quantize`` with the straight-through estimator through the fold:
    the weight's gradient is the output's (masked where clipped) times the factor, as the
    product ``w * factor`` with a constant factor gives it."""

    @staticmethod
    def forward(ctx, clip, w, *args):  # type: ignore[override]
        out, mask, factor, inverse = _triton().fold_observe_fake_quantize(w, *args)
        ctx.clip = clip
        ctx.save_for_backward(factor, mask if clip else None)
        ctx.mark_non_differentiable(inverse)
        return out, inverse

    @staticmethod
    def backward(ctx, grad, _):  # type: ignore[override]
        factor, mask = ctx.saved_tensors
        if ctx.clip:
            grad = pass_gradient(grad, mask)
        grad = grad * factor.reshape([-1] + [1] * (grad.dim() - 1))
        return (None, grad) + (None,) * 12


def fold_observe_fake_quantize(
    w: Tensor,
    gamma: Tensor | None,
    running_var: Tensor,
    bn_eps: float,
    min_val: Tensor,
    max_val: Tensor,
    scale: Tensor,
    non_finite: Tensor,
    averaging_constant: float,
    mode: Statistics,
    levels: int,
    qmin: int,
    qmax: int,
    clip_gradient: bool = True,
) -> tuple[Tensor, Tensor]:
    """A QAT training step's BatchNorm fold and weight fake quant as one Triton launch.

    ``factor = gamma / sqrt(running_var + eps)`` per output channel (``1 / sqrt(...)``
    without ``gamma``), set to 1 together with its inverse where the inverse is not finite,
    then ``observe_fake_quantize(w * factor, ..., ch_axis=0)``: what ``fxq.qat``'s
    convolutions and linears do with torch ops while their BatchNorm trains
    (``WeightedQAT.forward``), with the same float32 operations, so the same bits, in one
    launch instead of about ten. The factor is a constant (no gradient reaches ``gamma`` or
    ``running_var`` through it).

    The caller checked that the Triton kernels run for ``w`` and take it (``triton_usable``,
    ``kernels_take(w, 0)``) and that nothing is being compiled; the other arguments are
    ``observe_fake_quantize``'s, ``running_var`` and ``gamma`` float32 on ``w``'s device.

    Returns:
        the rounded folded weight (differentiable in ``w``) and the inverse factor.
    """
    return _FoldObserveFakeQuantizeSTE.apply(
        clip_gradient, w, gamma, running_var, float(bn_eps), min_val, max_val, scale,
        non_finite, float(averaging_constant), int(mode), int(levels), int(qmin), int(qmax),
    )  # fmt: skip


def _call(*args):
    """The op in a graph capture (``torch.compile``, ``torch.export``: one node); in eager its
    implementation directly. Same results: the dispatcher's checks of an op that writes its
    arguments cost about 120 us per call on the host (H100 machine, torch 2.11), more than
    the kernels themselves, and a CUDA QAT step is bound by the host."""
    if torch.compiler.is_compiling():
        return _observe_fake_quantize_op(*args)
    return _observe_fake_quantize_impl(*args)


def _call_kernels(*args):
    """``_call`` where the caller checked that the Triton kernels take the input."""
    if torch.compiler.is_compiling():
        return _observe_fake_quantize_op(*args)
    return _triton().observe_fake_quantize(*args)
