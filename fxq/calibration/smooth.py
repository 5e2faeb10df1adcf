"""Activation outliers of a LayerNorm moved into the linear layers that read it (SmoothQuant).

In transformers a few channels of a LayerNorm's output are often far larger than
the rest (mostly through the affine ``gamma``): with one per-tensor int8 scale the
other channels keep a handful of levels. A linear layer reading that output computes

    y = W x = (W diag(s)) (x / s)

for any positive per-channel ``s``, and the LayerNorm can emit ``x / s`` by dividing
its ``gamma`` and ``beta`` by ``s``: the float function is unchanged, the activation
stays one per-tensor int8 tensor, and the weights, quantized per output channel,
take the channels' spread instead. ``s_c = max|x_c|^alpha / max|W[:, c]|^(1 - alpha)``
(Xiao et al. 2023, SmoothQuant) balances the two. The strength ``alpha`` is chosen per
LayerNorm, as AWQ chooses its scales, by a grid search on the int8 error the migration
leaves at the LayerNorm's readers (``Q(x / s) Q(W s)^T`` against ``x W^T``, and the
residual's ``s Q(x / s)`` against ``x``), over ``ALPHAS``: the factors and the activation
range come from the first half of a sample of the output's rows, the error from the
second half, and a LayerNorm whose error no strength lowers is left as it is. An int16
output is scored as int8 too: it is one that ``mixed_precision`` chose on a model where
it was migrated as int8, and it keeps that migration (measured: MiniLM). Factors
fitted to the peaks of a few rows (a classifier head's pooled features, a small
calibration set) clip the rows they did not see; held-out scoring leaves such a
LayerNorm alone. On all-MiniLM-L6-v2 every LayerNorm chooses 0.8 (``docs/transformers.md``).

It applies where every reader of the LayerNorm output is a linear layer (pre-norm
blocks: ViT, Swin, GPT-style encoders), or a linear layer with a fused residual add
(``linear_add``) that reads the output as its residual (post-norm BERT:
``LayerNorm(dense(h) + x)``). Such a layer takes the factor back on its residual,
``dense(h) + s * (x / s)``: in the integer model the residual is requantized into the
accumulator with one multiplier per output channel anyway, so ``s`` folds into those
multipliers exactly. Where the output feeds a plain residual add, the add would read
``x / s`` and the next LayerNorm, which is not invariant to a per-channel scale, would
change: those LayerNorms are left alone (``docs/transformers.md``).

The change lives in the prepared model's parameters (QAT continues from it). ``ptq``
runs it before its calibration pass (``smooth=True``) where the graph has such a
LayerNorm; it costs one float pass over the calibration batches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Node

from fxq.calibration.data import batch_list
from fxq.calibration.runner import float_pass_with_hooks, keep_rank0_result
from fxq.dtypes import qint8
from fxq.fx.graph_utils import reads_metadata_only
from fxq.qat.base import QATModule
from fxq.qat.normalization import LayerNorm
from fxq.qat.weighted import Linear

__all__ = ["smooth_activations", "smoothing_pairs", "SmoothedNorm"]


@dataclass
class SmoothedNorm:
    """One LayerNorm whose output channels were divided, and the linear layers that took the
    factors."""

    norm: str
    linears: list[str]
    min_factor: float
    max_factor: float
    residuals: list[str] = field(default_factory=list)
    #: the migration strength used
    alpha: float = 0.5


def _through_dropout(node: object, stop: Node, modules: dict[str, nn.Module]) -> object:
    """``node``'s source up to ``stop``, looking through dropout modules and functions."""
    from fxq.registry import row_for

    while isinstance(node, Node) and node is not stop and node.args:
        if node.op == "call_module" and isinstance(modules.get(node.target), QATModule):
            break
        if node.op not in ("call_module", "call_function") or row_for(node, modules)[0].name != (
            "dropout"
        ):
            break
        node = node.args[0]
    return node


def _reads_as_residual_only(user: Node, norm: Node, modules: dict[str, nn.Module]) -> bool:
    """``user`` (a fused linear + add) reads ``norm`` as its residual and not as its input."""
    if (
        len(user.args) != 2
        or user.kwargs
        or _through_dropout(user.args[1], norm, modules) is not norm
    ):
        return False
    # the input must not be the LayerNorm's output itself (through ops that do not compute:
    # the other readers take the factor, so whatever they compute from it is unchanged)
    source = user.args[0]
    while isinstance(source, Node) and source is not norm:
        module = modules.get(source.target) if source.op == "call_module" else None
        if isinstance(module, QATModule) or len(source.all_input_nodes) != 1:
            break
        source = source.all_input_nodes[0]
    return source is not norm


def smoothing_pairs(model: nn.Module) -> list[tuple[str, list[str], list[str]]]:
    """``(layernorm, [linear, ...], [fused linear + add, ...])`` module names that
    ``smooth_activations`` can scale.

    The LayerNorm has an affine weight and bias and is called once; each reader of its
    output (through pass-through ops such as reshape or dropout; reads of its shape aside)
    is either a linear layer
    without a folded BatchNorm, called once, reading it as its input, whose weight no
    other module shares, or a linear layer with a fused residual add, called once, reading
    it (through dropout at most) as its residual only, one output channel per LayerNorm
    channel. At least one reader is of the first kind.
    """
    from fxq.calibration.range_search import _readers_through_passthrough

    if not isinstance(model, GraphModule):
        return []
    modules = dict(model.named_modules())
    calls: dict[str, int] = {}
    for node in model.graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    owners: dict[int, int] = {}
    for m in modules.values():
        if isinstance(m, Linear):
            owners[id(m.weight)] = owners.get(id(m.weight), 0) + 1
    pairs = []
    for node in model.graph.nodes:
        if node.op != "call_module" or calls[node.target] != 1:
            continue
        norm = modules[node.target]
        if not isinstance(norm, LayerNorm) or norm.standalone:
            continue
        weight, bias = norm.affine_parameters()
        if weight is None or bias is None:
            continue
        readers = _readers_through_passthrough(node, modules)
        linears, residuals = [], []
        for user in readers:
            if reads_metadata_only(user):
                continue
            m = modules.get(user.target) if user.op == "call_module" else None
            if (
                isinstance(m, Linear)
                and m.add
                and not m.standalone
                and calls.get(user.target) == 1
                and m.out_channels == weight.numel()
                and _reads_as_residual_only(user, node, modules)
            ):
                residuals.append(user.target)
                continue
            if (
                not isinstance(m, Linear)
                or m.bn is not None
                or m.standalone
                or calls.get(user.target) != 1
                or owners.get(id(m.weight), 0) != 1
                or len(user.all_input_nodes) != 1
                or m.in_features != weight.numel()
            ):
                break
            linears.append(user.target)
        else:
            if linears:
                pairs.append((node.target, linears, residuals))
    return pairs


#: the migration strengths tried per LayerNorm when ``alpha`` is None
ALPHAS: tuple[float, ...] = (0.3, 0.5, 0.65, 0.8)
#: the rows (tokens) of each LayerNorm output that score the strengths
SAMPLE_ROWS = 2048


def _channel_stats(
    model: nn.Module, norms: list[str], batches: list[Any], input_fn, rows: int
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Per channel (the last dim), the largest |value| each LayerNorm outputs (float), and
    its first ``rows`` output rows (none when ``rows`` is 0)."""
    peaks: dict[str, Tensor] = {}
    samples: dict[str, list[Tensor]] = {}

    def hook_for(name: str):
        def hook(_mod, _inp, out):
            flat = out.detach().reshape(-1, out.shape[-1]).float()
            peak = flat.abs().amax(0)
            peaks[name] = peak if name not in peaks else torch.maximum(peaks[name], peak)
            kept = samples.setdefault(name, [])
            have = sum(len(t) for t in kept)
            if have < rows:
                kept.append(flat[: rows - have].clone())

        return hook

    hooks = {model.get_submodule(n): hook_for(n) for n in norms}
    float_pass_with_hooks(model, hooks, batches, input_fn)
    return peaks, {n: torch.cat(t) for n, t in samples.items() if t}


def _factor(x_peak: Tensor, w_peak: Tensor, alpha: float) -> Tensor:
    usable = (x_peak > 0) & (w_peak > 0)
    return torch.where(
        usable,
        x_peak.clamp(min=1e-12).pow(alpha) / w_peak.clamp(min=1e-12).pow(1 - alpha),
        torch.ones_like(x_peak),
    )


def _round_trip(t: Tensor, peak: Tensor, qmax: int) -> Tensor:
    """``t`` on the symmetric grid whose step is ``peak / qmax`` (broadcast)."""
    step = peak.clamp(min=1e-12) / qmax
    return (t / step).round().clamp(-qmax, qmax) * step


def _migration_error(
    fit: Tensor,
    test: Tensor,
    weights: list[tuple[Tensor, int]],
    residual: bool,
    x_qmax: int,
    factor: Tensor,
) -> float:
    """The quantization error that migrating by ``factor`` leaves on the rows ``test``, the
    activation's per-tensor range (``x_qmax`` levels) taken from the rows ``fit`` (a factor
    fitted to a few rows can push other rows past it): for each linear reader ``(W,
    qmax)``, the relative squared error of ``Q(x / s) Q(W s)^T`` against ``x W^T`` (the
    weight per output channel); for a residual reader, that of ``s Q(x / s)`` against
    ``x``."""
    s = factor.to(test)
    xs = test / s
    xq = _round_trip(xs, (fit / s).abs().amax(), x_qmax)
    error = 0.0
    for w, w_qmax in weights:
        ws = w.to(test) * s
        wq = _round_trip(ws, ws.abs().amax(1, keepdim=True), w_qmax)
        exact = test @ w.to(test).T
        error += float((xq @ wq.T - exact).square().sum() / exact.square().sum().clamp(min=1e-30))
    if residual:
        error += float(((xq - xs) * s).square().sum() / test.square().sum().clamp(min=1e-30))
    return error


def smooth_activations(
    model: nn.Module,
    data: Iterable[Any],
    alpha: float | None = None,
    num_batches: int | None = None,
    input_fn: Callable[[Any], Any] | None = None,
    alphas: Sequence[float] = ALPHAS,
) -> list[SmoothedNorm]:
    """Move the per-channel spread of LayerNorm outputs into the linear layers reading them
    (module docstring).

    Args:
        model: a model from ``prepare_qat_fx``; changed in place. Run it before calibrating
            (the LayerNorms' output ranges change).
        data: batches to measure the float channel peaks on (the calibration batches).
        alpha: the migration strength in ``[0, 1]`` (0: nothing moves into the activation's
            favour; 1: every channel's peak moves into the weights); None: chosen per
            LayerNorm among ``alphas``, the one whose int8 error at its readers is smallest
            on held-out rows, or none (the LayerNorm left as it is) when no strength lowers
            that error (module docstring).
        num_batches: use only the first batches.
        input_fn: maps a batch to the model's arguments.
        alphas: the strengths tried when ``alpha`` is None.

    Returns:
        one ``SmoothedNorm`` per LayerNorm scaled.

    Raises:
        ValueError: an ``alpha`` outside ``[0, 1]``, or no batch.
    """
    tried = list(alphas) if alpha is None else [alpha]
    if not tried or any(not 0 <= a <= 1 for a in tried):
        raise ValueError(f"smooth_activations: alpha must lie in [0, 1], got {tried}")
    pairs = smoothing_pairs(model)
    if not pairs:
        return []
    batches = batch_list(data, num_batches, "smooth_activations", ranks="nonempty")
    peaks, samples = _channel_stats(
        model, [n for n, _, _ in pairs], batches, input_fn, SAMPLE_ROWS if len(tried) > 1 else 0
    )
    report = []
    with torch.no_grad():
        for norm_name, linear_names, residual_names in pairs:
            if norm_name not in peaks:  # not run by these batches
                continue
            norm: LayerNorm = model.get_submodule(norm_name)
            linears = [model.get_submodule(n) for n in linear_names]
            x_peak = peaks[norm_name].double()
            w_peak = torch.stack([m.weight.detach().abs().amax(0) for m in linears]).amax(0)
            w_peak = w_peak.double()
            chosen = tried[0]
            if len(tried) > 1:
                # scored on held-out rows: the factors and the range from the first half of
                # the sampled rows (the earlier samples), the error on the second
                x = samples[norm_name]
                fit, test = x[: len(x) // 2], x[len(x) // 2 :]
                if not len(fit):
                    continue
                fit_peak = fit.abs().amax(0).double()
                error = functools.partial(
                    _migration_error,
                    fit,
                    test,
                    [(m.weight.detach().float(), m.weight_fake_quant.dtype.qmax) for m in linears],
                    bool(residual_names),
                    # the activation scored on int8's grid whatever its dtype: an int16 output
                    # is one that mixed_precision chose from a model where the LayerNorm was
                    # smoothed as int8, and its ranking holds for that migration; scored on
                    # int16's grid (weights' error alone) MiniLM's one int16 LayerNorm took
                    # 0.3 instead of 0.8 and the 10 % int16 model fell from 0.9964 to 0.9940
                    min(norm.activation_post_process.dtype.qmax, qint8.qmax),
                )
                errors = [error(_factor(fit_peak, w_peak, a)) for a in tried]
                best = min(range(len(tried)), key=errors.__getitem__)
                if error(torch.ones_like(fit_peak)) <= errors[best]:
                    continue  # no strength does better than leaving the LayerNorm as it is
                chosen = tried[best]
            factor = _factor(x_peak, w_peak, chosen)
            weight, bias = norm.op.weight, norm.op.bias
            weight.div_(factor.to(weight.dtype).reshape(weight.shape))
            bias.div_(factor.to(bias.dtype).reshape(bias.shape))
            for m in linears:
                m.weight.mul_(factor.to(m.weight.dtype).reshape(1, -1))
            for name in residual_names:
                m = model.get_submodule(name)
                before = m.residual_factor if m.residual_factor is not None else 1.0
                m.set_residual_factor(before * factor.to(m.weight.device))
            norm.activation_post_process.activation_post_process.reset()
            report.append(
                SmoothedNorm(
                    norm_name,
                    linear_names,
                    float(factor.min()),
                    float(factor.max()),
                    residual_names,
                    chosen,
                )
            )
    keep_rank0_result(model)  # the peaks are each rank's own
    return report
