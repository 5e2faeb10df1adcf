"""``compare_weights``: how much each weighted layer loses when its weight is quantized."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fxq.debug.capture import as_graph, is_fxq_model, vendor_argument_ignored
from fxq.debug.metrics import SIMILARITIES, Similarity, cosine, similarity_for, sqnr
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
    *args: Any,
    **options: Any,
) -> list[dict[str, Any]]:
    """Per weighted layer, the float weight against its quantized weight, per output channel.

    The float weight is the float model's, with BatchNorm folded in where the
    quantized model folds it (so a trained QAT weight is compared with where it
    started, and a calibrated one with itself); the quantized weight is the QAT
    model's folded weight rounded with its weight fake quant, or the integer
    model's int8 weight times its per-channel scale. A module called at several
    places shares one weight and gives one row.

    Two argument orders are accepted after the two models:

    * fxq's: ``compare_weights(float_model, qat_or_integer_model, out_dir=None,
      show=False, worst_channels=3, *, similarity_func=None, with_tensorboard=False,
      tensorboard_dir=None)``;
    * the vendor plugin's: ``compare_weights(float_model, qat_quantized_model,
      similarity_func="Cosine", with_tensorboard=False, tensorboard_dir=None,
      out_dir=None)``, recognised by a similarity (a name below or a callable) as the
      third argument; ``show`` and ``worst_channels`` are then keyword-only.

    Any argument may be passed by keyword in either order
    (``compare_weights(m, q, "Cosine", out_dir=d)``).

    Args:
        float_model: the float model.
        qat_or_integer_model: a model from ``prepare_qat_fx`` (calibrated or trained)
            or from ``convert_fx``.
        out_dir: when given, writes ``weight_comparison.txt`` and ``weight_comparison.html``
            (per-channel SQNR of the worst layers).
        show: print the table.
        worst_channels: how many channels ``worst_channels`` names (a positive integer).
        similarity_func: also measure each whole weight with this (``"cosine"``,
            ``"sqnr"``, ``"mse"``, ``"l1"``, ``"max_abs"`` in any case, or a callable
            ``(reference, test) -> float``): the ``similarity`` key of each row.
        with_tensorboard, tensorboard_dir: the vendor plugin's options, accepted; when
            set they are ignored with a warning (fxq writes no TensorBoard logs).

    Returns:
        one dict per weighted layer, worst layer (lowest ``min_channel_sqnr``) first:
        ``layer``, ``type``, ``channels``, ``sqnr`` (dB, whole weight), ``cosine``,
        ``min_channel_sqnr``, ``worst_channels`` (``"3:12.1dB 0:25.3dB"``: channel and
        its SQNR), ``channel_sqnr`` (every channel, a list), ``max_abs``, ``max_lsb``
        (largest error in steps of the channel's scale: at most 0.5 unless the
        weight changed since its scale was set), ``scale_min``, ``scale_max``, and
        ``similarity`` when ``similarity_func`` is given.

    Raises:
        TypeError: ``qat_or_integer_model`` is no fxq model; arguments that fit neither
            order (too many, one given twice, an unknown keyword, or of the wrong type).
        ValueError: no weighted layer in common; an unknown similarity name; a
            ``worst_channels`` below 1; a weight whose scale is not set yet (a layer
            of a prepared model that never ran).
    """
    o = _options(args, options)
    out_dir, show, worst_channels = o["out_dir"], o["show"], o["worst_channels"]
    similarity_func = o["similarity_func"]
    if o["with_tensorboard"]:
        vendor_argument_ignored(
            "compare_weights", "with_tensorboard", "fxq writes no TensorBoard logs; pass out_dir"
        )
    if o["tensorboard_dir"] is not None:
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
    _require_weight_scales(qat_or_integer_model)
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


def _fxq_order(
    out_dir: str | os.PathLike | None = None,
    show: bool = False,
    worst_channels: int = 3,
    *,
    similarity_func: str | Callable[[Any, Any], float] | None = None,
    with_tensorboard: bool = False,
    tensorboard_dir: str | os.PathLike | None = None,
) -> None:
    """fxq's order of ``compare_weights``'s options (a signature to bind, never called)."""


def _vendor_order(
    similarity_func: str | Callable[[Any, Any], float] | None = "Cosine",
    with_tensorboard: bool = False,
    tensorboard_dir: str | os.PathLike | None = None,
    out_dir: str | os.PathLike | None = None,
    *,
    show: bool = False,
    worst_channels: int = 3,
) -> None:
    """The vendor plugin's order (``horizon_plugin_pytorch.utils.quant_profiler``)."""


_ORDER_NAMES = {"fxq": "fxq's order", "vendor": "the vendor plugin's order"}

_ORDERS = {
    "fxq": inspect.signature(_fxq_order),
    "vendor": inspect.signature(_vendor_order),
}

#: similarity names of the vendor plugin that fxq does not compute: still the vendor's
#: order (so the name is refused as a similarity, not made a directory)
_VENDOR_ONLY_SIMILARITIES = ("kl", "atol", "rtol")


def _names_similarity(value: Any) -> bool:
    if isinstance(value, Similarity) or callable(value):
        return True
    return isinstance(value, str) and (
        value.lower() in SIMILARITIES or value.lower() in _VENDOR_ONLY_SIMILARITIES
    )


def _options(args: tuple, options: dict[str, Any]) -> dict[str, Any]:
    """``compare_weights``'s options from either order, checked.

    Raises:
        TypeError: arguments that bind to neither order, or an option of the wrong type.
        ValueError: ``worst_channels`` below 1.
    """
    order = "vendor" if args and _names_similarity(args[0]) else "fxq"
    try:
        bound = _ORDERS[order].bind(*args, **options)
    except TypeError as e:
        raise TypeError(
            f"compare_weights: {e} (read in {_ORDER_NAMES[order]}); pass "
            "(float_model, qat_or_integer_model, out_dir=None, show=False, worst_channels=3, "
            "*, similarity_func=None, with_tensorboard=False, tensorboard_dir=None) or the "
            "vendor plugin's (float_model, qat_quantized_model, similarity_func='Cosine', "
            "with_tensorboard=False, tensorboard_dir=None, out_dir=None)"
        ) from None
    bound.apply_defaults()
    o = dict(bound.arguments)
    for name in ("out_dir", "tensorboard_dir"):
        if o[name] is not None and not isinstance(o[name], (str, os.PathLike)):
            raise TypeError(
                f"compare_weights: {name} must be a path (str or os.PathLike) or None, got "
                f"{type(o[name]).__name__} {o[name]!r}"
            )
    for name in ("show", "with_tensorboard"):
        if not isinstance(o[name], bool):
            raise TypeError(
                f"compare_weights: {name} must be True or False, got {type(o[name]).__name__} "
                f"{o[name]!r}"
            )
    worst = o["worst_channels"]
    if isinstance(worst, bool) or not isinstance(worst, int):
        raise TypeError(
            f"compare_weights: worst_channels must be an int, got {type(worst).__name__} {worst!r}"
        )
    if worst < 1:
        raise ValueError(f"compare_weights: worst_channels must be at least 1, got {worst}")
    sim = o["similarity_func"]
    if sim is not None and not isinstance(sim, str) and not _names_similarity(sim):
        raise TypeError(
            "compare_weights: similarity_func must be a name (cosine, sqnr, mse, l1, max_abs) "
            f"or a callable (reference, test) -> float, got {type(sim).__name__} {sim!r}"
        )
    return o


def _require_weight_scales(model: nn.Module) -> None:
    """Raise when a QAT module's weight fake quant has no scale yet (it is set by the first
    forward in CALIBRATION or QAT state): its rows would measure a placeholder scale."""
    missing = [
        path
        for path, m in model.named_modules()
        if isinstance(m, WeightedQAT)
        and not m.weight_fake_quant.is_fixed_scale
        and not bool(m.weight_fake_quant.observed)
    ]
    if missing:
        shown = ", ".join(repr(p) for p in missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(
            f"compare_weights: the weight of {len(missing)} layer(s) ({shown}) has no scale "
            "yet: the model was prepared but these layers never ran. Calibrate it "
            "(fxq.calibration.calibrate) or train it first"
        )


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
