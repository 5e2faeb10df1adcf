"""Weight rounding and bias correction after calibration.

``weight_reconstruction`` visits the conv / linear layers in the order the
model runs them. For each layer it records, on calibration data,

* its inputs in the quantized model (activations fake-quantized, earlier
  layers already reconstructed), and
* its inputs and output in the float model,

then:

Targets always come from the model as it was before the call. On a
GraphModule the model and its float copy are each run once, node by node, in
step with the layers (``_Stream``): a layer's inputs are read when the run
reaches it, after the layers before it have changed, so the cost of the
recording is two forward passes in all, not two per layer (MobileNetV2, 96
crops: block-wise learned rounding 189 s -> 82 s on 2 cores). ``ptq`` records
the float block outputs in its calibration pass instead (``recording_outputs``;
the same model, run once before the call), so the float copy runs only for
the blocks it could not record.

1. **learned rounding** (AdaRound, Nagel et al. 2020): each weight rounds
   down or up (``floor(w / s) + h``, ``h`` in {0, 1}) instead of to the
   nearest value. ``h`` is relaxed to a rectified sigmoid ``h(V)`` and ``V``
   is trained so that the layer fed the *quantized* inputs reproduces the
   *float* model's output (so the weights also absorb the error of the
   activations before them), with a regulariser that drives ``h`` to 0 or 1
   (``beta`` annealed from 20 to 2 after a warm-up). The weight scale is kept:
   the elements that set each channel's range keep their nearest rounding.
   With ``float_activations=True`` every activation stays float while
   learning (AdaRound's own setting): the rounding then approximates the float
   weights alone, without fitting the activations' rounding error of the
   calibration samples. That is worse where the activations are int8 (their
   error is what the learning takes away), better where the most sensitive
   ones are int16 (``docs/accuracy_log.md``, fourteenth session).
2. **bias correction** (Nagel et al. 2019, empirical): the mean shift per
   output channel that quantizing the weights causes, ``E[(W_q - W) x]`` on
   the inputs the layer sees in the quantized model, is subtracted from its
   bias (BatchNorm's ``beta`` when a BatchNorm is folded in). Only the
   weights' shift is corrected: correcting the whole difference to the float
   model would fit per-channel means of the calibration images themselves.

The model keeps its prepared form: only weights and biases change (a layer
without a bias gets one), so QAT can continue from it.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import inspect
import itertools
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from tabulate import tabulate
from torch import Tensor, nn
from torch.fx import Graph, GraphModule, Interpreter, Node

from fxq.calibration.data import batch_list
from fxq.calibration.runner import (
    average_over_ranks,
    batch_arguments,
    call_order,
    fast_layout,
    keep_rank0_result,
    progress,
    require_calibrated,
)
from fxq.debug import float_fake_quant
from fxq.fake_quantize import (
    FakeQuantState,
    activation_quants,
    bypass,
    bypassed,
    set_fake_quantize,
    training_rounding,
)
from fxq.fused import ACTIVATIONS
from fxq.qat.weighted import WeightedQAT

__all__ = ["weight_reconstruction"]

_ZETA, _GAMMA = 1.1, -0.1  # rectified sigmoid stretch (AdaRound)


def _rectified_sigmoid(v: Tensor) -> Tensor:
    return (torch.sigmoid(v) * (_ZETA - _GAMMA) + _GAMMA).clamp(0.0, 1.0)


def _inverse_rectified_sigmoid(h: Tensor) -> Tensor:
    p = ((h - _GAMMA) / (_ZETA - _GAMMA)).clamp(1e-4, 1 - 1e-4)
    return torch.log(p / (1 - p))


def _layers_in_order(model: nn.Module, batch: Any, input_fn) -> list[tuple[str, WeightedQAT]]:
    """Weighted layers in the order the model runs them (call-site copies share their weight: once)."""
    layers = _learned_layers(model)
    order = _graph_order(model, layers)
    if order is None:  # layers called from inside other modules: run the model to see
        order = call_order(model, layers, batch, input_fn)
    return _named_once(model, order)


def _learned_layers(model: nn.Module) -> list[WeightedQAT]:
    """The layers whose rounding is learned (standalone ones, in fx_wrap code, keep float)."""
    return [m for m in model.modules() if isinstance(m, WeightedQAT) and not m.standalone]


def _named_once(model: nn.Module, order: list[nn.Module]) -> list[tuple[str, WeightedQAT]]:
    """``order`` with the layers' names, each weight once (call-site copies share theirs)."""
    names = {id(m): n for n, m in model.named_modules()}
    out, weights = [], set()
    for m in order:
        if id(m.weight) not in weights:
            weights.add(id(m.weight))
            out.append((names[id(m)], m))
    return out


def _graph_order(model: nn.Module, layers: list[WeightedQAT]) -> list[nn.Module] | None:
    """The layers in the order a GraphModule's graph calls them, or None when a layer is not
    called by the graph itself (it runs inside another module, whose calls the graph does
    not show)."""
    if not isinstance(model, GraphModule):
        return None
    order = []
    for node in model.graph.nodes:
        if node.op != "call_module":
            continue
        module = model.get_submodule(node.target)
        if isinstance(module, WeightedQAT):
            order.append(module)
        elif any(isinstance(m, WeightedQAT) for m in module.modules()):
            return None
    called = {id(m) for m in order}
    return order if all(id(m) in called for m in layers) else None


def _capture_inputs(
    model: nn.Module, layer: nn.Module, batches: list[Any], input_fn
) -> list[tuple[Tensor, ...]]:
    captured: list[tuple[Tensor, ...]] = []

    def hook(mod, inp):
        if len(captured) < len(batches):  # the first call site only
            captured.append(tuple(t.detach().clone() for t in inp))
        raise _Stop

    handle = layer.register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            for batch in batches:
                args, kwargs = batch_arguments(model, batch, input_fn)
                with contextlib.suppress(_Stop):
                    model(*args, **kwargs)
    finally:
        handle.remove()
    return captured


class _Stop(Exception):
    """Ends a forward pass once the layer's inputs are recorded."""


def _pre_activation(
    layer: WeightedQAT, inputs: tuple[Tensor, ...], weight_out_major: Tensor, bias: Tensor | None
) -> Tensor:
    y = layer.float_op_forward(inputs[0], layer.weight_from_out_major(weight_out_major), bias)
    if layer.add:
        y = y + inputs[1]
    return y


def _activate(layer: WeightedQAT, y: Tensor) -> Tensor:
    return ACTIVATIONS[layer.activation](y) if layer.activation else y


def _expand(t: Tensor) -> list[int]:
    return [-1] + [1] * (t.dim() - 1)


class _Rounding:
    """The rounding variables of one layer's folded weight (out-major layout).

    ``weight(h)`` is ``s * clamp(floor(w / s) + h, qmin, qmax)``; the weights
    that set a channel's range (``|w / s| >= qmax - 1/2``) keep their nearest
    rounding so that the scale does not change.
    """

    def __init__(self, layer: WeightedQAT) -> None:
        self.layer = layer
        dtype = layer.weight_fake_quant.dtype
        self.qmin, self.qmax = dtype.qmin, dtype.qmax
        with torch.no_grad():
            w = layer.folded_weight().detach()
            self.scale = layer.weight_fake_quant.scale.detach().reshape(_expand(w))
            ratio = w / self.scale
            self.low = torch.floor(ratio)
            self.nearest = torch.floor(ratio + 0.5) - self.low  # what round-half-up picks
            self.frozen = ratio.abs() >= self.qmax - 0.5
        self.v = _inverse_rectified_sigmoid(ratio - self.low).requires_grad_(True)

    def weight(self, h: Tensor) -> Tensor:
        h = torch.where(self.frozen, self.nearest, h)
        return (self.low + h).clamp(self.qmin, self.qmax) * self.scale

    def soft(self) -> tuple[Tensor, Tensor]:
        h = _rectified_sigmoid(self.v)
        return self.weight(h), h

    def hard(self) -> Tensor:
        return self.weight((self.v >= 0).to(self.low.dtype))

    def nearest_weight(self) -> Tensor:
        return self.weight(self.nearest)

    def write_back(self, folded: Tensor) -> None:
        """Store a folded out-major weight as the layer's (unfolded) weight. A channel whose
        BatchNorm factor is 0 (a zero-initialised last ``gamma``) folds to 0 whatever its
        weight: it keeps the weight it has (dividing by the factor would make it NaN)."""
        layer = self.layer
        with torch.no_grad():
            factor = layer.bn_factor()
            unfolded = folded
            if factor is not None:
                factor = factor.reshape(_expand(folded))
                nonzero = factor != 0
                current = layer.weight_to_out_major(layer.weight)
                unfolded = torch.where(nonzero, folded / torch.where(nonzero, factor, 1), current)
            layer.weight.copy_(layer.weight_from_out_major(unfolded))


# samples on which learned rounding is compared with nearest rounding (a forward pass on
# every sample, twice per block, was a sixth of "best"'s time on MobileNetV2; with 32 samples
# the checks cost more than 12 training steps; 16 gave the same choices on MobileNetV2; 8,
# with "best" at 20.01 / 21.67 dB on MobileNetV2 / EfficientNet-Lite0, 0.3 s less)
_CHECKED_SAMPLES = 8


def _over_ranks(loss: Tensor) -> float:
    """``loss`` averaged over the ranks (itself outside a distributed run), so that every
    rank keeps or drops the learned rounding alike."""
    loss = loss.detach().reshape(1).to(torch.float64)
    average_over_ranks([loss])
    return float(loss)


def _learn(
    roundings: list[_Rounding],
    loss_of: Callable[[list[Tensor], Tensor], Tensor],
    samples: int,
    iters: int,
    lr: float,
    reg_weight: float,
    beta: tuple[float, float],
    warmup: float,
    batch_size: int,
) -> tuple[float, float]:
    """Train the rounding variables against ``loss_of(weights, sample_index)``, harden,
    keep the result only if it beats nearest rounding, write it back; returns the
    losses with nearest and with the final rounding, on the first ``_CHECKED_SAMPLES``
    samples."""
    checked = torch.arange(min(samples, _CHECKED_SAMPLES))
    with torch.no_grad():
        before = _over_ranks(loss_of([r.nearest_weight() for r in roundings], checked))
    variables = [r.v for r in roundings]
    # the fused step (one kernel for all variables) where torch has one: a third of the
    # per-step optimizer time on CPU
    try:
        fused = all(v.device.type in ("cpu", "cuda") for v in variables)
        opt = torch.optim.Adam(variables, lr=lr, fused=fused or None)
    except RuntimeError:  # torch < 2.4 fuses on CUDA only
        opt = torch.optim.Adam(variables, lr=lr)
    start = int(warmup * iters)
    generator = torch.Generator().manual_seed(0)
    for it in range(iters):
        idx = torch.randperm(samples, generator=generator)[: min(batch_size, samples)]
        soft = [r.soft() for r in roundings]
        loss = loss_of([w for w, _ in soft], idx)
        if it >= start:
            b_now = beta[0] + (beta[1] - beta[0]) * (it - start) / max(iters - start, 1)
            for _, h in soft:
                loss = loss + reg_weight * (1 - (2 * h - 1).abs().pow(b_now)).mean()
        opt.zero_grad()
        loss.backward()
        average_over_ranks([r.v.grad for r in roundings if r.v.grad is not None])  # DDP
        opt.step()
    with torch.no_grad():
        learned = [r.hard() for r in roundings]
        after = _over_ranks(loss_of(learned, checked))
        if after > before:  # learning did not help: keep nearest rounding
            learned, after = [r.nearest_weight() for r in roundings], before
        for r, w in zip(roundings, learned):
            r.write_back(w)
    return before, after


def _layer_loss(layer: WeightedQAT, quant_in: list[tuple[Tensor, ...]], targets: list[Tensor]):
    """Loss of one layer fed its quantized inputs, against the float layer's outputs."""
    x = torch.cat([t[0] for t in quant_in])
    res = torch.cat([t[1] for t in quant_in]) if layer.add else None
    target = torch.cat(targets)
    norm = target.pow(2).mean().clamp(min=1e-12)
    bias = layer.folded_bias()
    bias = None if bias is None else bias.detach()

    def loss_of(weights: list[Tensor], idx: Tensor) -> Tensor:
        idx = idx.to(x.device)
        inputs = (x[idx],) if res is None else (x[idx], res[idx])
        y = _activate(layer, _pre_activation(layer, inputs, weights[0], bias))
        return (y - target[idx]).pow(2).mean() / norm

    return loss_of, x.shape[0]


def _correct_bias(layer: WeightedQAT, delta: Tensor) -> None:
    """Shift the layer's (folded) bias by ``-delta`` per output channel."""
    with torch.no_grad():
        bn = layer.bn
        if bn is not None:
            if bn.bias is not None:
                bn.bias -= delta
            else:
                bn.running_mean += delta / layer.bn_factor()
        elif layer.bias is not None:
            layer.bias -= delta
        else:
            layer.bias = nn.Parameter(-delta.clone())


def rounded_weight(layer: WeightedQAT, w: Tensor | None = None) -> Tensor:
    """The layer's folded weight (or ``w``) rounded to nearest on its weight grid, out-major."""
    w = layer.folded_weight() if w is None else w
    scale = layer.weight_fake_quant.scale.reshape(_expand(w))
    dtype = layer.weight_fake_quant.dtype
    return torch.floor(w / scale + 0.5).clamp(dtype.qmin, dtype.qmax) * scale


def _bias_shift(layer: WeightedQAT, quant_in: list[tuple[Tensor, ...]]) -> Tensor:
    """``E[(W_q - W) x]`` per output channel on the inputs the layer sees."""
    with torch.no_grad():
        w_now = layer.folded_weight()
        wq = rounded_weight(layer, w_now)
        b_now = layer.folded_bias()
        axis = layer._out_axis
        diffs = []
        for tq in quant_in:
            d = _pre_activation(layer, tq, wq, b_now) - _pre_activation(layer, tq, w_now, b_now)
            diffs.append(d.transpose(0, axis % d.dim()).reshape(d.shape[axis], -1).mean(1))
        return torch.stack(diffs).mean(0)


@contextlib.contextmanager
def layerwise_session(model: nn.Module, copy_reference: bool = True) -> Iterator[nn.Module | None]:
    """Eval mode and VALIDATION for a layer-by-layer algorithm; yields the float reference.

    The reference is an untouched copy (the model itself changes layer after
    layer, its targets must not); ``copy_reference=False`` yields None and
    keeps only a copy of the parameters and buffers, for the restore. Training
    flags, fake-quant states and the parameters' gradients (an algorithm's
    backward passes reach the BatchNorm parameters folded into the weights) are
    put back on exit; on a failure (an exception, Ctrl-C) every weight and bias
    is too, and biases the algorithm created are removed.
    """
    states = {m: m.state for m in model.modules() if hasattr(m, "set_fake_quant_state")}
    grads = {p: p.grad for p in model.parameters()}
    training = model.training
    model.eval()
    set_fake_quantize(model, FakeQuantState.VALIDATION)
    reference = copy.deepcopy(model) if copy_reference else None
    saved = (
        None if copy_reference else {k: v.detach().clone() for k, v in model.state_dict().items()}
    )
    biasless = [m for m in model.modules() if isinstance(m, WeightedQAT) and m.bias is None]
    completed = False
    try:
        yield reference
        completed = True
    finally:
        if not completed:  # a failure leaves the model as it was
            for m in biasless:
                m.bias = None
            model.load_state_dict(reference.state_dict() if saved is None else saved)
        for m, state in states.items():
            m.set_fake_quant_state(state)
        for p, grad in grads.items():
            p.grad = grad
        model.train(training)


# -- block-wise reconstruction ------------------------------------------------------------
def _block_graph(
    gm: GraphModule, layer_targets: list[str]
) -> tuple[GraphModule, list[str], str, int]:
    """The sub-graph from the first to the last layer of a block.

    Returns the sub-module (sharing gm's modules), the names of the nodes it
    reads from outside (its inputs), the name of its output node and the index
    of its first node in gm's graph.
    """
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    layer_nodes = [n for n in nodes if n.op == "call_module" and n.target in layer_targets]
    first = min(index[n] for n in layer_nodes)
    last = max(index[n] for n in layer_nodes)
    inside = nodes[first : last + 1]
    members = set(inside)
    graph = Graph()
    env: dict[Node, Node] = {}
    outside: list[str] = []
    for node in inside:
        for inp in node.all_input_nodes:
            if inp not in members and inp not in env:
                env[inp] = graph.placeholder(inp.name)
                outside.append(inp.name)
        env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(env[nodes[last]])
    return GraphModule(gm, graph), outside, nodes[last].name, first


class _Stream:
    """Runs a graph node by node over every calibration batch at once, keeping a value
    only while a later node reads it.

    Layer-by-layer algorithms advance two streams (the model being changed and
    its float reference) to each layer in turn, read the values they need, and
    go on: the model runs once in all instead of once per layer, and the
    values after a layer come from its weights as they are when the stream
    passes it.
    """

    def __init__(self, gm: GraphModule, batches: list[Any], input_fn, context) -> None:
        self.gm, self.context = gm, context
        self.nodes = list(gm.graph.nodes)
        self.index = {n.name: i for i, n in enumerate(self.nodes)}
        last_use = {n: i for i, n in enumerate(self.nodes)}
        for i, n in enumerate(self.nodes):
            for inp in n.all_input_nodes:
                last_use[inp] = i
        self.free_after: dict[int, list[Node]] = {}
        for n, i in last_use.items():
            self.free_after.setdefault(i, []).append(n)
        signature = inspect.signature(gm.forward)
        self.runs = []
        for batch in batches:
            args, kwargs = batch_arguments(gm, batch, input_fn)
            run = Interpreter(gm, garbage_collect_values=False)
            run.env, run.args_iter = {}, iter(signature.bind(*args, **kwargs).args)
            self.runs.append(run)
        self.position = 0

    def advance(self, stop: int) -> None:
        """Run the nodes before index ``stop``."""
        with self.context(self.gm), torch.no_grad():
            for i in range(self.position, stop):
                node = self.nodes[i]
                for run in self.runs:
                    if node.op != "output":
                        run.env[node] = run.run_node(node)
                for done in self.free_after.get(i, ()):
                    for run in self.runs:
                        run.env.pop(done, None)
        self.position = max(self.position, stop)

    def values(self, name: str) -> list[Any]:
        """The value of node ``name`` in every batch (it must have run)."""
        node = self.nodes[self.index[name]]
        return [run.env[node] for run in self.runs]

    def arguments(self, name: str) -> list[tuple[Any, ...]]:
        """The positional arguments of node ``name`` in every batch (its inputs must have run)."""
        node = self.nodes[self.index[name]]
        return [run.fetch_args_kwargs_from_env(node)[0] for run in self.runs]


def check_block_depth(block_depth: Any) -> None:
    """Raise unless ``block_depth`` is None, an int >= 0 or ``"auto"``."""
    if (
        block_depth is not None
        and block_depth != "auto"
        and (isinstance(block_depth, bool) or not isinstance(block_depth, int) or block_depth < 0)
    ):
        raise ValueError(
            f"weight_reconstruction: block_depth must be None, an int >= 0 or 'auto', got "
            f"{block_depth!r}"
        )


def block_key(name: str, depth: int | str) -> str:
    """The block a layer's path puts it in: its first ``depth`` components, or with
    ``"auto"`` its path up to the first index after the first component (``features.3`` in
    a MobileNet, ``layer1.0`` in a ResNet, ``encoder.layer.0`` in a BERT: one repeated
    block of a ModuleList or Sequential), the first two components where it has none."""
    parts = name.split(".")
    if depth == "auto":
        for i in range(1, len(parts)):
            if parts[i].isdigit():
                return ".".join(parts[: i + 1])
        depth = 2
    return ".".join(parts[:depth])


def _blocks(
    layers: list[tuple[str, WeightedQAT]], depth: int | str
) -> list[list[tuple[str, WeightedQAT]]]:
    """Consecutive layers in the same block (``block_key``)."""
    groups: list[list[tuple[str, WeightedQAT]]] = []
    for name, layer in layers:
        key = block_key(name, depth)
        if groups and block_key(groups[-1][0][0], depth) == key:
            groups[-1].append((name, layer))
        else:
            groups.append([(name, layer)])
    return groups


@contextlib.contextmanager
def _quantized_arithmetic(model: nn.Module) -> Iterator[nn.Module]:
    """The float fake-quant arithmetic with QAT training's faster rounding: the values a
    layer-by-layer algorithm learns from (they differ from the exact rounding's at most by
    a step, where a value lies within a float32 rounding of a half)."""
    with float_fake_quant(model), training_rounding(model):
        yield model


class _Sources:
    """Where a layer-by-layer algorithm reads each layer's inputs in the model being changed
    and the float reference's outputs.

    On a GraphModule two ``_Stream`` s run the model and the reference once, in step with
    the algorithm; on another module forward hooks re-run both up to each layer.
    """

    def __init__(
        self,
        model: nn.Module,
        reference: nn.Module,
        batches: list[Any],
        input_fn,
        layers,
        recorded: dict[str, list[Tensor]] | None = None,
    ) -> None:
        self.model, self.reference = model, reference
        self.recorded = recorded
        self.batches, self.input_fn = batches, input_fn
        self.streams = None
        self.first_call: dict[str, tuple[int, str]] = {}
        if isinstance(model, GraphModule):
            for i, node in enumerate(model.graph.nodes):
                if node.op == "call_module":
                    self.first_call.setdefault(node.target, (i, node.name))
        nested = any(name not in self.first_call for name, _ in layers)
        if isinstance(model, GraphModule) and not nested:  # else hooks re-run up to each layer
            self.streams = (
                _Stream(model, batches, input_fn, _quantized_arithmetic),
                _Stream(reference, batches, input_fn, bypass),
            )

    def layer_inputs(self, name: str, layer: WeightedQAT) -> list[tuple[Tensor, ...]]:
        """The layer's inputs in the model as it is now, per batch."""
        if self.streams is None:
            with _quantized_arithmetic(self.model):
                return _capture_inputs(self.model, layer, self.batches, self.input_fn)
        index, node = self.first_call[name]
        self.streams[0].advance(index)
        return [tuple(a) for a in self.streams[0].arguments(node)]

    def reference_inputs(self, name: str) -> list[tuple[Tensor, ...]]:
        """The float reference layer's inputs, per batch."""
        if self.streams is not None:
            index, node = self.first_call[name]
            self.streams[1].advance(index)
            return [tuple(a) for a in self.streams[1].arguments(node)]
        original = self.reference.get_submodule(name)
        with bypass(self.reference), torch.no_grad():
            return _capture_inputs(self.reference, original, self.batches, self.input_fn)

    def layer_targets(self, name: str) -> list[Tensor]:
        """The float reference layer's outputs (no output quantization), per batch."""
        if self.streams is not None:
            index, node = self.first_call[name]
            self.streams[1].advance(index + 1)
            return self.streams[1].values(node)
        original = self.reference.get_submodule(name)
        float_in = self.reference_inputs(name)
        with bypass(self.reference), torch.no_grad():
            w0, b0 = original.folded_weight().detach(), original.folded_bias()
            return [_activate(original, _pre_activation(original, t, w0, b0)) for t in float_in]

    def block(self, names: list[str]) -> tuple[GraphModule, list[list[Any]], list[Tensor]]:
        """A block's sub-graph, its inputs in the model as it is now and the reference's
        block output, per batch."""
        sub, inputs, output, first = _block_graph(self.model, names)
        quant, ref = self.streams
        quant.advance(first)
        per_input = [quant.values(n) for n in inputs]
        target = quant.nodes[quant.index[output]].target
        if self.recorded is not None and target in self.recorded:
            targets = self.recorded.pop(target)  # recorded while calibrating (read once)
        else:
            ref.advance(ref.index[output] + 1)
            targets = ref.values(output)
        return sub, [list(args) for args in zip(*per_input)], targets


def _same(values: list[Any]) -> bool:
    first = values[0]
    if isinstance(first, Tensor):
        return all(
            isinstance(v, Tensor) and v.shape == first.shape and torch.equal(v, first)
            for v in values
        )
    return all(v == first for v in values)


def _block_chunks(
    args: list[list[Any]], targets: list[Tensor]
) -> tuple[list[list[Any]], list[Tensor], list[bool], bool]:
    """Group a block's per-batch inputs and targets into chunks that training samples from.

    An input is *batched* when in every batch it is a tensor whose first dimension is the
    batch's sample count (others: sizes, masks shared by the samples...). When the batched
    inputs and the targets have the same shape in every batch but the first dimension, and
    the other inputs are the same in every batch, the batches form one chunk (``_Joined``:
    read as one, not copied; samples are then drawn across batches); else each batch is a
    chunk (sequences of other lengths, inputs that differ per batch). When an input that
    is not batched is a number or a size (a reshape to the batch's size, as attention
    does), the block only runs on whole batches: each batch is a chunk and a training step
    takes one whole (the last value returned is then True).
    """
    counts = [t.shape[0] for t in targets]
    batched = [
        all(
            isinstance(a[j], Tensor) and a[j].dim() > 0 and a[j].shape[0] == n
            for a, n in zip(args, counts)
        )
        for j in range(len(args[0]))
    ]
    columns = list(zip(*args))
    sized = any(
        not is_batched and not isinstance(column[0], Tensor)
        for column, is_batched in zip(columns, batched)
    )
    if sized:
        return args, targets, batched, True
    joinable = (
        all(
            len({tuple(v.shape[1:]) for v in column}) == 1 if is_batched else _same(list(column))
            for column, is_batched in zip(columns, batched)
        )
        and len({tuple(t.shape[1:]) for t in targets}) == 1
    )
    if not joinable or len(args) == 1:
        return args, targets, batched, False
    joined = [
        _Joined(list(column)) if is_batched else column[0]
        for column, is_batched in zip(columns, batched)
    ]
    return [joined], [_Joined(targets)], batched, False


class _Joined:
    """The batches' values of a batched input (or their targets) read as one along dim 0,
    without copying them into one tensor: a step gathers its samples from the batches they
    lie in (the copy of every sample, per block, cost more than the steps' gathers)."""

    def __init__(self, parts: list[Tensor]) -> None:
        self.parts = parts
        self.ends = list(itertools.accumulate(p.shape[0] for p in parts))

    def take(self, idx: Tensor) -> Tensor:
        """The samples ``idx`` (indices into the joined dim 0), in that order."""
        pieces = []
        for i in idx.tolist():
            part = bisect.bisect_right(self.ends, i)
            j = i - (self.ends[part - 1] if part else 0)
            pieces.append(self.parts[part][j : j + 1])
        return torch.cat(pieces)


def _rows(value: Tensor | _Joined) -> int:
    return value.ends[-1] if isinstance(value, _Joined) else value.shape[0]


def _take(value: Tensor | _Joined, idx: Tensor) -> Tensor:
    return value.take(idx) if isinstance(value, _Joined) else value[idx.to(value.device)]


def _reconstruct_block(model, sources: _Sources, block, opts) -> tuple[float, float]:
    sub, args, targets = sources.block([n for n, _ in block])
    elements = sum(t.numel() for t in targets)
    norm = (sum(float(torch.linalg.vector_norm(t)) ** 2 for t in targets) / elements) or 1e-12
    chunks, targets, batched, whole = _block_chunks(args, targets)
    ends = torch.tensor([_rows(t) for t in targets]).cumsum(0)
    roundings = [_Rounding(layer) for _, layer in block]

    def squared_error(chunk: int, local: Tensor | None) -> Tensor:
        inputs = [
            _take(a, local) if local is not None and is_batched else a
            for a, is_batched in zip(chunks[chunk], batched)
        ]
        t = targets[chunk] if local is None else _take(targets[chunk], local)
        return (sub(*inputs) - t).pow(2).sum(), t.numel()

    def loss_of(weights: list[Tensor], idx: Tensor) -> Tensor:
        for r, w in zip(roundings, weights):  # the block's layers use these weights
            # (``factor``: ``WeightedQAT.forward`` passes the BatchNorm's; folded into w)
            r.layer.quantized_weight = lambda factor=None, w=w, r=r: r.layer.weight_from_out_major(
                w
            )
        try:  # the samples of idx that lie in the chunk of its first one
            chunk = int(torch.searchsorted(ends, idx[:1], right=True))
            start = 0 if chunk == 0 else int(ends[chunk - 1])
            local = idx[(idx >= start) & (idx < ends[chunk])] - start
            error, count = squared_error(chunk, None if whole else local)
        finally:
            for r in roundings:
                del r.layer.quantized_weight
        return error / count / norm

    # the float fake-quant arithmetic with training's faster rounding, set once for the
    # block (not per step: it walks every module of the model)
    with _quantized_arithmetic(sub):
        return _learn(roundings, loss_of, int(ends[-1]), **opts)


# the most memory the block outputs recorded while calibrating may take (MobileNetV2, 96
# crops: 0.4 GiB); beyond it the reference model is streamed again instead
_RECORDED_BYTES = 2 << 30


def block_outputs(model: nn.Module, block_depth: int | str | None) -> list[str] | None:
    """The layers whose outputs are the blocks' targets in block-wise learning (each
    block's last layer), or None where they cannot be recorded with forward hooks: layer
    by layer, a model that is not a GraphModule or whose graph does not call every layer
    itself, or a last layer that the graph calls more than once."""
    if block_depth is None or not isinstance(model, GraphModule):
        return None
    order = _graph_order(model, _learned_layers(model))
    if order is None:
        return None
    ordered = _named_once(model, order)
    calls: dict[str, int] = {}
    for node in model.graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    nodes = list(model.graph.nodes)
    lasts = []
    for group in _blocks(ordered, block_depth):
        targets = {n for n, _ in group}
        last = max(
            (i for i, n in enumerate(nodes) if n.op == "call_module" and n.target in targets)
        )
        if calls[nodes[last].target] != 1:
            return None
        lasts.append(nodes[last].target)
    return lasts


class RecordedOutputs:
    """The outputs of some layers over the first batches, recorded by forward hooks while
    the model runs (``recording_outputs``). ``values`` maps each layer to its output per
    batch; None when recording stopped (more than ``_RECORDED_BYTES``, or an output that is
    not a tensor)."""

    def __init__(self, names: list[str], batches: int) -> None:
        self.batches = batches
        self.values: dict[str, list[Tensor]] | None = {n: [] for n in names}
        self.bytes = 0

    def add(self, name: str, output: Any) -> None:
        if self.values is None or len(self.values[name]) >= self.batches:
            return
        if not isinstance(output, Tensor):
            self.values = None
            return
        self.bytes += output.numel() * output.element_size()
        if self.bytes > _RECORDED_BYTES:
            self.values = None  # too large: the reference is streamed instead
            return
        self.values[name].append(output.detach().clone())

    def complete(self) -> dict[str, list[Tensor]] | None:
        """The recordings when every layer was recorded on every batch, else None."""
        if self.values is None:
            return None
        if any(len(v) != self.batches for v in self.values.values()):
            return None
        return self.values


@contextlib.contextmanager
def recording_outputs(
    model: nn.Module, names: list[str], batches: int
) -> Iterator[RecordedOutputs]:
    """Within the block, the outputs of the layers ``names`` on the first ``batches`` calls
    are recorded. Run around a calibration pass (which passes float activations through),
    they are the float model's block outputs that block-wise learned rounding is trained
    to reproduce, and its float reference need not run again."""
    recorded = RecordedOutputs(names, batches)
    handles = [
        model.get_submodule(n).register_forward_hook(
            lambda module, args, output, n=n: recorded.add(n, output)
        )
        for n in names
    ]
    try:
        yield recorded
    finally:
        for h in handles:
            h.remove()


def leading_batches(
    model: nn.Module, batches: list[Any], num_samples: int, input_fn=None
) -> list[Any]:
    """The first batches that together hold at least ``num_samples`` samples (all of them
    when they hold fewer). A batch's samples are the first dimension of its first tensor
    argument (one when it has none)."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be at least 1, got {num_samples}")
    seen = 0
    for i, batch in enumerate(batches):
        args, kwargs = batch_arguments(model, batch, input_fn)
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)), None)
        seen += first.shape[0] if first is not None and first.dim() > 0 else 1
        if seen >= num_samples:
            return batches[: i + 1]
    return batches


def weight_reconstruction(
    model: nn.Module,
    data: Iterable[Any],
    num_batches: int | None = None,
    num_samples: int | None = None,
    iters: int = 300,
    batch_size: int = 4,
    lr: float = 3e-2,
    reg_weight: float = 0.01,
    beta: tuple[float, float] = (20.0, 2.0),
    warmup: float = 0.2,
    learned_rounding: bool = True,
    bias_correction: bool = False,
    block_depth: int | str | None = None,
    float_activations: bool = False,
    input_fn: Callable[[Any], Any] | None = None,
    show_progress: bool | None = None,
    show: bool = True,
    *,
    _recorded: dict[str, list[Tensor]] | None = None,
) -> list[dict[str, Any]]:
    """Learned weight rounding and bias correction for a calibrated model.

    Args:
        model: a calibrated model from ``prepare_qat_fx`` (activation scales
            must exist); modified in place, keeping its prepared form.
        data: calibration batches (see ``fxq.calibration.calibrate``).
        num_batches: how many batches to learn from (all by default).
        num_samples: learn from the first batches that hold at least this many
            samples (whole batches; a batch's samples are the first dimension
            of its first tensor argument): the cost of the recorded streams
            grows with the samples, the learning's steps do not.
        iters, batch_size, lr, reg_weight, beta, warmup: the learned-rounding
            optimisation (Adam on the rounding variables, samples drawn from the
            recorded batches).
        learned_rounding, bias_correction: the two steps. Bias correction is off
            by default: with per-channel weights the shift it corrects is small
            (on ImageNet MobileNetV2 it changed SQNR by -0.3 to 0.0 dB after
            learned rounding); it matters more for coarse per-tensor weights.
        block_depth: None learns layer by layer. An integer learns block by
            block: consecutive layers whose paths share their first
            ``block_depth`` components (2: ``layer1.0`` in a ResNet,
            ``features.3`` in a MobileNet; 0: the whole model) are trained
            together on the block's output, with the activations between them
            fake-quantized. ``"auto"``: a block is one element of the model's repeated blocks,
            the path up to its first index (``layer1.0``, ``features.3``, and
            ``encoder.layer.0`` in a BERT, where depth 2 would make the whole
            encoder one block); ``block_key``.
            Samples are drawn across batches when the batches stack; a block
            that reads the batch size as a number (attention's reshapes), or
            batches of other shapes (padded sequences of other lengths), train
            on one whole batch per step.
        float_activations: learn with every activation fake quant bypassed
            (the layers' inputs and the activations inside a block float; the
            weights quantized): the rounding approximates the float weights
            instead of also compensating the activations' rounding. Better
            when the sensitive activations are int16 (MobileNetV2 with 10 %
            int16, ``best``: 23.2 -> 24.2 dB), much worse in all-int8 models
            (22.1 -> 18.9 dB).
        _recorded: internal (``ptq``): the float block outputs recorded while
            calibrating (``recording_outputs``), read instead of streaming the
            float reference.

    Returns:
        one row per layer (per block with ``block_depth``): ``layer``, the
        relative output error on the first 8 samples with nearest rounding
        (``error_nearest``) and after (``error_learned``; the learned rounding
        is kept only where it is lower), and the RMS bias shift
        (``bias_shift``).

    Raises:
        RuntimeError: when the model is not calibrated.
        ValueError: when ``data`` yields no batch, or ``block_depth`` is used on
            a model that is not a GraphModule.

    A failure part-way (an exception, Ctrl-C) restores the model's weights and biases.
    """
    batches = batch_list(data, num_batches, "weight_reconstruction", ranks="nonempty")
    if num_samples is not None:
        batches = leading_batches(model, batches, num_samples, input_fn)
    batches = fast_layout(model, batches, input_fn)
    check_block_depth(block_depth)
    if block_depth is not None and not isinstance(model, GraphModule):
        raise ValueError(
            "block-wise reconstruction needs the GraphModule returned by prepare_qat_fx"
        )
    require_calibrated(model, "weight_reconstruction")
    opts = {
        "iters": iters,
        "lr": lr,
        "reg_weight": reg_weight,
        "beta": beta,
        "warmup": warmup,
        "batch_size": batch_size,
    }
    rows = []
    floats = activation_quants(model) if float_activations else []
    with layerwise_session(model) as reference, bypassed(floats):
        layers = _layers_in_order(model, batches[0], input_fn)
        sources = _Sources(model, reference, batches, input_fn, layers, _recorded)
        if block_depth is not None and sources.streams is None:
            inside = [n for n, _ in layers if n not in sources.first_call] or ["some layers"]
            warnings.warn(
                f"weight_reconstruction: {', '.join(inside[:5])} run inside other modules (the "
                "graph does not call them), so the model cannot be cut into blocks; learning "
                "layer by layer instead (block_depth=None)",
                stacklevel=2,
            )
            block_depth = None
        groups = (
            [[entry] for entry in layers] if block_depth is None else _blocks(layers, block_depth)
        )
        for group in progress(groups, len(groups), "weight reconstruction", show_progress):
            row: dict[str, Any] = {
                "layer": group[0][0] if len(group) == 1 else ", ".join(n for n, _ in group)
            }
            if learned_rounding:
                if block_depth is None:
                    name, layer = group[0]
                    quant_in = sources.layer_inputs(name, layer)
                    targets = sources.layer_targets(name)
                    loss_of, samples = _layer_loss(layer, quant_in, targets)
                    before, after = _learn([_Rounding(layer)], loss_of, samples, **opts)
                else:
                    before, after = _reconstruct_block(model, sources, group, opts)
                row.update(error_nearest=before, error_learned=after)
            if bias_correction:
                shifts = []
                for name, layer in group:
                    delta = _bias_shift(layer, sources.layer_inputs(name, layer))
                    _correct_bias(layer, delta)
                    shifts.append(delta.pow(2).mean())
                row["bias_shift"] = float(torch.stack(shifts).mean().sqrt())
            rows.append(row)
    keep_rank0_result(model)  # each rank learned from its own batches
    if show:
        headers = ["layer", "error_nearest", "error_learned", "bias_shift"]
        print(
            tabulate(
                [[r.get(h, "") for h in headers] for r in rows], headers=headers, floatfmt=".4g"
            )
        )
    return rows
