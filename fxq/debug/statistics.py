"""``get_raw_features`` and ``profile_featuremap``: what each layer's inputs and outputs hold."""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Node

from fxq.debug.capture import Recorder, as_graph, as_inputs, eval_no_grad, node_type, output_scale
from fxq.debug.metrics import flat
from fxq.debug.report import HtmlPage, figure, text_table, write_text
from fxq.dtypes import qint8
from fxq.fake_quantize import FakeQuantize, bypass
from fxq.qat.base import QATModule
from fxq.qtensor import QTensor

__all__ = ["get_raw_features", "profile_featuremap", "STATISTIC_COLUMNS"]

STATISTIC_COLUMNS = (
    "layer",
    "attr",
    "type",
    "min",
    "max",
    "mean",
    "std",
    "scale",
    "dtype",
    "clipped",
    "to_zero",
    "nan",
    "inf",
)


def get_raw_features(
    model: nn.Module,
    inputs: Any,
    prefixes: Sequence[str] | str | None = None,
    types: Sequence[type | str] | None = None,
    float_values: bool = False,
) -> list[dict[str, Any]]:
    """Every layer's inputs and outputs on ``inputs``, with the scale that quantizes them.

    Args:
        model: a float model, a model from ``prepare_qat_fx`` or from ``convert_fx``
            (layers are the nodes of its graph; a float model is fused first).
        inputs: one input or a tuple of positional inputs (the values are kept:
            use a few samples).
        prefixes: keep only layers whose node name or module path starts with one of these.
        types: keep only layers whose module is an instance of one of these classes
            (or whose type name is one of these strings, e.g. ``"Conv2d"``).
        float_values: for a QAT model, record the float values (fake quants
            bypassed, no statistics updated) so that ``clipped`` / ``to_zero``
            tell what the scales would do to them; otherwise the model runs as
            it is (in VALIDATION its outputs already lie on their grids).

    Returns:
        one dict per recorded tensor, in run order: ``layer`` (node name), ``module``,
        ``type``, ``attr`` (``"output"`` or ``"input0"``, ``"input1"``...), ``data``
        (a float tensor; a ``QTensor`` dequantized), ``scale`` (float or None),
        ``dtype`` (``"qint8"``... or the torch dtype), ``qmax``.
    """
    if isinstance(prefixes, str):
        prefixes = (prefixes,)
    gm = as_graph(model, "model")
    inputs = as_inputs(inputs)
    features: list[dict[str, Any]] = []

    def keep(node: Node) -> bool:
        return _selected(gm, node, prefixes, types)

    context = bypass(gm) if float_values else contextlib.nullcontext()
    with eval_no_grad(gm), context:
        recorder = Recorder(gm, keep=keep)
        recorder.run(*inputs)
    for node in gm.graph.nodes:
        if node.name not in recorder.values or node.op == "placeholder":
            continue
        features += _node_features(gm, node, recorder)
    return features


def _selected(
    gm: GraphModule, node: Node, prefixes: Sequence[str] | None, types: Sequence[Any] | None
) -> bool:
    if node.op not in ("call_module", "call_function", "call_method"):
        return True
    if prefixes is not None:
        names = (node.name, str(node.target))
        if not any(n.startswith(p) for n in names for p in prefixes):
            return False
    if types is not None:
        module = gm.get_submodule(node.target) if node.op == "call_module" else None
        kind = node_type(gm, node)
        ok = False
        for t in types:
            if isinstance(t, str):
                ok |= kind.split("(")[0] == t
            elif module is not None:
                ok |= isinstance(module, t)
        if not ok:
            return False
    return True


def _dtype_of(value: Any, fq: FakeQuantize | None) -> tuple[str, int | None]:
    # the largest level: an unsigned range stored shifted reaches qmax + offset
    if isinstance(value, QTensor):
        return value.dtype.name, value.dtype.qmax + value.offset
    if fq is not None and not fq.is_high_precision:
        return fq.dtype.name, fq.levels_above_zero
    if isinstance(value, Tensor):
        return str(value.dtype).replace("torch.", ""), None
    return type(value).__name__, None


def _node_features(gm: GraphModule, node: Node, recorder: Recorder) -> list[dict[str, Any]]:
    module = gm.get_submodule(node.target) if node.op == "call_module" else None
    kind = node_type(gm, node)
    name = node.target if node.op == "call_module" else kind
    out = []
    in_quants = module.input_quants if isinstance(module, QATModule) else ()
    for i, arg in enumerate(node.all_input_nodes):
        value = recorder.values.get(arg.name)
        data = flat(value)
        if data is None:
            continue
        fq = in_quants[i] if i < len(in_quants) else None
        scale = _fq_scale(fq)
        if isinstance(value, QTensor) and value.scale.numel() == 1:
            scale = float(value.scale)
        dtype, qmax = _dtype_of(value, fq)
        out.append(_feature(node, name, kind, f"input{i}", value, scale, dtype, qmax))
    value = recorder.values[node.name]
    if flat(value) is not None:
        fq = getattr(module, "activation_post_process", None)
        fq = fq if isinstance(fq, FakeQuantize) else None
        dtype, qmax = _dtype_of(value, fq)
        scale = output_scale(gm, node, value)
        out.append(_feature(node, name, kind, "output", value, scale, dtype, qmax))
    return out


def _fq_scale(fq: FakeQuantize | None) -> float | None:
    if fq is None or fq.is_high_precision or fq.scale.numel() != 1:
        return None
    if not (fq.is_fixed_scale or bool(fq.observed)):
        return None
    return float(fq.scale)


def _feature(
    node: Node, module: Any, kind: str, attr: str, value: Any, scale: Any, dtype: str, qmax: Any
) -> dict[str, Any]:
    data = flat(value)
    return {
        "layer": node.name,
        "module": str(module),
        "type": kind,
        "attr": attr,
        "data": data.to(torch.float32),
        "scale": scale,
        "dtype": dtype,
        "qmax": qmax if scale is not None else None,
    }


def profile_featuremap(
    features: Sequence[dict[str, Any]],
    out_dir: str | Path | None = None,
    show: bool = False,
    histograms: bool = True,
) -> list[dict[str, Any]]:
    """Statistics of features from ``get_raw_features``, and what their scales do to them.

    Args:
        features: the list ``get_raw_features`` returned.
        out_dir: when given, writes ``statistic.txt`` (run order, then a second table
            sorted by range) and ``statistic.html`` (the tables and one histogram per
            layer output with the quantization range overlaid).
        show: print the tables.
        histograms: draw the histograms in the HTML page.

    Returns:
        one dict per feature, in run order: ``layer``, ``module``, ``type``, ``attr``,
        ``min``, ``max``, ``mean``, ``std``, ``range`` (``max(|min|, |max|)``), ``scale``,
        ``dtype``, ``clipped`` (fraction of values beyond the largest quantized value,
        ``(qmax + 1/2) * scale``), ``to_zero`` (fraction of non-zero values below half a
        step, which round to 0), ``nan``, ``inf`` (counts); the scale-based fractions
        are None without a scale.
    """
    rows = [_statistics(f) for f in features]
    sorted_rows = sorted(rows, key=lambda r: -r["range"] if r["range"] == r["range"] else 0)
    text = (
        text_table(rows, STATISTIC_COLUMNS)
        + "\n\nsorted by range (largest first):\n"
        + text_table(sorted_rows, STATISTIC_COLUMNS)
    )
    if show:
        print(text)
    if out_dir is not None:
        out = Path(out_dir)
        write_text(out / "statistic.txt", text)
        _write_html(features, rows, sorted_rows, out, histograms)
    return rows


def _statistics(f: dict[str, Any]) -> dict[str, Any]:
    data: Tensor = f["data"].to(torch.float64)
    finite = data[torch.isfinite(data)]
    row = {k: f[k] for k in ("layer", "module", "type", "attr", "scale", "dtype")}
    row["nan"] = int(torch.isnan(data).sum())
    row["inf"] = int(torch.isinf(data).sum())
    if finite.numel():
        lo, hi = float(finite.min()), float(finite.max())
        row.update(
            min=lo,
            max=hi,
            mean=float(finite.mean()),
            std=float(finite.std()) if finite.numel() > 1 else 0.0,
            range=max(abs(lo), abs(hi)),
        )
    else:
        row.update(min=None, max=None, mean=None, std=None, range=math.nan)
    scale, qmax = f["scale"], f.get("qmax") or qint8.qmax
    if scale and data.numel():
        row["clipped"] = float((data.abs() > (qmax + 0.5) * scale).double().mean())
        small = (data.abs() < 0.5 * scale) & (data != 0)
        row["to_zero"] = float(small.double().mean())
    else:
        row["clipped"] = row["to_zero"] = None
    return row


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text)


def _histogram(feature: dict[str, Any]) -> Any:
    data = feature["data"]
    data = data[torch.isfinite(data)]
    fig = figure(4.2, 2.4)
    ax = fig.add_subplot()
    if data.numel():
        lo, hi = float(data.min()), float(data.max())
        if hi <= lo:
            lo, hi = lo - 0.5, hi + 0.5
        counts = torch.histc(data.to(torch.float64), 80, lo, hi)
        edges = torch.linspace(lo, hi, 81, dtype=torch.float64)
        ax.stairs(counts.numpy(), edges.numpy(), fill=True, color="#4477aa")
        ax.set_yscale("log")
    scale, qmax = feature["scale"], feature.get("qmax")
    if scale and qmax:
        limit = qmax * scale
        for x in (-limit, limit):
            ax.axvline(x, color="red", ls="--", lw=1)
        ax.axvspan(-limit, limit, color="red", alpha=0.06)
    ax.set_title(f"{feature['layer']} ({feature['attr']})", fontsize=8)
    ax.tick_params(labelsize=7)
    return fig


def _write_html(
    features: Sequence[dict[str, Any]],
    rows: list[dict[str, Any]],
    sorted_rows: list[dict[str, Any]],
    out: Path,
    histograms: bool,
) -> None:
    page = HtmlPage("feature map statistics")
    page.paragraph(
        "clipped: fraction of values beyond the largest quantized value; to_zero: fraction "
        "of non-zero values that round to 0. Histograms (log counts) show each layer's output "
        "with the quantization range [-qmax*scale, qmax*scale] in red."
    )
    page.heading("Run order")
    page.table("statistic", STATISTIC_COLUMNS, rows)
    page.heading("Sorted by range")
    page.table("sorted", STATISTIC_COLUMNS, sorted_rows)
    if histograms:
        page.heading("Histograms")
        for f in features:
            if f["attr"] == "output":
                page.figure(_histogram(f), f"{f['layer']} output", f"hist-{_slug(f['layer'])}")
    page.write(out / "statistic.html")
