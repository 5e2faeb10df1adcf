"""What every fxq.quantized module shares.

Runtime input scales: an integer module computes with the scale of the
QTensor it receives. Where that differs from the scale it was converted for
(a graph edit, a quantize stub whose scale was changed), it derives its
multipliers, shifts and int32 bias for the new scale, exactly as
``convert_fx`` would have for a model calibrated with that input scale,
caches them per scale (``QuantizedModule.derived``) and warns once
(``warn_rescaled``).

Dtypes: integer modules keep the dtype of every buffer under ``.half()``,
``.to(torch.bfloat16)``, ``.double()`` and the like (``QuantizedModule._apply``),
so a converted model computes the same integers whatever dtype it was
"converted" to; device moves apply as usual.

``torch.export``: an integer module decides in Python from the *values* of its
scales (the fast path, multipliers and tables derived per scale, window counts),
which the fake tensors export traces with do not have. While ``torch.export``
traces, a module therefore reads its buffers as the real tensors export swapped
out (``_Buffers`` remembers them), and every torch call on real tensors only runs
at once, outside the trace (``_FoldConstants``): the exported program computes
from the input, with the module's parameters and everything derived from them
as constants.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from fxq.dtypes import QDType, as_qdtype
from fxq.march import March, spec_for
from fxq.observer import keep_dtypes
from fxq.qtensor import QTensor
from fxq.quantized import functional as qf
from fxq.quantized import native  # registers the custom ops exported programs call

__all__ = [
    "QuantizedModule",
    "Standalone",
    "check_input",
    "same_scale",
    "warn_rescaled",
    "multiplier_for",
    "require_finite",
    "quantize_tensors",
    "warn_if_saturated",
]

_T = TypeVar("_T")

#: how many input scales a module keeps derived parameters for
_CACHE_SIZE = 16


class _Buffers(dict):
    """A module's ``_buffers`` that remembers the real tensors a graph capture swaps out.

    ``torch.export`` replaces every buffer with a fake tensor (no values) while it
    traces and puts the real one back afterwards, both by item assignment. The real
    tensors stay readable through ``real`` meanwhile (``QuantizedModule.__getattr__``).
    """

    __slots__ = ("real",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.real: dict[str, Tensor] = {}

    def __setitem__(self, name: str, value: Any) -> None:
        old = self.get(name)
        if type(value) is Tensor or not isinstance(value, Tensor):
            self.real.pop(name, None)  # a real tensor (or None) comes (back)
        elif type(old) is Tensor:
            self.real[name] = old  # a fake / functional stand-in replaces the real tensor
        super().__setitem__(name, value)

    def __reduce__(self) -> tuple:
        return (_Buffers, (dict(self),))


class QuantizedModule(nn.Module):
    """Base class: an integer op on QTensors, built from its QAT twin.

    Integer parameters are buffers, so ``state_dict`` round-trips and
    ``.to(device)`` moves them. Dtype conversions (``.half()``,
    ``.to(torch.bfloat16)``, ``.double()``, ``.to(device, dtype)``) leave every
    buffer in its own dtype: scales stay float32 (float64 where they are
    float64), multipliers and shifts int64, so the integer results do not
    change; only the device part of a conversion applies.

    Attributes:
        march: the march whose rounding and multiplier widths apply.
        name: where the module sits (for error messages), set by convert.
    """

    _fxq_leaf = True

    def __init__(self, march: March, name: str = "") -> None:
        super().__init__()
        self.__dict__["_buffers"] = _Buffers()
        self.march = march
        self.name = name

    def __getattr__(self, name: str) -> Any:
        value = super().__getattr__(name)
        if type(value) is Tensor or not isinstance(value, Tensor):
            return value  # the eager path: one type check
        buffers = self.__dict__["_buffers"]
        if isinstance(buffers, _Buffers) and torch.compiler.is_exporting():
            return buffers.real.get(name, value)  # the real tensor export swapped out
        return value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_exporting() or _active(_FoldConstants):
            return super().__call__(*args, **kwargs)
        with _FoldConstants():
            return super().__call__(*args, **kwargs)

    @property
    def spec(self):
        return spec_for(self.march)

    @property
    def rounding(self):
        return self.spec.rounding

    @classmethod
    def from_qat(cls, qat: nn.Module) -> QuantizedModule:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- nn.Module hooks ---------------------------------------------------------
    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> QuantizedModule:
        """``nn.Module._apply`` that keeps every tensor's dtype and follows the device.

        Where ``fn`` would change a tensor's dtype, the original tensor is moved
        to the device ``fn`` chose instead (its values are never cast).
        """

        self.__dict__.pop("_derived", None)  # cached tensors live on the old device
        return super()._apply(keep_dtypes(fn), recurse)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self.__dict__.pop("_derived", None)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state = dict(state)
        state.pop("_derived", None)  # a cache: not saved, not copied
        return state

    # -- parameters derived per input scale ------------------------------------------
    def derived(self, key: tuple, build: Callable[[], _T]) -> _T:
        """``build()``, cached under ``key`` (input scales as floats and other constants).

        The cache holds at most 16 entries (the oldest is dropped); it is cleared
        on device moves and ``load_state_dict``, and its key includes the
        version counters of the module's buffers, so in-place edits of a buffer
        (``scale.fill_``) are seen.
        """
        if torch.compiler.is_exporting():
            return build()  # constants of the exported program (_FoldConstants), not cached
        cache: dict = self.__dict__.setdefault("_derived", {})
        full = (key, tuple(_version(b) for b in self._buffers.values() if b is not None))
        value = cache.get(full)
        if value is None:
            if len(cache) >= _CACHE_SIZE:
                cache.pop(next(iter(cache)))
            value = cache[full] = _untraced(build)
        return value


def _untraced(build: Callable[[], _T]) -> _T:
    """``build()`` outside a ``torch.jit.trace``: what a cache builds on the first call is a
    constant of the trace, as on every later call (``check_trace`` compares two calls)."""
    state = torch._C._get_tracing_state()
    if state is None:
        return build()
    torch._C._set_tracing_state(None)
    try:
        return build()
    finally:
        torch._C._set_tracing_state(state)


class _FoldConstants(TorchFunctionMode):
    """While ``torch.export`` traces an integer module: what does not depend on the traced
    inputs runs at once on real tensors, and only the rest is recorded.

    A torch call whose tensor arguments are all real (scales, window counts, lookup
    tables, multipliers: the module's buffers and what is computed from them) runs
    eagerly, outside the trace, so Python may read its values (``float(x.scale)``,
    ``torch.equal``, cache keys). A call that touches a traced tensor is recorded; the
    real tensors it reads become constants of the exported program.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if all(type(t) is Tensor for t in tree_leaves((args, kwargs)) if _traceable(t)):
            with _disable_current_modes():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _active(mode: type) -> bool:
    return any(isinstance(m, mode) for m in _get_current_function_mode_stack())


def _traceable(value: Any) -> bool:
    return isinstance(value, (Tensor, torch.SymInt, torch.SymFloat, torch.SymBool))


def _version(t: Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor (made under torch.inference_mode): immutable
        return -1


def _describe(module: nn.Module) -> str:
    return f"{type(module).__name__} {getattr(module, 'name', '')!r}"


def check_input(
    module: QuantizedModule,
    x: Any,
    index: int = 0,
    dtype: QDType | str | None = None,
    offset_ok: bool = False,
) -> QTensor:
    """Check that input ``index`` is a per-tensor QTensor, at most as wide as ``dtype``.

    A narrower input (int8 where int16 was calibrated) computes exactly; a wider
    one could overflow the accumulation plan made at convert.

    Raises:
        TypeError: ``x`` is not a QTensor, or is wider than ``dtype``.
        ValueError: ``x`` has per-channel scales.
        fxq.quantized.native.ExporterError: under ``torch.onnx.export``.
    """
    native.refuse_onnx_export()
    if not isinstance(x, QTensor):
        raise TypeError(
            f"{_describe(module)} expects a QTensor as input {index}, got "
            f"{type(x).__name__}; quantize it first (fxq.quantized.Quantize)"
        )
    if x.scale.numel() != 1:
        raise ValueError(
            f"{_describe(module)}: input {index} has per-channel scales (axis {x.axis}); integer "
            "ops take one scale per activation tensor. Requantize it per tensor first"
        )
    if x.offset and not offset_ok:
        x._no_offset(_describe(module))
    if dtype is not None and x.qdtype.bits > as_qdtype(dtype).bits:
        expected = as_qdtype(dtype).name
        raise TypeError(
            f"{_describe(module)}: input {index} is {x.qdtype.name}, but the module was converted "
            f"for {expected} inputs (its accumulation plan depends on the width). If you edited "
            f"the graph, the op before this one must output {expected} (or narrower)"
        )
    return x


def same_scale(x: QTensor, scale: Tensor) -> bool:
    """Whether per-tensor ``x`` has exactly ``scale`` (the fast path of every module)."""
    s = x.scale
    if s is scale:
        return True
    if s.device.type == "cpu":
        return torch.equal(s, scale if scale.device == s.device else scale.to(s.device))
    # off the CPU torch.equal waits for the device: remembered while neither scale changes
    return qf.memo_by_identity("same_scale", (s, scale), lambda: torch.equal(s, scale.to(s.device)))


def warn_rescaled(
    module: QuantizedModule, index: int, converted: Tensor | float, got: Tensor | float
) -> None:
    """Warn, once per module, that input ``index`` arrives at another scale than at convert."""
    if module.__dict__.get("_warned_rescaled"):
        return
    module.__dict__["_warned_rescaled"] = True
    was, now = float(converted), float(got)
    warnings.warn(
        f"fxq: {_describe(module)} was converted for input {index} scale {was:.8g} but receives "
        f"scale {now:.8g}; it computes what a model converted for input scale {now:.8g} computes "
        "(multipliers, shifts and int32 bias derived again, cached per scale). If that is not "
        "intended, the op before it must output the scale it was converted for",
        RuntimeWarning,
        stacklevel=4,
    )


def multiplier_for(
    module: QuantizedModule,
    real: Tensor,
    scales: dict[str, Tensor | float],
    left_shift: bool = False,
) -> tuple[Tensor, Tensor]:
    """``qf.quantize_multiplier(real, module.spec)`` with errors that name the layer.

    Args:
        module: the layer (named in errors).
        real: the float64 factors.
        scales: the scales the factors come from, by role (``{"input": s_x,
            "weight": s_w, "output": s_y}``), quoted in errors.
        left_shift: as in ``quantize_multiplier``.

    Raises:
        MultiplierRangeError: naming the layer, the scales and what to do.
    """
    try:
        return qf.quantize_multiplier(real, module.spec, left_shift)
    except qf.MultiplierRangeError as e:
        quoted = ", ".join(f"{role} scale {_scale_text(s)}" for role, s in scales.items())
        raise qf.MultiplierRangeError(
            f"{_describe(module)}: {e} ({quoted}). Calibrate this layer with data that reaches "
            "its real output range (or fix the scale of its output), check the model for NaN/Inf "
            "scales, or keep the layer in float with a qconfig of None"
        ) from None


def _scale_text(s: Tensor | float) -> str:
    if isinstance(s, Tensor):
        values = s.detach().reshape(-1).tolist()
        if len(values) > 1:
            return f"{min(values):.6g} .. {max(values):.6g} ({len(values)} channels)"
        return f"{values[0]:.6g}"
    return f"{float(s):.6g}"


def require_finite(module: nn.Module, tensors: dict[str, Tensor | None]) -> None:
    """Refuse NaN / Inf in the float tensors a layer is converted from.

    Args:
        module: the QAT module being converted (its ``name`` is quoted).
        tensors: what each tensor is (``"weight"``, ``"BatchNorm running_var"``...) -> tensor
            (None entries are skipped).

    Raises:
        ValueError: naming the layer and the tensor, and saying what to do.
    """
    for what, t in tensors.items():
        if t is None:
            continue
        finite = torch.isfinite(t.detach())
        if not bool(finite.all()):
            bad = int((~finite).sum())
            raise ValueError(
                f"{_describe(module)}: its {what} has {bad} NaN/Inf value(s) of {t.numel()}, which "
                "cannot be quantized. The training diverged (or the checkpoint is damaged): load a "
                "good checkpoint, or train again with a lower learning rate; or keep this layer "
                "in float with a qconfig of None"
            )


def quantize_tensors(
    values: Any,
    scales: list[Tensor],
    dtypes: list[QDType],
    rounding,
    offsets: list[int] | None = None,
) -> Any:
    """Quantize the float tensors in a nested structure, in flattened order."""
    leaves, spec = tree_flatten(values)
    out, i = [], 0
    for leaf in leaves:
        if isinstance(leaf, Tensor) and leaf.is_floating_point():
            offset = offsets[i] if offsets is not None else 0
            out.append(QTensor.quantize(leaf, scales[i], dtypes[i], rounding, offset))
            i += 1
        else:
            out.append(leaf)
    return tree_unflatten(out, spec)


class Standalone(QuantizedModule):
    """A quantized op that opaque code calls with float tensors.

    Quantizes its tensor inputs with the scales its QAT twin learned, runs
    the integer op, and returns float (the dequantized result).
    """

    def __init__(self, inner: QuantizedModule, scales: list[Tensor], dtypes: list[QDType]) -> None:
        super().__init__(inner.march)
        self.inner = inner
        for i, s in enumerate(scales):
            self.register_buffer(f"input_scale_{i}", s.detach().clone().reshape(1))
        self.input_dtypes = [d.name for d in dtypes]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        scales = [getattr(self, f"input_scale_{i}") for i in range(len(self.input_dtypes))]
        dtypes = [as_qdtype(d) for d in self.input_dtypes]
        args, kwargs = quantize_tensors((args, kwargs), scales, dtypes, self.rounding)
        out = self.inner(*args, **kwargs)
        return out.dequantize() if isinstance(out, QTensor) else out


_INT32_LIMIT = float((1 << 31) - 1)


def warn_if_saturated(
    module: QuantizedModule, acc: Tensor, cause: str | Callable[[], str] = ""
) -> None:
    """Warn (once per module) when an int32 accumulator actually saturated.

    Only called where the worst case can exceed int32; the march's accumulator
    saturates, so results stay defined, but the layer is far less accurate.

    Args:
        module: the layer (named in the warning).
        acc: the exact accumulator (float or integer tensor of integers).
        cause: what the accumulator sums (operand dtypes and worst-case
            magnitudes) and what to do about it; a callable is only called when
            the warning is issued.
    """
    if module.__dict__.get("_warned_saturation") or torch.compiler.is_compiling():
        return  # a graph capture has no values to count
    hits = int((acc.abs() >= _INT32_LIMIT).sum())
    if hits:
        module.__dict__["_warned_saturation"] = True
        text = cause() if callable(cause) else cause
        warnings.warn(
            f"fxq: the int32 accumulator of {_describe(module)} saturated on {hits} of "
            f"{acc.numel()} elements, so its results are clipped; "
            + (
                text
                or "its operands are too large for 32 bits. Use narrower operands or smaller "
                "values, or keep the layer in float with a qconfig of None"
            ),
            RuntimeWarning,
            stacklevel=3,
        )
