"""Activation ranges clipped where the error after the next normalization says so.

A per-tensor int8 activation is a trade between rounding and clipping: its
range is the largest value kept, its step that range over 127. In transformers
a few values of some tensors are orders of magnitude above the rest (on
all-MiniLM-L6-v2 the residual stream before each LayerNorm peaks near 220 in
one channel of the first token, while the other values stay under 12), so a
range that keeps them leaves the other values a handful of levels, and a
statistic of the tensor alone (its mean range, a percentile, its own squared
error) cannot tell whether the extremes matter more than the rest: that depends
on what reads the tensor. A LayerNorm divides each token by its own spread, so
the token that holds the extreme values is hardly changed by clipping them,
while every other token is changed by a coarse step.

``search_ranges`` therefore chooses each range by the error it causes where the
values are next normalized. It visits the int8 activations that modules other than
normalizations output and that reach a normalization, in the order the graph computes
them, and for each tries clipping its range at
``candidates`` (fractions of the calibrated range). A candidate is scored by
running the graph from that activation to its *window end*, the first
normalization layers (LayerNorm, GroupNorm, ``F.normalize``) that each path from it
reaches (or the model outputs, for a path that reaches none), on a few
calibration samples in the fake-quantized arithmetic, with every range chosen
before it in place (greedy, like a layer-by-layer reconstruction), and taking
the squared error against the float model's values there. The smallest error
wins; ties keep the wider range.

The ranges live in the observers' ``min_val`` / ``max_val`` and the fake
quants' scales (``state_dict`` carries them; QAT continues from them).
``ptq`` applies it to models with a normalization layer (transformers) after
the calibration pass (``search_ranges=None``: automatically). Measured on
all-MiniLM-L6-v2: ``docs/transformers.md``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Interpreter, Node

from fxq.calibration.data import batch_list
from fxq.calibration.runner import batch_arguments, keep_rank0_result
from fxq.fake_quantize import FakeQuantize, bypass
from fxq.qat.base import QATModule
from fxq.qat.normalization import L2Normalize, _Normalization

__all__ = [
    "search_ranges",
    "SearchedRange",
    "searchable_quants",
    "has_normalization",
    "DEFAULT_CANDIDATES",
]

#: fractions of the calibrated range tried for each activation (1.0: the range as it is)
DEFAULT_CANDIDATES: tuple[float, ...] = (1.0, 0.8, 0.6, 0.45, 0.33, 0.25, 0.18, 0.13, 0.09, 0.06)

_NORMALIZATIONS = (_Normalization, L2Normalize)


@dataclass
class SearchedRange:
    """One activation whose range was searched: the fraction kept and its errors."""

    module: str
    fraction: float
    #: the window error with the calibrated range and with the chosen one
    error_before: float
    error_after: float


def has_normalization(model: nn.Module) -> bool:
    """Whether ``model`` (a prepared GraphModule) has a normalization layer that a linear
    layer reads: the transformer-style graphs ``ptq`` searches ranges for by default."""
    from fxq.qat.weighted import Linear

    if not isinstance(model, GraphModule):
        return False
    modules = dict(model.named_modules())
    for node in model.graph.nodes:
        if node.op == "call_module" and isinstance(modules[node.target], _NORMALIZATIONS):
            for user in _readers_through_passthrough(node, modules):
                if user.op == "call_module" and isinstance(modules[user.target], Linear):
                    return True
    return False


def _readers_through_passthrough(node: Node, modules: dict[str, nn.Module]) -> list[Node]:
    """The nodes that read ``node``'s value, looking through pass-through ops."""
    from fxq.registry import Kind, row_for

    found, todo, seen = [], list(node.users), set()
    while todo:
        user = todo.pop()
        if user in seen:
            continue
        seen.add(user)
        module = modules.get(user.target) if user.op == "call_module" else None
        if user.op in ("call_method", "call_function") or (
            module is not None and not isinstance(module, QATModule)
        ):
            rule, _ = row_for(user, modules)
            if rule.kind.value == Kind.PASSTHROUGH.value:
                todo.extend(user.users)
                continue
        found.append(user)
    return found


def _reaching_normalization(model: GraphModule, modules: dict[str, nn.Module]) -> set[Node]:
    """The nodes from whose value some path reaches a normalization layer (one backward
    pass over the graph: a node reaches one when a reader is one or reaches one)."""
    reaching: set[Node] = set()
    for node in reversed(model.graph.nodes):
        if any(
            user in reaching
            or (user.op == "call_module" and isinstance(modules.get(user.target), _NORMALIZATIONS))
            for user in node.users
        ):
            reaching.add(node)
    return reaching


def searchable_quants(model: GraphModule) -> list[tuple[Node, FakeQuantize]]:
    """The activations ``search_ranges`` visits, in graph order: the output fake quant of
    each QAT module called once, other than a normalization, whose value reaches a
    normalization layer, per tensor, int8 or narrower, with a calibrated (not fixed) scale
    and no offset, and not a model output.

    A normalization's own output is left as calibrated: in a post-norm encoder it is the
    residual stream of the next layer as well, and clipping it (its ``gamma`` outlier
    channels) costs every later layer (measured on all-MiniLM-L6-v2, ``docs/transformers.md``).
    """
    from fxq.calibration.graph_outputs import output_quants

    modules = dict(model.named_modules())
    calls: dict[str, int] = {}
    for node in model.graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    outputs = {id(m.activation_post_process) for _, m in output_quants(model)}
    reaching = _reaching_normalization(model, modules)
    found = []
    for node in model.graph.nodes:
        if node.op != "call_module" or calls[node.target] != 1:
            continue
        module = modules[node.target]
        if (
            not isinstance(module, QATModule)
            or not module.has_output_quant
            or isinstance(module, _NORMALIZATIONS)
        ):
            continue
        fq = module.activation_post_process
        if (
            isinstance(fq, FakeQuantize)
            and fq.ch_axis is None
            and not fq.is_high_precision
            and not fq.is_fixed_scale
            and fq.dtype.bits <= 8
            and not fq.offset
            and id(fq) not in outputs
            and fq.activation_post_process.has_statistics()
            and node in reaching
        ):
            found.append((node, fq))
    return found


def _window_ends(start: Node, modules: dict[str, nn.Module], depth: int) -> tuple[set[Node], bool]:
    """The normalization nodes that the paths from ``start`` reach as their ``depth``-th,
    and whether a path reaches the graph output before that."""
    ends: set[Node] = set()
    reaches_output = False
    todo, seen = [(u, depth) for u in start.users], set()
    while todo:
        node, left = todo.pop()
        if (node, left) in seen:
            continue
        seen.add((node, left))
        if node.op == "output":
            reaches_output = True
            continue
        if node.op == "call_module" and isinstance(modules.get(node.target), _NORMALIZATIONS):
            if left == 1:
                ends.add(node)
                continue
            left -= 1
        todo.extend((u, left) for u in node.users)
    return ends, reaches_output


class _Run:
    """One batch run node by node (``torch.fx.Interpreter``) on an environment of node
    values that the caller keeps."""

    def __init__(self, gm: GraphModule, args: tuple) -> None:
        self.interpreter = Interpreter(gm, garbage_collect_values=False)
        self.args = args
        self.env: dict[Node, Any] = {}

    def start(self) -> None:
        """Begin a run from the first placeholder."""
        self.interpreter.args_iter = iter(self.args)

    def run_node(self, node: Node, env: dict[Node, Any]) -> Any:
        """``node``'s value from the values in ``env``; the output node gives its value."""
        self.interpreter.env = env
        if node.op == "output":
            return self.interpreter.fetch_args_kwargs_from_env(node)[0][0]
        return self.interpreter.run_node(node)


def _error(got: Any, want: Any) -> float:
    from fxq.calibration.auto import _flatten_outputs

    return float((_flatten_outputs(got).float() - _flatten_outputs(want).float()).pow(2).sum())


@torch.no_grad()
def _set_range(fq: FakeQuantize, low: Tensor, high: Tensor, amax: float) -> None:
    """Give ``fq`` the calibrated ``low`` / ``high`` clipped to ``[-amax, amax]``."""
    obs = fq.activation_post_process
    obs.min_val.copy_(low.clamp(min=-amax))
    obs.max_val.copy_(high.clamp(max=amax))
    fq.update_scale()


def search_ranges(
    model: nn.Module,
    data: Iterable[Any],
    candidates: Sequence[float] = DEFAULT_CANDIDATES,
    num_samples: int = 32,
    depth: int = 1,
    input_fn: Callable[[Any], Any] | None = None,
) -> list[SearchedRange]:
    """Clip each int8 activation's range where the error at the next normalization is smaller
    (module docstring).

    Args:
        model: a calibrated model from ``prepare_qat_fx`` (a GraphModule); changed in place.
        data: calibration batches; the first ones holding ``num_samples`` samples are used.
        candidates: fractions of each calibrated range to try, each in ``(0, 1]``.
        num_samples: how many calibration samples score the candidates.
        input_fn: maps a batch to the model's arguments.

    Returns:
        one ``SearchedRange`` per activation whose range was clipped.

    Raises:
        ValueError: a candidate outside ``(0, 1]``, or no batch.
    """
    if not candidates or any(not 0 < c <= 1 for c in candidates):
        raise ValueError(f"search_ranges: candidates must lie in (0, 1], got {list(candidates)}")
    if not isinstance(model, GraphModule):
        return []
    from fxq.calibration.reconstruction import (
        _quantized_arithmetic,
        layerwise_session,
        leading_batches,
    )

    batches = batch_list(data, None, "search_ranges", ranks="nonempty")
    batches = leading_batches(model, batches, num_samples, input_fn)
    visits = searchable_quants(model)
    if not visits:
        return []
    modules = dict(model.named_modules())
    nodes = list(model.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    windows = {node: _window_ends(node, modules, depth) for node, _ in visits}
    watched = {end for ends, _ in windows.values() for end in ends}
    output = nodes[-1]
    signature = inspect.signature(model.forward)
    runs = []
    for batch in batches:
        args, kwargs = batch_arguments(model, batch, input_fn)
        runs.append(_Run(model, tuple(signature.bind(*args, **kwargs).args)))
    last_use = {n: i for i, n in enumerate(nodes)}
    for i, n in enumerate(nodes):
        for inp in n.all_input_nodes:
            last_use[inp] = i
    report = []
    with layerwise_session(model, copy_reference=False):
        # the float values at the window ends (and the outputs), one run per batch
        references = []
        with bypass(model), torch.no_grad():
            for run in runs:
                env: dict[Node, Any] = {}
                kept = {}
                run.start()
                for i, node in enumerate(nodes):
                    env[node] = run.run_node(node, env)
                    if node in watched or node.op == "output":
                        kept[node] = env[node]
                    for inp in node.all_input_nodes:
                        if last_use[inp] == i:
                            env.pop(inp, None)
                references.append(kept)
        with _quantized_arithmetic(model), torch.no_grad():
            position = 0
            for run in runs:
                run.start()

            def advance(stop: int) -> None:
                nonlocal position
                for i in range(position, stop):
                    node = nodes[i]
                    for run in runs:
                        run.env[node] = run.run_node(node, run.env)
                        for inp in node.all_input_nodes:
                            if last_use[inp] == i:
                                run.env.pop(inp, None)
                position = max(position, stop)

            def window_error(start: int, ends: set[Node], to_output: bool) -> float:
                stop = max([index[e] for e in ends] + ([index[output]] if to_output else []))
                total = 0.0
                for run, reference in zip(runs, references):
                    env = dict(run.env)
                    for i in range(start, stop + 1):
                        node = nodes[i]
                        env[node] = run.run_node(node, env)
                        if node in ends or node is output:
                            total += _error(env[node], reference[node])
                return total

            for node, fq in visits:
                advance(index[node])
                ends, to_output = windows[node]
                obs = fq.activation_post_process
                low, high = obs.min_val.detach().clone(), obs.max_val.detach().clone()
                amax = float(torch.maximum(-low, high).max())
                if amax <= 0:
                    continue
                errors = []
                for fraction in candidates:
                    _set_range(fq, low, high, amax * fraction)
                    errors.append(window_error(index[node], ends, to_output))
                best = min(range(len(candidates)), key=lambda k: (errors[k], -candidates[k]))
                _set_range(fq, low, high, amax * candidates[best])
                if candidates[best] < 1.0:
                    report.append(
                        SearchedRange(
                            node.target,
                            candidates[best],
                            errors[candidates.index(1.0)] if 1.0 in candidates else float("nan"),
                            errors[best],
                        )
                    )
    keep_rank0_result(model)  # the errors are each rank's own
    return report
