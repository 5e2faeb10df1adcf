"""``compare_qat_quantized``: the QAT model against its integer model, layer by layer.

``compare_qat_quantized`` runs the QAT model and the converted integer model
on the same inputs and reports, per layer, how many output elements agree
exactly and the largest difference in units of the layer's output scale
(LSB). In VALIDATION state the QAT model computes with the integer kernels,
so every row reads 100%; ``float_fake_quant(qat_model)`` switches that off to
measure how far the float fake-quant computation used in training is from
the integer one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from tabulate import tabulate
from torch import Tensor, nn

from fxq.calibration.data import batch_arguments, one_batch
from fxq.debug.capture import (
    eval_no_grad,
    is_converted,
    require_fake_quant_model,
    snapshot,
    validation_state,
)
from fxq.qat.base import QATModule
from fxq.qtensor import QTensor
from fxq.quantized.base import QuantizedModule

__all__ = ["compare_qat_quantized", "float_fake_quant"]


@contextlib.contextmanager
def float_fake_quant(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, VALIDATION computes in float with fake quantization
    (the training-time arithmetic) instead of with the integer kernels."""
    saved = [
        (m, m.__dict__.get("simulate_integer")) for m in model.modules() if isinstance(m, QATModule)
    ]
    for m, _ in saved:
        m.simulate_integer = False
    try:
        yield model
    finally:  # restore what each module had, so nested blocks unwind correctly
        for m, value in saved:
            if value is None:
                m.__dict__.pop("simulate_integer", None)
            else:
                m.simulate_integer = value


def _capture(model: nn.Module, kind: type, inputs: Any) -> dict[str, list[Any]]:
    outputs: dict[str, list[Any]] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, kind):
            hooks.append(
                module.register_forward_hook(
                    lambda m, i, o, name=name: outputs.setdefault(name, []).append(snapshot(o))
                )
            )
    args, kwargs = batch_arguments(model, inputs)
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return outputs


def compare_qat_quantized(
    qat_model: nn.Module,
    quantized_model: nn.Module,
    inputs: Any,
    show: bool = True,
) -> list[dict[str, Any]]:
    """Compare a QAT model with its converted integer model, layer by layer.

    Args:
        qat_model: the model from ``prepare_qat_fx``; it is put in VALIDATION
            state for the comparison (its state is restored after).
        quantized_model: the model from ``convert_fx`` of it.
        inputs: one batch (``fxq.calibration.data``): a tensor, a tuple whose first
            elements are the inputs, or a dict of keyword inputs.
        show: print the table (tabulate).

    Returns:
        one dict per layer: ``layer``, ``type``, ``exact`` (fraction of output
        elements that agree exactly), ``max_lsb`` (largest difference in
        output steps; for float outputs, the largest absolute difference),
        ``elements``.

    Raises:
        ValueError: ``inputs`` is empty or holds no sample.
        TypeError: ``qat_model`` is no model from ``prepare_qat_fx``, or
            ``quantized_model`` is no model from ``convert_fx``.
    """
    require_fake_quant_model(qat_model, "compare_qat_quantized", "qat_model")
    if not isinstance(quantized_model, nn.Module) or not is_converted(quantized_model):
        raise TypeError(
            "compare_qat_quantized: quantized_model must be the model fxq.convert_fx made "
            f"from qat_model, got {type(quantized_model).__name__}"
        )
    one_batch(inputs, "compare_qat_quantized")
    with eval_no_grad(qat_model), validation_state(qat_model):
        qat_out = _capture(qat_model, QATModule, inputs)
    int_out = _capture(quantized_model, QuantizedModule, inputs)
    rows = []
    for name, outs in int_out.items():
        refs = qat_out.get(name)
        if refs is None:
            continue
        exact = total = 0
        worst = 0.0
        for ref, out in zip(refs, outs):
            e, n, w = _agreement(ref, out)
            exact, total, worst = exact + e, total + n, max(worst, w)
        module = dict(quantized_model.named_modules())[name]
        rows.append(
            {
                "layer": name,
                "type": type(module).__name__,
                "exact": exact / total if total else 1.0,
                "max_lsb": worst,
                "elements": total,
            }
        )
    if show:
        print(
            tabulate(
                [
                    [
                        r["layer"],
                        r["type"],
                        f"{100 * r['exact']:.3f}%",
                        f"{r['max_lsb']:g}",
                        r["elements"],
                    ]
                    for r in rows
                ],
                headers=["layer", "type", "exact match", "max diff (LSB)", "elements"],
            )
        )
    return rows


def _agreement(ref: Tensor, out: Any) -> tuple[int, int, float]:
    if isinstance(out, QTensor):
        q_ref = torch.floor(ref.to(torch.float64) / out.scale.to(torch.float64) + 0.5)
        diff = (q_ref - out.data.to(torch.float64)).abs()
    else:
        diff = (ref.to(torch.float64) - out.to(torch.float64)).abs()
    return int((diff == 0).sum()), diff.numel(), float(diff.max()) if diff.numel() else 0.0
