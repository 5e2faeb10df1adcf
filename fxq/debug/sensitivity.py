"""``sensitivity``: how much the model output suffers from each quantized value alone."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Interpreter, Node

from fxq.calibration.data import batch_arguments, one_or_more_batches, positional_arguments
from fxq.debug.capture import (
    call_function_bound,
    eval_no_grad,
    is_fxq_model,
    require_fake_quant_model,
    validation_state,
)
from fxq.debug.compare import float_fake_quant
from fxq.debug.metrics import Similarity, flat, similarity_for
from fxq.debug.report import HtmlPage, figure, text_table, write_text
from fxq.dtypes import QDType, as_qdtype
from fxq.fake_quantize import FakeQuantize, bypass
from fxq.qat.base import QATModule

__all__ = ["sensitivity", "SENSITIVITY_MODES", "QuantizedValue", "quantized_values"]

#: ``"quantize_one"``: only this value quantized, the rest float;
#: ``"float_one"``: every value quantized but this one.
SENSITIVITY_MODES = ("quantize_one", "float_one")


@dataclass
class QuantizedValue:
    """One quantized value of a QAT model: an activation or a weight.

    Attributes:
        name: the owning module's path (``"convs.1"``); a weight shared by several
            call sites is named after the first.
        kind: ``"activation"`` (the module's output), ``"weight"`` or ``"input<i>"``
            (a standalone module's own input quantization).
        fake_quant: the ``FakeQuantize`` that quantizes it.
        node: the first graph node it affects (None: before the graph can tell).
        type: the owning module's class name.
    """

    name: str
    kind: str
    fake_quant: FakeQuantize
    node: Node | None
    type: str


def quantized_values(gm: GraphModule) -> list[QuantizedValue]:
    """Every activation and weight fake quant of a QAT model, in run order."""
    found: list[QuantizedValue] = []
    seen: set[int] = set()

    def add(name: str, kind: str, fq: Any, node: Node | None, module: nn.Module) -> None:
        if isinstance(fq, FakeQuantize) and id(fq) not in seen and not fq.is_high_precision:
            seen.add(id(fq))
            found.append(QuantizedValue(name, kind, fq, node, type(module).__name__))

    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        if not isinstance(module, QATModule):
            continue
        add(node.target, "weight", getattr(module, "weight_fake_quant", None), node, module)
        if module.has_output_quant:
            add(node.target, "activation", module.activation_post_process, node, module)
    for path, module in gm.named_modules():  # standalone modules, called from opaque code
        if isinstance(module, QATModule) and module.standalone:
            for i, fq in enumerate(module.input_quant):
                add(path, f"input{i}", fq, None, module)
            add(path, "weight", getattr(module, "weight_fake_quant", None), None, module)
            if module.has_output_quant:
                add(path, "activation", module.activation_post_process, None, module)
    return found


class _SuffixRunner(Interpreter):
    """Runs a graph once keeping every value, then re-runs only what one node affects.

    ``run_from(node)`` runs ``node`` and the nodes that read its value, directly or
    through others (in run order); every other node's value is the one of the base
    run. When the base run overwrote a node's value in place after computing it
    (``x.add_(y)`` on a value others read too), the cache does not hold what each
    reader saw, and ``run_from`` runs the whole graph instead: each result equals a
    full forward with the change.
    """

    def __init__(self, gm: GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.nodes = list(gm.graph.nodes)
        self.position = {n: i for i, n in enumerate(self.nodes)}
        self.base: dict[Node, Any] = {}
        self.base_output: Any = None
        self.overwritten = False
        self._affected: dict[Node, list[Node]] = {}
        self._versions: dict[Node, Any] | None = None

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        return call_function_bound(self.module, target, args, kwargs)

    def run_node(self, n: Node) -> Any:
        value = super().run_node(n)
        if self._versions is not None:
            self._versions[n] = _versions(value)
        return value

    def run_base(self, *args: Any) -> Any:
        """Run the whole graph and keep every node's value."""
        self._versions = {}
        try:
            self.base_output = self.run(*args)
        finally:
            versions, self._versions = self._versions, None
        self.base = dict(self.env)
        self.overwritten = any(v != _versions(self.base[n]) for n, v in versions.items())
        return self.base_output

    def affected(self, node: Node) -> list[Node]:
        """``node`` and every node that reads its value, directly or not, in run order."""
        if node not in self._affected:
            found = {node}
            for n in self.nodes[self.position[node] + 1 :]:
                if any(i in found for i in n.all_input_nodes):
                    found.add(n)
            self._affected[node] = [n for n in self.nodes if n in found]
        return self._affected[node]

    def run_from(self, node: Node | None, *args: Any) -> Any:
        """The output when ``node`` and what it affects run again (the rest reused)."""
        if node is None or self.overwritten:
            return self.run(*args)
        nodes = self.affected(node)
        env = dict(self.base)
        changed = set(nodes)
        for n in nodes:
            for inp in n.all_input_nodes:
                if inp not in changed and env[inp] is self.base[inp]:
                    env[inp] = _clone(self.base[inp])  # a later in-place op must not touch it
        self.env = env
        for n in nodes:
            if n.op == "output":
                args_, _ = self.fetch_args_kwargs_from_env(n)
                return args_[0]
            env[n] = self.run_node(n)
        return self.base_output  # the value never reaches the output


def _versions(value: Any) -> Any:
    """The version counters of the tensors in ``value`` (in-place ops bump them; tensors
    made under ``torch.inference_mode`` have none: an in-place op there goes unseen)."""
    if isinstance(value, Tensor):
        return None if value.is_inference() else value._version
    if isinstance(value, (tuple, list)):
        return tuple(_versions(v) for v in value)
    return None


def _clone(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_clone(v) for v in value)
    return value


@contextlib.contextmanager
def _state(gm: GraphModule, mode: str) -> Iterator[None]:
    """The baseline every value is toggled against: all float, or all fake-quantized."""
    context = bypass(gm) if mode == "quantize_one" else float_fake_quant(gm)
    with validation_state(gm), context:
        yield


@contextlib.contextmanager
def _toggled(value: QuantizedValue, mode: str, dtype: QDType | None) -> Iterator[None]:
    fq = value.fake_quant
    saved_bypass = fq.__dict__.get("bypassed")
    saved = (fq.dtype, fq.scale.clone(), fq.offset)
    try:
        if dtype is not None:
            with torch.no_grad():
                # the same range on a finer grid (a symmetric one: the offset is int8's)
                fq.scale.mul_(fq.levels_above_zero / dtype.qmax)
            fq.dtype, fq.offset = dtype, 0
        elif mode == "quantize_one":
            fq.bypassed = False
        else:
            fq.bypassed = True
        yield
    finally:
        if saved_bypass is None:
            fq.__dict__.pop("bypassed", None)
        else:
            fq.bypassed = saved_bypass
        fq.dtype, fq.offset = saved[0], saved[2]
        with torch.no_grad():
            fq.scale.copy_(saved[1])


def sensitivity(
    float_model: nn.Module,
    calib_model: GraphModule,
    inputs: Any,
    metric: str | Callable[[Tensor, Tensor], float] | None = None,
    dtype: QDType | str | None = None,
    mode: str = "quantize_one",
    out_dir: str | Path | None = None,
    show: bool = False,
    top: int = 30,
    kinds: Sequence[str] | None = None,
    input_fn: Callable[[Any], Any] | None = None,
    output_fn: Callable[[Any], Any] | None = None,
) -> list[dict[str, Any]]:
    """The model-output error caused by each quantized value alone, worst first.

    For every quantized value of ``calib_model`` (each activation fake quant and
    each weight fake quant), the model runs with only that value changed against
    a baseline, and its output is compared with ``float_model``'s:

    * ``mode="quantize_one"`` (default): baseline all float, only this value quantized;
      the lowest SQNR is the most sensitive value;
    * ``mode="float_one"``: baseline all quantized, only this value left float; the
      highest SQNR is the value whose quantization costs most;
    * ``dtype=fxq.qint16``: baseline all quantized, only this activation raised to
      ``dtype`` (its range kept, its step ``qmax8 / qmax16`` finer; weights stay int8,
      as on every march): the highest SQNR is where a wider type helps most (the
      base of mixed precision). A wider type cannot undo a clipped range.

    The quantized computation is the training-time float fake-quant arithmetic
    (``float_fake_quant``), which the integer model matches closely; it is fast.

    Cost: per batch, one forward of the float model and one of the baseline
    (every node's value is cached), then for every value a run of its layer and
    of the nodes that read its output, directly or not (the rest comes from the
    cache): on a chain about ``2 + V/2`` forwards per batch for ``V`` quantized
    values, less where a value's branch leaves the others. The convolutions are
    nearly all of it. Memory: the cached values of one batch; pass a list of
    batches to bound it (e.g. 96 crops as 6 batches of 16). Measured with
    ``benchmarks/sensitivity_speed.py`` (two threads, idle two-core machine):
    MobileNetV2, 108 values, 96 crops of 224 pixels in 6 batches of 16: 70 s
    (35 s for the 55 activations alone); on a machine shared with other jobs the
    wall time grows with the load (see ``docs/debugging.md``).

    Args:
        float_model: the float model (its outputs are the reference).
        calib_model: the calibrated (or QAT) model from ``prepare_qat_fx``; its
            fake-quant states and scales are restored after.
        inputs: one batch (a tensor, a tuple whose first elements are the inputs, a
            dict of keyword inputs) or a list (any iterable) of batches
            (``fxq.calibration.data``).
        metric: ``"sqnr"`` (default), ``"cosine"``, ``"mse"``, ``"l1"``, or a callable
            ``(reference, output) -> float`` (higher means better) on the model outputs
            of all batches concatenated (flattened, float64).
        dtype: raise each value to this dtype instead (see above).
        mode: ``"quantize_one"`` or ``"float_one"``.
        out_dir: when given, writes ``sensitivity.txt`` and ``sensitivity.html`` (a bar
            chart of the ``top`` most sensitive values and the table).
        show: print the table.
        top: how many values the bar chart shows.
        kinds: only these kinds of value (``"activation"``, ``"weight"``, ``"input"`` for
            a standalone module's inputs); e.g. ``("activation",)`` halves the cost when
            only activations can change (choosing int16 layers).
        input_fn: maps a batch to the models' arguments.
        output_fn: maps a model's output to the part that is compared (default: all of
            its floating-point tensors), e.g. ``lambda out: out["last_hidden_state"]``
            for a Hugging Face encoder's last hidden state without its pooler output.

    Returns:
        one dict per quantized value, most harmful first: ``rank``, ``name``, ``kind``
        (``"activation"``, ``"weight"``, ``"input0"``...), ``type``, ``dtype``, the metric
        (key ``metric``, e.g. ``"sqnr"``: the model-output measure with only this value
        changed), ``baseline`` (the measure of the baseline), ``seconds`` (total run time,
        on the first row).

    Raises:
        TypeError: ``calib_model`` is not a model from ``prepare_qat_fx`` (a converted,
            integer model included).
        ValueError: an unknown mode or metric, no quantized value, or no batch (``[]``,
            a batch of zero samples).
    """
    if mode not in SENSITIVITY_MODES:
        raise ValueError(f"sensitivity: mode must be one of {SENSITIVITY_MODES}, got {mode!r}")
    if not isinstance(calib_model, GraphModule) or not is_fxq_model(calib_model):
        raise TypeError(
            "sensitivity: calib_model must be the calibrated or QAT model returned by "
            f"fxq.prepare_qat_fx, got {type(calib_model).__name__}"
        )
    require_fake_quant_model(calib_model, "sensitivity", "calib_model")
    batches = one_or_more_batches(inputs, "sensitivity")
    sim = similarity_for(metric or "sqnr")
    target_dtype = as_qdtype(dtype) if dtype is not None else None
    if target_dtype is not None:
        mode = "float_one"  # the baseline is all quantized
    values = quantized_values(calib_model)
    if target_dtype is not None:  # weights are int8 on every march: only activations can widen
        values = [v for v in values if v.kind != "weight"]
    if kinds is not None:
        unknown = set(kinds) - {"activation", "weight", "input"}
        if unknown:
            raise ValueError(
                f"sensitivity: unknown kinds {sorted(unknown)}; use 'activation', 'weight', 'input'"
            )
        values = [v for v in values if v.kind.rstrip("0123456789") in kinds]
    if not values:
        raise ValueError("sensitivity: calib_model has no quantized value")
    start = time.perf_counter()
    reference: list[Tensor] = []
    outputs: list[list[Tensor]] = [[] for _ in values]
    baseline: list[Tensor] = []
    runner = _SuffixRunner(calib_model)
    pick = output_fn if output_fn is not None else (lambda out: out)
    with eval_no_grad(float_model, calib_model), _state(calib_model, mode):
        for batch in batches:
            float_args, float_kwargs = batch_arguments(float_model, batch, input_fn)
            reference.append(_flat(pick(float_model(*float_args, **float_kwargs))))
            args = positional_arguments(calib_model, *batch_arguments(calib_model, batch, input_fn))
            baseline.append(_flat(pick(runner.run_base(*args))))
            for i, value in enumerate(values):
                if target_dtype is not None and value.fake_quant.dtype.bits >= target_dtype.bits:
                    outputs[i].append(baseline[-1])
                    continue
                with _toggled(value, mode, target_dtype):
                    outputs[i].append(_flat(pick(runner.run_from(value.node, *args))))
    ref = torch.cat(reference)
    rows = []
    for value, outs in zip(values, outputs):
        rows.append(
            {
                "name": value.name,
                "kind": value.kind,
                "type": value.type,
                "dtype": value.fake_quant.dtype.name,
                sim.name: sim.fn(ref, torch.cat(outs)),
            }
        )
    base = sim.fn(ref, torch.cat(baseline))
    harmful_first = mode == "quantize_one"

    def key(r: dict[str, Any]) -> float:
        k = sim.worst_first_key(r[sim.name])
        return k if harmful_first else -k

    rows.sort(key=key)
    for i, r in enumerate(rows):
        r["rank"] = i
        r["baseline"] = base
    rows[0]["seconds"] = time.perf_counter() - start
    columns = ["rank", "name", "kind", "type", "dtype", sim.name, "baseline"]
    if show:
        print(text_table(rows, columns))
    if out_dir is not None:
        _write(rows, columns, Path(out_dir), sim, mode, target_dtype, top)
    return rows


def _flat(out: Any) -> Tensor:
    value = flat(out)
    if value is None:
        raise ValueError("sensitivity: the model output holds no floating-point tensor")
    return value.cpu()


def _write(
    rows: list[dict[str, Any]],
    columns: Sequence[str],
    out: Path,
    sim: Similarity,
    mode: str,
    dtype: QDType | None,
    top: int,
) -> None:
    what = {
        "quantize_one": "only this value quantized (the rest float)",
        "float_one": "every value quantized but this one (left float)",
    }[mode]
    if dtype is not None:
        what = f"every value quantized, this one raised to {dtype.name}"
    write_text(
        out / "sensitivity.txt", f"model output {sim.name}: {what}\n" + text_table(rows, columns)
    )
    page = HtmlPage("sensitivity")
    page.paragraph(
        f"Model-output {sim.name} against the float model with {what}; "
        f"baseline {rows[0]['baseline']:.4g}. Most harmful first."
    )
    shown = rows[:top]
    fig = figure(9.0, max(2.5, 0.22 * len(shown) + 1.0))
    ax = fig.add_subplot()
    labels = [f"{r['name']} ({r['kind']})" for r in shown][::-1]
    values = [max(min(float(r[sim.name]), 300.0), -300.0) for r in shown][::-1]
    ax.barh(range(len(shown)), values, color="#cc4444")
    ax.set_yticks(range(len(shown)), labels, fontsize=7)
    ax.set_xlabel(f"model output {sim.name}")
    ax.grid(axis="x", alpha=0.3)
    page.figure(fig, f"the {len(shown)} most harmful values", "sensitivity-bars")
    page.table("sensitivity", columns, rows, marked=set(range(min(5, len(rows)))))
    page.write(out / "sensitivity.html")
