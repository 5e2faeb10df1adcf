"""Running calibration data through a model: batches of any shape, progress, limits."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from fxq.calibration.data import (
    BatchCountAgreement,
    agree_on_batch_count,
    batch_arguments,
    check_data,
    check_num_batches,
    each_batch,
    holds_sample,
    no_batch_error,
    no_sample_error,
)
from fxq.fake_quantize import FakeQuantize, FakeQuantState, bypass, set_fake_quantize
from fxq.observer import synchronized, world_size
from fxq.utils.warning_summary import summarises_warnings

__all__ = [
    "calibrate",
    "batch_arguments",
    "progress",
    "run_batches",
    "call_order",
    "keep_rank0_result",
    "average_over_ranks",
    "fast_layout",
]


# tensor methods whose result depends on the memory layout (a ``view`` of a channels_last
# tensor fails where the same view of a contiguous one works)
_LAYOUT_METHODS = frozenset(
    {
        "view",
        "view_as",
        "view_as_complex",
        "view_as_real",
        "as_strided",
        "stride",
        "is_contiguous",
        "data_ptr",
        "storage",
        "untyped_storage",
    }
)
_LAYOUT_FREE_PACKAGES = ("torch", "fxq", "operator", "_operator", "math", "builtins")


def _layout_free(model: nn.Module) -> bool:
    """Whether every op of a GraphModule is expected to work on tensors of any memory
    layout: its modules are torch's or fxq's, its functions come from torch, fxq or the
    standard library, and no node calls one of the tensor methods known to depend on the
    layout (``_LAYOUT_METHODS``: ``view``, ``view_as``...). A module of the user's own (kept
    as a leaf, or inside a wrapper) may do anything: False."""
    if not isinstance(model, GraphModule):
        return False
    for m in model.modules():
        if type(m).__module__.split(".")[0] not in ("torch", "fxq"):
            return False
        if not isinstance(m, GraphModule):
            continue
        for node in m.graph.nodes:
            if node.op == "call_method" and node.target in _LAYOUT_METHODS:
                return False
            if node.op == "call_function":
                package = (getattr(node.target, "__module__", None) or "").split(".")[0]
                name = getattr(node.target, "__name__", "")
                if package not in _LAYOUT_FREE_PACKAGES or name in _LAYOUT_METHODS:
                    return False
    return True


def _channels_last(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if (
            value.dim() == 4
            and value.is_floating_point()
            and value.device.type == "cpu"
            and not value.is_contiguous(memory_format=torch.channels_last)
        ):
            return value.contiguous(memory_format=torch.channels_last)
        return value
    if isinstance(value, (tuple, list)):
        return (
            type(value)(_channels_last(v) for v in value) if type(value) in (tuple, list) else value
        )
    if type(value) is dict:
        return {k: _channels_last(v) for k, v in value.items()}
    return value


def fast_layout(model: nn.Module, batches: list[Any], input_fn=None) -> list[Any]:
    """The calibration batches in the memory layout the model's passes run fastest in.

    On CPU, 4-d float tensors (images) are given the ``channels_last`` layout, which
    convolutions (oneDNN) run in about half the time of the default layout on 2 cores,
    forward and backward; the layout then carries through the model. This is only done
    when every op of the model is known not to depend on the layout (``_layout_free``: a
    ``view`` fails on a channels_last tensor). Values agree with the default layout's to
    float rounding (the convolutions sum in another order). A model on another device
    (CUDA: not measured) and batches that an ``input_fn`` turns into arguments (it may
    ``view`` them) keep their layout. Nothing else in the batches changes.
    """
    first = next(model.parameters(), None)
    on_cpu = first is None or first.device.type == "cpu"
    if input_fn is not None or not on_cpu or not _layout_free(model):
        return batches
    return [_channels_last(b) for b in batches]


def progress(
    items: Iterable[Any], total: int | None, label: str, enabled: bool | None = None
) -> Iterator[Any]:
    """Yield ``items``, drawing a one-line progress bar on stderr when it is a terminal."""
    show = sys.stderr.isatty() if enabled is None else enabled
    start = time.perf_counter()
    done = 0
    for item in items:
        yield item
        done += 1
        if show:
            elapsed = time.perf_counter() - start
            if total:
                filled = int(30 * done / total)
                bar = "#" * filled + "." * (30 - filled)
                sys.stderr.write(f"\r{label} [{bar}] {done}/{total} {elapsed:.1f}s")
            else:
                sys.stderr.write(f"\r{label} {done} batches {elapsed:.1f}s")
            sys.stderr.flush()
    if show and done:
        sys.stderr.write("\n")


_END = object()


def run_batches(
    model: nn.Module,
    data: Iterable[Any],
    num_batches: int | None = None,
    input_fn: Callable[[Any], Any] | None = None,
    label: str = "running",
    show_progress: bool | None = None,
    who: str = "run_batches",
    agreement: BatchCountAgreement | None = None,
) -> list[Any]:
    """Run ``model`` on up to ``num_batches`` batches without gradients; return the outputs.

    ``data`` follows ``fxq.calibration.data``'s contract. With ``agreement``, the ranks
    of a distributed run agree before each batch that every rank has one.

    Raises:
        ValueError: when ``num_batches`` is not a positive integer (naming ``who``), or the
            ranks run out of batches at different steps.
        TypeError: when ``data`` is one tensor or one dict (wrap it in a list).
    """
    batches = each_batch(data, num_batches, who)
    total = num_batches
    if total is None:
        try:
            total = len(data)  # type: ignore[arg-type]
        except TypeError:
            total = None

    def agreed() -> Iterator[Any]:
        while True:
            batch = next(batches, _END)
            if agreement is not None and not agreement.step(batch is not _END):
                return
            if batch is _END:
                return
            yield batch

    outputs = []
    with torch.no_grad():
        for batch in progress(agreed(), total, label, show_progress):
            args, kwargs = batch_arguments(model, batch, input_fn)
            outputs.append(model(*args, **kwargs))
    return outputs


def float_pass_with_hooks(
    model: nn.Module,
    hooks: dict[nn.Module, Callable[..., Any]],
    batches: list[Any],
    input_fn: Callable[[Any], Any] | None = None,
) -> None:
    """Run ``batches`` through ``model`` in float (fake quants bypassed), in eval mode (no
    BatchNorm statistics move), without gradients, with each module's forward hook
    attached; the model's mode and hooks are put back afterwards, also on an error."""
    handles = [module.register_forward_hook(hook) for module, hook in hooks.items()]
    training = model.training
    model.eval()
    try:
        with bypass(model), torch.no_grad():
            run_batches(model, batches, input_fn=input_fn, show_progress=False)
    finally:
        model.train(training)
        for h in handles:
            h.remove()


class _SampleCount:
    """``data`` as it is (its ``len`` too), noting a batch without samples while no batch
    seen so far held one (``empty``: None once one did)."""

    def __init__(self, data: Iterable[Any]) -> None:
        self.data = data
        self.empty: Any = None
        self.seen = False

    def __iter__(self) -> Iterator[Any]:
        for batch in self.data:
            if not self.seen:
                if holds_sample(batch):
                    self.seen, self.empty = True, None
                else:
                    self.empty = batch
            yield batch

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]  # TypeError where it has none


def _known_length(data: Any, num_batches: int | None) -> int | None:
    """How many batches ``data`` will yield, when it says (``len``), capped at ``num_batches``."""
    try:
        count = len(data)
    except TypeError:
        return None
    return count if num_batches is None else min(count, num_batches)


@summarises_warnings("fxq.calibration.calibrate")
def calibrate(
    model: nn.Module,
    data: Iterable[Any],
    num_batches: int | None = None,
    input_fn: Callable[[Any], Any] | None = None,
    show_progress: bool | None = None,
    sync_ranks: bool = True,
) -> nn.Module:
    """Calibrate a prepared model: observers see ``data``, nothing is rounded.

    Puts the model in eval mode and CALIBRATION state, runs the batches
    without gradients, and computes every scale (searching observers such as
    ``mse`` or ``kl`` search once, at the end). Empty tensors in a batch carry
    no statistics and are skipped by the observers. Warns for every fake
    quant whose scale ends at the ``2**-23`` floor (data that would quantize
    to zeros).

    When it fails (no batch, or a batch the model cannot run), the model is
    left in the training mode and fake-quant states it had before the call;
    statistics of the batches that did run are kept.

    Args:
        model: the model from ``prepare_qat_fx``.
        data: an iterable of batches: tensors, tuples such as ``(images,
            labels)`` (the model gets the images), or dicts of keyword inputs
            (keys that are no input, such as ``"label"``, are left out); see
            ``fxq.calibration.data``. A single tensor is refused: wrap it in a list.
        num_batches: stop after this many batches (a positive integer).
        input_fn: maps a batch to the model's arguments.
        show_progress: draw a progress bar (default: when stderr is a terminal).
        sync_ranks: in a ``torch.distributed`` run with several ranks, combine
            every batch's activation statistics over the ranks
            (``fxq.observer.synchronized``), so N ranks on N shards get the
            scales one process gets on all the data. Every rank must then run
            the same number of batches: the ranks agree on it first (from
            ``len(data)`` when it has one, else batch by batch), and uneven or
            empty shards raise the same error on every rank. False keeps each
            rank's own statistics.

    Returns:
        ``model``, calibrated (still in CALIBRATION state).

    Raises:
        ValueError: when ``model`` has no fake quant, ``num_batches`` is not a
            positive integer, ``data`` yielded no batch, or (``sync_ranks``) the
            ranks have different numbers of batches.
        TypeError: when ``data`` is one tensor or one dict.
    """
    saved = _ModelModes(model)
    try:
        check_num_batches(num_batches, "calibrate")
        check_data(data, "calibrate")
        ranks = sync_ranks and world_size() > 1
        known = _known_length(data, num_batches) if ranks else None
        if known is not None:  # before any collective on statistics
            agree_on_batch_count(known, "calibrate")
        set_fake_quantize(model, FakeQuantState.CALIBRATION)
        model.eval()
        sync = synchronized(model) if sync_ranks else contextlib.nullcontext(model)
        counted = _SampleCount(data)
        with sync:
            outputs = run_batches(
                model,
                counted,
                num_batches,
                input_fn,
                "calibrating",
                show_progress,
                who="calibrate",
                agreement=BatchCountAgreement("calibrate") if ranks else None,
            )
        if not outputs:
            raise no_batch_error(
                data,
                "calibrate",
                note="Nothing was observed; the model was left in the mode and fake-quant "
                "state it had.",
            )
        if counted.empty is not None and not ranks:  # (on a rank alone: no hang)
            raise no_sample_error(counted.empty, "calibrate")
    except BaseException:
        saved.restore()
        raise
    fake_quants = [m for m in model.modules() if isinstance(m, FakeQuantize)]
    for m in fake_quants:
        m.finalize()
    for m in fake_quants:
        m.warn_if_scale_at_floor()
    return model


class _ModelModes:
    """The training flag of every submodule and the fake-quant state of every
    fxq module, to put back after a failed call."""

    def __init__(self, model: nn.Module) -> None:
        self.training = [(m, m.training) for m in model.modules()]
        self.states = [
            (m, m.state)
            for m in model.modules()
            if hasattr(m, "set_fake_quant_state")
            and isinstance(getattr(m, "state", None), FakeQuantState)
        ]

    def restore(self) -> None:
        for m, training in self.training:
            m.training = training
        for m, state in self.states:
            m.set_fake_quant_state(state)


def call_order(
    model: nn.Module,
    modules: Iterable[nn.Module],
    batch: Any,
    input_fn: Callable[[Any], Any] | None = None,
) -> list[nn.Module]:
    """``modules`` in the order one float forward pass on ``batch`` first calls them
    (modules it never calls are left out)."""
    order: list[nn.Module] = []
    seen: set[int] = set()

    def record(module: nn.Module, inputs: Any) -> None:
        if id(module) not in seen:
            seen.add(id(module))
            order.append(module)

    hooks = [m.register_forward_pre_hook(record) for m in modules]
    try:
        with torch.no_grad(), bypass(model):
            args, kwargs = batch_arguments(model, batch, input_fn)
            model(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return order


def keep_rank0_result(model: nn.Module, group: Any = None) -> None:
    """In a ``torch.distributed`` run with several ranks, give every rank rank 0's parameters
    and buffers.

    The recipes that change a model from its data beyond the observers (depthwise
    equalization, bias correction, learned rounding, ``ptq``'s choice of ranges) work on
    each rank's own batches; they end with this so that the ranks leave with one model,
    rank 0's, and not one per shard. Outside a distributed run (or with one rank) it does
    nothing. Every rank must call it (it is a collective).
    """
    if world_size(group) < 2:
        return
    import torch.distributed as dist

    src = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for t in model.state_dict().values():  # they share the storage of the model's tensors
            if t.dtype == torch.bool:  # not every backend broadcasts bool
                carrier = t.to(torch.uint8)
                dist.broadcast(carrier, src=src, group=group)
                t.copy_(carrier.bool())
            else:
                dist.broadcast(t, src=src, group=group)


def average_over_ranks(tensors: list[torch.Tensor]) -> None:
    """Average each tensor in place over the ranks of the default process group (nothing
    outside a distributed run): a step of an algorithm that learns from data then sees every
    rank's batches. Every rank must call it with tensors of the same shapes."""
    world = world_size()
    if world < 2:
        return
    import torch.distributed as dist

    for t in tensors:
        dist.all_reduce(t)
        t.div_(world)


def require_calibrated(model: nn.Module, who: str) -> None:
    """Raise unless every activation fake quant of ``model`` has a scale.

    Raises:
        RuntimeError: naming the first fake quant without one and what to do.
    """
    missing = [
        n
        for n, m in model.named_modules()
        if isinstance(m, FakeQuantize)
        and not (m.is_high_precision or m.is_fixed_scale or bool(m.observed))
        and not n.endswith("weight_fake_quant")
    ]
    if missing:
        raise RuntimeError(
            f"{who} needs a calibrated model; {len(missing)} fake quant(s) have no scale "
            f"(e.g. {missing[0]}). Run fxq.calibration.calibrate first"
        )
