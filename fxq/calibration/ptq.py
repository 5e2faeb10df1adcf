"""``ptq``: post-training quantization recipes in one call.

``ptq(prepared, data, method=...)`` calibrates a model from ``prepare_qat_fx``
in place and keeps its prepared form (observers, fake quants, weights), so
QAT can continue from it and ``convert_fx`` gives the integer model.

Methods (MobileNetV2 on real photos, logits SQNR against float: see
``docs/accuracy.md``):

* ``"default"``: the recipe to use unless there is a reason not to: one pass
  over the calibration data, then a short learned rounding on its first 16
  samples (MobileNetV2, 96 crops, 2 cores: 7.5-10 s, 19.6-20.3 dB; see
  ``docs/accuracy_log.md``):

  1. **model outputs wide**: an output produced by a conv / linear keeps its
     int32 accumulator on marches that have a high-precision output; other
     outputs become int16 where the march has int16 activations, else keep
     their qconfig's int8 observer (a global min / max);
  2. **ranges**: every other int8 activation takes the mean over calibration
     samples of each sample's min and max (``mean_min_max``, NNCF's range
     estimator), not the global extremes that a few images stretch; int16
     activations keep their qconfig's observer (global min / max: 16 bits
     leave levels to spare, clipping would only cost);
  3. **depthwise inputs equalized** (``equalize=True``,
     ``fxq.calibration.equalization``): the output channels of a conv that
     feeds a depthwise conv are scaled to a common range and the depthwise
     weights take the inverse, so the per-tensor int8 activation between them
     serves every channel (the effect of NNCF's per-channel activation
     quantizers there, with per-tensor arithmetic). The channel ranges are
     recorded in the calibration pass and the pairs scaled after it, with the
     ranges and weight scales it found scaled alike (``equalize_calibrated``;
     the same result as equalizing first, without a pass of its own; under
     ``torch.distributed`` with several ranks, or for an int16 producer whose
     observer is not a min / max, it is equalized first, with a pass);
  4. **unsigned ReLU outputs** (``offset=True``,
     ``fxq.calibration.offset``): a ReLU / ReLU6 output read only by
     convolutions and linear layers is quantized onto ``[0, 255]`` steps and
     stored shifted by 128 in int8, the consumers undoing the shift in their
     biases and borders: the step halves for the same range, with signed
     integer arithmetic and no zero point;
  5. **transformers** (a graph where a LayerNorm feeds a linear layer): before the pass,
     each LayerNorm whose output only linear layers read moves its per-channel spread into
     their weights, with a strength chosen per LayerNorm on held-out rows
     (``smooth=True``, ``fxq.calibration.smooth``, SmoothQuant; pre-norm blocks; in
     post-norm blocks the linear layer that adds it back as its residual, ``linear_add``,
     takes the factor on that residual); after it, the ranges of the int8 activations
     before each normalization (the residual stream, the GELU outputs, ...; not the
     normalizations' own outputs) are clipped where the error after that normalization
     is smaller (``search_ranges``, ``fxq.calibration.range_search``; a few extreme
     values, such as BERT's first-token outliers, otherwise take every level from the
     rest). Neither runs on a graph without such layers (CNNs); see
     ``docs/transformers.md``;
  6. **learned rounding** (``weight_reconstruction(block_depth="auto", iters=10,
     batch_size=4, lr=0.7, num_samples=16)``, ``DEFAULT_ROUNDING``): block by
     block, the weights' up / down rounding is fitted to the float block
     outputs. The recorded streams cost in proportion to the samples, so only
     the first batches holding 16 samples are used. It replaces the fast bias
     correction, which lowers the result when the rounding is learned after it.
     Options (e.g. ``iters=0``) override the settings; with ``iters=0`` the
     default corrects the biases instead (``bias_correction(..., mode="fast",
     skip_depthwise=True)``, NNCF's formulation: per layer except depthwise
     convs, the mean output shift caused by rounding its weights and quantizing
     its mean input is folded into its bias, from mean inputs recorded in the
     calibration pass).

* ``"calibrate"``: the observers of the qconfig as they are (``calibrate``).
* ``"best"``: the same one calibration pass and equalization, then the ranges
  of ``"default"`` or percentile ranges (99.99 %), both recorded in that pass
  (the equalized producers' outputs keep their mean range in both: a
  histogram cannot be rescaled channel by channel), whichever gives the
  smaller output error with the weights left unrounded on the first
  calibration batch, then learned weight rounding block by block
  (``weight_reconstruction(block_depth="auto", iters=30, batch_size=4,
  lr=0.4)`` on every sample, ``BEST_ROUNDING``; 100 steps where a LayerNorm
  feeds a linear layer, ``BEST_ROUNDING_TRANSFORMERS``: MiniLM 0.9951 -> 0.9958
  mean cosine, 38 -> 90 s). Learned rounding absorbs the weights' rounding but not the
  activations' clipping, so the clipped ranges that serve ``"default"`` best
  can be the wrong start (on EfficientNet-Lite0 percentile ranges end 1.4 dB
  higher, on MobileNetV2 2.1 dB lower), and the activations' own error
  picks the right one on both, with and without int16 mixed precision.
  **No bias correction**, before or after the learning (unless
  ``bias_correction=True`` is passed): the rounding fits the float block
  outputs itself, and a correction first lowered the result by 1.2 dB
  (MobileNetV2) to 3.6 dB (Lite0 with int16 mixed precision); one after, by
  0.4-0.6 dB. On MobileNetV2 with 96 crops on 2 cores: 12-14 s on a machine
  where NNCF's ``nncf.quantize`` took 11.7 s (1.2x), 24.4 s where it took
  26.4 s (0.92x; ``benchmarks/RESULTS.md``).

Two options for the last dB, off by default (``docs/accuracy_log.md``, fourteenth session):

* ``float_activations=True`` (a ``weight_reconstruction`` option): the rounding is
  learned with every activation float, approximating the float weights alone. After
  ``mixed_precision`` (the sensitive activations int16) it is the better learning
  (MobileNetV2, 10 % int16: 23.2 -> 24.2 dB); in all-int8 models it loses 3 dB, since the
  learning no longer takes away the activations' error.
* ``tune_biases=True``: last, the biases alone are trained end to end on the model output
  against the float outputs recorded while calibrating (``fxq.calibration.bias_tuning``;
  4 epochs of Adam at lr 3e-5, +0.2-0.5 dB; about 100 s on MobileNetV2 on 2 cores);
  ``tune_biases=8``: 8 epochs (MobileNetV2 with 10 % int16: 25.05 -> 25.30 dB).

Speed (both learning methods): on CPU the batches' 4-d float tensors run in
the ``channels_last`` layout, where oneDNN's convolutions take about half the
time, when every op of the model is known to allow it (``fast_layout``; a
``view`` or a module of the user's own keeps the given layout); the float
block outputs that the learned rounding reproduces are recorded in the
calibration pass (``recording_outputs``), so the float model runs once; and
the learning rounds as QAT training does (``training_rounding``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from fxq.calibration.data import batch_list
from fxq.calibration.graph_outputs import output_quants
from fxq.calibration.observers import MeanMinMaxObserver, PercentileObserver
from fxq.calibration.runner import calibrate, fast_layout, keep_rank0_result, run_batches
from fxq.dtypes import qint16, qint32
from fxq.fake_quantize import FakeQuantize, activation_quants, bypassed, weight_quants
from fxq.march import spec_for
from fxq.observer import ObserverBase
from fxq.qat.weighted import WeightedQAT
from fxq.utils.warning_summary import summarises_warnings

__all__ = [
    "ptq",
    "PTQ_METHODS",
    "DEFAULT_ROUNDING",
    "BEST_ROUNDING",
    "output_quants",
    "activation_quants",
    "widen_outputs",
]

PTQ_METHODS = ("default", "calibrate", "best")

# learned rounding in method="best" (MobileNetV2 / EfficientNet-Lite0, 96 crops, 2 cores, after
# the range choice; see docs/accuracy_log.md): iters 60 / batch 4 / lr 0.2 20.46 / 21.14 dB in
# 33 / 46 s; 30 / 4 / 0.4 20.10 / 21.45 dB in 26 / 28 s; 20 / 8 / 0.4 19.96 / 21.25 dB;
# 25 / 6 / 0.4 20.22 / 20.82 dB (the draws of samples move a result by a few tenths)
BEST_ROUNDING = {"block_depth": "auto", "iters": 30, "batch_size": 4, "lr": 0.4}
# ... and where a LayerNorm feeds a linear layer (transformers: larger blocks, fewer samples):
# all-MiniLM-L6-v2, 128 calibration / 256 evaluation sentences, mean cosine: 30 steps 0.9967 /
# 0.9951 (38 s); 100 steps 0.9977 / 0.9958 (90 s), lr 0.2 0.9976 / 0.9957; 300 steps at lr 0.2
# 0.9979 / 0.9957 (226 s). With 10 % int16 (mixed_precision): 30 0.9974 / 0.9964, 60 0.9980 /
# 0.9968, 100 0.9982 / 0.9970 (batch 8 the same in 1.5x the time)
BEST_ROUNDING_TRANSFORMERS = {**BEST_ROUNDING, "iters": 100}
# learned rounding in method="default": fewer steps, on the first 16 samples only (the
# recorded streams cost in proportion to the samples). MobileNetV2 / EfficientNet-Lite0, 96
# crops, 2 cores: 12 / 4 / 0.7 on 32 samples 18.43 / 17.41 dB, learning 5-7 s; 15 / 4 / 0.6
# 18.49 / 17.77 dB; none 15.71 / 11.83 dB (16.44 / 12.67 with the fast bias correction instead).
# With the unsigned ReLU outputs (offset): on 32 samples 19.54 / 17.50 dB in 12.4 / 13.2 s
# (prepare to convert), on 16 19.65 / 18.23 dB in 9.6 / 11.6 s; 10 steps at lr 0.85 on 32
# 19.24 / 16.41 dB. On 16 samples, three calibration draws (seeds 0, 2, 3), mean dB: 12 steps
# 19.67 / 17.11, 10 steps 19.60 / 16.86 (about 1 s less: 7.5-10.4 s against 8.5-11.4 s for
# MobileNetV2), 8 steps 18.95 / 16.67 (6.2-8.5 s): 10 steps kept (2026-11-26)
DEFAULT_ROUNDING = {
    "block_depth": "auto",
    "iters": 10,
    "batch_size": 4,
    "lr": 0.7,
    "num_samples": 16,
}


def widen_outputs(model: nn.Module, output: str = "auto") -> list[tuple[str, str]]:
    """Give the model outputs a wider type than int8 where the march allows.

    Args:
        output: ``"auto"``: int32 for an output a conv / linear produces on a
            march with a high-precision output, else int16 where the march has
            int16 activations; ``"int16"``: int16 where allowed; ``"int8"``:
            nothing changes.

    Returns:
        ``(module name, dtype name)`` for every output changed.
    """
    if output not in ("auto", "int16", "int8"):
        raise ValueError(f"output must be 'auto', 'int16' or 'int8', got {output!r}")
    changed = []
    if output == "int8":
        return changed
    for name, module in output_quants(model):
        fq = module.activation_post_process
        if fq.is_high_precision or fq.is_fixed_scale or fq.dtype.bits > 8:
            continue
        spec = spec_for(fq.march)
        if output == "auto" and isinstance(module, WeightedQAT) and spec.high_precision_output:
            fq.dtype = qint32
        elif spec.supports_activation(qint16):
            fq.set_dtype(qint16)
        else:
            continue
        changed.append((name, fq.dtype.name))
    return changed


class _ModelSnapshot:
    """Everything a recipe may change, to put back when it fails part-way: parameters and
    buffers, fake-quant dtypes and observers, and biases created on the way."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.quants = [
            (m, m.dtype, m.activation_post_process, m.activation_post_process.qmax, m.offset)
            for m in model.modules()
            if isinstance(m, FakeQuantize)
        ]
        self.biasless = [
            m for m in model.modules() if isinstance(m, WeightedQAT) and m.bias is None
        ]

    def restore(self) -> None:
        for m in self.biasless:
            m.bias = None
        for fq, dtype, obs, qmax, offset in self.quants:
            fq.dtype = dtype
            fq.activation_post_process = obs
            obs.qmax = qmax
            fq.offset = offset
        self.model.load_state_dict(self.state)


@contextlib.contextmanager
def restored_on_failure(model: nn.Module) -> Iterator[None]:
    """Within the block, an exception (or Ctrl-C) puts ``model`` back as it was."""
    snapshot = _ModelSnapshot(model)
    try:
        yield
    except BaseException:
        snapshot.restore()
        raise


def _fitted(obs: ObserverBase, fq: FakeQuantize) -> ObserverBase:
    """``obs`` set up to observe for ``fq``: its levels, its name, its device."""
    obs.qmax = fq.levels_above_zero
    obs.name = fq.activation_post_process.name
    return obs.to(fq.scale.device)


@contextlib.contextmanager
def observers_swapped(
    quants: Sequence[FakeQuantize], make: Callable[[], ObserverBase]
) -> Iterator[None]:
    """Within the block, ``quants`` observe with ``make()``; on exit their own observers come
    back holding the range that was found (``min_val`` / ``max_val`` at the clip), so QAT's
    observers start from the calibrated scales."""
    originals = [fq.activation_post_process for fq in quants]
    for fq in quants:
        fq.activation_post_process = _fitted(make(), fq)
    try:
        yield
    finally:
        for fq, original in zip(quants, originals):
            temporary = fq.activation_post_process
            fq.finalize()
            fq.activation_post_process = original
            if temporary.has_statistics() and not original.deferred:
                with torch.no_grad():
                    original._resize_to(temporary.min_val)
                    original.min_val.copy_(temporary.min_val)
                    original.max_val.copy_(temporary.max_val)
            fq._stale = False


@contextlib.contextmanager
def _also_observed(quants: Sequence[FakeQuantize], observers: list[ObserverBase]) -> Iterator[None]:
    """Within the block, each of ``observers`` (when given) also records what the observer of
    the fake quant beside it in ``quants`` records.

    Each rides as a child of that observer, so that it is one of the model's modules:
    ``calibrate`` synchronizes it across ranks like the model's own observers.
    """
    hosts, handles = [], []
    try:
        for fq, obs in zip(quants, observers):
            host = fq.activation_post_process
            host.add_module("_also_observed", _fitted(obs, fq))
            hosts.append(host)
            handles.append(host.register_forward_hook(lambda m, args, out, o=obs: o(args[0])))
        yield
    finally:
        for handle in handles:
            handle.remove()
        for host in hosts:
            del host._modules["_also_observed"]


def _take_ranges(quants: Sequence[FakeQuantize], observers: list[ObserverBase]) -> None:
    """Give ``quants`` the ranges that ``observers`` (filled by ``_also_observed``) found, as
    a calibration with them would."""
    with observers_swapped(quants, iter(observers).__next__):
        for fq in quants:
            fq._stale = True  # the scale comes from the swapped-in observer on exit


@summarises_warnings("fxq.calibration.ptq")
def ptq(
    model: nn.Module,
    data: Iterable[Any],
    method: str = "default",
    output: str = "auto",
    bias_correction: bool | None = None,
    equalize: bool = True,
    offset: bool = True,
    tune_biases: bool | int = False,
    search_ranges: bool | None = None,
    smooth: bool = True,
    num_batches: int | None = None,
    input_fn: Callable[[Any], Any] | None = None,
    show_progress: bool | None = None,
    **options: Any,
) -> nn.Module:
    """Calibrate a prepared model with a post-training recipe (see the module docstring).

    Args:
        model: the model from ``prepare_qat_fx`` (any qconfig); calibrated in
            place, keeping its prepared form.
        data: calibration batches: tensors, ``(images, labels)`` tuples or dicts of
            keyword inputs (``fxq.calibration.data``; a single tensor is refused: wrap
            it in a list).
        method: ``"default"``, ``"calibrate"`` or ``"best"``.
        output: how model outputs are quantized (``widen_outputs``): ``"auto"``,
            ``"int16"`` or ``"int8"`` (the qconfig's dtype and observer).
        bias_correction: fold the fast bias correction into the biases (after
            the ranges, before any learned rounding); ``None``: yes where no
            rounding is learned (``"calibrate"``, or ``iters=0``), else no.
        equalize: for ``"default"`` and ``"best"``, equalize the activations
            that feed depthwise convs channel by channel
            (``fxq.calibration.equalization``: after the calibration pass, from
            the channel ranges recorded in it, where it can; else first, with
            ``equalize_depthwise``).
        offset: for ``"default"`` and ``"best"``, quantize the ReLU / ReLU6
            outputs that only convolutions and linear layers read onto all of
            int8's levels, stored shifted (``fxq.calibration.offset_activations``).
        tune_biases: last, train the biases end to end on the model output
            (``fxq.calibration.bias_tuning``), against the float outputs
            recorded while calibrating. Off by default: it costs about four
            forward and backward passes over the data (about 100 s on
            MobileNetV2 on 2 cores) and gains a few tenths of a dB. An int: that many
            epochs (``True``: ``fxq.calibration.bias_tuning.DEFAULT_EPOCHS``).
        search_ranges: for ``"default"`` and ``"best"``, clip the ranges of the
            int8 activations that reach a normalization layer (other than the
            normalizations' outputs) where the error after that normalization is
            smaller (``fxq.calibration.range_search``; after the calibration pass,
            before any learned rounding); ``None``: where a
            normalization layer feeds a linear layer (transformers), never in CNNs.
        smooth: for ``"default"`` and ``"best"``, move the per-channel spread of each
            LayerNorm output that only linear layers read (as input, or as the residual of
            a fused ``linear_add``) into their weights (and residual factors)
            (``fxq.calibration.smooth``, SmoothQuant; before the calibration pass, with a
            float pass of its own; nothing to do in models without such a LayerNorm).
        num_batches: use only the first batches.
        input_fn: maps a batch to the model's arguments.
        options: for ``"default"`` and ``"best"``, arguments of
            ``weight_reconstruction`` that override the method's learned-rounding
            settings (``DEFAULT_ROUNDING``, ``BEST_ROUNDING``,
            ``BEST_ROUNDING_TRANSFORMERS``; e.g. ``iters=0``:
            none; ``float_activations=True``: learn the rounding with float
            activations, the better choice after ``mixed_precision``).

    Returns:
        ``model``, calibrated, in CALIBRATION state (switch to VALIDATION or
        convert it).

    Raises:
        ValueError: an unknown method or output, no batch, ``num_batches < 1``, or (in a
            distributed run) ranks with different numbers of batches, on every rank.
        TypeError: ``data`` is one tensor or one dict.

    A failure part-way puts the model back as it was (weights, biases, scales,
    observers, dtypes).

    Under ``torch.distributed`` with several ranks, the observers combine every
    rank's batches (``calibrate``); the other steps see each rank's own batches,
    and each ends with rank 0's model on every rank (``keep_rank0_result``; the
    equalization, bias correction and learned rounding do it themselves, the
    choice of ranges here). Every rank must call it.
    """
    if method not in PTQ_METHODS:
        raise ValueError(f"ptq: unknown method {method!r}; choose from {', '.join(PTQ_METHODS)}")
    epochs = _tuning_epochs(tune_biases)
    if options and method == "calibrate":
        raise ValueError(
            f"ptq: {sorted(options)} (learned-rounding settings) do not apply to "
            "method='calibrate', which learns no rounding"
        )
    batches = fast_layout(model, batch_list(data, num_batches, "ptq", ranks="equal"), input_fn)
    from fxq.calibration.range_search import has_normalization

    # a normalization feeding a linear layer (transformers): the range search by default, and
    # the longer learned rounding of "best"
    transformer = method != "calibrate" and has_normalization(model)
    rounding = {}
    if method != "calibrate":
        _check_options(options)
        settings = DEFAULT_ROUNDING
        if method == "best":
            settings = BEST_ROUNDING_TRANSFORMERS if transformer else BEST_ROUNDING
        rounding = {**settings, **options}
        if not isinstance(model, GraphModule) and "block_depth" not in options:
            rounding["block_depth"] = None  # blocks are cut from a graph: layer by layer
    learns = rounding.get("iters", 0) > 0
    if bias_correction is None:
        bias_correction = not learns
    from fxq.calibration.bias_correction import recording_input_means

    # the fast bias correction needs each layer's mean float input: recorded while
    # calibrating, which passes float activations through (no pass of its own); entered
    # once, around the one calibration below
    recorded = recording_input_means(model) if bias_correction else contextlib.nullcontext()
    # the float model's outputs, recorded while calibrating: "best" compares its candidate
    # ranges on the first batch's, the bias tuning fits the biases to all of them
    kept_outputs = len(batches) if epochs else _COMPARED_BATCHES if method == "best" else 0
    with restored_on_failure(model):
        if method == "calibrate":
            widen_outputs(model, output)
            with recorded as means, _first_outputs(model, kept_outputs) as reference:
                calibrate(model, batches, input_fn=input_fn, show_progress=show_progress)
            if bias_correction:
                _fast_bc(model, batches, input_fn, show_progress, means)
            if epochs:
                _tune(model, batches, reference, input_fn, show_progress, epochs)
            return model
        from fxq.calibration import equalization, range_search
        from fxq.calibration.equalization import depthwise_pairs as pairs_of
        from fxq.calibration.offset import offset_activations, release_overflowing

        if smooth:
            from fxq.calibration.smooth import smooth_activations

            smooth_activations(model, batches, input_fn=input_fn)
        widen_outputs(model, output)
        if offset:
            offset_activations(model)
        outputs = {id(m.activation_post_process) for _, m in output_quants(model)}
        # int16 activations have levels to spare: their qconfig's observer (a global min / max)
        # keeps the tails that the per-sample mean range would clip
        inner = [
            fq for fq in activation_quants(model) if id(fq) not in outputs and fq.dtype.bits <= 8
        ]
        # the depthwise equalization is applied after the calibration pass, from channel
        # ranges recorded in it (one pass instead of two, same result), where it can be
        mean_ranged = {id(fq) for fq in inner}
        after = equalize and equalization.can_equalize_calibrated(model, mean_ranged)
        if equalize and not after:
            equalization.equalize_depthwise(model, batches, input_fn=input_fn)
        channels = (
            equalization.recording_channel_ranges(model) if after else contextlib.nullcontext()
        )
        # "best" also weighs percentile ranges, observed in the same pass (calibration
        # passes float activations through, so both observers see the same tensors); not
        # on the outputs equalized after the pass (a histogram cannot be rescaled channel by
        # channel): those keep their mean range in both candidates
        equalized = {p for p, _ in pairs_of(model)} if after else set()
        scaled = {id(model.get_submodule(p).activation_post_process) for p in equalized}
        candidates = [fq for fq in inner if id(fq) not in scaled] if method == "best" else []
        wide = [PercentileObserver() for _ in candidates]
        # the float block outputs that learned rounding reproduces, recorded in the same pass
        # (the float model then need not run again); not when bias correction changes the
        # float model after the pass, nor the outputs of producers equalized after it (their
        # channels are scaled then): those blocks read the streamed reference
        targets = (
            _recording_targets(model, batches, rounding, input_fn, equalized)
            if learns and rounding.get("learned_rounding", True) and not bias_correction
            else contextlib.nullcontext()
        )
        with (
            observers_swapped(inner, MeanMinMaxObserver),
            _also_observed(candidates, wide),
            recorded as means,
            _first_outputs(model, kept_outputs) as reference,
            channels as ranges,
            targets as outputs,
        ):
            calibrate(model, batches, input_fn=input_fn, show_progress=show_progress)
        if ranges is not None:
            equalization.equalize_calibrated(model, ranges, mean_ranged, means=means)
        if method == "best":
            mean_error = _activation_error(model, batches, reference, input_fn)
            mean = _ModelSnapshot(model)
            _take_ranges(candidates, wide)
            if _activation_error(model, batches, reference, input_fn) >= mean_error:
                mean.restore()
            keep_rank0_result(model)  # every rank learns from the same start
        if search_ranges is None:
            search_ranges = transformer
        if search_ranges:
            range_search.search_ranges(model, batches, input_fn=input_fn)
        if offset:
            release_overflowing(model)  # now that every scale is known
        if bias_correction:
            _fast_bc(model, batches, input_fn, show_progress, means)
        if learns:
            from fxq.calibration.reconstruction import weight_reconstruction

            opts = {"show": False, **rounding}
            weight_reconstruction(
                model,
                batches,
                input_fn=input_fn,
                show_progress=show_progress,
                _recorded=None if outputs is None else outputs.complete(),
                **opts,
            )
        if epochs:
            _tune(model, batches, reference, input_fn, show_progress, epochs)
    return model


def _tuning_epochs(tune_biases: bool | int) -> int:
    """The bias tuning's epochs that ``ptq(tune_biases=...)`` asks for (0: none)."""
    from fxq.calibration.bias_tuning import DEFAULT_EPOCHS

    if tune_biases is True:
        return DEFAULT_EPOCHS
    if tune_biases is False or tune_biases is None:
        return 0
    if not isinstance(tune_biases, int) or tune_biases < 0:
        raise ValueError(
            f"ptq: tune_biases must be True, False or a number of epochs (0: none), got "
            f"{tune_biases!r}"
        )
    return tune_biases


def _tune(model, batches, reference, input_fn, show_progress, epochs: int) -> None:
    from fxq.calibration.bias_tuning import tune_biases

    tune_biases(
        model,
        batches,
        epochs=epochs,
        input_fn=input_fn,
        show_progress=show_progress,
        _targets=reference,
    )


# batches on which "best" compares its two candidate ranges: one batch (16 crops) makes the
# choices of two on MobileNetV2 and EfficientNet-Lite0, int8 and 10 % int16 (the candidates
# are 1.4-2.1 dB apart), in half the time
_COMPARED_BATCHES = 1


def _check_options(options: dict[str, Any]) -> None:
    """Learned-rounding options are ``weight_reconstruction``'s arguments, checked before
    anything runs."""
    import inspect

    from fxq.calibration.reconstruction import check_block_depth, weight_reconstruction

    allowed = set(inspect.signature(weight_reconstruction).parameters) - {
        "model",
        "data",
        "input_fn",
        "show_progress",
        "num_batches",
        "_recorded",
    }
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(
            f"ptq: unknown option(s) {unknown}; the learned-rounding options are "
            f"{', '.join(sorted(allowed))} (weight_reconstruction's arguments)"
        )
    check_block_depth(options.get("block_depth"))


def _recording_targets(
    model: nn.Module, batches: list[Any], rounding: dict, input_fn, skipped: set[str]
):
    """``recording_outputs`` of the blocks' last layers (but ``skipped``) on the batches that
    learned rounding will use; a null context (yielding None) where none can be recorded."""
    from fxq.calibration import reconstruction

    names = reconstruction.block_outputs(model, rounding.get("block_depth"))
    names = [n for n in names or () if n not in skipped]
    if not names:
        return contextlib.nullcontext()
    used = batches if rounding.get("num_batches") is None else batches[: rounding["num_batches"]]
    if rounding.get("num_samples") is not None:
        used = reconstruction.leading_batches(model, used, rounding["num_samples"], input_fn)
    return reconstruction.recording_outputs(model, names, len(used))


@contextlib.contextmanager
def _first_outputs(model: nn.Module, count: int) -> Iterator[list[torch.Tensor]]:
    """Within the block, the model's flattened outputs of its first ``count`` calls are
    collected: while calibrating, the float model's outputs (calibration passes float
    activations through), the reference that "best" compares its candidate ranges with."""
    from fxq.calibration.auto import _flatten_outputs

    outputs: list[torch.Tensor] = []

    def keep(module, args, output):
        if len(outputs) < count:
            outputs.append(_flatten_outputs(output).detach())

    handle = model.register_forward_hook(keep) if count else None
    try:
        yield outputs
    finally:
        if handle is not None:
            handle.remove()


def _outputs(model: nn.Module, batches: list[Any], input_fn, context) -> list[torch.Tensor]:
    """The model's flattened outputs on the first batches, in eval mode and VALIDATION,
    within ``context(model)`` (``bypass``: float; ``float_fake_quant``: quantized)."""
    from fxq.calibration.auto import _flatten_outputs
    from fxq.calibration.reconstruction import layerwise_session

    with layerwise_session(model, copy_reference=False), context(model):
        outs = run_batches(model, batches[:_COMPARED_BATCHES], None, input_fn, show_progress=False)
    return [_flatten_outputs(o) for o in outs]


def _output_error(model: nn.Module, batches: list[Any], reference, input_fn) -> float:
    """Squared error of the model's outputs (float fake-quant arithmetic, with QAT training's
    faster rounding: it only ranks candidates) against ``reference``."""
    from fxq.calibration.reconstruction import _quantized_arithmetic

    outs = _outputs(model, batches, input_fn, _quantized_arithmetic)
    return sum(float((o - r).pow(2).sum()) for o, r in zip(outs, reference))


def _activation_error(model: nn.Module, batches: list[Any], reference, input_fn) -> float:
    """``_output_error`` with the weights unrounded: the error that learned rounding cannot
    take away (their fake quants are bypassed; the activations' are not)."""
    with bypassed(weight_quants(model)):
        return _output_error(model, batches, reference, input_fn)


def _fast_bc(model, batches, input_fn, show_progress, means) -> None:
    from fxq.calibration.bias_correction import fast_bias_correction

    fast_bias_correction(model, batches, input_fn, show_progress, skip_depthwise=True, means=means)
