"""Cross-layer equalization of the activations that feed depthwise convolutions.

A depthwise convolution computes each output channel from one input channel,
so a per-channel factor on its input can be moved into its weights:

    dw(x)[c] = w[c] * x[c] = (w[c] / k[c]) * (k[c] * x[c])

and the producer of ``x`` (a conv, with or without BatchNorm and ReLU /
ReLU6) can emit ``k[c] * x[c]`` by scaling its output channel ``c`` (the
BatchNorm's ``gamma`` and ``beta``, or the weight and bias). Weights are
quantized per output channel, so neither layer's weight rounding changes; what
changes is the *activation* between them, which is quantized per tensor. In
MobileNet-style blocks the channels of that activation have very different
ranges (on MobileNetV2 some channels peak at 0.05 while the tensor's range is
6), so a per-tensor int8 scale leaves the small channels a handful of levels.
``equalize_depthwise`` picks ``k[c] = R / max_c`` (``max_c`` the channel's
largest magnitude over the calibration data in float, ``R`` the largest over
channels; ``k`` capped at ``max_gain``), so every channel spans the whole
int8 range: the effect of per-channel activation scales (what NNCF uses on
depthwise inputs), with per-tensor integer arithmetic and no new op.

ReLU6 stays exact on the calibration data: a channel is only amplified when
its largest value ``max_c`` is below ``R <= 6``, so ``k[c] * relu6(z) =
relu6(k[c] * z)`` wherever ``z <= max_c``; beyond the calibration range the
equalized ReLU6 clips at ``R / k[c] = max_c`` in the original units, where
per-tensor int8 quantization of the same channel would saturate anyway.

The change lives in the prepared model's parameters (QAT continues from it;
``convert_fx`` needs nothing new). ``ptq`` runs it before calibrating
(``equalize=True``). Measured on MobileNetV2: ``docs/accuracy_log.md``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import GraphModule

from fxq.calibration.data import batch_list
from fxq.calibration.runner import float_pass_with_hooks, keep_rank0_result
from fxq.observer import MinMaxObserver, world_size
from fxq.qat.weighted import WeightedQAT, _Conv

__all__ = ["equalize_depthwise", "EqualizedPair", "depthwise_pairs"]

_SAFE_ACTIVATIONS = (None, "relu", "relu6")


@dataclass
class EqualizedPair:
    """One producer -> depthwise conv pair and the gains applied to its channels."""

    producer: str
    consumer: str
    min_gain: float
    max_gain: float
    #: channels whose gain hit ``max_gain``
    capped: int


def _is_depthwise(m: nn.Module) -> bool:
    return (
        isinstance(m, _Conv)
        and m.groups == m.in_channels > 1
        and m.out_channels % m.in_channels == 0
        and m.weight.shape[1] == 1
    )


def _can_scale_output(m: nn.Module) -> bool:
    if not isinstance(m, _Conv) or m.add or m.activation not in _SAFE_ACTIVATIONS:
        return False
    if m.bn is not None:
        return m.bn.weight is not None and m.bn.bias is not None
    return True


def depthwise_pairs(model: GraphModule) -> list[tuple[str, str]]:
    """``(producer, depthwise consumer)`` module names that ``equalize_depthwise`` can scale.

    The producer is a (fused) conv without a residual add whose activation is
    none, ReLU or ReLU6, called once, and whose output goes only to depthwise
    convs (each called once); neither shares its weight with another module (a
    module called at several places is copied per call site, the copies sharing
    the weight and BatchNorm that the scaling would change for all of them).
    """
    if not isinstance(model, GraphModule):
        return []
    # call-site copies of a module called several times share its weight (and BatchNorm):
    # scaling one copy would scale the others' outputs too
    owners: dict[int, int] = {}
    for m in model.modules():
        if isinstance(m, WeightedQAT):
            owners[id(m.weight)] = owners.get(id(m.weight), 0) + 1

    def shared(m: nn.Module) -> bool:
        return owners.get(id(m.weight), 0) > 1

    calls: dict[str, int] = {}
    for node in model.graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    pairs = []
    for node in model.graph.nodes:
        if node.op != "call_module" or calls[node.target] != 1:
            continue
        producer = model.get_submodule(node.target)
        if not _can_scale_output(producer) or not node.users or shared(producer):
            continue
        consumers = []
        for user in node.users:
            ok = (
                user.op == "call_module"
                and calls.get(user.target) == 1
                and user.args[:1] == (node,)
                and node not in user.args[1:]
                and node not in user.kwargs.values()
                and _is_depthwise(model.get_submodule(user.target))
                and not shared(model.get_submodule(user.target))
            )
            if not ok:
                break
            consumers.append(user.target)
        else:
            pairs.extend((node.target, c) for c in consumers)
    return pairs


def _channel_max(batches: list[Any], model: nn.Module, modules: dict[str, nn.Module], input_fn):
    """Per output channel, the largest |value| each module gives over the batches (float)."""
    found: dict[str, Tensor] = {}

    def hook_for(name: str):
        def hook(_mod, _inp, out):
            dims = [d for d in range(out.dim()) if d != 1]
            peak = out.detach().abs().amax(dim=dims).float()
            found[name] = peak if name not in found else torch.maximum(found[name], peak)

        return hook

    float_pass_with_hooks(model, {m: hook_for(n) for n, m in modules.items()}, batches, input_fn)
    return found


@torch.no_grad()
def _scale_output_channels(m: _Conv, k: Tensor) -> None:
    if m.bn is not None:
        m.bn.weight.mul_(k.to(m.bn.weight.dtype))
        m.bn.bias.mul_(k.to(m.bn.bias.dtype))
    else:
        m.weight.mul_(k.to(m.weight.dtype).reshape([-1] + [1] * (m.weight.dim() - 1)))
        if m.bias is not None:
            m.bias.mul_(k.to(m.bias.dtype))


@torch.no_grad()
def _scale_depthwise_inputs(m: _Conv, k: Tensor) -> None:
    per_input = k.repeat_interleave(m.out_channels // m.in_channels)
    m.weight.div_(per_input.to(m.weight.dtype).reshape([-1] + [1] * (m.weight.dim() - 1)))


def equalize_depthwise(
    model: nn.Module,
    data: Iterable[Any],
    max_gain: float = 32.0,
    num_batches: int | None = None,
    input_fn: Callable[[Any], Any] | None = None,
) -> list[EqualizedPair]:
    """Equalize, channel by channel, the activations that feed depthwise convs (module doc).

    Args:
        model: a model from ``prepare_qat_fx``; changed in place. Run it before
            calibration (the producers' activation ranges change; their
            observers are reset).
        data: batches to measure the float channel ranges on (the calibration
            batches).
        max_gain: the largest factor a channel is scaled by (channels that are
            almost always zero are not blown up).
        num_batches: use only the first batches.
        input_fn: maps a batch to the model's arguments.

    Returns:
        one ``EqualizedPair`` per producer / consumer pair that was scaled.
    """
    if max_gain < 1:
        raise ValueError(f"equalize_depthwise: max_gain must be >= 1, got {max_gain}")
    pairs = depthwise_pairs(model)
    if not pairs:
        return []
    batches = batch_list(data, num_batches, "equalize_depthwise", ranks="nonempty")
    producers = {p: model.get_submodule(p) for p, _ in pairs}
    peaks = _channel_max(batches, model, producers, input_fn)
    report, _ = _equalize(model, pairs, peaks, max_gain)
    keep_rank0_result(model)  # the peaks are each rank's own
    return report


def _equalize(
    model: nn.Module, pairs: list[tuple[str, str]], peaks: dict[str, Tensor], max_gain: float
) -> tuple[list[EqualizedPair], dict[str, Tensor]]:
    """Scale each pair by the gains its producer's channel peaks give; the producers' output
    observers are reset. Returns the report and each scaled producer's gains (float64)."""
    report = []
    gains: dict[str, Tensor] = {}
    for p, c in pairs:
        if p not in peaks:  # not run by these batches
            continue
        peak = peaks[p].to(torch.float64)
        top = float(peak.max())
        if top <= 0:
            continue
        gain = torch.where(peak > 0, top / peak, torch.ones_like(peak)).clamp(1.0, max_gain)
        producer: WeightedQAT = model.get_submodule(p)
        if p not in gains:
            _scale_output_channels(producer, gain)
            producer.activation_post_process.activation_post_process.reset()
            gains[p] = gain
        _scale_depthwise_inputs(model.get_submodule(c), gain)
        report.append(
            EqualizedPair(p, c, float(gain.min()), float(gain.max()), int((gain >= max_gain).sum()))
        )
    return report, gains


class _ChannelRanges:
    """Per sample and channel, the min and max of a producer's output (dim 1: channels)."""

    def __init__(self) -> None:
        self.mins: list[Tensor] = []
        self.maxs: list[Tensor] = []

    def add(self, out: Tensor) -> None:
        out = out.detach()
        if out.dim() > 2 and out.stride(1) == 1 and not out.is_contiguous():
            # channels_last: the channels are the innermost dim in memory (a view, no copy;
            # for any other layout a copy, with the same values)
            flat, dim = out.movedim(1, -1).reshape(out.shape[0], -1, out.shape[1]), 1
        else:
            flat, dim = out.reshape(out.shape[0], out.shape[1], -1), 2
        flat = flat.float()
        self.mins.append(flat.amin(dim).double())
        self.maxs.append(flat.amax(dim).double())

    def peak(self) -> Tensor:
        """The largest magnitude of each channel over everything recorded."""
        low, high = torch.cat(self.mins).amin(0), torch.cat(self.maxs).amax(0)
        return torch.maximum(-low, high).float()


@contextlib.contextmanager
def recording_channel_ranges(model: nn.Module) -> Iterator[dict[str, _ChannelRanges] | None]:
    """Within the block, the outputs of the producers ``equalize_depthwise`` would scale are
    recorded channel by channel as the model runs, so that ``equalize_calibrated`` can
    equalize after a calibration pass instead of before it (one pass, not two). Yields None
    when the model has no such pair."""
    pairs = depthwise_pairs(model)
    if not pairs:
        yield None
        return
    found = {p: _ChannelRanges() for p, _ in pairs}
    handles = [
        model.get_submodule(p).register_forward_hook(
            lambda m, args, out, r=ranges: r.add(out) if out.dim() > 1 and out.numel() else None
        )
        for p, ranges in found.items()
    ]
    try:
        yield found
    finally:
        for h in handles:
            h.remove()


def can_equalize_calibrated(model: nn.Module, mean_ranged: set[int]) -> bool:
    """Whether ``equalize_calibrated`` can give every producer the range a calibration after
    equalizing would: its output observer is a per-sample mean range (``id`` of the fake
    quant in ``mean_ranged``) or a plain global min / max, and the process is alone (the
    recorded ranges are not combined across ranks)."""
    if world_size() > 1:
        return False
    for p, _ in depthwise_pairs(model):
        fq = model.get_submodule(p).activation_post_process
        if id(fq) not in mean_ranged and type(fq.activation_post_process) is not MinMaxObserver:
            return False
    return True


@torch.no_grad()
def equalize_calibrated(
    model: nn.Module,
    recorded: dict[str, _ChannelRanges],
    mean_ranged: set[int],
    max_gain: float = 32.0,
    means: dict[int, Any] | None = None,
) -> list[EqualizedPair]:
    """``equalize_depthwise`` after a calibration pass that ``recording_channel_ranges``
    watched (``can_equalize_calibrated`` must hold): the pairs are scaled as before, and what
    the pass measured is scaled with them, as a calibration after equalizing would have
    found it:

    * each producer's output range: the per-sample mean of min / max when its fake quant's
      id is in ``mean_ranged``, else the global min / max, of the gains times the recorded
      per-sample, per-channel extremes;
    * the weight scales of both layers of each pair, observed again;
    * the depthwise convs' mean inputs in ``means`` (``recording_input_means``), per channel.

    The calibration saw float activations, and the pairs' float outputs do not change
    (ReLU6 included: a channel is amplified only up to its own recorded peak), so the rest
    of the model's statistics stand.
    """
    pairs = depthwise_pairs(model)
    peaks = {p: r.peak() for p, r in recorded.items() if r.mins}
    report, gains = _equalize(model, pairs, peaks, max_gain)
    refreshed: set[str] = set()
    for p, gain in gains.items():
        ranges = recorded[p]
        k = gain.reshape(1, -1)
        low = torch.cat(ranges.mins).mul(k).amin(1)  # per sample
        high = torch.cat(ranges.maxs).mul(k).amax(1)
        fq = model.get_submodule(p).activation_post_process
        if id(fq) in mean_ranged:  # the float32 of the float64 means, as MeanMinMaxObserver
            low, high = low.sum() / low.numel(), high.sum() / high.numel()
        else:
            low, high = low.amin(), high.amax()
        obs = fq.activation_post_process
        obs._resize_to(obs.min_val.new_empty(1))
        obs.min_val.copy_(low.reshape(1).float())
        obs.max_val.copy_(high.reshape(1).float())
        fq.update_scale()
        refreshed.add(p)
    for p, c in pairs:
        if p not in gains:
            continue
        if means is not None and id(model.get_submodule(c)) in means:
            means[id(model.get_submodule(c))].scale_channels(gains[p].float())
        refreshed.add(c)
    # an all-zero output takes its scale from its inputs' (FakeQuantize.zero_range_inputs):
    # one whose inputs include a rescaled producer output takes it again
    rescaled = {id(model.get_submodule(p).activation_post_process) for p in gains}
    for fq in model.modules():
        inputs = getattr(fq, "zero_range_inputs", ())
        if not any(q is not None and id(q) in rescaled for q in inputs):
            continue
        obs = fq.activation_post_process
        if fq.observed.any() and obs.has_statistics() and float(obs.amax().max()) == 0:
            fq.update_scale()
    for name in refreshed:  # the weight scales of the new weights
        layer: WeightedQAT = model.get_submodule(name)
        wfq = layer.weight_fake_quant
        wfq.activation_post_process.reset()
        layer.quantized_weight()
        wfq.finalize()
    return report
