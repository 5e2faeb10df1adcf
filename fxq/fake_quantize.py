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
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from fxq.dtypes import QDType, as_qdtype, qint8, qint32
from fxq.march import March, get_march_spec, spec_for
from fxq.march.spec import Rounding, ScaleConstraint
from fxq.observer import FixedScaleObserver, MovingAverageMinMaxObserver, ObserverBase
from fxq.quantized import functional as qf

__all__ = [
    "FakeQuantState",
    "FakeQuantize",
    "FakeQuantizeFactory",
    "set_fake_quantize",
    "fake_quantize_ste",
    "bypass",
]

_EPS = float(torch.finfo(torch.float32).eps)


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
    def forward(ctx, x, scale, qmin, qmax, rounding, ch_axis, exact):  # type: ignore[override]
        out, mask = qf.fake_quantize(x, scale, qmin, qmax, rounding, ch_axis, exact)
        ctx.save_for_backward(mask)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (mask,) = ctx.saved_tensors
        return grad * mask, None, None, None, None, None, None


def fake_quantize_ste(
    x: Tensor,
    scale: Tensor,
    dtype: QDType,
    rounding: Rounding,
    ch_axis: int | None = None,
    exact: bool = True,
) -> Tensor:
    """Differentiable fake quantization (gradient passes where not clipped).

    ``exact=False`` rounds with the faster ``floor(v + 0.5)`` (QAT training).
    """
    return _FakeQuantSTE.apply(x, scale, dtype.qmin, dtype.qmax, rounding, ch_axis, exact)


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


def _finalize_before_saving(module: FakeQuantize, prefix: str, keep_vars: bool) -> None:
    module.finalize()  # a state_dict holds the scale the statistics give


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
    """

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
        if self.dtype not in (qint32, spec.weight_dtype) and not spec.supports_activation(
            self.dtype
        ):
            raise ValueError(
                f"dtype {self.dtype.name} is not available on march {spec.march.value} "
                f"(it runs: {spec.allowed_dtype_names()})"
            )
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
        n = num_channels if (ch_axis is not None and num_channels) else 1
        self.register_buffer("scale", torch.ones(n))
        self.register_buffer("observed", torch.zeros((), dtype=torch.bool))
        self.state = FakeQuantState.QAT
        self.name = ""
        self._checked_observed = False

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

    def set_fake_quant_state(self, state: FakeQuantState | str) -> None:
        self.finalize()
        self.state = _as_state(state)
        self._checked_observed = False

    def finalize(self) -> None:
        """Compute the scale from statistics gathered by a deferred observer (if any are pending)."""
        if self._stale:
            self._stale = False
            self.update_scale()

    # -- scale -------------------------------------------------------------
    def calculate_scale(self) -> Tensor:
        """The scale the current statistics give (does not store it)."""
        obs = self.activation_post_process
        if isinstance(obs, FixedScaleObserver):
            return obs.fixed_scale.expand(self.scale.shape).clone()
        scale = (obs.amax().to(self.scale.device) / self.dtype.qmax).clamp(min=_EPS)
        return qf.constrain_scale(scale, self.spec.scale_constraint)

    @torch.no_grad()
    def update_scale(self) -> None:
        """Recompute ``scale`` from the observer's statistics."""
        new = self.calculate_scale()
        if new.shape != self.scale.shape:
            self.scale = torch.empty_like(new)
        self.scale.copy_(new)
        self.observed.fill_(True)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors
    ):
        saved = state_dict.get(prefix + "scale")
        if saved is not None and saved.shape != self.scale.shape:
            self.scale = torch.empty_like(saved, device=self.scale.device)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing, unexpected, errors
        )

    # -- forward -----------------------------------------------------------
    #: set by ``bypass``: neither observe nor round (the float model)
    bypassed = False

    def forward(self, x: Tensor) -> Tensor:
        if self.is_high_precision or self.bypassed:
            return x
        state = self.state
        if state is FakeQuantState.VALIDATION:
            self._require_observed()
            return fake_quantize_ste(x, self.scale, self.dtype, self.rounding, self.ch_axis)
        self.activation_post_process(x)
        if state is FakeQuantState.CALIBRATION and self.activation_post_process.deferred:
            self._stale = True  # the search runs once, when calibration ends
            self.observed.fill_(True)
            return x
        self.update_scale()
        if state is FakeQuantState.CALIBRATION:
            return x
        # training: the faster rounding formula (it differs only at the float just below 1/2)
        return fake_quantize_ste(
            x, self.scale, self.dtype, self.rounding, self.ch_axis, exact=False
        )

    def _require_observed(self) -> None:
        if self._checked_observed:
            return
        if not self.is_fixed_scale and not bool(self.observed):
            raise RuntimeError(
                f"fake quant {self.name or '(unnamed)'} has never observed data, so it has no scale; "
                "run some batches in CALIBRATION or QAT state (or load a calibrated state_dict) "
                "before VALIDATION"
            )
        self._checked_observed = True

    def extra_repr(self) -> str:
        parts = [
            f"dtype={self.dtype.name}",
            f"march={self.march.value}",
            f"state={self.state.value}",
        ]
        if self.ch_axis is not None:
            parts.append(f"ch_axis={self.ch_axis}")
        if self.scale.numel() == 1:
            parts.append(f"scale={self.scale.item():.6g}")
        return ", ".join(parts)


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
    return model


@contextlib.contextmanager
def bypass(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block the model computes in float: fake quants neither observe
    nor round, and QAT modules use their float path (statistics are untouched)."""
    from fxq.qat.base import QATModule

    fqs = [m for m in model.modules() if isinstance(m, FakeQuantize)]
    qats = [(m, m.state) for m in model.modules() if isinstance(m, QATModule)]
    for m in fqs:
        m.bypassed = True
    for m, _ in qats:
        m.simulate_integer = False
        m.state = FakeQuantState.CALIBRATION  # no bias rounding either
    try:
        yield model
    finally:
        for m in fqs:
            m.__dict__.pop("bypassed", None)
        for m, state in qats:
            m.__dict__.pop("simulate_integer", None)
            m.state = state
