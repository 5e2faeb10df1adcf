"""The one data contract of every fxq function that takes calibration or evaluation data.

``data`` (``calibrate``, ``ptq``, ``auto_calibrate``, ``weight_reconstruction``,
``bias_correction``, ``equalize_depthwise``, ``tune_biases``, ``mixed_precision``,
``fxq.debug.sensitivity``, ``QuantAnalysis.auto_find_bad_case``) is an iterable of
batches: a list, a ``DataLoader``, a generator. One batch is

* a tensor: the model's one input;
* a tuple or list: its first elements are the positional inputs, as many as
  ``forward`` takes, so a DataLoader's ``(images, labels)`` calls ``model(images)``;
* a dict: the keyword inputs; keys that are no parameter of ``forward`` (a
  ``"label"``) are left out, and a dict none of whose keys is one is an error;

and ``input_fn(batch)`` maps anything else (it returns one input, a tuple of
positional inputs or a dict of keyword inputs). The debug tools that look at one
input (``featuremap_similarity``, ``get_raw_features``, ``QuantAnalysis.set_bad_case``)
take one such batch.

A bare tensor given as ``data`` is refused (iterating it would give its samples,
not batches: wrap it in a list), and so are empty data and ``num_batches <= 0``. In
a ``torch.distributed`` run the functions whose steps are collectives agree on the
number of batches first (``agree_on_batch_count``), so that uneven shards fail on
every rank alike instead of hanging.

>>> import torch
>>> from torch import nn
>>> model = nn.Conv2d(3, 4, 1)
>>> image, label = torch.randn(2, 3, 4, 4), torch.tensor([0, 1])
>>> args, kwargs = batch_arguments(model, (image, label))
>>> len(args), kwargs
(1, {})
>>> batch_list(torch.randn(2, 3), None, "calibrate")
Traceback (most recent call last):
...
TypeError: calibrate: `data` is one tensor of shape (2, 3); iterating it would give its 2 samples one by one, not batches. Wrap it in a list: [x] (one batch), or pass a list of batches or a DataLoader
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.fx import GraphModule
from torch.utils._pytree import tree_flatten

from fxq.observer import world_size

__all__ = [
    "batch_arguments",
    "batch_list",
    "each_batch",
    "holds_sample",
    "no_sample_error",
    "check_data",
    "check_num_batches",
    "no_batch_error",
    "one_batch",
    "one_or_more_batches",
    "positional_arguments",
    "agree_on_batch_count",
    "BatchCountAgreement",
]


def _forward_of(model: nn.Module) -> nn.Module:
    """The module whose ``forward`` defines the inputs (DDP / DataParallel unwrapped)."""
    parallel = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    while isinstance(model, parallel):
        model = model.module
    return model


def _vararg_uses(gm: GraphModule, node: torch.fx.Node) -> int | None:
    """How many leading elements of a ``*args`` placeholder the graph reads (None: unknown)."""
    used = -1
    for user in node.users:
        if user.target is not operator.getitem or not isinstance(user.args[1], int):
            return None
        if user.args[1] < 0:
            return None
        used = max(used, user.args[1])
    return used + 1


def _positional_count(model: nn.Module) -> int | None:
    """How many positional inputs ``model`` takes (None: any number).

    A GraphModule is read from its placeholders: a ``*args`` placeholder counts the
    elements its graph reads (``args[0]`` only: one), so ``(image, label)`` calls a
    model traced from ``forward(self, *args)`` with the image alone.
    """
    model = _forward_of(model)
    if isinstance(model, GraphModule):
        count = 0
        for node in model.graph.nodes:
            if node.op != "placeholder":
                continue
            target = str(node.target)
            if target.startswith("**"):
                continue
            if target.startswith("*"):
                used = _vararg_uses(model, node)
                return None if used is None else count + used
            count += 1
        return count
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    count = 0
    for p in params:
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            return None
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            count += 1
    return count


def _signature(model: nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(_forward_of(model).forward)
    except (TypeError, ValueError):
        return None


def _keyword_arguments(model: nn.Module, batch: Mapping) -> dict:
    """The entries of a dict batch that are ``forward``'s keyword inputs."""
    signature = _signature(model)
    if signature is None:
        return dict(batch)
    params = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(batch)
    names = [
        n
        for n, p in params.items()
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.POSITIONAL_ONLY)
    ]
    chosen = {k: v for k, v in batch.items() if k in names}
    where = f"{type(_forward_of(model)).__name__}.forward({', '.join(params)})"
    if not chosen:
        raise ValueError(
            f"a batch is a dict with keys {sorted(map(str, batch))}, none of which is an input "
            f"of {where}; pass input_fn to say what the model takes, e.g. "
            "input_fn=lambda batch: batch['image'] (or input_fn=lambda batch: (batch,) to pass "
            "the dict itself as the one input)"
        )
    missing = [
        n
        for n, p in params.items()
        if n not in chosen
        and p.default is inspect.Parameter.empty
        and p.kind is not inspect.Parameter.VAR_POSITIONAL
    ]
    if missing:
        raise ValueError(
            f"a batch is a dict with keys {sorted(map(str, batch))}, which lack the required "
            f"input(s) {missing} of {where}; pass input_fn to map a batch to the model's inputs"
        )
    return chosen


def batch_arguments(
    model: nn.Module, batch: Any, input_fn: Callable[[Any], Any] | None = None
) -> tuple[tuple, dict]:
    """How to call ``model`` on one batch: ``(args, kwargs)`` (module docstring).

    * ``input_fn(batch)`` decides when given: a dict it returns is keyword
      arguments, a tuple / list positional arguments, anything else the one argument;
    * a tensor is the one argument;
    * a tuple / list is the positional arguments, cut to the number ``forward``
      takes, so ``(images, labels)`` from a DataLoader calls ``model(images)``;
    * a dict is keyword arguments: its keys that are ``forward`` parameters (all of
      them when ``forward`` takes ``**kwargs``).

    Raises:
        ValueError: an empty tuple / list, or a dict none of whose keys is an input of
            ``forward`` (or that lacks a required one); the message says to pass ``input_fn``.
    """
    if input_fn is not None:
        batch = input_fn(batch)
        if isinstance(batch, Mapping):
            return (), dict(batch)
        return (tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)), {}
    if isinstance(batch, (tuple, list)):
        if not batch:
            raise ValueError(
                f"a batch is an empty {type(batch).__name__}; a tuple or list batch holds the "
                "model's inputs first (e.g. (images, labels))"
            )
        count = _positional_count(model)
        return tuple(batch[:count] if count is not None else batch), {}
    if isinstance(batch, Mapping):
        return (), _keyword_arguments(model, batch)
    return (batch,), {}


def positional_arguments(model: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """``args`` and ``kwargs`` as the positional arguments of ``model.forward`` (defaults
    filled in), for runners that take positional arguments only (``torch.fx.Interpreter``)."""
    if not kwargs:
        return args
    signature = _signature(model)
    if signature is None:
        raise ValueError(f"{type(model).__name__} takes no keyword inputs")
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return tuple(bound.args)


def check_num_batches(num_batches: Any, who: str) -> None:
    """Raise unless ``num_batches`` is a positive integer or None.

    Raises:
        ValueError: naming ``who`` and the value.
    """
    if num_batches is not None and (
        isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 1
    ):
        raise ValueError(
            f"{who}: num_batches must be a positive integer or None (every batch), "
            f"got {num_batches!r}"
        )


def check_data(data: Any, who: str, argument: str = "data") -> None:
    """Raise for a ``data`` that is one batch rather than an iterable of batches.

    Raises:
        TypeError: a tensor or a dict (iterating it gives samples or keys, not batches);
            the message says to wrap it in a list.
    """
    if isinstance(data, torch.Tensor):
        samples = f"its {data.shape[0]} samples" if data.dim() else "its elements"
        raise TypeError(
            f"{who}: `{argument}` is one tensor of shape {tuple(data.shape)}; iterating it would "
            f"give {samples} one by one, not batches. Wrap it in a list: [x] (one batch), or "
            "pass a list of batches or a DataLoader"
        )
    if isinstance(data, Mapping):
        raise TypeError(
            f"{who}: `{argument}` is one dict (keys {sorted(map(str, data))}); iterating it would "
            "give its keys, not batches. Wrap it in a list: [batch] (one batch), or pass a list "
            "of batches or a DataLoader"
        )
    if not isinstance(data, Iterable):
        raise TypeError(
            f"{who}: `{argument}` must be an iterable of batches (a list of tensors, a "
            f"DataLoader), got {type(data).__name__}"
        )


def no_batch_error(data: Any, who: str, argument: str = "data", note: str = "") -> ValueError:
    """The error for data that yielded no batch."""
    return ValueError(
        f"{who}: `{argument}` ({type(data).__name__}) yielded no batch. Pass a non-empty "
        "iterable of batches (a DataLoader, or a list of tensors); an iterator or generator "
        f"can only be consumed once.{' ' + note if note else ''}"
    )


def batch_list(
    data: Iterable[Any],
    num_batches: int | None,
    who: str,
    argument: str = "data",
    ranks: str | None = None,
) -> list[Any]:
    """The first ``num_batches`` batches of ``data`` (all of them when None), as a list.

    Args:
        data: an iterable of batches (module docstring).
        num_batches: how many to take (None: all).
        who: the calling function's name, for the messages.
        argument: the name of ``data`` in the caller, for the messages.
        ranks: for a function whose steps are collectives in a ``torch.distributed`` run:
            ``"nonempty"`` (every rank must have batches) or ``"equal"`` (and the same
            number); the ranks agree before anything runs (``agree_on_batch_count``, a
            collective every rank reaches, even one without batches). None: no agreement.

    Raises:
        TypeError: ``data`` is a tensor or a dict (``check_data``).
        ValueError: ``num_batches`` is not a positive integer or None, or no batch (on
            every rank alike when ``ranks`` is given).
    """
    check_num_batches(num_batches, who)
    check_data(data, who, argument)
    batches = list(data) if num_batches is None else [b for _, b in zip(range(num_batches), data)]
    if ranks is not None:
        agree_on_batch_count(len(batches), who, equal=ranks == "equal")
    if not batches:
        raise no_batch_error(data, who, argument)
    if world_size() < 2 and not any(map(holds_sample, batches)):  # (a rank alone: no hang)
        raise no_sample_error(batches[0], who, argument)
    return batches


def holds_sample(batch: Any) -> bool:
    """Whether ``batch`` holds a sample: a non-empty tensor or array, or neither (inputs
    that ``input_fn`` makes tensors of)."""
    arrays = [t for t in tree_flatten(batch)[0] if isinstance(t, (torch.Tensor, np.ndarray))]
    return not arrays or any(t.size if isinstance(t, np.ndarray) else t.numel() for t in arrays)


def no_sample_error(batch: Any, who: str, argument: str = "data") -> ValueError:
    """The error for data whose every batch holds no sample (tensors of shape ``(0, ...)``)."""
    return ValueError(
        f"{who}: every batch of `{argument}` holds no sample (e.g. tensor shape "
        f"{_shapes(batch)}); nothing can be observed. Pass batches with at least one sample"
    )


def _shapes(batch: Any) -> str:
    """The shapes of a batch's first three tensors, for messages."""
    tensors = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    return ", ".join(str(tuple(t.shape)) for t in tensors[:3])


def each_batch(
    data: Iterable[Any], num_batches: int | None, who: str, argument: str = "data"
) -> Iterator[Any]:
    """The first ``num_batches`` batches of ``data``, one at a time (nothing is kept).

    Checks ``num_batches`` and ``data`` before the first batch; the caller raises
    ``no_batch_error`` when nothing came.
    """
    check_num_batches(num_batches, who)
    check_data(data, who, argument)
    for i, batch in enumerate(data):
        if num_batches is not None and i >= num_batches:
            return
        yield batch


def one_batch(inputs: Any, who: str, argument: str = "inputs") -> Any:
    """Check one batch for the debug tools that look at a single input.

    Raises:
        ValueError: ``inputs`` is empty (``[]``, ``()``, ``{}``) or holds no sample (every
            tensor in it is empty, e.g. of shape ``(0, 3, 8, 8)``).
    """
    if isinstance(inputs, (tuple, list, Mapping)) and not inputs:
        raise ValueError(
            f"{who}: `{argument}` is an empty {type(inputs).__name__}; pass the model's "
            "input(s): a tensor, a tuple of positional inputs or a dict of keyword inputs"
        )
    tensors = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)]
    if tensors and all(t.numel() == 0 for t in tensors):
        raise ValueError(
            f"{who}: `{argument}` holds no sample (tensor shape {_shapes(inputs)}); every "
            "measure on zero values would be meaningless. Pass at least one sample"
        )
    return inputs


def one_or_more_batches(
    inputs: Any, who: str, argument: str = "inputs", ranks: str | None = None
) -> list[Any]:
    """``inputs`` as a list of batches, for the tools that take either one batch or many
    (``fxq.debug.sensitivity``, ``mixed_precision``): a tensor, a tuple or a dict is one
    batch (checked by ``one_batch``); a list or any other iterable is batches (``batch_list``,
    with ``ranks`` as there).

    Raises:
        ValueError: an empty list or iterable, or a batch with no sample.
    """
    if isinstance(inputs, (torch.Tensor, tuple, Mapping)):
        if ranks is not None:
            agree_on_batch_count(1, who, equal=ranks == "equal")
        return [one_batch(inputs, who, argument)]
    return batch_list(inputs, None, who, argument, ranks)


class BatchCountAgreement:
    """Makes the ranks of a ``torch.distributed`` run agree, step by step, that each has
    one more batch, for data whose length is not known in advance (a generator).

    ``step(has_batch)`` is a collective: it returns True when every rank has a batch,
    False when none has, and raises the same error on every rank when some have and
    some do not. Outside a distributed run (or with one rank) it costs nothing.
    """

    def __init__(self, who: str) -> None:
        self.who = who
        self.active = world_size() > 1
        self.steps = 0

    def step(self, has_batch: bool) -> bool:
        if not self.active:
            return has_batch
        import torch.distributed as dist

        flags = [None] * dist.get_world_size()
        dist.all_gather_object(flags, bool(has_batch))
        if all(flags):
            self.steps += 1
            return True
        counts = [self.steps + 1 if f else self.steps for f in flags]
        if self.steps == 0:  # no rank has a batch, or some have none
            raise ValueError(_empty_ranks_message(self.who, counts, at_least=True))
        if not any(flags):
            return False
        raise ValueError(
            _uneven_message(
                self.who,
                counts,
                at_least=True,
                outcome=f"The {self.steps} batch(es) every rank had were run; data without a "
                "len() is counted as it goes",
            )
        )


def _empty_ranks_message(who: str, counts: list[int], at_least: bool = False) -> str:
    empty = [r for r, c in enumerate(counts) if c == 0]
    return (
        f"{who}: rank(s) {empty} of {len(counts)} have no batch (batches per rank: "
        f"{_per_rank(counts, at_least)}); every rank must have batches. Give each rank a "
        "non-empty shard (e.g. DistributedSampler with at least as many batches as ranks). "
        "Nothing was run"
    )


def _per_rank(counts: list[int], at_least: bool = False) -> str:
    top = max(counts)
    return ", ".join(
        f"rank {r}: {'at least ' if at_least and c == top else ''}{c}" for r, c in enumerate(counts)
    )


def _uneven_message(
    who: str, counts: list[int], at_least: bool = False, outcome: str = "Nothing was run"
) -> str:
    alone = (
        ", or calibrate with sync_ranks=False (each rank keeps its own statistics)"
        if who == "calibrate"
        else ""
    )
    return (
        f"{who}: the ranks have different numbers of batches ({_per_rank(counts, at_least)}); "
        "every rank must run the same number, because each batch's statistics or steps are "
        "combined over the ranks. Give the ranks equal shards "
        f"(DistributedSampler(drop_last=True)) or pass num_batches={min(counts)} on every "
        f"rank{alone}. {outcome}"
    )


def agree_on_batch_count(count: int, who: str, equal: bool = True) -> None:
    """In a ``torch.distributed`` run with several ranks, check that every rank has
    batches (and, with ``equal``, the same number) before any collective on statistics.

    Every rank must call it (it gathers the counts); outside a distributed run it does
    nothing.

    Raises:
        ValueError: on every rank alike, naming each rank's count: a rank with no batch,
            or (``equal``) counts that differ.
    """
    if world_size() < 2:
        return
    import torch.distributed as dist

    counts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(counts, int(count))
    if min(counts) == 0:
        raise ValueError(_empty_ranks_message(who, counts))
    if equal and min(counts) != max(counts):
        raise ValueError(_uneven_message(who, counts))
