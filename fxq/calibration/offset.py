"""Unsigned ranges on signed hardware: ReLU outputs that use every int8 level.

fxq's marches quantize activations signed with zero point 0, so the output of
a ReLU or ReLU6 (never negative) uses 128 of int8's 256 levels. When every
consumer of such an output is a convolution or a linear layer, the whole
range can be had without a zero point in the hardware, by storing the value
shifted (``k = -qmin`` steps, 128 for int8):

* the output's fake quant takes ``offset = k``: its grid is
  ``[0, qmax + k] * scale`` (``FakeQuantize.offset``), so the step halves for
  the same range; QAT, calibration and learned rounding see the real values;
* the producer's integer model stores ``q - k``: its int32 bias is lowered by
  ``k`` output steps and its ReLU / ReLU6 clamps move by ``-k``;
* each consumer adds ``k * sum_k W[c, k]`` (exact, in integers) to its bias
  and pads a border with ``-k``, the stored form of 0 (``pad_value`` in the
  exported graph).

The deployed graph keeps plain convolutions, clamps and pads. The shifted
tensor is a ``QTensor`` with ``offset`` set; any op other than those
consumers refuses it.

The lowered bias is ``k * s_y / (s_x * s_w)`` accumulator units, which a
fine input grid (int16) or a tiny weight scale can take past int32:
``convert_fx`` refuses such an offset, naming the layer, and
``release_overflowing`` gives it back once the scales are known.

``ptq`` applies it (``offset=True``) before calibrating and releases what
overflows before learning the rounding; measured in ``docs/accuracy_log.md``
(MobileNetV2: ``default`` +1.2 dB, ``best`` +1.8 dB).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.fx import GraphModule

from fxq.fake_quantize import FakeQuantize
from fxq.qat.base import QATModule
from fxq.qat.weighted import WeightedQAT, _Conv, _ConvTranspose

__all__ = ["offset_activations", "offset_candidates", "release_overflowing"]

_NON_NEGATIVE = ("relu", "relu6")


def _readers(modules: Iterable[nn.Module]) -> dict[int, list[QATModule]]:
    """The QAT modules that read each fake quant (by ``id``) as one of their inputs."""
    readers: dict[int, list[QATModule]] = {}
    for m in modules:
        if isinstance(m, QATModule):
            for q in m.input_quants:
                if q is not None:
                    readers.setdefault(id(q), []).append(m)
    return readers


def offset_candidates(model: nn.Module) -> list[str]:
    """Names of the modules whose output ``offset_activations`` would store shifted.

    A candidate is a (fused) conv or linear with a ReLU or ReLU6 and a per-tensor
    int8 output fake quant with a calibrated (not fixed) scale, whose output goes
    only to convolutions padding with zeros (not transposed) and linear layers,
    each reading it as its main input (not a residual) through that fake quant,
    which no other module reads.
    """
    if not isinstance(model, GraphModule):
        return []
    modules = dict(model.named_modules())
    readers = _readers(modules.values())
    owners: dict[int, int] = {}
    for m in modules.values():
        if isinstance(m, QATModule) and m.has_output_quant:
            fq = m.activation_post_process
            owners[id(fq)] = owners.get(id(fq), 0) + 1
    out = []
    seen: set[str] = set()
    for node in model.graph.nodes:
        if node.op != "call_module" or node.target in seen:
            continue
        producer = modules[node.target]
        if not isinstance(producer, WeightedQAT) or producer.activation not in _NON_NEGATIVE:
            continue
        fq = producer.activation_post_process
        if (
            not isinstance(fq, FakeQuantize)
            or fq.ch_axis is not None
            or fq.is_high_precision
            or fq.is_fixed_scale
            or fq.dtype.bits > 8
            or owners.get(id(fq), 0) != 1
            or not node.users
        ):
            continue
        reading = 0
        ok = True
        for user in node.users:
            m = modules.get(user.target) if user.op == "call_module" else None
            if (
                m is None
                or not isinstance(m, WeightedQAT)
                or m.standalone
                or isinstance(m, _ConvTranspose)
                or (isinstance(m, _Conv) and m.padding_mode != "zeros")
                or user.args[:1] != (node,)
                or node in user.args[1:]
                or node in user.kwargs.values()
                or not m.input_quants
                or m.input_quants[0] is not fq
            ):
                ok = False
                break
            reading += 1
        # a module called at several places is one node per call: every reader is a user
        if ok and len(readers.get(id(fq), [])) == reading:
            out.append(node.target)
            seen.add(node.target)
    return out


def offset_activations(model: nn.Module, skip: Iterable[str] = ()) -> list[str]:
    """Store every candidate ReLU / ReLU6 output shifted, on all of int8's levels.

    Call it on a prepared model, before calibrating (the scales then follow the
    new grid) or after (each scale is recomputed from its statistics, or halved
    for the same range). QAT, calibration and ``convert_fx`` need nothing else:
    the fake quants round onto the unsigned grid, and the integer model undoes
    the shift in the consumers' biases and borders (module docstring).

    Args:
        model: a model from ``prepare_qat_fx``.
        skip: names of producers to leave as they are.

    Returns:
        the names of the producers whose output fake quant took the offset
        (``offset_candidates`` less ``skip``).
    """
    skipped = set(skip)
    names = [n for n in offset_candidates(model) if n not in skipped]
    for name in names:
        fq = model.get_submodule(name).activation_post_process
        fq.set_offset(-fq.dtype.qmin)
    return names


def release_overflowing(model: nn.Module) -> list[str]:
    """Take the offset back from producers whose integer model could not hold it.

    The producer's int32 bias is lowered by ``offset`` output steps, that is
    ``offset * s_out / (s_x * s_w)`` accumulator units: a channel with a tiny
    weight scale or an int16 input can take it past int32. Each consumer adds
    ``offset * sum |W|``, bounded here from the float weights. Call it once the
    scales are set (``ptq`` does, before learning the rounding).

    Returns:
        the names of the producers set back to the symmetric grid.
    """
    modules = dict(model.named_modules())
    readers = _readers(modules.values())
    released = []
    limit = float(1 << 30)  # half of int32: the products need room too
    with torch.no_grad():
        for name, m in modules.items():
            if not isinstance(m, WeightedQAT) or not m.has_output_quant:
                continue
            fq = m.activation_post_process
            if not getattr(fq, "offset", 0):
                continue
            s_x = m.input_scale(0)
            s_w = m.weight_fake_quant.scale.double()
            if s_x is None:
                continue
            acc = s_x.double().reshape(()) * s_w
            bias = m.folded_bias()
            bias = torch.zeros_like(acc) if bias is None else bias.double()
            worst = float(((bias - fq.offset * fq.scale.double()).abs() / acc).max())
            for consumer in readers.get(id(fq), []):
                if not isinstance(consumer, WeightedQAT):
                    continue  # not a reader offset_candidates allows (the model was edited)
                w = consumer.folded_weight().double()
                sw = consumer.weight_fake_quant.scale.double().reshape([-1] + [1] * (w.dim() - 1))
                steps = (w / sw).abs().round().reshape(w.shape[0], -1).sum(1)
                worst = max(worst, float((steps * fq.offset).max()))
            if not worst < limit:
                fq.set_offset(0)
                released.append(name)
    return released
