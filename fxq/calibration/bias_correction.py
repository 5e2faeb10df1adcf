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

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
from tabulate import tabulate
from torch import Tensor, nn

from fxq.calibration.reconstruction import (
    _capture_inputs,
    _correct_bias,
    _expand,
    _layers_in_order,
    _pre_activation,
)
from fxq.calibration.runner import progress, require_calibrated
from fxq.debug import float_fake_quant
from fxq.fake_quantize import FakeQuantState, bypass, set_fake_quantize
from fxq.qat.weighted import WeightedQAT

__all__ = ["bias_correction"]


def _channel_means(layer: WeightedQAT, y: Tensor) -> Tensor:
    axis = layer._channel_shape(y.dim()).index(-1)
    return y.transpose(0, axis).reshape(y.shape[axis], -1).mean(1)


def _quantized_weight(layer: WeightedQAT) -> Tensor:
    w = layer.folded_weight()
    scale = layer.weight_fake_quant.scale.reshape(_expand(w))
    dtype = layer.weight_fake_quant.dtype
    return torch.floor(w / scale + 0.5).clamp(dtype.qmin, dtype.qmax) * scale


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
    states = {m: m.state for m in model.modules() if hasattr(m, "set_fake_quant_state")}
    training = model.training
    biasless = [m for m in model.modules() if isinstance(m, WeightedQAT) and m.bias is None]
    model.eval()
    set_fake_quantize(model, FakeQuantState.VALIDATION)
    reference = copy.deepcopy(model)  # the float model: targets never move
    rows: list[dict[str, Any]] = []
    completed = False
    try:
        layers = _layers_in_order(model, batches[0], input_fn)
        for name, layer in progress(layers, len(layers), "bias correction", show_progress):
            original = reference.get_submodule(name)
            with bypass(reference):
                float_in = _capture_inputs(reference, original, batches, input_fn)
                w0, b0 = original.folded_weight(), original.folded_bias()
                target = torch.stack(
                    [
                        _channel_means(original, _pre_activation(original, t, w0, b0))
                        for t in float_in
                    ]
                ).mean(0)
                rms = float(
                    torch.stack(
                        [_pre_activation(original, t, w0, b0).pow(2).mean() for t in float_in]
                    )
                    .mean()
                    .sqrt()
                )
            with float_fake_quant(model):
                quant_in = _capture_inputs(model, layer, batches, input_fn)
            wq, b = _quantized_weight(layer), layer.folded_bias()
            got = torch.stack(
                [_channel_means(layer, _pre_activation(layer, t, wq, b)) for t in quant_in]
            ).mean(0)
            delta = target - got
            _correct_bias(layer, -delta)
            shift = float(delta.pow(2).mean().sqrt())
            rows.append({"layer": name, "shift": shift, "relative": shift / max(rms, 1e-30)})
        completed = True
    finally:
        if not completed:
            for m in biasless:
                m.bias = None
            model.load_state_dict(reference.state_dict())
        for m, s in states.items():
            m.set_fake_quant_state(s)
        model.train(training)
    if show:
        print(
            tabulate(
                [[r["layer"], r["shift"], r["relative"]] for r in rows],
                headers=["layer", "shift", "relative"],
                floatfmt=".4g",
            )
        )
    return rows
