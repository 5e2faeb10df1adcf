"""Fake quantization: float tensors rounded onto the integer grid.

``FakeQuantize`` owns an observer and a ``scale`` buffer. Its behaviour
follows a state shared by the whole model (``fxq.set_fake_quantize``):

======================  ==================  ======================
state                   observer            rounding
======================  ==================  ======================
``CALIBRATION``         records statistics  none (float passes through)
``QAT``                 records statistics  yes, straight-through gradient
``VALIDATION``          frozen              yes, with the frozen scale
======================  ==================  ======================

Rounding is the march's (``fxq.march.Rounding``), the same function the
integer kernels use, so a value fake-quantized here equals the value the
converted model quantizes.

Devices and dtypes: a fake quant's buffers (``scale``, the observer's
statistics) follow the model's device and stay float32 under ``.half()``,
``.to(torch.bfloat16)`` or ``.double()``. Inputs of any dtype are quantized
with that exact float32 scale; see ``fake_quantize_ste`` for the dtype of the
result.

A scale is never below ``2**-23`` (the float32 machine epsilon): a tensor whose
values are all smaller than that quantizes to zeros, and the fake quant warns
once, naming itself and the range it saw.
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from fxq.dtypes import QDType, as_qdtype, qint8, qint16, qint32
from fxq.march import March, get_march_spec, spec_for
from fxq.march.spec import Rounding, ScaleConstraint
from fxq.observer import (
    FixedScaleObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    ObserverBase,
    PerChannelMinMaxObserver,
    keep_dtypes,
)
from fxq.quantized import fake_quant_ops
from fxq.quantized import functional as qf
from fxq.quantized.fake_quant_ops import Statistics
from fxq.utils.grad_mask import keep_mask, pass_gradient
from fxq.utils.warning_summary import summarises_warnings, warn_per_module

__all__ = [
    "FakeQuantState",
    "FakeQuantize",
    "FakeQuantizeFactory",
    "set_fake_quantize",
    "check_non_finite",
    "fake_quantize_ste",
    "bypass",
]

#: the smallest scale fxq uses (``2**-23``): smaller statistics are clamped up to it
_EPS = fake_quant_ops.EPS


class FakeQuantState(str, enum.Enum):
    """What fake quantization does; see the module docstring."""

    CALIBRATION = "calibration"
    QAT = "qat"
    VALIDATION = "validation"


def _as_state(state: FakeQuantState | str) -> FakeQuantState:
    if isinstance(state, FakeQuantState):
        return state
    try:
        return FakeQuantState(str(state).lower())
    except ValueError:
        raise ValueError(
            f"unknown fake-quant state {state!r}; use fxq.FakeQuantState.CALIBRATION, QAT or VALIDATION"
        ) from None


class _FakeQuantSTE(torch.autograd.Function):
    """Fake quantization with the clipped straight-through estimator."""

    @staticmethod
    def forward(ctx, x, scale, qmin, qmax, rounding, ch_axis, exact, clip):  # type: ignore[override]
        out, mask = qf.fake_quantize(x, scale, qmin, qmax, rounding, ch_axis, exact, with_mask=clip)
        if clip:
            ctx.save_for_backward(keep_mask(mask))
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if not ctx.saved_tensors:  # nothing was clipped (``clip_gradient=False``)
            return grad, None, None, None, None, None, None, None
        (mask,) = ctx.saved_tensors
        return pass_gradient(grad, mask), None, None, None, None, None, None, None


def fake_quantize_ste(
    x: Tensor,
    scale: Tensor,
    dtype: QDType,
    rounding: Rounding,
    ch_axis: int | None = None,
    exact: bool = True,
    inplace: bool = False,
    offset: int = 0,
    clip_gradient: bool = True,
) -> Tensor:
    """Differentiable fake quantization (gradient passes where not clipped).

    ``inplace``: the result may be written into ``x`` where no gradient is recorded
    (the caller owns ``x`` and no longer needs it).

    ``exact=False`` rounds with the faster ``floor(v + 0.5)`` (QAT training).

    Dtypes: the arithmetic never runs in a 16-bit float or an integer dtype,
    and ``scale`` (float32) is never rounded to ``x``'s dtype:

    * float32 and float64 ``x``: computed in ``x``'s dtype (the division of
      ``fxq.quantized.functional.quantize``, which the integer model's quantize
      step also does in its input's dtype); the result has ``x``'s dtype.
    * float16 and bfloat16 ``x`` (``.half()`` models, ``torch.autocast``):
      computed in float32, the result is converted back to ``x``'s dtype, so a
      model in half precision keeps computing in it. The grid values are then
      rounded to that dtype (float16 keeps 11 significant bits, bfloat16 8): the
      next quantization recovers every int8 value exactly from float16, but not
      every int16 value; VALIDATION, which re-quantizes the inputs of every
      integer op in float32, is exact for int8 activations in float16.
    * integer ``x`` (``uint8`` camera frames): computed in float32 and returned
      as float32; no integer dtype holds ``q * scale``.

    Args:
        x: the tensor to fake-quantize.
        scale: ``[1]`` or ``[C]`` float32 scale.
        dtype: the quantized dtype (its ``qmin`` / ``qmax`` clamp).
        rounding: the march's rounding.
        ch_axis: the channel axis of a per-channel ``scale``.
        exact: False for the faster training formula.
        offset: the grid's shift in steps (``FakeQuantize.offset``): the clamp is
            ``[qmin + offset, qmax + offset]``.
        clip_gradient: False where the caller knows that no value is clamped (the scale
            covers ``x``'s own range): the gradient then passes everywhere and no mask is
            made or kept (the same gradient, a pass and a tensor fewer).

    Returns:
        ``clamp(round(x / scale), qmin + offset, qmax + offset) * scale`` in the dtype above.
    """
    wide = x if x.dtype is torch.float32 or x.dtype is torch.float64 else x.to(torch.float32)
    qmin, qmax = dtype.qmin + offset, dtype.qmax + offset
    if torch.is_grad_enabled() and x.requires_grad:
        out = _FakeQuantSTE.apply(wide, scale, qmin, qmax, rounding, ch_axis, exact, clip_gradient)
    else:  # no graph to record: the same numbers without the mask
        out, _ = qf.fake_quantize(
            wide,
            scale,
            qmin,
            qmax,
            rounding,
            ch_axis,
            exact,
            with_mask=False,
            inplace=inplace and wide is x and not x.requires_grad,
        )
    return out if out.dtype is x.dtype or not x.is_floating_point() else out.to(x.dtype)


def quantize_in_place(fq: nn.Module, x: Tensor) -> bool:
    """Whether ``fq(x, inplace=True)`` may round ``x`` in place, for a caller that owns ``x``:
    ``fq`` is a ``FakeQuantize`` whose ``forward`` is fxq's (a subclass's own may not take
    ``inplace``), without hooks (a hook may read the input after the call, as the debugging
    tools do), no module hook is registered globally, and nothing records ``x`` for
    autograd."""
    return not x.requires_grad and _called_plainly(fq)


def _called_plainly(fq: nn.Module) -> bool:
    """Whether calling ``fq`` runs fxq's ``FakeQuantize.forward`` and nothing else: no
    subclass's own ``forward``, no hook on it or registered globally."""
    return (
        isinstance(fq, FakeQuantize)
        and type(fq).forward is FakeQuantize.forward
        and not fq._forward_hooks
        and not fq._forward_pre_hooks
        and not nn.modules.module._global_forward_hooks
        and not nn.modules.module._global_forward_pre_hooks
    )


def fold_qat_forward(fq: nn.Module, w: Tensor, bn: nn.Module) -> tuple[Tensor, Tensor] | None:
    """QAT training's BatchNorm fold and the weight's fake quant ``fq`` in one Triton launch.

    ``w``: the out-major weight; ``bn``: the BatchNorm folded into it (its factor a
    constant, the BatchNorm training on batch statistics: ``WeightedQAT.forward``). Returns
    the rounded folded weight and the inverse folding factor
    (``fake_quant_ops.fold_observe_fake_quantize``), or None where the fused step does not
    apply: ``fq`` not called plainly (``_called_plainly``: its hooks would not run), not in
    QAT, not on the Triton path (``FakeQuantize._fused_statistics``: CUDA, float32, an
    observer and a march the kernels cover, not compiling), not per output channel, or
    BatchNorm statistics that are not float32 on ``w``'s device. The caller then folds with
    torch ops and calls ``fq``: the same results, bit for bit.
    """
    if not _called_plainly(fq) or not w.numel():
        return None
    return fq._fold_qat_forward(w, bn)


class FakeQuantizeFactory:
    """A deferred ``FakeQuantize(...)`` constructor, as stored in a ``QConfig``.

    Call it to build a fresh module; ``keywords`` holds its arguments so
    prepare can check the dtype against the march without building one.
    """

    def __init__(self, cls: type[FakeQuantize], **keywords: Any) -> None:
        self.cls = cls
        self.keywords = keywords

    @property
    def dtype(self) -> QDType:
        return as_qdtype(self.keywords.get("dtype", qint8))

    def __call__(self, **overrides: Any) -> FakeQuantize:
        kw = {**self.keywords, **overrides}
        return self.cls(**kw)

    def with_args(self, **keywords: Any) -> FakeQuantizeFactory:
        return FakeQuantizeFactory(self.cls, **{**self.keywords, **keywords})

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={_short(v)}" for k, v in self.keywords.items())
        return f"{self.cls.__name__}.with_args({args})"


def _short(v: Any) -> str:
    if isinstance(v, type):
        return v.__name__
    if isinstance(v, functools.partial):
        return f"{_short(v.func)}({', '.join(f'{k}={w}' for k, w in v.keywords.items())})"
    return repr(v)


_BY_BITS = {d.bits: d for d in (qint8, qint16, qint32)}


def _unavailable(dtype: QDType, spec: Any) -> str:
    """Why ``dtype`` is not available on ``spec``'s march ("" when it is): weights' and
    high-precision outputs' dtypes always are, activation dtypes as the march says."""
    if dtype in (qint32, spec.weight_dtype) or spec.supports_activation(dtype):
        return ""
    return (
        f"{dtype.name} is not available on march {spec.march.value} "
        f"(it runs: {spec.allowed_dtype_names()})"
    )


def _finalize_before_saving(module: FakeQuantize, prefix: str, keep_vars: bool) -> None:
    module.finalize()  # a state_dict holds the scale the statistics give


def _save_grid(module: FakeQuantize, state_dict, prefix: str, local_metadata) -> None:
    # the grid's dtype and offset, always (8 and 0 included): a loader that fills the keys of
    # a fresh model's state dict (torch.distributed.checkpoint) must find them there
    state_dict[prefix + "bits"] = torch.tensor(module.bits)
    state_dict[prefix + "offset"] = torch.tensor(module.offset)


class FakeQuantize(nn.Module):
    """Observe, then round onto the symmetric integer grid of ``dtype``.

    Args:
        observer: observer class or factory (called with ``ch_axis`` and
            ``num_channels``, plus ``observer_kwargs``).
        dtype: ``fxq.qint8``, ``fxq.qint16``, or ``fxq.qint32``. qint32 marks a
            high-precision output: the producing op keeps its int32
            accumulator, and this module passes values through unchanged.
        ch_axis: None (per tensor) or the channel axis (weights: 0).
        num_channels: number of channels for per-channel buffers, if known.
        scale: a fixed scale (uses ``FixedScaleObserver``).
        march: the march whose rounding and scale constraint apply; the
            current march (``fxq.set_march``) when None.
        **observer_kwargs: passed to the observer (e.g. ``averaging_constant``).

    Raises:
        ValueError: for a dtype the march cannot run, or a fixed scale the
            march cannot represent.
        RuntimeError: when no march is given and none is set.

    Attributes:
        offset: 0 (the symmetric grid ``[qmin, qmax] * scale``), or ``-qmin``
            for a tensor that is never negative (a ReLU output): the grid is then
            ``[0, qmax - qmin] * scale``, every level on the values that occur,
            and the integer model stores ``q - offset`` in the same signed dtype
            (``fxq.calibration.offset_activations`` sets it, with the consumers
            that undo the shift in their biases). Saved in the state dict (a
            state dict without it, from before, means 0).
        dtype: saved in the state dict as ``bits`` (8, 16 or 32), since recipes
            change it (``ptq`` widens the outputs, ``mixed_precision`` picks
            int16 layers) and the scale is only right on its own grid: loading
            gives a freshly prepared model the saved dtype, or fails naming the
            fake quant when its march cannot run it (a state dict without it,
            from before, keeps the qconfig's dtype).
        on_chip_with: "" for a tensor the integer model stores; else the path of the
            normalization that the march runs fused with this tensor's producer, the
            tensor never leaving the chip (``MarchSpec.norm_input_dtype``; set by
            ``prepare_qat_fx``). Activation-byte budgets do not count it.
    """

    #: see the class docstring
    on_chip_with = ""

    def __init__(
        self,
        observer: Callable[..., ObserverBase] = MovingAverageMinMaxObserver,
        dtype: QDType | str = qint8,
        ch_axis: int | None = None,
        num_channels: int | None = None,
        scale: float | None = None,
        march: March | str | None = None,
        **observer_kwargs: Any,
    ) -> None:
        super().__init__()
        spec = get_march_spec(march)
        self.march = spec.march
        self.dtype = as_qdtype(dtype)
        problem = _unavailable(self.dtype, spec)
        if problem:
            raise ValueError(f"dtype {problem}")
        self.ch_axis = ch_axis
        if scale is not None:
            if spec.scale_constraint is ScaleConstraint.POWER_OF_TWO and float(
                qf.constrain_scale(torch.tensor(float(scale)), spec.scale_constraint)
            ) != float(scale):
                raise ValueError(
                    f"fixed scale {scale} is not a power of two, which march {spec.march.value} requires"
                )
            observer = functools.partial(FixedScaleObserver, scale=float(scale))
            observer_kwargs = {}  # statistics options do not apply to a fixed scale
        self.activation_post_process = observer(
            ch_axis=ch_axis, num_channels=num_channels, **observer_kwargs
        )
        self.activation_post_process.qmax = self.dtype.qmax
        self._stale = False  # a deferred observer has statistics the scale does not reflect yet
        self.register_state_dict_pre_hook(_finalize_before_saving)
        self.register_state_dict_post_hook(_save_grid)
        n = num_channels if (ch_axis is not None and num_channels) else 1
        self.register_buffer("scale", torch.ones(n))
        self.register_buffer("observed", torch.zeros((), dtype=torch.bool))
        self.state = FakeQuantState.QAT
        self.name = ""
        self.offset = 0
        self._checked_observed = False
        self._warned_floor = False

    # -- configuration ---------------------------------------------------
    @classmethod
    def with_args(cls, **keywords: Any) -> FakeQuantizeFactory:
        """A factory that builds ``cls(**keywords)`` (for ``QConfig``)."""
        return FakeQuantizeFactory(cls, **keywords)

    @property
    def spec(self):
        return spec_for(self.march)

    @property
    def rounding(self) -> Rounding:
        return self.spec.rounding

    @property
    def bits(self) -> int:
        """``dtype``'s width, as the state dict saves it (state-dict tools look keys up as
        attributes: ``torch.distributed.checkpoint``)."""
        return self.dtype.bits

    @property
    def is_high_precision(self) -> bool:
        return self.dtype is qint32

    @property
    def observer(self) -> ObserverBase:
        return self.activation_post_process

    @property
    def is_fixed_scale(self) -> bool:
        return isinstance(self.activation_post_process, FixedScaleObserver)

    def set_name(self, name: str) -> None:
        """Say where this fake quant sits (used in error messages)."""
        self.name = name
        self.activation_post_process.name = name

    def set_offset(self, offset: int) -> None:
        """Shift the grid by ``offset`` steps: 0 or ``-qmin`` (see the class docstring).

        The scale keeps covering the same largest value: it is recomputed from
        the statistics when there are some, else scaled by the ratio of the
        levels above zero.

        Raises:
            ValueError: another offset, a per-channel or high-precision fake quant,
                or one with a fixed scale.
        """
        offset = int(offset)
        if offset == self.offset:
            return
        problem = self._offset_problem(offset)
        if problem:
            raise ValueError(f"fake quant {self.name or '(unnamed)'}: {problem}")
        if self.ch_axis is not None or self.is_high_precision or self.is_fixed_scale:
            raise ValueError(
                f"fake quant {self.name or '(unnamed)'}: only a per-tensor activation with a "
                "calibrated int8 / int16 scale can take an offset"
            )
        before = self.levels_above_zero
        self._adopt_offset(offset)
        with torch.no_grad():
            if self.activation_post_process.has_statistics():
                self.update_scale()
            else:
                ratio = before / self.levels_above_zero
                scale = self.scale * self.scale.new_full((), ratio)
                self.scale.copy_(qf.constrain_scale(scale, self.spec.scale_constraint))

    def _offset_problem(self, offset: int) -> str:
        """Why ``offset`` cannot be this fake quant's ("" when it can)."""
        if offset in (0, -self.dtype.qmin):
            return ""
        return (
            f"offset must be 0 or {-self.dtype.qmin} (an unsigned range in {self.dtype.name}), "
            f"got {offset}"
        )

    def set_dtype(self, dtype: QDType) -> None:
        """Quantize onto ``dtype``'s grid from now on (the scale is kept: recalibrate, or
        load the scale that goes with it); the observer counts its levels."""
        self.dtype = dtype
        self.activation_post_process.qmax = self.levels_above_zero

    def _adopt_offset(self, offset: int) -> None:
        """Set the offset and the levels the observer's searches count (scale unchanged)."""
        self.offset = offset
        self.activation_post_process.qmax = self.levels_above_zero

    @property
    def levels_above_zero(self) -> int:
        """``qmax + offset``: the grid step is the largest value over this."""
        return self.dtype.qmax + self.offset

    def set_fake_quant_state(self, state: FakeQuantState | str) -> None:
        """Switch to ``state`` (pending statistics become the scale first)."""
        state = _as_state(state)
        self.check_non_finite()
        self.finalize()
        self.warn_if_scale_at_floor()
        self.state = state
        self._checked_observed = False

    def check_non_finite(self) -> None:
        """Raise if NaN / Inf reached the observer since its last check (see
        ``ObserverBase.check_non_finite``; on CUDA that check is deferred)."""
        check = getattr(self.activation_post_process, "check_non_finite", None)
        if check is not None:
            check()

    def finalize(self) -> None:
        """Compute the scale from statistics gathered by a deferred observer (if any are pending)."""
        if self._stale:
            self._stale = False
            self.update_scale()

    # -- scale -------------------------------------------------------------
    def calculate_scale(self) -> Tensor:
        """The scale the current statistics give (does not store it)."""
        return self._scale_from_statistics()

    def _scale_from_statistics(self, out: Tensor | None = None) -> Tensor:
        """``calculate_scale``, written into ``out`` where no further step needs a new tensor.

        This runs at every QAT step of every fake quant, where each small op is a kernel
        launch and a Python call (what bounds a CUDA QAT step): no host sync, as few ops as
        the arithmetic allows.
        """
        obs = self.activation_post_process
        if isinstance(obs, FixedScaleObserver):
            return obs.fixed_scale.expand(self.scale.shape).clone()
        if type(obs).amax is ObserverBase.amax:
            # ``obs.amax()`` without its clamp at 0: the clamp at _EPS below covers it
            amax = torch.maximum(obs.min_val.neg(), obs.max_val)
        else:
            amax = obs.amax()
        amax = amax.to(self.scale.device)
        fallback = self._zero_range_scale()
        constrained = self.spec.scale_constraint is not ScaleConstraint.ANY
        if out is not None and (constrained or out.shape != amax.shape):
            out = None  # the last step makes a new tensor anyway
        scale = fake_quant_ops.scale_from_amax(amax, self._levels_divisor(amax), fallback, out)
        return qf.constrain_scale(scale, self.spec.scale_constraint) if constrained else scale

    def _levels_divisor(self, like: Tensor) -> Tensor:
        """``levels_above_zero`` as a 0-dim tensor on ``like``'s device, made once.

        A tensor divisor: CUDA divides by a Python number as a product with its reciprocal,
        which can differ from the CPU by an ulp.
        """
        if type(like) is not Tensor:  # a traced or fake tensor: made in its own mode
            return like.new_full((), float(self.levels_above_zero))
        key = (self.levels_above_zero, like.device, like.dtype)
        cached = self.__dict__.get("_divisor")
        if cached is None or cached[0] != key:
            cached = (key, torch.full((), float(key[0]), dtype=like.dtype, device=like.device))
            self._divisor = cached
        return cached[1]

    #: per-tensor fake quants of the producing op's inputs (set by ``fxq.qat``): a value whose
    #: calibrated range is zero (a constant 0, e.g. an attention mask of an unpadded batch)
    #: takes the largest of their scales, so requantizing to it stays representable
    zero_range_inputs: tuple[FakeQuantize | None, ...] = ()

    def _zero_range_scale(self) -> Tensor | None:
        """The scale for an all-zero value: the largest input scale, one element (None
        without inputs). Runs at every QAT step: an op per extra input, none to reshape or
        move a scale that is already one element on this device."""
        scale = self.scale
        if scale.numel() != 1:
            return None
        device = scale.device
        scales = []
        for fq in self.zero_range_inputs:
            if fq is None or fq is self or fq.is_high_precision:
                continue
            other = fq.scale
            if other.numel() != 1:
                continue
            if not fq._observed_set:  # 0 until observed
                other = other * fq.observed
            if other.device != device:
                other = other.to(device)
            scales.append(other)
        if not scales:
            return None
        return functools.reduce(torch.maximum, scales)

    def warn_if_scale_at_floor(self) -> bool:
        """Warn (once per fake quant) when the scale sits at the ``2**-23`` floor
        although the values seen were not all zero: they quantize to zeros, or
        to a few levels, whatever the data meant.

        Called when calibration ends, on state switches and on the first
        VALIDATION forward (never on every training step). Returns whether
        the scale is at the floor (False on the meta device, where nothing
        can be checked).
        """
        if self.is_fixed_scale or self.is_high_precision or self.scale.device.type == "meta":
            return False
        if not bool(self.observed):
            return False
        obs = self.activation_post_process
        if obs.min_val.numel() == 0:
            return False
        seen = torch.maximum(-obs.min_val, obs.max_val).to(self.scale.device)
        if seen.shape != self.scale.shape and seen.numel() != 1:
            return False
        at_floor = (self.scale <= _EPS) & (seen > 0) & torch.isfinite(seen)
        if not bool(at_floor.any()):
            return False
        if not self._warned_floor:
            self._warned_floor = True
            warn_per_module(  # one summary per public call (set_fake_quantize, calibrate, ...)
                self.name or "(unnamed)",
                self._floor_message(seen, at_floor),
                headline="the scale is clamped at fxq's smallest scale 2**-23, so their values "
                "quantize to 0 or to a few levels",
                what="fake quant",
                stacklevel=3,
            )
        return True

    def _floor_message(self, seen: Tensor, at_floor: Tensor) -> str:
        obs = self.activation_post_process
        where = self.name or "(unnamed)"
        qmax = self.dtype.qmax
        largest = float(seen[at_floor].max())
        levels = min(round(largest / _EPS), qmax)
        if at_floor.numel() > 1:
            what = (
                f"{int(at_floor.sum())} of its {at_floor.numel()} channels saw values of "
                f"magnitude at most {largest:.3g}"
            )
        else:
            what = (
                f"it saw values in [{float(obs.min_val.min()):.3g}, {float(obs.max_val.max()):.3g}]"
            )
        if largest / qmax < _EPS:
            why = (
                f"the scale they ask for ({largest / qmax:.3g}) is below fxq's smallest scale "
                f"2**-23 ({_EPS:.3g})"
            )
        else:
            why = f"its observer chose a clipping range smaller than {_EPS * qmax:.3g}"
        result = (
            "every value quantizes to 0"
            if levels == 0
            else f"values quantize to at most {levels} of the {qmax} levels"
        )
        head = (
            f"fxq: fake quant {where}: {what}; {why}, so the scale is clamped there and {result}."
        )
        if self.holds_weight:
            return (
                f"{head} These weights are (nearly) zero there (e.g. normalization gammas "
                "that training drove to about 0, or pruned channels); below 2**-23 they change "
                "the layer's output by less than 2**-23 times its input, which is usually "
                "harmless. If the model needs them, keep this layer in float with a qconfig "
                "of None."
            )
        return (
            f"{head} This usually means vanishing activations (e.g. a randomly initialised "
            "model, or a layer whose inputs are nearly zero). Calibrate with trained weights "
            "and representative data, or keep this layer in float with a qconfig of None."
        )

    @torch.no_grad()
    def update_scale(self) -> None:
        """Recompute ``scale`` from the observer's statistics."""
        new = self._scale_from_statistics(out=self.scale)
        if new is not self.scale:
            if new.shape != self.scale.shape:
                self.scale = torch.empty_like(new)
            self.scale.copy_(new)
        self._mark_observed()

    def _mark_observed(self) -> None:
        if not self._observed_set:  # it stays True (only a loaded state dict can change it)
            self.observed.fill_(True)
            self._observed_set = True

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors
    ):
        saved_bits = state_dict.pop(prefix + "bits", None)
        if saved_bits is not None and int(saved_bits) != self.dtype.bits:
            saved = _BY_BITS.get(int(saved_bits))
            if saved is None:
                errors.append(
                    f"{prefix}bits: a quantized dtype of {int(saved_bits)} bits does not exist "
                    "(8, 16 or 32)"
                )
            elif problem := _unavailable(saved, self.spec):
                errors.append(
                    f"{prefix}bits: the saved dtype {problem}; load with the march it was saved with"
                )
            else:
                self.set_dtype(saved)
        # a state dict from before offsets were always saved: no key means symmetric
        saved_offset = state_dict.pop(prefix + "offset", None)
        offset = 0 if saved_offset is None else int(saved_offset)
        if offset != self.offset:
            problem = self._offset_problem(offset)
            if problem:
                errors.append(f"{prefix}offset: {problem}")
            else:
                self._adopt_offset(offset)
        saved = state_dict.get(prefix + "scale")
        if problem := self._saved_scale_problem(saved):
            errors.append(f"{prefix}scale: {problem}; load with the march it was saved with")
        if isinstance(saved, Tensor) and saved.shape != self.scale.shape:
            self.scale = torch.empty(saved.shape, dtype=self.scale.dtype, device=self.scale.device)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing, unexpected, errors
        )
        # what the loaded ``observed`` says, read once here: a compiled QAT step then writes it
        # no more, as after an eager step (a flag first learnt inside a compiled step changes
        # the state it was compiled for, and the model recompiles at its second step)
        observed = self.observed
        self._observed_set = observed.device.type != "meta" and bool(observed)

    def _saved_scale_problem(self, saved: Any) -> str:
        """Why a saved scale is not one this module's march can represent ("" when it is): a
        state dict of a march with any scale loaded into a power-of-two march's model."""
        constraint = self.spec.scale_constraint
        if (
            constraint is ScaleConstraint.ANY
            or not isinstance(saved, Tensor)
            or saved.device.type == "meta"
            or not saved.is_floating_point()
        ):
            return ""
        saved = saved.detach()
        bad = qf.constrain_scale(saved, constraint) != saved
        if not bool(bad.any()):
            return ""
        first = float(saved.reshape(-1)[bad.reshape(-1)][0])
        return (
            f"{int(bad.sum())} of {saved.numel()} saved scales (e.g. {first:.6g}) are not powers "
            f"of two, which march {self.march.value} requires"
        )

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> nn.Module:
        # the scale and statistics follow the model's device but stay float32
        return super()._apply(keep_dtypes(fn), recurse)

    # -- forward -----------------------------------------------------------
    #: set by ``prepare_qat_fx`` on a layer's weight fake quant (for its messages)
    holds_weight = False
    #: set by ``bypass``: neither observe nor round (the float model)
    bypassed = False
    #: whether ``observed`` is known to be True (``update_scale`` then writes it no more)
    _observed_set = False
    #: set by ``training_rounding``: VALIDATION rounds with QAT training's formula
    inexact = False

    def forward(self, x: Tensor, inplace: bool = False) -> Tensor:
        """Observe and / or round ``x`` as the state says (dtypes: see ``fake_quantize_ste``).

        ``inplace``: in VALIDATION without autograd, the rounded values may be written into
        ``x`` (a module's own output, which nothing else reads; see ``quantize_in_place``).
        """
        if self.is_high_precision or self.bypassed:
            return x
        if not x.is_floating_point():
            x = x.to(torch.float32)  # integer data (uint8 frames): quantized with the float scale
        state = self.state
        if state is FakeQuantState.VALIDATION:
            self._require_observed()
            return fake_quantize_ste(
                x,
                self.scale,
                self.dtype,
                self.rounding,
                self.ch_axis,
                exact=not self.inexact,
                inplace=inplace,
                offset=self.offset,
            )
        if x.numel() == 0:  # an empty tensor carries no statistics (as in torch.ao)
            return x
        if state is FakeQuantState.QAT:
            statistics = self._fused_statistics(x)
            if statistics is not None:
                return self._fused_qat_forward(x, statistics)
        self.activation_post_process(x)
        if state is FakeQuantState.CALIBRATION and self.activation_post_process.deferred:
            self._stale = True  # the search runs once, when calibration ends
            self._mark_observed()
            return x
        self.update_scale()
        if state is FakeQuantState.CALIBRATION:
            return x
        # training: the faster rounding formula (it differs only at the float just below 1/2)
        return fake_quantize_ste(
            x,
            self.scale,
            self.dtype,
            self.rounding,
            self.ch_axis,
            exact=False,
            offset=self.offset,
            clip_gradient=self._clips_gradient(),
        )

    def _clips_gradient(self) -> bool:
        """Whether QAT's straight-through estimator can clip a gradient here.

        Not when the statistics just updated with the tensor being rounded cover its whole
        range (a running or the latest min / max: ``MinMaxObserver``, the weights'
        ``PerChannelMinMaxObserver``), the scale is their ``amax / levels`` (or the power of
        two above it) and the grid holds ``[-levels, levels]``: then ``|x / scale|`` is at
        most ``levels`` but for a few ulps, far less than the half step that would round it
        one level out (up to 16 bits), so every mask value is True and none is made (a pass
        less forward, a pass and a tensor less backward). A NaN or Inf, where the mask would
        have been False, is reported by the observer's check.
        """
        obs = self.activation_post_process
        kind = type(obs)
        if kind is not PerChannelMinMaxObserver and kind is not MinMaxObserver:
            return True
        dtype = self.dtype
        return (
            obs.ch_axis != self.ch_axis
            or dtype.bits > 16
            or dtype.qmin + self.offset > -self.levels_above_zero
        )

    def _fused_statistics(self, x: Tensor) -> Statistics | None:
        """How ``fxq::observe_fake_quantize`` updates this fake quant's statistics, when its
        Triton kernels can take the QAT step (a float32 CUDA tensor, an observer and a march
        they cover, not under ``torch.compile``, whose own kernels fuse the torch ops), else
        None: the step then runs as separate torch ops, with the same results."""
        if torch.compiler.is_compiling() or not fake_quant_ops.triton_usable(x):
            return None
        obs = self.activation_post_process
        cached = self.__dict__.get("_fused_cache")  # this runs at every step: the fixed facts once
        if (
            cached is None
            or cached[0] is not obs
            or cached[1] is not obs.sync_group
            or cached[2] is not self.dtype
            or cached[3] != self.offset
        ):
            cached = (
                obs,
                obs.sync_group,
                self.dtype,
                self.offset,
                self._fused_kind(obs),
                self._clips_gradient(),
            )
            self.__dict__["_fused_cache"] = cached
        statistics = cached[4]
        if statistics is None:
            return None
        min_val, scale, ch_axis = obs.min_val, self.scale, self.ch_axis
        if (
            min_val.shape != scale.shape
            or min_val.device != x.device
            or scale.numel() != (1 if ch_axis is None else x.shape[ch_axis])
            or not fake_quant_ops.kernels_take(x, ch_axis)
        ):
            return None
        return statistics

    def _fused_kind(self, obs: ObserverBase) -> Statistics | None:
        """The statistics the fused op keeps for ``obs`` (None: it does not cover it)."""
        kind = type(obs)
        per_channel = self.ch_axis is not None
        if (
            obs.sync_group is not None
            or obs.immediate_check
            or self.rounding is not Rounding.HALF_UP
            or self.spec.scale_constraint is not ScaleConstraint.ANY
        ):
            return None
        if kind is MovingAverageMinMaxObserver or kind is MovingAveragePerChannelMinMaxObserver:
            return Statistics.MOVING
        if kind is PerChannelMinMaxObserver and per_channel:
            return Statistics.LATEST
        if kind is MinMaxObserver and not per_channel:
            return Statistics.RUNNING
        return None

    def _fused_qat_forward(
        self, x: Tensor, statistics: Statistics, bn: nn.Module | None = None
    ) -> Tensor | tuple[Tensor, Tensor]:
        """The QAT step (observe, scale, round) as one ``fxq::observe_fake_quantize``; with
        ``bn``, the weight ``x`` folded with it first
        (``fake_quant_ops.fold_observe_fake_quantize``: the rounded weight and the inverse
        folding factor)."""
        obs = self.activation_post_process
        state = (obs.min_val, obs.max_val, self.scale, obs.non_finite)
        step = (
            getattr(obs, "averaging_constant", 0.0),
            statistics,
            self.levels_above_zero,
            self.dtype.qmin + self.offset,
            self.dtype.qmax + self.offset,
        )
        clip = self.__dict__["_fused_cache"][5]  # set by ``_fused_statistics``
        if bn is None:
            out = fake_quant_ops.observe_fake_quantize(
                x, *state, self._zero_range_scale(), *step, self.ch_axis,
                clip_gradient=clip, kernels_take_x=True,  # as ``_fused_statistics`` found
            )  # fmt: skip
        else:
            out = fake_quant_ops.fold_observe_fake_quantize(
                x, bn.weight, bn.running_var, bn.eps, *state, *step, clip_gradient=clip
            )
        obs.count_deferred_check()
        self._mark_observed()
        return out

    def _fold_qat_forward(self, w: Tensor, bn: nn.Module) -> tuple[Tensor, Tensor] | None:
        """``fold_qat_forward`` once the caller found this module called plainly."""
        if (
            self.state is not FakeQuantState.QAT
            or self.ch_axis != 0
            or self.bypassed
            or self.is_high_precision
        ):
            return None
        statistics = self._fused_statistics(w)
        if statistics is None:
            return None
        running_var, gamma = bn.running_var, bn.weight
        if running_var.dtype is not torch.float32 or running_var.device != w.device:
            return None
        if gamma is not None and (gamma.dtype is not torch.float32 or gamma.device != w.device):
            return None
        return self._fused_qat_forward(w, statistics, bn)

    def _require_observed(self) -> None:
        if self._checked_observed:
            return
        if torch.compiler.is_compiling():  # a host read: outside the graph, once
            self._check_observed_outside_graph()
        else:
            self._check_observed()

    def _check_observed(self) -> None:
        if not self.is_fixed_scale and not bool(self.observed):
            raise RuntimeError(
                f"fake quant {self.name or '(unnamed)'} has never observed data, so it has no scale; "
                "run some batches in CALIBRATION or QAT state (or load a calibrated state_dict) "
                "before VALIDATION"
            )
        self._checked_observed = True
        self.warn_if_scale_at_floor()

    _check_observed_outside_graph = torch.compiler.disable(_check_observed)

    def extra_repr(self) -> str:
        parts = [
            f"dtype={self.dtype.name}",
            f"march={self.march.value}",
            f"state={self.state.value}",
        ]
        if self.ch_axis is not None:
            parts.append(f"ch_axis={self.ch_axis}")
        if self.offset:
            parts.append(f"offset={self.offset}")
        if self.scale.numel() == 1 and self.scale.device.type != "meta":
            parts.append(f"scale={self.scale.item():.6g}")
        return ", ".join(parts)


def check_non_finite(model: nn.Module) -> None:
    """Raise if NaN or Inf reached a fake quant of ``model`` since the last check.

    On CUDA an eager QAT step checks every 32 steps, and a compiled step (``torch.compile``)
    never, to make no host sync: its flags are read when the fake-quant state changes or the
    model is converted. A compiled training loop calls this every few hundred steps, outside
    the compiled function, to stop within that many steps of a bad batch (one host read for
    the whole model while nothing is wrong).

    Raises:
        ValueError: naming the fake quant where the values entered (the first in the
            graph's order that saw them; the others it reached are listed after it).
    """
    quants = [(name, m) for name, m in model.named_modules() if isinstance(m, FakeQuantize)]
    observers = [m.activation_post_process for _, m in quants]
    flags = [f for obs in observers for f in getattr(obs, "non_finite_flags", list)()]
    failed = any(getattr(obs, "failed", False) for obs in observers)
    one_device = flags and len({f.device for f in flags}) == 1
    if (
        not failed
        and one_device
        and not bool(torch.cat([f.reshape(-1) for f in flags]).isnan().any())
    ):
        for obs in observers:  # all read at once: the deferred counts start again
            getattr(obs, "found_finite", lambda: None)()
        return
    errors = []
    for name, m in quants:
        try:
            m.check_non_finite()
        except ValueError as e:
            errors.append((name, m.activation_post_process.name or name, e))
    if not errors:
        return
    order = _graph_order(model)
    errors.sort(key=lambda item: order(item[0]))
    first = errors[0][2]
    if len(errors) == 1:
        raise first
    others = "; ".join(where for _, where, _ in errors[1:6]) + ("; ..." if len(errors) > 6 else "")
    raise ValueError(
        f"{first} It is the first of {len(errors)} fake quants in the graph's order that "
        f"saw them; the others are after it: {others}"
    ) from first


def _graph_order(model: nn.Module) -> Callable[[str], int]:
    """A module name's position in ``model``'s graph: that of the first node calling it or
    a module holding it (models without a graph: their modules' order)."""
    graph = getattr(model, "graph", None)
    position: dict[str, int] = {}
    if isinstance(graph, torch.fx.Graph):
        for i, node in enumerate(graph.nodes):
            if node.op == "call_module":
                position.setdefault(str(node.target), i)
    names = {name: i for i, (name, _) in enumerate(model.named_modules())}

    def order(name: str) -> int:
        path = name
        while path:
            if path in position:
                return position[path]
            path = path.rpartition(".")[0]
        return len(position) + names.get(name, 0)

    return order


@summarises_warnings("fxq.set_fake_quantize")
def set_fake_quantize(model: nn.Module, state: FakeQuantState | str) -> nn.Module:
    """Put every fake quant (and every fxq.qat module) of ``model`` in ``state``.

    Args:
        model: a model returned by ``prepare_qat_fx`` (or any module holding
            fxq fake quants).
        state: ``FakeQuantState.CALIBRATION``, ``QAT`` or ``VALIDATION`` (or
            their strings).

    Returns:
        ``model`` itself, for chaining.

    Raises:
        ValueError: for an unknown state, or when ``model`` holds no fake quant.
    """
    state = _as_state(state)
    check_non_finite(model)  # every NaN / Inf first, so none is switched on an error
    found = False
    for module in model.modules():
        setter = getattr(module, "set_fake_quant_state", None)
        if setter is not None:
            setter(state)
            found = True
    if not found:
        raise ValueError(
            "set_fake_quantize: the model has no fxq fake quant; pass the model returned by "
            "fxq.prepare_qat_fx"
        )
    _link_fsdp_parameters(model)
    return model


def _link_fsdp_parameters(model: nn.Module) -> None:
    """Give each module whose parameters FSDP2 (``fully_shard``) manages its ``FSDPParam``
    per parameter name (``module.__dict__["_fsdp_params"]``).

    FSDP2 refills a module's unsharded parameters at every forward without a version
    bump, so what a QAT module caches from them (its integer twin, ``QATModule._twin_key``)
    is keyed on the sharded parameters, whose versions do change with the weights. Reads
    FSDP2's private state; where it differs (another torch version) nothing is linked and
    the twin is rebuilt at every forward.
    """
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        if state is None:
            continue
        try:
            fsdp_state = state()
            groups = getattr(fsdp_state, "_fsdp_param_groups", None)
            if groups is None:
                groups = [fsdp_state._fsdp_param_group]
            params = [p for g in groups if g is not None for p in g.fsdp_params]
            for fsdp_param in params:
                info = fsdp_param._module_info
                links = info.module.__dict__.setdefault("_fsdp_params", {})
                links[info.param_name] = fsdp_param
        except AttributeError:
            continue


_UNSET = object()


def _restore_attribute(module: nn.Module, name: str, saved: object) -> None:
    if saved is _UNSET:
        module.__dict__.pop(name, None)  # back to the class default
    else:
        module.__dict__[name] = saved


@contextlib.contextmanager
def _attribute_set(modules: Iterable[nn.Module], name: str, value: object) -> Iterator[None]:
    """Within the block each module's attribute ``name`` is ``value``; on exit each gets
    back what it had (its own value, or the class default): re-entrant."""
    saved = [(m, m.__dict__.get(name, _UNSET)) for m in modules]
    try:
        for m, _ in saved:
            setattr(m, name, value)
        yield
    finally:
        for m, previous in saved:
            _restore_attribute(m, name, previous)


@contextlib.contextmanager
def bypass(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block the model computes in float: fake quants neither observe
    nor round, and QAT modules use their float path (statistics are untouched).

    Re-entrant: blocks may nest (on the same model or on parts of it), and each
    exit restores what its entry found. QAT modules are recognised by their
    ``simulate_integer`` attribute (``fxq.qat.QATModule``), so this module
    does not depend on ``fxq.qat``.
    """
    fake_quants = [m for m in model.modules() if isinstance(m, FakeQuantize)]
    qat_modules = [
        m
        for m in model.modules()
        if not isinstance(m, FakeQuantize) and hasattr(m, "simulate_integer")
    ]
    saved_qat = [(m, m.__dict__.get("simulate_integer", _UNSET), m.state) for m in qat_modules]
    try:
        with bypassed(fake_quants):
            for m in qat_modules:
                m.simulate_integer = False
                m.state = FakeQuantState.CALIBRATION  # no bias rounding either
            yield model
    finally:
        for m, simulate, state in saved_qat:
            _restore_attribute(m, "simulate_integer", simulate)
            m.state = state


@contextlib.contextmanager
def training_rounding(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block the model's fake quants round in VALIDATION as in QAT training:
    multiplied by ``1 / scale`` and ``floor(v + 0.5)``, three passes over the tensor fewer
    than the exact division and rounding (``fake_quantize``). The two differ at most by
    one step, where ``x / scale`` lies within a float32 rounding of a half: for the many
    steps of an optimisation that only approximates the integer model anyway (learned
    rounding), not for results that must equal the integer model. Re-entrant like
    ``bypass``."""
    with _attribute_set(
        [m for m in model.modules() if isinstance(m, FakeQuantize)], "inexact", True
    ):
        yield model


def weight_quants(model: nn.Module) -> list[FakeQuantize]:
    """The weights' fake quants: the ``weight_fake_quant`` of ``model``'s QAT modules and
    their other ``*_weight_fake_quant`` children (``nn.MultiheadAttention``'s
    ``in_proj_weight_fake_quant`` and ``out_proj_weight_fake_quant``)."""
    return [
        child
        for m in model.modules()
        for name, child in m.named_children()
        if isinstance(child, FakeQuantize)
        and (name == "weight_fake_quant" or name.endswith("_weight_fake_quant"))
    ]


def activation_quants(model: nn.Module) -> list[FakeQuantize]:
    """Activation fake quants whose scale calibration sets (not weights, fixed scales or int32)."""
    weights = {id(fq) for fq in weight_quants(model)}
    return [
        m
        for m in model.modules()
        if isinstance(m, FakeQuantize)
        and id(m) not in weights
        and not m.is_high_precision
        and not m.is_fixed_scale
    ]


@contextlib.contextmanager
def bypassed(fake_quants: Iterable[FakeQuantize]) -> Iterator[None]:
    """Within the block the given fake quants pass their input through unchanged
    (no observation, no rounding); re-entrant like ``bypass``."""
    with _attribute_set(fake_quants, "bypassed", True):
        yield
