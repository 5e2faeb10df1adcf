"""``get_raw_features`` and ``profile_featuremap``: what each layer's inputs and outputs hold."""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Node

from fxq.calibration.data import one_batch
from fxq.debug.capture import (
    Recorder,
    as_graph,
    eval_no_grad,
    model_inputs,
    node_type,
    output_scale,
    validation_state,
    vendor_argument_ignored,
)
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
    inputs: Any = None,
    prefixes: Sequence[str] | str | None = None,
    types: Sequence[type | str] | None = None,
    float_values: bool = False,
    *,
    example_inputs: Any = None,
    input_fn: Callable[[Any], Any] | None = None,
    device: Any = None,
    preserve_int: bool = False,
    use_class_name: bool = False,
    skip_identity: bool = False,
) -> list[dict[str, Any]]:
    """Every layer's inputs and outputs on ``inputs``, with the scale that quantizes them.

    Args:
        model: a float model, a model from ``prepare_qat_fx`` or from ``convert_fx``
            (layers are the nodes of its graph; a float model is fused first).
        inputs: one batch (``fxq.calibration.data``): a tensor, a tuple whose first
            elements are the positional inputs, or a dict of keyword inputs (the values
            are kept: use a few samples). The vendor plugin's name ``example_inputs=``
            is accepted too.
        prefixes: keep only layers whose node name or module path starts with one of these.
        types: keep only layers whose module is an instance of one of these classes
            (or whose type name is one of these strings, e.g. ``"Conv2d"``).
        float_values: for a QAT model, record the float values (fake quants
            bypassed, no statistics updated) so that ``clipped`` / ``to_zero``
            tell what the scales would do to them; otherwise the values the model
            computes in VALIDATION, on their grids (a model in CALIBRATION or QAT
            state runs in VALIDATION for the call and gets its states back: no
            statistics are updated either way).
        input_fn: maps ``inputs`` to the model's arguments.
        device, preserve_int, use_class_name, skip_identity: the vendor plugin's
            options, accepted and ignored with a warning when set (the model runs where
            it is; ``data`` is always float; ``type`` is the class name; fxq's graphs
            record no identity layers).

    Returns:
        one dict per recorded tensor, in run order: ``layer`` (node name), ``module``,
        ``type``, ``attr`` (``"output"`` or ``"input0"``, ``"input1"``...), ``data``
        (a float tensor; a ``QTensor`` dequantized), ``scale`` (float or None),
        ``dtype`` (``"qint8"``... or the torch dtype), ``qmax``.

    Raises:
        ValueError: no inputs, or inputs with no sample.
    """
    if (inputs is None) == (example_inputs is None):
        raise ValueError(
            "get_raw_features: pass the model's inputs once, as `inputs` (or the vendor "
            "plugin's name `example_inputs`)"
        )
    inputs = example_inputs if inputs is None else inputs
    if not isinstance(float_values, bool):  # the vendor's order: (..., types, device, ...)
        device, float_values = float_values, False
    for name, value, why in (
        ("device", device is not None, "the model runs on the device it is on"),
        ("preserve_int", preserve_int, "`data` is the float value (a QTensor dequantized)"),
        ("use_class_name", use_class_name, "`type` already holds the class name"),
        ("skip_identity", skip_identity, "fxq's graphs hold no identity layers to skip"),
    ):
        if value:
            vendor_argument_ignored("get_raw_features", name, why)
    if isinstance(prefixes, str):
        prefixes = (prefixes,)
    gm = as_graph(model, "model")
    one_batch(inputs, "get_raw_features")
    features: list[dict[str, Any]] = []

    def keep(node: Node) -> bool:
        return _selected(gm, node, prefixes, types)

    context = bypass(gm) if float_values else contextlib.nullcontext()
    with eval_no_grad(gm), validation_state(gm), context:
        recorder = Recorder(gm, keep=keep)
        recorder.run(*model_inputs(gm, inputs, input_fn))
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
    if prefixes:  # None or () (the vendor's default): every layer
        names = (node.name, str(node.target))
        if not any(n.startswith(p) for n in names for p in prefixes):
            return False
    if types:
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
    *,
    file_name: str | None = None,
    with_tensorboard: bool = False,
    tensorboard_dir: str | None = None,
    print_per_channel_scale: bool = False,
    show_per_channel: bool = False,
) -> list[dict[str, Any]]:
    """Statistics of features from ``get_raw_features``, and what their scales do to them.

    Args:
        features: the list ``get_raw_features`` returned.
        out_dir: when given, writes ``statistic.txt`` (run order, then a second table
            sorted by range) and ``statistic.html`` (the tables and one histogram per
            layer output with the quantization range overlaid).
        show: print the tables.
        histograms: draw the histograms in the HTML page.
        file_name: the files' name without extension (default ``"statistic"``).
        with_tensorboard, tensorboard_dir, print_per_channel_scale, show_per_channel: the
            vendor plugin's options, accepted; when set they are ignored with a warning
            (fxq writes no TensorBoard logs: the histograms are in the HTML page, and
            activations have one scale each). The vendor's positional order
            ``(featuremap, with_tensorboard, tensorboard_dir, ...)`` is accepted too: a
            bool where ``out_dir`` stands is ``with_tensorboard``.

    Returns:
        one dict per feature, in run order: ``layer``, ``module``, ``type``, ``attr``,
        ``min``, ``max``, ``mean``, ``std``, ``range`` (``max(|min|, |max|)``), ``scale``,
        ``dtype``, ``clipped`` (fraction of values beyond the largest quantized value,
        ``(qmax + 1/2) * scale``), ``to_zero`` (fraction of non-zero values below half a
        step, which round to 0), ``nan``, ``inf`` (counts); the scale-based fractions
        are None without a scale.
    """
    if isinstance(out_dir, bool):  # the vendor's positional order
        with_tensorboard, out_dir = out_dir, None
        if isinstance(show, str):
            tensorboard_dir, show = show, False
    for name, value, why in (
        (
            "with_tensorboard",
            with_tensorboard,
            "fxq writes no TensorBoard logs; the histograms are in the HTML page (out_dir)",
        ),
        (
            "tensorboard_dir",
            tensorboard_dir is not None,
            "fxq writes no TensorBoard logs; pass out_dir for the HTML page with the histograms",
        ),
        (
            "print_per_channel_scale",
            print_per_channel_scale,
            "activations have one scale each; compare_weights gives the weights' per-channel "
            "scales",
        ),
        ("show_per_channel", show_per_channel, "statistics are per tensor"),
    ):
        if value:
            vendor_argument_ignored("profile_featuremap", name, why)
    stem = file_name or "statistic"
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
        write_text(out / f"{stem}.txt", text)
        _write_html(features, rows, sorted_rows, out, histograms, stem)
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
    stem: str = "statistic",
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
    page.write(out / f"{stem}.html")
