"""Empirical bias correction: make each layer's mean output match the float model's.

After calibration, a quantized layer's output is shifted on average: its
weights are rounded and its input carries the rounding of every layer before
it. Layer by layer, in the order the model runs them, ``bias_correction``
measures per output channel

    delta[c] = mean( float layer on the float model's input )[c]
             - mean( quantized layer on the quantized model's input )[c]

(both before the activation) on the calibration batches, and adds ``delta``
to the layer's (BatchNorm-folded) bias. Each correction is in place before
the next layer is measured, so later layers see corrected inputs (what NNCF
calls bias correction; its "fast" variant uses the float input for both).
The corrected bias lives in the prepared model's own parameters, so the
integer model and a later QAT run start from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from tabulate import tabulate
from torch import Tensor, nn

from fxq.calibration.reconstruction import (
    _capture_inputs,
    _correct_bias,
    _layers_in_order,
    _pre_activation,
    layerwise_session,
    rounded_weight,
)
from fxq.calibration.runner import progress, require_calibrated
from fxq.debug import float_fake_quant
from fxq.fake_quantize import bypass
from fxq.qat.weighted import WeightedQAT

__all__ = ["bias_correction"]


def _channel_means(layer: WeightedQAT, y: Tensor) -> Tensor:
    axis = layer._channel_shape(y.dim()).index(-1)
    return y.transpose(0, axis).reshape(y.shape[axis], -1).mean(1)


@torch.no_grad()
def bias_correction(
    model: nn.Module,
    data: Iterable[Any],
    num_batches: int | None = None,
    input_fn: Callable[[Any], Any] | None = None,
    show_progress: bool | None = None,
    show: bool = False,
) -> list[dict[str, Any]]:
    """Correct every weighted layer's bias for the mean shift quantization causes.

    Args:
        model: a calibrated model from ``prepare_qat_fx``; modified in place
            (the BatchNorm bias, or the layer's bias, which is created when
            the layer had none), keeping its prepared form.
        data: calibration batches (see ``fxq.calibration.calibrate``).
        num_batches: how many batches to measure on (all by default).
        input_fn: maps a batch to the model's arguments.
        show_progress: draw a progress bar (default: when stderr is a terminal).
        show: print the table of corrections.

    Returns:
        one row per layer: ``layer`` and the RMS over channels of the
        correction (``shift``) relative to the RMS of the layer's float output
        (``relative``).

    Raises:
        ValueError: when ``data`` yields no batch.
        RuntimeError: when the model is not calibrated.

    Cost: two partial forwards per layer and batch (each stops at the layer).
    A failure part-way restores every weight and bias.
    """
    batches = list(data) if num_batches is None else [b for _, b in zip(range(num_batches), data)]
    if not batches:
        raise ValueError("bias_correction: `data` yielded no batch; pass calibration batches")
    require_calibrated(model, "bias_correction")
    rows: list[dict[str, Any]] = []
    with layerwise_session(model) as reference:
        layers = _layers_in_order(model, batches[0], input_fn)
        for name, layer in progress(layers, len(layers), "bias correction", show_progress):
            original = reference.get_submodule(name)
            with bypass(reference):
                float_in = _capture_inputs(reference, original, batches, input_fn)
                w0, b0 = original.folded_weight(), original.folded_bias()
                outputs = [_pre_activation(original, t, w0, b0) for t in float_in]
                target = torch.stack([_channel_means(original, y) for y in outputs]).mean(0)
                rms = float(torch.stack([y.pow(2).mean() for y in outputs]).mean().sqrt())
                del outputs
            with float_fake_quant(model):
                quant_in = _capture_inputs(model, layer, batches, input_fn)
            wq, b = rounded_weight(layer), layer.folded_bias()
            got = torch.stack(
                [_channel_means(layer, _pre_activation(layer, t, wq, b)) for t in quant_in]
            ).mean(0)
            delta = target - got
            _correct_bias(layer, -delta)
            shift = float(delta.pow(2).mean().sqrt())
            rows.append({"layer": name, "shift": shift, "relative": shift / max(rms, 1e-30)})
    if show:
        print(
            tabulate(
                [[r["layer"], r["shift"], r["relative"]] for r in rows],
                headers=["layer", "shift", "relative"],
                floatfmt=".4g",
            )
        )
    return rows
