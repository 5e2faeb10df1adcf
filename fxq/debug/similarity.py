"""``featuremap_similarity``: where do two versions of a model part ways, layer by layer."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from numbers import Real
from pathlib import Path
from typing import Any

from torch import Tensor, nn
from torch.fx import GraphModule, Node
from torch.utils._pytree import tree_flatten

from fxq.calibration.data import one_batch
from fxq.debug.capture import (
    Recorder,
    as_graph,
    eval_no_grad,
    model_inputs,
    node_type,
    output_scale,
    snapshot,
    validation_state,
    vendor_argument_ignored,
)
from fxq.debug.metrics import Similarity, cosine, flat, l1, max_abs, mse, similarity_for, sqnr
from fxq.debug.report import HtmlPage, figure, text_table, write_text
from fxq.quantized.base import Standalone

__all__ = ["featuremap_similarity", "SIMILARITY_COLUMNS"]

#: the columns of ``similarity.txt`` (``similarity`` / ``op_similarity`` use ``similarity_func``)
SIMILARITY_COLUMNS = (
    "index",
    "layer",
    "module",
    "type",
    "similarity",
    "sqnr",
    "cosine",
    "l1",
    "mse",
    "max_abs",
    "max_lsb",
    "scale",
    "op_similarity",
    "op_sqnr",
    "op_max_lsb",
)

_COMPUTING = ("call_module", "call_function", "call_method")


def featuremap_similarity(
    model1: nn.Module,
    model2: nn.Module,
    inputs: Any,
    similarity_func: str | Callable[[Any, Any], float] = "cosine",
    out_dir: str | Path | None = None,
    show: bool = False,
    worst: int = 5,
    *,
    threshold: float | None = None,
    devices: Any = None,
    input_fn: Callable[[Any], Any] | None = None,
) -> list[dict[str, Any]]:
    """Run two versions of a model on the same inputs and compare every layer's output.

    The layers are matched by node name (see ``fxq.debug.capture``), so any two of
    the float model, the calibrated / QAT model and the integer model can be
    compared, in either order; ``model1`` is the reference. A float model is
    compared through its fused graph (``conv+bn+relu`` is one layer, as in the
    quantized models). A calibrated or QAT model is measured as it will be deployed:
    fake quants in CALIBRATION or QAT state (which would compute in float, or record
    the inputs and move their scales) run in VALIDATION for the call and get their
    states back after (``fxq.debug.capture.validation_state``); the tool never changes
    a model's numbers. To compare the training-time float fake quantization with the
    integer computation, compare a ``copy.deepcopy`` of the model inside
    ``fxq.debug.float_fake_quant(copy)`` with the model. Both run in eval mode
    without gradients (their modes are restored).

    A module called at several places gives one row per call (``head.conv``,
    ``head.conv_1``...); ops inserted by prepare (the quantize at the model input,
    the dequantize at its output, quantize / dequantize around float regions) are
    compared with their input's reference; an ``@fx_wrap()`` function is one row.

    Args:
        model1: the reference model (usually the float model).
        model2: the model to check.
        inputs: one batch (``fxq.calibration.data``): a tensor, a tuple whose first
            elements are the positional inputs, or a dict of keyword inputs (a few
            samples are enough; every layer's output of ``model1`` is held in memory).
        similarity_func: the measure of the ``similarity`` and ``op_similarity``
            columns and of the ordering: ``"cosine"`` (vendor default), ``"sqnr"``,
            ``"mse"``, ``"l1"``, ``"max_abs"``, or a callable ``(reference, test) ->
            float`` where higher means more similar.
        out_dir: when given, writes ``similarity.txt`` (in run order),
            ``ordered_op_error_similarity.txt`` (worst own error first) and
            ``similarity.html`` (the SQNR along the depth of the network with the
            worst layers marked, and the table).
        show: print the table.
        worst: how many layers the HTML marks as worst.
        threshold: print the layers whose ``similarity`` is worse than this (below it
            for cosine / SQNR, above it for MSE / L1...), as the vendor plugin does.
        devices: the vendor plugin's device choice; ignored (with a warning): the models
            run where they are.
        input_fn: maps ``inputs`` to the models' arguments.

    The vendor plugin's positional order ``(model1, model2, inputs, similarity_func,
    threshold, devices, out_dir)`` is accepted too: a number where ``out_dir`` stands is
    the threshold.

    Returns:
        one dict per layer of ``model2``, in run order: ``index``, ``layer`` (node
        name), ``module`` (module path, or the function's name), ``type``,
        ``similarity``, ``sqnr`` (dB), ``cosine``, ``l1`` (mean absolute error),
        ``mse``, ``max_abs``, ``max_lsb`` (``max_abs`` in steps of the output
        scale), ``scale`` (``model2``'s output scale, else ``model1``'s), and the
        layer's own error, with ``model1``'s inputs fed to ``model2``'s layer
        (rounded as ``model2`` rounds them): ``op_similarity``, ``op_sqnr``,
        ``op_max_lsb``.

    Raises:
        TypeError: a model is no ``nn.Module`` or an fxq model that is not a GraphModule.
        ValueError: an unknown ``similarity_func``; no layer in common; ``inputs`` with no
            sample; or models of different structure (a layer whose outputs differ in
            shape, named with both shapes).
    """
    if isinstance(worst, (str, os.PathLike)):  # the vendor's order, up to out_dir
        out_dir, threshold, devices, show, worst = worst, out_dir, show, False, 5
    elif isinstance(out_dir, Real) and not isinstance(out_dir, bool):  # ... up to threshold
        threshold, out_dir = out_dir, None
        if not isinstance(show, bool):
            devices, show = show, False
    if devices is not None:
        vendor_argument_ignored(
            "featuremap_similarity", "devices", "the models run on the device they are on"
        )
    sim = similarity_for(similarity_func)
    one_batch(inputs, "featuremap_similarity")
    g1, g2 = as_graph(model1, "model1"), as_graph(model2, "model2")
    with eval_no_grad(g1, g2), validation_state(g1, g2), _Standalone(g1, g2) as standalone:
        first = Recorder(g1)
        first.run(*model_inputs(g1, inputs, input_fn))
        second = Recorder(g2, reference=first)
        second.run(*model_inputs(g2, inputs, input_fn))
        rows = _rows(g1, g2, first, second, sim)
        rows += standalone.rows(sim, len(rows))
    if not rows:
        raise ValueError(
            "featuremap_similarity: the models have no layer in common (layers are matched by "
            "node name); pass a float model and a model prepared or converted from it"
        )
    if show:
        print(text_table(_renamed(rows, sim), _columns(sim)))
    if threshold is not None:
        beyond = [
            r
            for r in rows
            if sim.worst_first_key(r["similarity"]) < sim.worst_first_key(float(threshold))
        ]
        print(
            f"{len(beyond)} layer(s) with {sim.name} worse than {threshold}:\n"
            + text_table(_renamed(beyond, sim), _columns(sim))
        )
    if out_dir is not None:
        write_similarity_files(rows, Path(out_dir), sim, worst)
    return rows


def _shapes(value: Any) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in tree_flatten(value)[0] if isinstance(t, Tensor)]


def _structure_error(layer: str, ref: Any, out: Any) -> ValueError:
    return ValueError(
        f"featuremap_similarity: layer {layer!r} gives output shape(s) {_shapes(ref)} in "
        f"model1 but {_shapes(out)} in model2: the models differ in structure (e.g. in "
        "width), so their layers cannot be compared. Pass a float model and a model prepared "
        "or converted from it"
    )


class _Standalone:
    """Rows for modules that only opaque code calls (inside ``@fx_wrap()`` functions):
    forward hooks on both models' module of the same path, one row per call."""

    def __init__(self, g1: GraphModule, g2: GraphModule) -> None:
        modules1 = dict(g1.named_modules())
        self.pairs = [
            (path, modules1[path], module)
            for path, module in g2.named_modules()
            if (getattr(module, "standalone", False) or isinstance(module, Standalone))
            and path in modules1
        ]
        self.calls: dict[tuple[str, int], list[tuple[tuple, Any]]] = {}
        self.handles: list[Any] = []

    def __enter__(self) -> _Standalone:
        for path, m1, m2 in self.pairs:
            for side, module in ((0, m1), (1, m2)):
                self.handles.append(
                    module.register_forward_hook(
                        lambda m, args, out, key=(path, side): self.calls.setdefault(
                            key, []
                        ).append((snapshot(args), snapshot(out)))
                    )
                )
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()

    def rows(self, sim: Similarity, start: int) -> list[dict[str, Any]]:
        rows = []
        for path, _, m2 in self.pairs:
            ones, twos = self.calls.get((path, 0), []), self.calls.get((path, 1), [])
            for i, ((args1, ref), (_, out)) in enumerate(zip(ones, twos)):
                a, b = flat(ref), flat(out)
                if a is None or b is None:
                    continue
                if a.shape != b.shape:
                    raise _structure_error(path, ref, out)
                try:
                    same = flat(m2(*args1))  # quantizes its own (float) inputs
                except Exception:
                    same = None
                fq = getattr(m2, "activation_post_process", None)
                scale = float(fq.scale) if fq is not None and fq.scale.numel() == 1 else None
                scale = scale or _standalone_scale(m2)
                row = {
                    "index": start + len(rows),
                    "layer": path if len(ones) == 1 else f"{path}#{i}",
                    "module": path,
                    "type": f"{type(m2).__name__}(standalone)",
                    "similarity": sim.fn(a, b),
                    "sqnr": sqnr(a, b),
                    "cosine": cosine(a, b),
                    "l1": l1(a, b),
                    "mse": mse(a, b),
                    "max_abs": max_abs(a, b),
                    "max_lsb": max_abs(a, b) / scale if scale else None,
                    "scale": scale,
                    "op_similarity": None,
                    "op_sqnr": None,
                    "op_max_lsb": None,
                }
                if same is not None and same.shape == a.shape:
                    row["op_similarity"] = sim.fn(a, same)
                    row["op_sqnr"] = sqnr(a, same)
                    row["op_max_lsb"] = max_abs(a, same) / scale if scale else None
                rows.append(row)
        return rows


def _standalone_scale(module: nn.Module) -> float | None:
    inner = getattr(module, "inner", None)
    scale = getattr(inner, "output_scale", None)
    return float(scale) if scale is not None and scale.numel() == 1 else None


def _reference(first: Recorder, second: Recorder, node: Node) -> Any:
    try:
        return second._reference_for(node)
    except KeyError:
        return None


def _rows(
    g1: GraphModule, g2: GraphModule, first: Recorder, second: Recorder, sim: Similarity
) -> list[dict[str, Any]]:
    g1_nodes = {n.name: n for n in g1.graph.nodes}
    rows = []
    for node in g2.graph.nodes:
        if node.op not in _COMPUTING or node.name not in second.values:
            continue
        out = second.values[node.name]
        ref = _reference(first, second, node)
        a, b = flat(ref), flat(out)
        if a is None or b is None:
            continue
        if a.shape != b.shape:
            raise _structure_error(node.name, ref, out)
        scale = output_scale(g2, node, out)
        if scale is None and node.name in g1_nodes:
            scale = output_scale(g1, g1_nodes[node.name], ref)
        worst_abs = max_abs(a, b)
        row = {
            "layer": node.name,
            "module": node.target if node.op == "call_module" else node_type(g2, node),
            "type": node_type(g2, node),
            "similarity": sim.fn(ref, out),
            "sqnr": sqnr(a, b),
            "cosine": cosine(a, b),
            "l1": l1(a, b),
            "mse": mse(a, b),
            "max_abs": worst_abs,
            "max_lsb": worst_abs / scale if scale else None,
            "scale": scale,
            "op_similarity": None,
            "op_sqnr": None,
            "op_max_lsb": None,
        }
        same = second.same_input.get(node.name)
        if same is not None:
            theirs, mine = flat(same[0]), flat(same[1])
            if theirs is not None and mine is not None and theirs.shape == mine.shape:
                row["op_similarity"] = sim.fn(same[0], same[1])
                row["op_sqnr"] = sqnr(theirs, mine)
                row["op_max_lsb"] = max_abs(theirs, mine) / scale if scale else None
        row["index"] = len(rows)
        rows.append(row)
    return rows


def _columns(sim: Similarity) -> list[str]:
    names = {"similarity": sim.name, "op_similarity": f"op_{sim.name}"}
    return [names.get(c, c) for c in SIMILARITY_COLUMNS if c not in (sim.name, f"op_{sim.name}")]


def _renamed(rows: list[dict[str, Any]], sim: Similarity) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        r = dict(r)
        r[sim.name] = r["similarity"]
        r[f"op_{sim.name}"] = r["op_similarity"]
        out.append(r)
    return out


def ordered_by_op_error(rows: list[dict[str, Any]], sim: Similarity) -> list[dict[str, Any]]:
    """Rows sorted by the layer's own error, worst first (rows without one last)."""

    def key(r: dict[str, Any]) -> tuple[int, float]:
        value = r["op_similarity"]
        if value is None:
            return (1, 0.0)
        return (0, sim.worst_first_key(value))

    return sorted(rows, key=key)


def write_similarity_files(
    rows: list[dict[str, Any]], out_dir: Path, sim: Similarity, worst: int = 5
) -> dict[str, Path]:
    """Write ``similarity.txt``, ``ordered_op_error_similarity.txt`` and ``similarity.html``."""
    columns = _columns(sim)
    shown = _renamed(rows, sim)
    ordered = _renamed(ordered_by_op_error(rows, sim), sim)
    files = {
        "similarity.txt": write_text(out_dir / "similarity.txt", text_table(shown, columns)),
        "ordered_op_error_similarity.txt": write_text(
            out_dir / "ordered_op_error_similarity.txt", text_table(ordered, columns)
        ),
    }
    worst_layers = [r["layer"] for r in ordered[:worst] if r["op_similarity"] is not None]
    page = HtmlPage("featuremap similarity")
    page.paragraph(
        f"{len(rows)} layers. The curve is the SQNR of each layer's output along the depth of the "
        "network (the error accumulated so far) and the SQNR of the layer alone, fed the "
        f"reference's inputs; the {len(worst_layers)} layers with the largest own error are marked."
    )
    page.figure(similarity_plot(rows, worst_layers), "SQNR (dB) per layer", "similarity-curve")
    page.heading("Layers by their own error (worst first)")
    page.table("ordered", columns, ordered, marked=set(range(len(worst_layers))))
    page.heading("Layers in run order")
    marked = {i for i, r in enumerate(rows) if r["layer"] in worst_layers}
    page.table("similarity", columns, shown, marked=marked)
    files["similarity.html"] = page.write(out_dir / "similarity.html")
    return files


def _finite(v: Any, cap: float = 150.0) -> float:
    """A plottable value: None and infinities (exact pass-through ops) leave a gap."""
    if v is None or math.isinf(v):
        return float("nan")
    return max(min(float(v), cap), -cap)


def similarity_plot(rows: list[dict[str, Any]], worst_layers: list[str]) -> Any:
    """SQNR along the depth of the network; the worst layers marked and named."""
    fig = figure(9.0, 3.6)
    ax = fig.add_subplot()
    x = [r["index"] for r in rows]
    ax.plot(x, [_finite(r["sqnr"]) for r in rows], "-o", ms=2.5, label="output SQNR (accumulated)")
    ax.plot(
        x, [_finite(r["op_sqnr"]) for r in rows], "-", alpha=0.6, label="layer alone (same input)"
    )
    for r in rows:
        if r["layer"] in worst_layers:
            y = _finite(r["op_sqnr"])
            ax.plot([r["index"]], [y], "rv", ms=7)
            ax.annotate(r["layer"], (r["index"], y), fontsize=7, rotation=30, color="red")
    ax.set_xlabel("layer index (run order)")
    ax.set_ylabel("SQNR (dB)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig
