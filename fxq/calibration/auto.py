"""``auto_calibrate``: per layer, the observer that minimises the final output's error.

Every observer gives each activation a clipping range from the same
statistics, but the range that minimises a tensor's own quantization error
is not always the one that serves the model's output best. ``auto_calibrate``

1. collects one histogram per activation fake quant (one calibration pass);
2. derives each observer's candidate scale from it;
3. starts every fake quant at the ``mse`` candidate and then, in the order the
   model runs them, tries each candidate and keeps the one with the smallest
   mean squared error of the model's outputs against the float model, on a few
   evaluation batches (the training-time float fake-quant arithmetic is used
   for speed; the integer model is what it approximates closely).

Trying a candidate re-runs only the part of the graph after the fake quant's
layer: every value before it is cached once per evaluation batch, and the
values of the chosen candidate's run become the cache for the next layer (no
re-run after a choice), so the cost is about half a forward per candidate
instead of a whole one; candidates that give the same clip run once.
MobileNetV2, 96 crops, one evaluation batch, 2 cores: 76 s (713 s before the
cache).

The model keeps its observers (so QAT can follow); only the scales change.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from tabulate import tabulate
from torch import Tensor, nn
from torch.fx import GraphModule, Interpreter, Node

from fxq.calibration.data import batch_list
from fxq.calibration.observers import HistogramObserver
from fxq.calibration.runner import batch_arguments, call_order, progress, run_batches
from fxq.debug import float_fake_quant
from fxq.debug.sensitivity import _clone
from fxq.fake_quantize import FakeQuantize, FakeQuantState, bypass, set_fake_quantize
from fxq.observer import world_size
from fxq.quantized import functional as qf
from fxq.utils.warning_summary import summarises_warnings

__all__ = ["auto_calibrate", "AUTO_CANDIDATES"]

AUTO_CANDIDATES = ("min_max", "percentile", "mse", "kl")


class _Collector(HistogramObserver):
    """Histogram statistics from which every candidate clip is derived."""

    counts_zeros = True  # the kl candidate leaves exact zeros out

    def clips(self, names: Sequence[str]) -> dict[str, float]:
        table = {
            "min_max": self._observed_max,
            "percentile": lambda: self.percentile_clip(99.99),
            "mse": self.mse_clip,
            "kl": self.kl_clip,
        }
        unknown = [n for n in names if n not in table]
        if unknown:
            raise ValueError(
                f"auto_calibrate: unknown candidates {unknown}; choose from {', '.join(table)}"
            )
        return {n: table[n]() for n in names}

    def clip(self) -> float:
        return self.mse_clip()


def _flatten_outputs(out: Any) -> Tensor:
    if isinstance(out, Tensor):
        return out.reshape(-1).to(torch.float64)
    if isinstance(out, dict):
        return torch.cat([_flatten_outputs(v) for v in out.values()]) if out else torch.zeros(0)
    if isinstance(out, (list, tuple)):
        parts = [_flatten_outputs(v) for v in out if isinstance(v, (Tensor, dict, list, tuple))]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
    return torch.zeros(0, dtype=torch.float64)


def _activation_quants(model: nn.Module, batch: Any, input_fn) -> list[tuple[str, FakeQuantize]]:
    """Activation fake quants (not weights, fixed scales or int32 outputs), in the order the model runs them."""
    weights = {
        id(m.weight_fake_quant)
        for m in model.modules()
        if isinstance(getattr(m, "weight_fake_quant", None), FakeQuantize)
    }
    candidates = [
        m
        for m in model.modules()
        if isinstance(m, FakeQuantize)
        and id(m) not in weights
        and not m.is_high_precision
        and not m.is_fixed_scale
    ]
    names = {id(m): n for n, m in model.named_modules()}
    return [(names[id(m)], m) for m in call_order(model, candidates, batch, input_fn)]


class _Whole:
    """The fallback of ``_Suffix`` for a model that is not a GraphModule."""

    def __init__(self, model: nn.Module, batch: Any, input_fn) -> None:
        self.model, self.args = model, batch_arguments(model, batch, input_fn)

    def run_from(self, start: Any) -> Any:
        return self.model(*self.args[0], **self.args[1])

    def values(self) -> dict:
        return {}

    def commit(self, values: dict) -> None:
        pass


class _Suffix(Interpreter):
    """Runs a graph once per batch keeping every value, then re-runs it from a node on."""

    def __init__(self, gm: GraphModule, args: tuple) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.nodes = list(gm.graph.nodes)
        self.position = {n: i for i, n in enumerate(self.nodes)}
        self.args = args
        self.run_from(None)
        self.base: dict[Node, Any] = dict(self.env)

    def values(self) -> dict[Node, Any]:
        """The values of the last run (a shallow copy: the tensors are shared)."""
        return dict(self.env)

    def commit(self, values: dict[Node, Any]) -> None:
        """Make ``values`` (from ``values()``) the base."""
        self.base = values

    def run_from(self, start: Node | None) -> Any:
        if start is None:
            self.env = {}
            return self.run(*self.args)
        first = self.position[start]
        env = dict(self.base)
        for n in self.nodes[first:]:
            for inp in n.all_input_nodes:
                if self.position[inp] < first and env[inp] is self.base[inp]:
                    env[inp] = _clone(self.base[inp])  # an in-place op must not touch the cache
        self.env = env
        for n in self.nodes[first:]:
            if n.op == "output":
                return self.fetch_args_kwargs_from_env(n)[0][0]
            env[n] = self.run_node(n)
        raise RuntimeError("the graph has no output node")


def _nodes_of(model: nn.Module) -> dict[int, Node]:
    """The graph node whose module owns each output fake quant (by the fake quant's id)."""
    if not isinstance(model, GraphModule):
        return {}
    found: dict[int, Node] = {}
    for node in model.graph.nodes:
        if node.op == "call_module":
            fq = getattr(model.get_submodule(node.target), "activation_post_process", None)
            if isinstance(fq, FakeQuantize) and id(fq) not in found:
                found[id(fq)] = node
    return found


def _require_one_rank() -> None:
    ranks = world_size()
    if ranks > 1:
        raise RuntimeError(
            "auto_calibrate: each rank would choose its observers from its own batches and "
            f"leave with its own model ({ranks} ranks); run it in one process "
            "(e.g. on rank 0 before the others start, then load its state_dict on every rank), "
            "or use fxq.calibration.ptq, which keeps rank 0's result on every rank"
        )


@summarises_warnings("fxq.calibration.auto_calibrate")
def auto_calibrate(
    model: nn.Module,
    data: Iterable[Any],
    candidates: Sequence[str] = AUTO_CANDIDATES,
    num_batches: int | None = None,
    eval_batches: int = 2,
    input_fn: Callable[[Any], Any] | None = None,
    show_progress: bool | None = None,
    show: bool = True,
) -> list[dict[str, Any]]:
    """Calibrate ``model`` choosing, per activation, the observer that serves the output best.

    Args:
        model: a model from ``prepare_qat_fx`` (any qconfig: its observers are
            kept; only the scales are set).
        data: calibration batches (see ``fxq.calibration.calibrate``).
        candidates: observer names to choose from (``min_max``, ``percentile``
            (99.99), ``mse``, ``kl``).
        num_batches: batches used for the statistics.
        eval_batches: the first batches of ``data``, on which each choice is judged.
        show: print the table of choices.

    Returns:
        one row per activation fake quant: ``layer``, ``chosen``, ``scale``,
        and the output SQNR (dB) each candidate gave when it was tried. The choice is
        judged with QAT's arithmetic (``fxq.debug.float_fake_quant``: activations rounded
        in float), which is fast to run per candidate; the integer model adds its
        requantization error, so its SQNR is lower (measure it with
        ``fxq.debug.featuremap_similarity`` on the model in VALIDATION).

    Raises:
        ValueError: for unknown candidates or empty data (a failure part-way
            restores the model's scales and states).
        RuntimeError: in a ``torch.distributed`` run with several ranks (each
            would choose from its own batches); run it in one process.
    """
    _require_one_rank()
    batches = batch_list(data, num_batches, "auto_calibrate")
    training = model.training
    model.eval()
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    states = {m: m.state for m in model.modules() if hasattr(m, "set_fake_quant_state")}
    try:
        return _auto_calibrate(
            model, batches, candidates, eval_batches, input_fn, show_progress, show
        )
    except BaseException:  # a failure leaves the model as it was
        model.load_state_dict(snapshot)
        for m, st in states.items():
            m.set_fake_quant_state(st)
        raise
    finally:
        model.train(training)


def _auto_calibrate(
    model, batches, candidates, eval_batches, input_fn, show_progress, show
) -> list[dict[str, Any]]:
    quants = _activation_quants(model, batches[0], input_fn)
    originals = [fq.activation_post_process for _, fq in quants]
    for _, fq in quants:
        collector = _Collector()
        collector.qmax = fq.levels_above_zero
        fq.activation_post_process = collector
    try:
        set_fake_quantize(model, FakeQuantState.CALIBRATION)
        run_batches(model, batches, None, input_fn, "auto-calibrate: statistics", show_progress)
        clips = [fq.activation_post_process.clips(candidates) for _, fq in quants]
    finally:
        for (_, fq), obs in zip(quants, originals):
            fq.activation_post_process = obs
            fq._stale = False
    evaluation = batches[:eval_batches]
    with bypass(model):
        reference = [
            _flatten_outputs(o)
            for o in run_batches(model, evaluation, None, input_fn, show_progress=False)
        ]
    signal = sum(float((r**2).sum()) for r in reference)
    nodes = _nodes_of(model)
    runners: list[_Suffix] = []

    def output_error(start: Node | None) -> float:
        total = 0.0
        with torch.no_grad():
            for runner, ref in zip(runners, reference):
                out = runner.run_from(start)
                total += float(((_flatten_outputs(out) - ref) ** 2).sum())
        return total

    def set_clip(fq: FakeQuantize, clip: float) -> None:
        scale = torch.tensor(
            [max(clip, 1e-30) / fq.levels_above_zero], device=fq.scale.device
        ).clamp(min=float(torch.finfo(torch.float32).eps))
        fq.scale.copy_(qf.constrain_scale(scale, fq.spec.scale_constraint))
        fq.observed.fill_(True)

    for (_, fq), c in zip(quants, clips):
        set_clip(fq, c.get("mse", next(iter(c.values()))))
    set_fake_quantize(model, FakeQuantState.VALIDATION)
    rows = []
    with float_fake_quant(model), torch.no_grad():
        if isinstance(model, GraphModule):
            for batch in evaluation:
                args, kwargs = batch_arguments(model, batch, input_fn)
                bound = inspect.signature(model.forward).bind(*args, **kwargs)
                runners.append(_Suffix(model, tuple(bound.args)))
        else:  # no graph to cut: every candidate runs the whole model
            nodes = {}
            runners.extend(_Whole(model, batch, input_fn) for batch in evaluation)
        for (name, fq), c in progress(
            list(zip(quants, clips)), len(quants), "auto-calibrate: choosing", show_progress
        ):
            start = nodes.get(id(fq))
            tried: dict[str, float] = {}
            seen: dict[float, float] = {}
            values: dict[float, list[dict]] = {}  # each run's values: the choice's become the cache
            for cand, clip in c.items():
                key = round(clip, 9)
                if key not in seen:
                    set_clip(fq, clip)
                    seen[key] = output_error(start)
                    values[key] = [runner.values() for runner in runners]
                tried[cand] = seen[key]
            best = min(tried, key=tried.get)
            set_clip(fq, c[best])
            for runner, kept in zip(runners, values[round(c[best], 9)]):
                runner.commit(kept)
            values.clear()
            rows.append(
                {
                    "layer": name.removesuffix(".activation_post_process"),
                    "chosen": best,
                    "scale": float(fq.scale.reshape(-1)[0]),
                    **{
                        f"sqnr_{k}": 10 * torch.log10(torch.tensor(signal / max(v, 1e-30))).item()
                        for k, v in tried.items()
                    },
                }
            )
    if show:
        headers = ["layer", "chosen", "scale"] + [f"sqnr_{k}" for k in candidates]
        print(
            tabulate(
                [[r.get(h, "") for h in headers] for r in rows], headers=headers, floatfmt=".4g"
            )
        )
    return rows
