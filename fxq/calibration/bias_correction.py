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
calls bias correction; ``mode="sequential"``).

``mode="fast"`` (NNCF's "fast bias correction"; ``ptq`` uses it) feeds both
versions of the layer the *float* model's input: the float layer sees it as
it is, the quantized layer sees it quantized by the fake quant that produces
it in the quantized model, and computes with its rounded weights:

    delta[c] = mean( W x + b )[c] - mean( W_q Q(x) + b )[c]

where ``x`` is the layer's mean float input over the calibration samples
(position by position; a conv is linear, so ``W x`` of the mean input is the
mean output). Each layer corrects only the shift its own weight rounding
causes (and the rounding of its mean input), not the accumulated error of the
layers before it nor the clipping of its inputs' tails. One float forward per
batch measures every layer at once. Measured (``docs/accuracy_log.md``): it helps
on a model whose weights round one way (the tests) and on the first blocks of
MobileNetV2, and lowers the logits SQNR of the whole MobileNetV2 (12.80 ->
11.53 dB after ``ptq``'s ranges), as the sequential form did.

The corrected bias lives in the prepared model's own parameters, so the
integer model and a later QAT run start from it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from tabulate import tabulate
from torch import Tensor, nn

from fxq.calibration.data import batch_list
from fxq.calibration.reconstruction import (
    _correct_bias,
    _layers_in_order,
    _pre_activation,
    _Sources,
    layerwise_session,
    rounded_weight,
)
from fxq.calibration.runner import keep_rank0_result, progress, require_calibrated, run_batches
from fxq.fake_quantize import FakeQuantize, bypass, fake_quantize_ste
from fxq.qat.weighted import WeightedQAT

__all__ = ["bias_correction", "BIAS_CORRECTION_MODES"]

BIAS_CORRECTION_MODES = ("fast", "sequential")


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
    mode: str = "sequential",
    skip_depthwise: bool = False,
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
        mode: ``"sequential"`` (each layer on the quantized model's input,
            after the layers before it were corrected) or ``"fast"`` (each
            layer's own shift on the mean float input, one pass); see the
            module docstring.
        skip_depthwise: leave depthwise convolutions' biases as they are
            (``ptq`` does: on MobileNetV2 correcting them costs 0.6-0.8 dB while
            correcting every other layer gains 0.8 dB, ``docs/accuracy_log.md``).

    Returns:
        one row per layer: ``layer`` and the RMS over channels of the
        correction (``shift``) relative to the RMS of the layer's float output
        (``relative``).

    Raises:
        ValueError: when ``data`` yields no batch, or for an unknown mode.
        RuntimeError: when the model is not calibrated.

    Cost: ``"fast"``: one float forward per batch, and two more convolutions
    per layer; ``"sequential"``: on a GraphModule (a model from ``prepare_qat_fx``),
    one forward of the model and one of its float copy per batch, run node by node in
    step with the corrections (MobileNetV2, 96 crops, 2 cores: 9 s, against 206 s
    when each layer re-ran the model up to itself); on other modules, and for layers
    called inside another module's code, two partial forwards per layer and batch.
    A failure part-way restores every weight and bias.
    """
    if mode not in BIAS_CORRECTION_MODES:
        raise ValueError(
            f"bias_correction: unknown mode {mode!r}; choose from {', '.join(BIAS_CORRECTION_MODES)}"
        )
    batches = batch_list(data, num_batches, "bias_correction", ranks="nonempty")
    require_calibrated(model, "bias_correction")
    if mode == "fast":
        rows = fast_bias_correction(model, batches, input_fn, show_progress, skip_depthwise)
    else:
        rows = _sequential(model, batches, input_fn, show_progress, skip_depthwise)
        keep_rank0_result(model)  # the shifts are each rank's own
    if show:
        print(
            tabulate(
                [[r["layer"], r["shift"], r["relative"]] for r in rows],
                headers=["layer", "shift", "relative"],
                floatfmt=".4g",
            )
        )
    return rows


def _quantized_like(fq: FakeQuantize | None, x: Tensor) -> Tensor:
    """``x`` as the fake quant ``fq`` rounds it (``x`` itself without one, or at int32)."""
    if fq is None or fq.is_high_precision:
        return x
    return fake_quantize_ste(x, fq.scale, fq.dtype, fq.rounding, fq.ch_axis, offset=fq.offset)


def _is_depthwise(layer: nn.Module) -> bool:
    groups = getattr(layer, "groups", 1)
    return groups > 1 and groups == getattr(layer, "in_channels", 0)


def _corrected_layers(model, batch, input_fn, skip_depthwise: bool):
    layers = _layers_in_order(model, batch, input_fn)
    return [(n, m) for n, m in layers if not (skip_depthwise and _is_depthwise(m))]


@contextlib.contextmanager
def recording_input_means(model: nn.Module) -> Iterator[dict[int, _InputMean]]:
    """Within the block, every weighted layer's mean float input is recorded as the model
    runs (keyed by ``id(layer)``), for ``fast_bias_correction``.

    ``ptq`` records them while it calibrates: calibration passes every activation through
    as float, so the layers see the float model's inputs, and the correction needs no
    forward pass of its own.
    """
    layers = [m for m in model.modules() if isinstance(m, WeightedQAT) and not m.standalone]
    means = {id(layer): _InputMean(layer._out_axis) for layer in layers}
    hooks = [
        layer.register_forward_pre_hook(lambda m, inputs: means[id(m)].add(inputs[0]))
        for layer in layers
    ]
    try:
        yield means
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def fast_bias_correction(
    model: nn.Module,
    batches: list[Any],
    input_fn=None,
    show_progress: bool | None = None,
    skip_depthwise: bool = False,
    means: dict[int, _InputMean] | None = None,
) -> list[dict[str, Any]]:
    """``bias_correction(mode="fast")`` on a calibrated model, from the mean inputs
    ``recording_input_means`` gave when ``means`` is passed (else one float pass over
    ``batches`` measures them); rank 0's result on every rank."""
    with layerwise_session(model, copy_reference=False):
        rows = _fast(model, batches, input_fn, show_progress, skip_depthwise, means)
    keep_rank0_result(model)  # the shifts are each rank's own
    return rows


def _fast(
    model: nn.Module,
    batches: list[Any],
    input_fn,
    show_progress,
    skip_depthwise: bool,
    means: dict[int, _InputMean] | None = None,
) -> list[dict[str, Any]]:
    layers = _corrected_layers(model, batches[0], input_fn, skip_depthwise)
    if means is None:
        with recording_input_means(model) as means, bypass(model):
            run_batches(model, batches, None, input_fn, "fast bias correction", show_progress)
    rows = []
    for name, layer in layers:
        x = means[id(layer)].value()
        if x is None:
            continue
        fq = layer.input_quant[0] if layer.standalone else (layer.input_quants or (None,))[0]
        w, b = layer.folded_weight(), layer.folded_bias()
        y_float = layer.float_op_forward(x, layer.weight_from_out_major(w), b)
        y_quant = layer.float_op_forward(
            _quantized_like(fq, x), layer.weight_from_out_major(rounded_weight(layer, w)), b
        )
        delta = _channel_means(layer, y_float - y_quant)
        _correct_bias(layer, -delta)
        shift = float(delta.pow(2).mean().sqrt())
        rms = float(y_float.pow(2).mean().sqrt())
        rows.append({"layer": name, "shift": shift, "relative": shift / max(rms, 1e-30)})
    return rows


class _InputMean:
    """The mean input of a layer over the samples (dim 0), position by position; over the
    positions too (per channel: ``axis``, 1 for a conv, -1 for a linear) when the batches
    differ in shape (images of other sizes, padded sequences of other lengths)."""

    def __init__(self, axis: int = 1) -> None:
        self.axis = axis
        self.total: Tensor | None = None
        self.count = 0
        self.spatial = False

    def add(self, x: Tensor) -> None:
        x = x.detach()
        if self.spatial or (self.total is not None and self.total.shape[1:] != x.shape[1:]):
            x = self._collapse(x.to(torch.float64))
            if not self.spatial:
                self.total, self.spatial = self._collapse(self.total) * 1.0, True
        # the batch summed in x's dtype (14x faster than in float64 for a float32 conv
        # input), the batches accumulated in float64; value() returns float32
        part = x.sum(0, keepdim=True).to(torch.float64)
        self.total = part if self.total is None else self.total + part
        self.count += x.shape[0]

    def scale_channels(self, k: Tensor) -> None:
        """Multiply the recorded mean of every channel (``axis``) by ``k`` (an equalization
        that scaled this layer's input after it was recorded)."""
        if self.total is None:
            return
        shape = [1] * self.total.dim()
        shape[self.axis % self.total.dim()] = -1
        self.total = self.total * k.to(self.total.device, torch.float64).reshape(shape)

    def _collapse(self, x: Tensor) -> Tensor:
        channel = self.axis % x.dim()
        dims = tuple(d for d in range(1, x.dim()) if d != channel)
        return x.mean(dims, keepdim=True) if dims else x

    def value(self) -> Tensor | None:
        if self.total is None or self.count == 0:
            return None
        return (self.total / self.count).to(torch.float32)


def _sequential(model, batches, input_fn, show_progress, skip_depthwise) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with layerwise_session(model) as reference:
        layers = _corrected_layers(model, batches[0], input_fn, skip_depthwise)
        # a GraphModule and its reference each run once, node by node, in step with the
        # corrections, instead of a partial forward per layer; other models re-run up to
        # each layer
        sources = _Sources(model, reference, batches, input_fn, layers)
        for name, layer in progress(layers, len(layers), "bias correction", show_progress):
            original = reference.get_submodule(name)
            float_in = sources.reference_inputs(name)
            with bypass(reference):
                w0, b0 = original.folded_weight(), original.folded_bias()
                outputs = [_pre_activation(original, t, w0, b0) for t in float_in]
                target = torch.stack([_channel_means(original, y) for y in outputs]).mean(0)
                rms = float(torch.stack([y.pow(2).mean() for y in outputs]).mean().sqrt())
                del outputs, float_in
            quant_in = sources.layer_inputs(name, layer)
            wq, b = rounded_weight(layer), layer.folded_bias()
            got = torch.stack(
                [_channel_means(layer, _pre_activation(layer, t, wq, b)) for t in quant_in]
            ).mean(0)
            delta = target - got
            _correct_bias(layer, -delta)
            shift = float(delta.pow(2).mean().sqrt())
            rows.append({"layer": name, "shift": shift, "relative": shift / max(rms, 1e-30)})
    return rows
