"""Running a model node by node and keeping what each node computed.

The float model, its QAT model and its integer model share node names:
``prepare_qat_fx`` and ``convert_fx`` keep the names of the fused float graph
(``fxq.fuse_fx``) and only add nodes at quantization borders (``x_quant``,
``fc_dequant``). A module called at several places keeps one node per call
(``conv``, ``conv_1``), and in the QAT / integer model each call site has its
own module (``conv``, ``conv_call1``). So the debug tools match layers by node
name, and a float model is compared through its fused graph.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Interpreter, Node
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from fxq.calibration.data import batch_arguments, positional_arguments
from fxq.fake_quantize import FakeQuantize, FakeQuantState, check_non_finite, fake_quantize_ste
from fxq.fx.fuse import fuse_fx
from fxq.fx.tracer import bind_root, call_wrapped_method
from fxq.march import get_march_spec, spec_for
from fxq.qat.base import QATModule
from fxq.qtensor import QTensor
from fxq.quantized.base import QuantizedModule

__all__ = [
    "is_fxq_model",
    "is_converted",
    "require_fake_quant_model",
    "vendor_argument_ignored",
    "model_inputs",
    "as_graph",
    "as_inputs",
    "snapshot",
    "Recorder",
    "eval_no_grad",
    "validation_state",
    "node_type",
    "output_scale",
]


def is_fxq_model(model: nn.Module) -> bool:
    """True for a model made by ``prepare_qat_fx`` or ``convert_fx``."""
    return any(isinstance(m, (FakeQuantize, QATModule, QuantizedModule)) for m in model.modules())


def is_converted(model: nn.Module) -> bool:
    """True for a model made by ``convert_fx`` (it holds integer modules)."""
    return any(isinstance(m, QuantizedModule) for m in model.modules())


def require_fake_quant_model(model: nn.Module, who: str, role: str) -> None:
    """Raise unless ``model`` is a calibrated or QAT model from ``prepare_qat_fx``.

    Raises:
        TypeError: a float model, or a converted (integer) model, naming ``who`` and ``role``.
    """
    if is_converted(model):
        raise TypeError(
            f"{who}: {role} is a converted (integer) model from fxq.convert_fx, but a "
            "fake-quant model is needed; pass the calibrated or QAT model from "
            "fxq.prepare_qat_fx (the one you converted), or compare an integer model with "
            "fxq.debug.featuremap_similarity / compare_qat_quantized"
        )
    if not any(isinstance(m, (FakeQuantize, QATModule)) for m in model.modules()):
        raise TypeError(
            f"{who}: {role} must be the calibrated or QAT model from fxq.prepare_qat_fx, "
            f"got a float {type(model).__name__}"
        )


_NOTED: set[tuple[str, str]] = set()


def vendor_argument_ignored(who: str, argument: str, why: str) -> None:
    """Warn once per process that ``who`` accepts the vendor plugin's ``argument`` but
    ignores it, and why (a ``UserWarning`` naming the argument)."""
    if (who, argument) in _NOTED:
        return
    _NOTED.add((who, argument))
    warnings.warn(
        f"{who}: `{argument}` (an argument of the vendor plugin's tool) is accepted and "
        f"ignored: {why}",
        stacklevel=3,
    )


def model_inputs(
    model: nn.Module, batch: Any, input_fn: Callable[[Any], Any] | None = None
) -> tuple:
    """One batch (``fxq.calibration.data``) as the positional arguments of ``model``'s
    forward, for runners that take positional arguments only (``torch.fx.Interpreter``)."""
    return positional_arguments(model, *batch_arguments(model, batch, input_fn))


def as_graph(model: nn.Module, role: str = "model") -> GraphModule:
    """The graph the debug tools run: fxq models as they are, float models fused.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or is an fxq model that is no
            GraphModule (pass the model ``prepare_qat_fx`` / ``convert_fx`` returned).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"{role}: expected an nn.Module, got {type(model).__name__}")
    if is_fxq_model(model):
        if not isinstance(model, GraphModule):
            raise TypeError(
                f"{role}: {type(model).__name__} holds fxq modules but is no GraphModule; "
                "pass the model returned by fxq.prepare_qat_fx or fxq.convert_fx"
            )
        return model
    return fuse_fx(model)


def as_inputs(inputs: Any) -> tuple:
    """One input or a tuple of positional inputs, as a tuple."""
    return inputs if isinstance(inputs, tuple) else (inputs,)


def snapshot(value: Any) -> Any:
    """A copy of every tensor in ``value`` (a later in-place op may overwrite it)."""
    return tree_map(lambda v: v.clone() if isinstance(v, (Tensor, QTensor)) else v, value)


@contextlib.contextmanager
def eval_no_grad(*models: nn.Module) -> Iterator[None]:
    """Eval mode and no gradients inside the block; each model's mode is restored."""
    saved = [(m, m.training) for m in models]
    try:
        for m in models:
            m.eval()
        with torch.no_grad():
            yield
    finally:
        for m, training in saved:
            m.train(training)


@contextlib.contextmanager
def validation_state(*models: nn.Module) -> Iterator[None]:
    """Inside the block every fake quant and QAT module of ``models`` is in VALIDATION:
    the arithmetic the converted model runs, with the scales frozen.

    A debug tool measures the quantized model as it will be deployed, and never changes
    its numbers: in CALIBRATION state a model computes in float and its observers would
    record the debug inputs, and in QAT state they would move the scales. Modules already
    in VALIDATION are left alone. Entering switches the others as ``set_fake_quantize``
    does (a deferred observer's pending statistics become its scale, as ``state_dict``
    would make them); on exit each switched module gets its state back directly (the
    switch back would finalize and warn again). Float and converted models hold no such
    module and are untouched.

    Raises:
        ValueError: a fake quant saw NaN or Inf (``fxq.fake_quantize.check_non_finite``);
            nothing is switched then.
    """
    found: dict[int, nn.Module] = {}
    for model in models:
        for m in model.modules():
            state = getattr(m, "state", None)
            if (
                hasattr(m, "set_fake_quant_state")
                and isinstance(state, FakeQuantState)
                and state is not FakeQuantState.VALIDATION
            ):
                found.setdefault(id(m), m)
    for model in models:  # every NaN / Inf first, so that none is switched on an error
        check_non_finite(model)
    switched: list[tuple[nn.Module, FakeQuantState]] = []
    try:
        for m in found.values():
            state = m.state
            m.set_fake_quant_state(FakeQuantState.VALIDATION)
            switched.append((m, state))
        yield
    finally:
        for m, state in switched:
            if isinstance(m, FakeQuantize):
                m.state = state  # the switch back would finalize and warn again
            else:
                m.set_fake_quant_state(state)


def node_type(gm: GraphModule, node: Node) -> str:
    """A short description of what ``node`` runs (module class or function name)."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        fused = getattr(module, "pattern", "") or ""
        name = type(module).__name__
        return f"{name}({fused})" if fused and isinstance(fused, str) else name
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    if node.op == "call_method":
        return f".{node.target}"
    return node.op


def output_scale(gm: GraphModule, node: Node, value: Any) -> float | None:
    """The per-tensor scale of ``node``'s output, when it has one.

    A ``QTensor`` output carries it; a QAT module's output fake quant holds it.
    """
    if isinstance(value, QTensor) and value.scale.numel() == 1:
        return float(value.scale)
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        fq = getattr(module, "activation_post_process", None)
        if (
            isinstance(fq, FakeQuantize)
            and not fq.is_high_precision
            and fq.scale.numel() == 1
            and (fq.is_fixed_scale or bool(fq.observed))
        ):
            return float(fq.scale)
    return None


def call_function_bound(gm: GraphModule, target: Any, args: tuple, kwargs: dict) -> Any:
    """Run a ``call_function`` node's target, binding the root of ``@fx_wrap()`` methods
    (see ``fxq.fx.tracer.bind_root``)."""
    if target is call_wrapped_method:
        args = bind_root(gm, args)
    return target(*args, **kwargs)


class Recorder(Interpreter):
    """Runs a GraphModule and keeps every node's output by node name.

    Args:
        gm: the graph to run.
        keep: which node names to keep (None: every node that computes).
        reference: a Recorder that has run the other model; when given, every op
            of this model and the other model's op of the same name also run on
            the same input, the reference's values rounded as this model rounds
            them (``same_input``): the op's own error, separated from what its
            inputs inherited.
    """

    def __init__(
        self,
        gm: GraphModule,
        keep: Callable[[Node], bool] | None = None,
        reference: Recorder | None = None,
    ) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.keep = keep
        self.reference = reference.values if reference is not None else None
        self.reference_nodes = (
            {node.name: node for node in reference.module.graph.nodes} if reference else None
        )
        self.reference_runner = reference
        self.values: dict[str, Any] = {}
        self.same_input: dict[str, tuple[Any, Any]] = {}

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        return call_function_bound(self.module, target, args, kwargs)

    def run_node(self, n: Node) -> Any:
        out = super().run_node(n)
        if n.op in ("placeholder", "output", "get_attr"):
            if n.op == "placeholder":
                self.values[n.name] = snapshot(out)
            return out
        if self.keep is not None and not self.keep(n):
            return out
        self.values[n.name] = snapshot(out)
        if self.reference is not None:
            same = self._run_on_reference(n)
            if same is not None:
                self.same_input[n.name] = same
        return out

    # -- the op on the other model's inputs -------------------------------------------------
    def _reference_for(self, arg: Node) -> Any:
        ref = self.reference
        if arg.name in ref:
            return ref[arg.name]
        # a node only this model has (a quantize / dequantize at a border): its input's value
        inputs = [a for a in arg.all_input_nodes]
        if len(inputs) == 1:
            return self._reference_for(inputs[0])
        raise KeyError(arg.name)

    def _run_on_reference(self, n: Node) -> tuple[Any, Any] | None:
        """Both models' op on the same input: the reference's values, rounded as this model
        rounds them. Returns ``(reference op output, this op output)`` or None."""

        def convert(arg: Node) -> Any:
            return _like(self._reference_for(arg), self.values.get(arg.name), self._rounding(n))

        try:
            args = torch.fx.node.map_arg(n.args, convert)
            kwargs = torch.fx.node.map_arg(n.kwargs, convert)
        except KeyError:
            return None
        module = self.module.get_submodule(n.target) if n.op == "call_module" else None
        if (
            isinstance(module, QATModule)
            and module.state is not FakeQuantState.CALIBRATION
            and not module.standalone
        ):  # its inputs are on its producers' grids (rounding twice changes nothing)
            args, kwargs = _fake_quantize_inputs((args, kwargs), module)
        try:
            with torch.no_grad():
                mine = snapshot(getattr(self, n.op)(n.target, args, kwargs))
                theirs = self._reference_op(n, args, kwargs)
        except Exception:  # an op that cannot take the other model's values: no value
            return None
        return None if theirs is None else (theirs, mine)

    def _reference_op(self, n: Node, args: Any, kwargs: Any) -> Any:
        """The reference model's node of the same name on ``args`` (identity for a node
        only this model has, a quantize / dequantize at a border)."""
        ref_node = self.reference_nodes.get(n.name) if self.reference_nodes else None
        if ref_node is None:
            tensors = [
                a for a in tree_flatten((args, kwargs))[0] if isinstance(a, (Tensor, QTensor))
            ]
            return _dequantized(tensors[0]) if len(tensors) == 1 else None
        seen = self.reference

        def convert(value: Any, arg: Node) -> Any:
            return _like(_dequantized(value), seen.get(arg.name), get_march_spec().rounding)

        ref_args = _map_like(args, ref_node.args, convert)
        ref_kwargs = {k: _map_like(v, ref_node.kwargs.get(k), convert) for k, v in kwargs.items()}
        return snapshot(
            getattr(self.reference_runner, ref_node.op)(ref_node.target, ref_args, ref_kwargs)
        )

    def _rounding(self, n: Node) -> Any:
        if n.op == "call_module":
            march = getattr(self.module.get_submodule(n.target), "march", None)
            if march is not None:
                return spec_for(march).rounding
        return get_march_spec().rounding


def _dequantized(value: Any) -> Any:
    return value.dequantize() if isinstance(value, QTensor) else value


def _map_like(value: Any, template: Any, convert: Callable[[Any, Node], Any]) -> Any:
    """Convert the leaves of ``value`` that sit where ``template`` (node arguments) has a Node."""
    if isinstance(template, Node):
        return convert(value, template)
    if isinstance(template, (tuple, list)) and isinstance(value, (tuple, list)):
        return type(value)(_map_like(v, t, convert) for v, t in zip(value, template))
    if isinstance(template, dict) and isinstance(value, dict):
        return {k: _map_like(v, template.get(k), convert) for k, v in value.items()}
    return value


def _like(ref: Any, actual: Any, rounding: Any) -> Any:
    """``ref`` in the form this model's op takes: quantized where the op saw a QTensor."""
    if isinstance(actual, QTensor):
        x = ref.dequantize() if isinstance(ref, QTensor) else ref
        return QTensor.quantize(x.to(torch.float32), actual.scale, actual.dtype, rounding)
    if isinstance(ref, QTensor):
        return ref.dequantize()
    if isinstance(ref, (tuple, list)) and isinstance(actual, (tuple, list)):
        return type(ref)(_like(r, a, rounding) for r, a in zip(ref, actual))
    return ref


def _fake_quantize_inputs(values: Any, module: QATModule) -> Any:
    """Round a QAT module's float inputs as its producers would (without observing)."""
    leaves, spec = tree_flatten(values)
    quants = list(module.input_quants)
    out, i = [], 0
    for leaf in leaves:
        if isinstance(leaf, Tensor) and leaf.is_floating_point() and i < len(quants):
            q = quants[i]
            i += 1
            if q is not None and not q.is_high_precision and not q.bypassed:
                leaf = fake_quantize_ste(
                    leaf, q.scale, q.dtype, q.rounding, q.ch_axis, offset=q.offset
                )
        out.append(leaf)
    return tree_unflatten(out, spec)
