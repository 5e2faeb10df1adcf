"""``compare_weights``: how much each weighted layer loses when its weight is quantized."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fxq.debug.capture import as_graph, is_fxq_model, vendor_argument_ignored
from fxq.debug.metrics import SIMILARITIES, cosine, similarity_for, sqnr
from fxq.debug.report import HtmlPage, figure, text_table, write_text
from fxq.fake_quantize import fake_quantize_ste
from fxq.fused import Fused
from fxq.qat.weighted import WeightedQAT, batchnorm_factor
from fxq.quantized.base import QuantizedModule

__all__ = ["compare_weights", "WEIGHT_COLUMNS"]

WEIGHT_COLUMNS = (
    "layer",
    "type",
    "channels",
    "sqnr",
    "cosine",
    "min_channel_sqnr",
    "worst_channels",
    "max_abs",
    "max_lsb",
    "scale_min",
    "scale_max",
)


def compare_weights(
    float_model: nn.Module,
    qat_or_integer_model: nn.Module,
    out_dir: str | Path | None = None,
    show: bool = False,
    worst_channels: int = 3,
    *,
    similarity_func: str | Callable[[Any, Any], float] | None = None,
    with_tensorboard: bool = False,
    tensorboard_dir: str | None = None,
) -> list[dict[str, Any]]:
    """Per weighted layer, the float weight against its quantized weight, per output channel.

    The float weight is the float model's, with BatchNorm folded in where the
    quantized model folds it (so a trained QAT weight is compared with where it
    started, and a calibrated one with itself); the quantized weight is the QAT
    model's folded weight rounded with its weight fake quant, or the integer
    model's int8 weight times its per-channel scale. A module called at several
    places shares one weight and gives one row.

    Args:
        float_model: the float model.
        qat_or_integer_model: a model from ``prepare_qat_fx`` (calibrated or trained)
            or from ``convert_fx``.
        out_dir: when given, writes ``weight_comparison.txt`` and ``weight_comparison.html``
            (per-channel SQNR of the worst layers).
        show: print the table.
        worst_channels: how many channels ``worst_channels`` names.
        similarity_func: also measure each whole weight with this (``"cosine"``,
            ``"sqnr"``, ``"mse"``, ``"l1"``, ``"max_abs"`` in any case, or a callable
            ``(reference, test) -> float``): the ``similarity`` key of each row.
        with_tensorboard, tensorboard_dir: the vendor plugin's options, accepted; when
            set they are ignored with a warning (fxq writes no TensorBoard logs).

    The vendor plugin's positional order ``(float_model, qat_quantized_model,
    similarity_func, with_tensorboard, tensorboard_dir, out_dir)`` is accepted too: a
    similarity name or callable where ``out_dir`` stands is ``similarity_func``.

    Returns:
        one dict per weighted layer, worst layer (lowest ``min_channel_sqnr``) first:
        ``layer``, ``type``, ``channels``, ``sqnr`` (dB, whole weight), ``cosine``,
        ``min_channel_sqnr``, ``worst_channels`` (``"3:12.1dB 0:25.3dB"``: channel and
        its SQNR), ``channel_sqnr`` (every channel, a list), ``max_abs``, ``max_lsb``
        (largest error in steps of the channel's scale: at most 0.5 unless the
        weight changed since its scale was set), ``scale_min``, ``scale_max``, and
        ``similarity`` when ``similarity_func`` is given.

    Raises:
        TypeError: ``qat_or_integer_model`` is no fxq model.
        ValueError: no weighted layer in common.
    """
    if callable(out_dir) or (isinstance(out_dir, str) and out_dir.lower() in SIMILARITIES):
        similarity_func, out_dir = out_dir, None  # the vendor's positional order
        with_tensorboard, show = with_tensorboard or bool(show), False
        if isinstance(worst_channels, str):
            tensorboard_dir, worst_channels = worst_channels, 3
    if with_tensorboard:
        vendor_argument_ignored(
            "compare_weights", "with_tensorboard", "fxq writes no TensorBoard logs; pass out_dir"
        )
    if tensorboard_dir is not None:
        vendor_argument_ignored(
            "compare_weights", "tensorboard_dir", "fxq writes no TensorBoard logs; pass out_dir"
        )
    sim = similarity_for(similarity_func) if similarity_func is not None else None
    if not is_fxq_model(qat_or_integer_model):
        raise TypeError(
            "compare_weights: the second model must come from fxq.prepare_qat_fx or "
            f"fxq.convert_fx, got a float {type(qat_or_integer_model).__name__}"
        )
    reference = dict(as_graph(float_model, "float_model").named_modules())
    rows = []
    seen: set[int] = set()
    for path, module in qat_or_integer_model.named_modules():
        got = _quantized_weight(module)
        if got is None or path not in reference:
            continue
        weight, scale = got
        if id(module) in seen:
            continue
        seen.add(id(module))
        ref = _float_weight(reference[path], module)
        if ref is None or ref.shape != weight.shape:
            continue
        rows.append(_row(path, module, ref, weight, scale, worst_channels))
        if sim is not None:
            rows[-1]["similarity"] = sim.fn(ref, weight)
    if not rows:
        raise ValueError(
            "compare_weights: no weighted layer in common; pass the float model and a model "
            "prepared or converted from it"
        )
    rows.sort(key=lambda r: r["min_channel_sqnr"])
    if show:
        print(text_table(rows, WEIGHT_COLUMNS))
    if out_dir is not None:
        _write(rows, Path(out_dir))
    return rows


def _quantized_weight(module: nn.Module) -> tuple[Tensor, Tensor] | None:
    """(quantized weight out-major, per-channel scale) of a QAT or integer weighted module."""
    with torch.no_grad():
        if isinstance(module, WeightedQAT):
            fq = module.weight_fake_quant
            w = module.folded_weight().detach()
            return fake_quantize_ste(w, fq.scale, fq.dtype, fq.rounding, 0), fq.scale.detach()
        if isinstance(module, QuantizedModule) and hasattr(module, "weight_scale"):
            q = module.weight
            if "Transpose" in type(module).__name__:
                q = q.transpose(0, 1)
            scale = module.weight_scale.detach().reshape(-1)
            shape = [-1] + [1] * (q.dim() - 1)
            return q.to(torch.float32) * scale.reshape(shape), scale
    return None


def _float_weight(float_module: nn.Module, quantized: nn.Module) -> Tensor | None:
    """The float weight, BatchNorm folded in, out-major, as the quantized model sees it."""
    op, bn = (
        (float_module.op, float_module.bn)
        if isinstance(float_module, Fused)
        else (float_module, None)
    )
    w = getattr(op, "weight", None)
    if not isinstance(w, Tensor):
        return None
    with torch.no_grad():
        w = w.detach().to(torch.float32)
        if "Transpose" in type(op).__name__:
            w = w.transpose(0, 1)
        if bn is not None:
            w = w * batchnorm_factor(bn).reshape([-1] + [1] * (w.dim() - 1))
    return w


def _row(
    path: str, module: nn.Module, ref: Tensor, test: Tensor, scale: Tensor, worst: int
) -> dict[str, Any]:
    channels = ref.shape[0]
    per_channel = [sqnr(ref[c], test[c]) for c in range(channels)]
    order = sorted(range(channels), key=lambda c: per_channel[c])
    err = (ref - test).abs().reshape(channels, -1)
    lsb = err / scale.reshape(-1, 1).clamp_min(1e-30)
    return {
        "layer": path,
        "type": type(module).__name__,
        "channels": channels,
        "sqnr": sqnr(ref, test),
        "cosine": cosine(ref, test),
        "min_channel_sqnr": per_channel[order[0]],
        "worst_channels": " ".join(f"{c}:{per_channel[c]:.1f}dB" for c in order[:worst]),
        "channel_sqnr": per_channel,
        "max_abs": float(err.max()),
        "max_lsb": float(lsb.max()),
        "scale_min": float(scale.min()),
        "scale_max": float(scale.max()),
    }


def _write(rows: list[dict[str, Any]], out_dir: Path) -> None:
    write_text(out_dir / "weight_comparison.txt", text_table(rows, WEIGHT_COLUMNS))
    page = HtmlPage("weight comparison")
    page.paragraph(
        "Per output channel, the SQNR of the quantized weight against the float weight "
        "(BatchNorm folded); layers sorted by their worst channel."
    )
    fig = figure(9.0, 3.2)
    ax = fig.add_subplot()
    for r in rows[:5]:
        ax.plot(r["channel_sqnr"], "-o", ms=2.5, label=r["layer"])
    ax.set_xlabel("output channel")
    ax.set_ylabel("weight SQNR (dB)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    page.figure(fig, "per-channel weight SQNR of the five worst layers", "weight-sqnr")
    page.table("weights", WEIGHT_COLUMNS, rows, marked={0})
    page.write(out_dir / "weight_comparison.html")
