"""Bias tuning: the biases of a calibrated model trained end to end on the model output.

Learned rounding (``weight_reconstruction``) fits each block to the float
model's block output; what it leaves is an error spread over the whole
network, part of it a shift that no single block sees. ``tune_biases`` trains
only the biases (a BatchNorm's ``beta`` where one is folded in, else the
layer's own bias), with Adam, so that the fake-quantized model's outputs
match the float model's on the calibration batches (the squared error
relative to the float outputs' power, in float fake-quant arithmetic with the
scales frozen). Weights, their rounding and every scale stay as they are;
the integer model takes the new biases at ``convert_fx``, and QAT can go on
from them.

A bias is one number per channel, so the tuning has few parameters to fit
the calibration samples with (tuning the weights the same way lowered the
held-out SQNR). Measured on MobileNetV2 with 10 % int16 activations
(``docs/accuracy_log.md``, fourteenth session): +0.3 to +0.5 dB after learned
rounding, in 4 epochs at ``lr=3e-5``; a learning rate of 1e-3 ruins the
model (the steps are far larger than the shifts to correct).

``ptq(..., tune_biases=True)`` runs it last, with the float outputs it
recorded while calibrating.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from fxq.calibration.auto import _flatten_outputs
from fxq.calibration.data import batch_list
from fxq.calibration.runner import (
    average_over_ranks,
    batch_arguments,
    progress,
    require_calibrated,
    run_batches,
)
from fxq.debug import float_fake_quant
from fxq.fake_quantize import training_rounding
from fxq.qat.weighted import WeightedQAT

__all__ = ["tune_biases", "tuned_biases"]

#: Adam's learning rate and the epochs (MobileNetV2 / EfficientNet-Lite0, 96 crops)
DEFAULT_LR = 3e-5
DEFAULT_EPOCHS = 4


def tuned_biases(model: nn.Module) -> list[nn.Parameter]:
    """The parameters ``tune_biases`` trains: per conv / linear layer, the folded
    BatchNorm's ``beta`` or the layer's bias (none for a layer with neither; a parameter
    shared by call-site copies once)."""
    found: dict[int, nn.Parameter] = {}
    for m in model.modules():
        if not isinstance(m, WeightedQAT):
            continue
        bias = m.bn.bias if m.bn is not None else m.bias
        if isinstance(bias, nn.Parameter):
            found.setdefault(id(bias), bias)
    return list(found.values())


def _error(model: nn.Module, batches: list[Any], targets: list[Tensor], input_fn) -> float:
    """The squared error of the outputs relative to the targets' power, over the batches."""
    with torch.no_grad():
        outs = [
            _flatten_outputs(o)
            for o in run_batches(model, batches, input_fn=input_fn, show_progress=False)
        ]
    for o, t in zip(outs, targets):
        if o.numel() != t.numel():
            raise ValueError(
                f"tune_biases: the float model gives {t.numel()} output values on a batch where "
                f"the model gives {o.numel()}; pass the float model of this model"
            )
    err = sum(
        float((o.float() - t.to(o.device, torch.float32)).pow(2).sum())
        for o, t in zip(outs, targets)
    )
    err = torch.tensor([err, sum(float(t.pow(2).sum()) for t in targets)], dtype=torch.float64)
    average_over_ranks([err])
    return float(err[0] / err[1].clamp(min=1e-30))


def tune_biases(
    model: nn.Module,
    data: Iterable[Any],
    float_model: nn.Module | None = None,
    epochs: int = DEFAULT_EPOCHS,
    lr: float = DEFAULT_LR,
    num_batches: int | None = None,
    input_fn: Callable[[Any], Any] | None = None,
    show_progress: bool | None = None,
    _targets: list[Tensor] | None = None,
) -> dict[str, float]:
    """Train the biases of a calibrated model on its outputs (module docstring).

    Args:
        model: a calibrated model from ``prepare_qat_fx`` (after ``ptq`` or
            ``weight_reconstruction``); its biases change in place.
        data: the calibration batches (as ``fxq.calibration.calibrate`` takes them).
        float_model: the float model whose outputs on ``data`` are the targets.
        epochs: passes over the batches, one Adam step per batch, in a seeded
            random order.
        lr: Adam's learning rate (in the biases' own units).
        num_batches: use only the first batches.
        input_fn: maps a batch to the model's arguments.
        show_progress: draw a progress bar (default: when stderr is a terminal).

    Returns:
        ``{"before": e0, "after": e1}``: the outputs' squared error relative to
        the float outputs' power on the batches, before and after. The tuned
        biases are kept only when ``e1 < e0``; otherwise the model is left as
        it was.

    Raises:
        ValueError: no batch, ``epochs < 1``, ``lr <= 0``, no float model (and no
            targets), or a float model whose outputs differ in size from the model's.
        RuntimeError: when the model is not calibrated.

    A failure part-way (an exception, Ctrl-C) leaves the biases as they were; the
    parameters' gradients and ``requires_grad`` flags are put back either way. In a
    distributed run the gradients are averaged over the ranks, so every rank takes the
    same steps.
    """
    from fxq.calibration.reconstruction import layerwise_session

    batches = batch_list(data, num_batches, "tune_biases", ranks="equal")
    if epochs < 1 or not lr > 0:
        raise ValueError(f"tune_biases: epochs must be >= 1 and lr > 0, got {epochs} and {lr}")
    require_calibrated(model, "tune_biases")
    targets = _targets
    if targets is None:
        if float_model is None:
            raise ValueError("tune_biases: pass the float model (its outputs are the targets)")
        training = float_model.training
        float_model.eval()
        try:
            with torch.no_grad():
                outs = run_batches(float_model, batches, input_fn=input_fn, show_progress=False)
        finally:
            float_model.train(training)
        targets = [_flatten_outputs(o) for o in outs]
    params = tuned_biases(model)
    if not params:
        return {"before": float("nan"), "after": float("nan")}
    flags = {p: p.requires_grad for p in model.parameters()}
    saved = [p.detach().clone() for p in params]
    with layerwise_session(model, copy_reference=False), float_fake_quant(model):
        before = _error(model, batches, targets, input_fn)
        try:
            for p in flags:
                p.requires_grad_(False)
            for p in params:
                p.requires_grad_(True)
            opt = torch.optim.Adam(params, lr=lr)
            generator = torch.Generator().manual_seed(0)
            steps = [
                i for _ in range(epochs) for i in torch.randperm(len(batches), generator=generator)
            ]
            with training_rounding(model):
                for i in progress(steps, len(steps), "bias tuning", show_progress):
                    args, kwargs = batch_arguments(model, batches[int(i)], input_fn)
                    out = _flatten_outputs(model(*args, **kwargs)).float()  # the loss in float32
                    target = targets[int(i)].to(out.device, out.dtype)
                    loss = (out - target).pow(2).mean() / target.pow(2).mean().clamp(min=1e-30)
                    opt.zero_grad()
                    loss.backward()
                    average_over_ranks([p.grad for p in params if p.grad is not None])
                    opt.step()
        finally:
            for p, flag in flags.items():
                p.requires_grad_(flag)
        after = _error(model, batches, targets, input_fn)
        if not after < before:
            with torch.no_grad():
                for p, s in zip(params, saved):
                    p.copy_(s)
            after = before
    return {"before": before, "after": after}
