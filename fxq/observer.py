"""Observers: statistics that decide a quantization scale.

An observer sees float tensors and keeps running statistics in buffers (so
they travel with ``state_dict``); ``FakeQuantize`` turns them into a scale.
Every observer is symmetric (zero point 0) and reports ``amax()``, the
magnitude that should map to the largest quantized value.

Observers raise ``ValueError`` naming the layer when they see NaN or Inf: a
non-finite activation would silently poison the scale, and it is almost
always a training bug worth stopping for.

Per-channel observers reduce over every axis but ``ch_axis``. An empty
tensor carries no statistics and is skipped (as in ``torch.ao``).

Statistics stay float32 whatever the model's dtype: ``.half()`` or
``.double()`` move an observer's buffers to the model's device but keep
their dtypes (a scale rounded to half precision would no longer be the scale
the integer model uses).

Observers are selected by name (``get_default_qconfig(activation_observer=...)``)
through a registry: the ones here are built in, and other modules add theirs
with ``register_observer`` (``fxq.calibration.observers`` registers
``percentile``, ``mse``, ``kl`` and ``mix`` when it is imported, which
``import fxq.calibration`` does). This module imports nothing from
``fxq.calibration``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "ObserverBase",
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "PerChannelMinMaxObserver",
    "MovingAveragePerChannelMinMaxObserver",
    "FixedScaleObserver",
    "OBSERVERS",
    "get_observer_class",
    "observer_registry",
    "register_observer",
    "keep_dtypes",
    "batch_minmax",
    "running_minmax_",
    "moving_average_",
    "latest_minmax_",
    "non_finite_poison",
    "synchronized",
    "world_size",
]


def keep_dtypes(fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """Wrap an ``nn.Module._apply`` function so that it moves tensors but keeps their dtypes.

    ``.to(device)`` and ``.cuda()`` still move the tensor; ``.half()``,
    ``.double()`` or ``.to(torch.bfloat16)`` leave it as it was (on the device
    ``fn`` chose). Fake quants and observers use it for their buffers:
    scales and statistics are float32 in every model dtype.
    """

    def apply(t: Tensor) -> Tensor:
        out = fn(t)
        if out.dtype != t.dtype:
            out = t.to(device=out.device)
        return out

    return apply


def memory_order(x: Tensor, keep_batch: bool = False) -> Tensor:
    """``x`` with its dims permuted into the order they lie in memory, when that makes a
    contiguous view (``channels_last``: NCHW -> NHWC); else ``x`` itself. With
    ``keep_batch`` only a permutation that leaves dim 0 first is used (per-sample
    reductions).

    Reductions over every element, or over all but the batch dim, then read the memory as
    it lies instead of first copying the tensor into the default layout (``reshape``,
    ``aminmax`` and ``histc`` copy a ``channels_last`` tensor: a third of an observer's
    time).
    """
    if x.dim() < 2 or x.is_contiguous():
        return x
    order = sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))
    if keep_batch and order[0] != 0:
        return x
    dense = x.permute(order)
    return dense if dense.is_contiguous() else x


def rowwise_minmax(flat: Tensor) -> tuple[Tensor, Tensor]:
    """The min and max of each row of a 2-d tensor.

    On the CPU ``amin`` and ``amax`` rather than ``torch.aminmax(flat, dim=1)``, which is
    10-20x slower there (torch 2.14, 2 threads: 1.4 ms against 0.07 ms for a 1000x1280
    weight, 5.3 ms against 0.3 ms for 16 samples of a 96x56x56 activation); elsewhere
    ``aminmax``, one kernel launch instead of two. Same values.
    """
    if flat.device.type == "cpu":
        return flat.amin(1), flat.amax(1)
    return torch.aminmax(flat, dim=1)


def non_finite_poison(mn: Tensor, mx: Tensor) -> Tensor:
    """0 where both ``mn`` and ``mx`` are finite, NaN where either is NaN or infinite
    (``0 * inf`` is NaN), in two elementwise kernels; ``torch.isfinite`` of both, combined,
    takes ten (it is composed of four ops). Never overflows: ``0 * x`` is 0 for every finite
    ``x``. Used by the NaN / Inf check at every observer update."""
    return mn.mul(0).add_(mx, alpha=0)


def batch_minmax(x: Tensor, ch_axis: int | None) -> tuple[Tensor, Tensor]:
    """Per-tensor ``[1]`` or per-channel ``[C]`` float32 min and max of a non-empty ``x``."""
    x = x.detach()
    if ch_axis is None:
        mn, mx = torch.aminmax(memory_order(x))
        return mn.reshape(1).float(), mx.reshape(1).float()
    axis = ch_axis % x.dim()
    flat = x.transpose(0, axis).reshape(x.shape[axis], -1)
    mn, mx = rowwise_minmax(flat)
    return mn.float(), mx.float()


def running_minmax_(min_val: Tensor, max_val: Tensor, mn: Tensor, mx: Tensor) -> None:
    """The running minimum and maximum, in place (``MinMaxObserver``)."""
    torch.minimum(min_val, mn, out=min_val)
    torch.maximum(max_val, mx, out=max_val)


def moving_average_(min_val: Tensor, max_val: Tensor, mn: Tensor, mx: Tensor, c: float) -> None:
    """``stat + c * (batch - stat)`` in place, the batch's own where ``stat`` was never set
    (``MovingAverageMinMaxObserver``); ``c = 0`` keeps statistics once set."""
    fresh = torch.isinf(min_val)
    stats = [min_val, max_val]
    if c == 0:  # frozen once set (no host sync to ask whether they are)
        averages = stats
    else:  # stat + c * (batch - stat), both statistics in each call (one kernel on CUDA)
        steps = torch._foreach_sub([mn, mx], stats)
        torch._foreach_mul_(steps, c)
        averages = torch._foreach_add(stats, steps)
    torch.where(fresh, mn, averages[0], out=min_val)
    torch.where(fresh, mx, averages[1], out=max_val)


def latest_minmax_(min_val: Tensor, max_val: Tensor, mn: Tensor, mx: Tensor) -> None:
    """The batch's min and max, in place (``PerChannelMinMaxObserver``)."""
    torch._foreach_copy_([min_val, max_val], [mn, mx])


#: devices where a NaN / Inf is reported by the update that saw it; elsewhere (CUDA) the
#: check is deferred so that QAT steps run without a host sync
IMMEDIATE_CHECK_DEVICES = ("cpu",)
#: on the other devices, the largest number of updates before the check runs
NON_FINITE_CHECK_EVERY = 32


class ObserverBase(nn.Module):
    """Base class: min/max buffers, NaN/Inf checks and ``amax``.

    Args:
        ch_axis: None for per-tensor statistics, else the channel axis.
        num_channels: size of the per-channel buffers when known up front;
            otherwise they are sized by the first observed tensor.

    Attributes:
        name: set by ``prepare_qat_fx`` to say where the observer sits; used in
            error messages.
    """

    #: computing ``amax`` is expensive (a search): FakeQuantize computes the
    #: scale once when calibration ends instead of after every batch
    deferred = False
    #: check NaN / Inf at once on every device (observers that read their statistics on
    #: the host at every batch anyway, and must not take a NaN into them)
    immediate_check = False

    def __init__(self, ch_axis: int | None = None, num_channels: int | None = None) -> None:
        super().__init__()
        self.ch_axis = ch_axis
        self.qmax = 127  # the largest quantized value; FakeQuantize sets it from its dtype
        shape = (num_channels,) if (ch_axis is not None and num_channels) else (1,)
        if ch_axis is not None and not num_channels:
            shape = (0,)
        self.register_buffer("min_val", torch.full(shape, float("inf")))
        self.register_buffer("max_val", torch.full(shape, float("-inf")))
        # NaN once a NaN / Inf reached a compiled step (``torch.compile``), which never reads
        # it on the host; ``check_non_finite`` does. Not saved: a flag, not a statistic.
        self.register_buffer("non_finite", torch.zeros(()), persistent=False)
        self.name = ""

    # -- statistics -------------------------------------------------------
    def _batch_minmax(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Per-tensor ``[1]`` or per-channel ``[C]`` float32 min and max of a non-empty ``x``."""
        return batch_minmax(x, self.ch_axis)

    def _check_finite(self, mn: Tensor, mx: Tensor) -> None:
        """Raise for NaN / Inf statistics: at once on the CPU; on an accelerator without a
        host sync at every step (which would stall the GPU at every fake quant): the flag is
        kept on the device and read every ``NON_FINITE_CHECK_EVERY`` updates and when the
        fake-quant state changes or the model is converted (``check_non_finite``)."""
        if mn.is_meta:  # shapes only: nothing to check
            return
        if torch.compiler.is_compiling():
            # a compiled step has no host sync and no Python state that changes per step
            # (each would split or recompile the graph): NaN sticks in a buffer, read by
            # ``check_non_finite`` when the state changes or the model is converted
            self.non_finite.add_(non_finite_poison(mn, mx).sum())
            return
        if self.immediate_check or mn.device.type in IMMEDIATE_CHECK_DEVICES:
            if bool(non_finite_poison(mn, mx).isnan().any()):
                self._raise_non_finite()
            return
        pending = getattr(self, "_non_finite", None)
        if pending is not None and (pending.device != mn.device or pending.shape != mn.shape):
            self.check_non_finite()  # the model moved: read the old device's flag first
            pending = None
        if pending is None:
            self._non_finite = non_finite_poison(mn, mx)
        else:  # NaN sticks: two small kernels per update, no host sync
            pending.add_(mn, alpha=0).add_(mx, alpha=0)
        self.count_deferred_check()

    def count_deferred_check(self) -> None:
        """Count an update whose NaN / Inf check was deferred; every
        ``NON_FINITE_CHECK_EVERY`` of them, check (one host sync)."""
        # through ``__dict__``: ``nn.Module.__setattr__`` costs more than the count, per step
        unchecked = self.__dict__["_unchecked"] = self.__dict__.get("_unchecked", 0) + 1
        if unchecked >= NON_FINITE_CHECK_EVERY:
            self.check_non_finite()

    def non_finite_flags(self) -> list[Tensor]:
        """The device flags ``check_non_finite`` reads (NaN where NaN / Inf was seen): the
        compiled and fused steps' and the deferred updates' (``fxq.fake_quantize.
        check_non_finite`` reads a whole model's at once)."""
        flags = [] if self.non_finite.is_meta else [self.non_finite]
        pending = getattr(self, "_non_finite", None)
        return flags if pending is None else [*flags, pending]

    @property
    def failed(self) -> bool:
        """Whether a check found NaN / Inf (every later check raises until ``reset``)."""
        return getattr(self, "_failed", False)

    def found_finite(self) -> None:
        """Note that a read of ``non_finite_flags`` found no NaN: the deferred updates are
        checked, and their count starts again."""
        self._non_finite, self._unchecked = None, 0

    def check_non_finite(self) -> None:
        """Raise if NaN / Inf reached this observer since its last ``reset`` (one host sync).

        The error sticks: the bad values are in the statistics, so every later check
        raises again until ``reset()``.
        """
        pending = getattr(self, "_non_finite", None)
        self.found_finite()  # read now (a NaN makes it raise below)
        if not self.non_finite.is_meta:
            bad = self.non_finite.isnan()  # from compiled and fused steps
            if pending is not None:
                bad = bad | pending.isnan().any()
            if bool(bad):  # one host read for both flags
                self._failed = True
                self.non_finite.zero_()
        if self.failed:
            self._raise_non_finite()

    def _raise_non_finite(self) -> None:
        where = self.name or type(self).__name__
        raise ValueError(
            f"observer of {where} saw NaN or Inf values; fxq does not ignore them. "
            "Check the inputs and the loss (a diverging QAT run often starts here), "
            "or keep this layer in float with a qconfig of None."
        )

    def _resize_to(self, mn: Tensor) -> None:
        if self.min_val.shape != mn.shape:
            self.min_val = torch.full_like(mn, float("inf"))
            self.max_val = torch.full_like(mn, float("-inf"))

    def _update(self, mn: Tensor, mx: Tensor) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        """Record statistics of ``x`` and return it unchanged (an empty ``x`` records nothing)."""
        stats = self._observed_minmax(x)
        if stats is not None:
            self._resize_to(stats[0])
            self._update(*stats)
        return x

    # -- statistics across processes -------------------------------------------
    #: the process group whose ranks observe together (set by ``synchronized``), or None
    sync_group: Any = None

    def _observed_minmax(self, x: Tensor) -> tuple[Tensor, Tensor] | None:
        """The batch's min and max, over every rank of ``sync_group`` when one is set.

        Returns None when there is nothing to record (an empty tensor on every
        rank). Raises for NaN / Inf on any rank (on every rank alike, so none
        is left waiting in a collective).
        """
        if self.sync_group is None:
            if x.numel() == 0:
                return None
            mn, mx = self._batch_minmax(x)
            self._check_finite(mn, mx)
            return mn, mx
        import torch.distributed as dist

        if x.numel() == 0:
            channels = 1 if self.ch_axis is None else x.shape[self.ch_axis % x.dim()]
            mn = torch.full((channels,), float("inf"), device=x.device)
            mx = torch.full((channels,), float("-inf"), device=x.device)
        else:
            mn, mx = self._batch_minmax(x)
        bad = ~(torch.isfinite(mn).all() & torch.isfinite(mx).all()) if x.numel() else None
        flag = torch.zeros(1, device=x.device)
        if bad is not None and bool(bad):
            flag.fill_(1.0)
            mn, mx = torch.full_like(mn, float("inf")), torch.full_like(mx, float("-inf"))
        packed = torch.cat([-mn, mx, flag])  # one MAX reduction: min = -max(-min)
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=self.sync_group)
        n = mn.numel()
        mn, mx, flag = -packed[:n], packed[n : 2 * n], packed[2 * n]
        if bool(flag):
            self._raise_non_finite()
        if bool(torch.isinf(mn).all()):
            return None  # empty on every rank
        return mn, mx

    def _sum_over_ranks(self, t: Tensor) -> Tensor:
        """``t`` summed over the ranks of ``sync_group`` (``t`` itself when there is none)."""
        if self.sync_group is None:
            return t
        import torch.distributed as dist

        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.sync_group)
        return t

    def amax(self) -> Tensor:
        """Largest magnitude to represent (per channel for per-channel observers)."""
        return torch.maximum(-self.min_val, self.max_val).clamp(min=0)

    def has_statistics(self) -> bool:
        return bool(self.min_val.numel()) and bool(torch.isfinite(self.min_val).all())

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> nn.Module:
        # buffers follow the model's device but keep their dtypes (see ``keep_dtypes``)
        return super()._apply(keep_dtypes(fn), recurse)

    def reset(self) -> None:
        """Forget every statistic (and a NaN / Inf that a deferred check holds)."""
        self.min_val.fill_(float("inf"))
        self.max_val.fill_(float("-inf"))
        self.non_finite.zero_()
        self._non_finite, self._unchecked, self._failed = None, 0, False

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors
    ):
        # per-channel buffers may be sized lazily: adopt the saved shapes
        for key in ("min_val", "max_val"):
            saved = state_dict.get(prefix + key)
            current = getattr(self, key)
            if isinstance(saved, torch.Tensor) and current.shape != saved.shape:
                setattr(
                    self,
                    key,
                    torch.empty(saved.shape, dtype=current.dtype, device=current.device),
                )
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing, unexpected, errors
        )
        # the statistics are the loaded ones: no NaN / Inf seen since (the flag is not saved,
        # and after ``to_empty`` it holds whatever the memory held)
        if not self.non_finite.is_meta:
            with torch.no_grad():
                self.non_finite.zero_()
        self._non_finite, self._unchecked = None, 0

    def extra_repr(self) -> str:
        axis = "" if self.ch_axis is None else f"ch_axis={self.ch_axis}, "
        if self.min_val.numel() == 1 and self.min_val.device.type != "meta":
            return f"{axis}min={self.min_val.item():.6g}, max={self.max_val.item():.6g}"
        return f"{axis}channels={self.min_val.numel()}"


class MinMaxObserver(ObserverBase):
    """Running minimum and maximum over everything observed."""

    def __init__(self, ch_axis: int | None = None, num_channels: int | None = None) -> None:
        super().__init__(ch_axis, num_channels)

    def _update(self, mn: Tensor, mx: Tensor) -> None:
        running_minmax_(self.min_val, self.max_val, mn, mx)


class MovingAverageMinMaxObserver(ObserverBase):
    """Exponential moving average of each batch's minimum and maximum.

    The first batch initialises the averages; afterwards
    ``stat = stat + averaging_constant * (batch_stat - stat)``.
    A state_dict loaded from a calibrated model is the starting point.
    ``averaging_constant=0`` freezes the statistics (the vendor plugin's
    "fixed activation" QAT): the first batch, or a loaded calibrated
    state_dict, fixes them and the scale never moves.
    """

    def __init__(
        self,
        averaging_constant: float = 0.01,
        ch_axis: int | None = None,
        num_channels: int | None = None,
    ) -> None:
        super().__init__(ch_axis, num_channels)
        if not 0.0 <= averaging_constant <= 1.0:
            raise ValueError(
                f"averaging_constant must be in [0, 1] (0 freezes the statistics), got "
                f"{averaging_constant}"
            )
        self.averaging_constant = averaging_constant

    def _update(self, mn: Tensor, mx: Tensor) -> None:
        moving_average_(self.min_val, self.max_val, mn, mx, self.averaging_constant)


class PerChannelMinMaxObserver(ObserverBase):
    """Per-channel min/max of the most recent tensor: the weight observer.

    Weights change at every training step and the integer model uses the
    final ones, so the range is that of the latest weights, not a running
    extreme that could only grow.
    """

    def __init__(self, ch_axis: int = 0, num_channels: int | None = None) -> None:
        super().__init__(ch_axis, num_channels)

    def _update(self, mn: Tensor, mx: Tensor) -> None:
        latest_minmax_(self.min_val, self.max_val, mn, mx)


class MovingAveragePerChannelMinMaxObserver(MovingAverageMinMaxObserver):
    """Per-channel moving-average min/max."""

    def __init__(
        self, averaging_constant: float = 0.01, ch_axis: int = 0, num_channels: int | None = None
    ) -> None:
        super().__init__(averaging_constant, ch_axis, num_channels)


class FixedScaleObserver(ObserverBase):
    """An observer whose scale is given, e.g. ``1/128`` for centered YUV input.

    ``amax`` is such that ``FakeQuantize`` computes exactly ``scale`` for any
    dtype, so the scale is independent of what is observed (statistics are
    still recorded for summaries).
    """

    def __init__(
        self, scale: float, ch_axis: int | None = None, num_channels: int | None = None
    ) -> None:
        super().__init__(ch_axis, num_channels)
        if not scale > 0:
            raise ValueError(f"a fixed scale must be positive, got {scale}")
        self.register_buffer("fixed_scale", torch.tensor([float(scale)]))

    def _update(self, mn: Tensor, mx: Tensor) -> None:
        running_minmax_(self.min_val, self.max_val, mn, mx)

    def has_statistics(self) -> bool:
        return True


# Observer classes by the names accepted in get_default_qconfig(...observer=...).
OBSERVERS: dict[str, tuple[type[ObserverBase], type[ObserverBase]]] = {
    # name: (per-tensor class, per-channel class)
    "min_max": (MinMaxObserver, PerChannelMinMaxObserver),
    "moving_average": (MovingAverageMinMaxObserver, MovingAveragePerChannelMinMaxObserver),
    "fixed_scale": (FixedScaleObserver, FixedScaleObserver),
}

_ObserverPair = tuple[type[ObserverBase] | None, type[ObserverBase] | None]
_REGISTRY: dict[str, _ObserverPair] = dict(OBSERVERS)

#: names registered by ``fxq.calibration.observers`` (for the hint in error messages)
_CALIBRATION_NAMES = ("percentile", "mse", "kl", "mix")


def register_observer(
    name: str,
    per_tensor: type[ObserverBase] | None = None,
    per_channel: type[ObserverBase] | None = None,
) -> None:
    """Make observer classes selectable by ``name`` (``get_default_qconfig(activation_observer=name)``).

    Args:
        name: the name users pass.
        per_tensor: the class for activations (per tensor), or None if there is none.
        per_channel: the class for weights (per output channel), or None if there is none.

    Raises:
        ValueError: when both classes are None, or ``name`` is already taken by
            other classes.
    """
    if per_tensor is None and per_channel is None:
        raise ValueError(f"register_observer({name!r}): give a per-tensor or a per-channel class")
    pair = (per_tensor, per_channel)
    existing = _REGISTRY.get(name)
    if existing is not None and existing != pair:
        raise ValueError(
            f"observer name {name!r} is already registered for "
            f"{[c.__name__ if c else None for c in existing]}; choose another name"
        )
    _REGISTRY[name] = pair


def observer_registry() -> dict[str, _ObserverPair]:
    """Every observer by name: ``(per-tensor class, per-channel class)``, either may be None.

    The built-in ones (``OBSERVERS``) and those added with ``register_observer``
    (``import fxq.calibration`` adds percentile, mse, kl and mix).
    """
    return dict(_REGISTRY)


def get_observer_class(name: str, per_channel: bool) -> type[ObserverBase]:
    """Look up an observer class by name (per channel: the weight version).

    Raises:
        ValueError: for an unknown name, or a name without the requested
            version, listing the known ones.
    """
    registry = _REGISTRY
    try:
        pair = registry[name]
    except KeyError:
        hint = ""
        if name in _CALIBRATION_NAMES:
            hint = f"; {name!r} is a calibration observer: `import fxq.calibration` registers it"
        raise ValueError(
            f"unknown observer {name!r}; known observers: {', '.join(sorted(registry))}{hint}"
        ) from None
    cls = pair[1] if per_channel else pair[0]
    if cls is None:
        usable = sorted(k for k, v in registry.items() if v[1 if per_channel else 0] is not None)
        kind = "weights (per channel)" if per_channel else "activations (per tensor)"
        raise ValueError(
            f"observer {name!r} has no version for {kind}; use one of: {', '.join(usable)}"
        )
    return cls


def world_size(group: Any = None) -> int:
    """The number of ranks of ``group`` (the default group when None) in a
    ``torch.distributed`` run; 1 outside one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


@contextlib.contextmanager
def synchronized(model: nn.Module, group: Any = None) -> Iterator[nn.Module]:
    """Within the block, activation observers of ``model`` observe across processes.

    When ``torch.distributed`` is initialised with more than one rank, every
    per-tensor observer combines each batch's statistics over the ranks of
    ``group`` (the default group when None) before recording them: min / max
    are reduced, histograms share one range and sum their counts. N ranks
    calibrating on N shards then reach exactly the scales one process reaches
    on the concatenated batches. Outside a distributed run it changes nothing.

    Every rank must run the same forwards in the same order (the usual data
    parallel calibration loop); an observer that runs on one rank only would
    wait for the others. Weight observers are left alone (weights are the
    same on every rank). ``fxq.calibration.calibrate`` uses this by default.
    """
    if world_size(group) < 2:
        yield model
        return
    import torch.distributed as dist

    observers = [m for m in model.modules() if isinstance(m, ObserverBase) and m.ch_axis is None]
    saved = [(m, m.__dict__.get("sync_group")) for m in observers]
    for m in observers:
        m.sync_group = group if group is not None else dist.group.WORLD
    try:
        yield model
    finally:
        for m, value in saved:
            if value is None:
                m.__dict__.pop("sync_group", None)
            else:
                m.sync_group = value
