"""``prepare_qat_fx``: float model -> QAT model.

Steps (each reads a table, none edits the user's model):

1. copy the model, resolve and check the qconfig_dict for the current march;
2. trace (``fxq.symbolic_trace``), rewire readers of in-place writes to the
   writing node (``functionalize_inplace``) and fuse (``fuse_graph_module``);
3. walk the graph once, in order, tracking for each value the fake quant
   whose grid it lies on (or None for float values):

   * WEIGHTED / COMPUTE ops with a qconfig become fxq.qat modules owning
     their output fake quant; their tensor inputs are linked to the fake
     quants that produce them, and a float input gets a quantize stub first
     (so model inputs are quantized automatically when there is no
     ``QuantStub``, and float regions are re-quantized at their border);
   * PASSTHROUGH ops keep their input's fake quant;
   * a module called at several places gets one QAT module per call site,
     sharing weights, weight fake quant and BatchNorm, each with its own
     output fake quant;

4. swap modules that only opaque code reaches (``@fx_wrap()`` methods and
   leaf classes) for standalone QAT modules that quantize their own inputs.
"""

from __future__ import annotations

import copy
import itertools
import operator
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Node

from fxq.fake_quantize import FakeQuantize, FakeQuantState, set_fake_quantize
from fxq.fused import Fused
from fxq.fx.foreign import adopt_graph_module
from fxq.fx.functional_layers import modularize_functional_layers
from fxq.fx.fuse import fuse_graph_module
from fxq.fx.graph_utils import (
    call_sites,
    data_dependent_nodes,
    infer_tensor_nodes,
    owner_path,
    set_submodule,
    tensor_inputs,
    unique_name,
)
from fxq.fx.inplace import functionalize_inplace
from fxq.fx.load_guard import guard_loads
from fxq.fx.tracer import (
    is_fx_wrapped,
    is_opaque_call,
    symbolic_trace,
)
from fxq.march import MarchSpec, get_march_spec
from fxq.qat.base import QATModule
from fxq.qat.stubs import QuantStub
from fxq.qconfig import QConfig, QConfigChoice, QConfigResolver
from fxq.registry import (
    Kind,
    OpRow,
    canonical_key,
    functional_target,
    is_mask_fill,
    registry_class,
    row_for,
    row_for_module,
    target_name,
)

__all__ = ["prepare_qat_fx", "FloatOpWarning"]


def prepare_qat_fx(
    model: nn.Module,
    qconfig_dict: Mapping[str, Any] | None = None,
    example_inputs: Sequence[Any] | Mapping[str, Any] | None = None,
    float_ops: str = "warn",
    concrete_args: dict[str, Any] | None = None,
) -> GraphModule:
    """Turn a float model into a QAT model for the current march.

    Args:
        model: the float model (not modified): an ``nn.Module``, or a
            ``torch.fx.GraphModule`` traced already, by ``fxq.symbolic_trace``
            or by another FX tracer (``torch.fx.symbolic_trace`` with its own
            ``concrete_args``, a ``torch.fx.Tracer`` subclass; see
            ``fxq.fx.foreign``), which is then used as it is.
        qconfig_dict: see ``fxq.qconfig``; may be None when modules carry
            ``qconfig`` attributes (e.g. ``model.qconfig = ...``).
        example_inputs: optional inputs, positional (a sequence) or keyword
            (a dict: ``{"input_ids": ids}``); when given, the float graph runs
            once so that tensors and Python values are told apart exactly
            (otherwise static rules decide). The arguments of ``forward``
            they leave out (with a dict: those it does not name; with a
            sequence: those after it) are traced at their defaults (made
            concrete), unless ``concrete_args`` says otherwise.
        float_ops: what to do about ops that have a qconfig but no integer
            implementation (they run in float, i.e. off the accelerator):
            ``"warn"`` (one warning listing every such op, its location and
            the reason), ``"error"`` (raise ``ValueError`` with that list; for
            models that must deploy entirely in integers) or ``"ignore"``.
            An op given a qconfig of ``None`` is float on purpose and never
            listed.
        concrete_args: arguments of ``forward`` to trace at a fixed Python
            value, as in ``torch.fx.symbolic_trace`` (``{"attention_mask": None}``).

    Returns:
        a GraphModule in ``FakeQuantState.QAT``, on the model's device.

    Raises:
        RuntimeError: no march is set.
        ValueError: bad qconfig_dict (unknown key, wrong type, a dtype the
            march cannot run), nothing to quantize, or float ops with
            ``float_ops="error"``.
        fxq.fx.tracer.FxqTraceError: the model cannot be traced; the message
            names the source line and what to wrap with ``@fxq.fx_wrap()``.
    """
    spec = get_march_spec()
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare_qat_fx expects an nn.Module, got {type(model).__name__}")
    if float_ops not in _FLOAT_OPS_CHOICES:
        raise ValueError(
            f"prepare_qat_fx: float_ops must be one of {_FLOAT_OPS_CHOICES}, got {float_ops!r}"
        )
    if isinstance(example_inputs, Tensor):  # one input: (x,), not x's samples
        example_inputs = (example_inputs,)
    work = copy.deepcopy(model)
    resolver = QConfigResolver(qconfig_dict, work, spec)
    if not resolver.anything_quantized():
        raise ValueError(
            "prepare_qat_fx: nothing to quantize. Pass a qconfig_dict, e.g. "
            "{'': fxq.qconfig.default_qat_8bit_fake_quant_qconfig}, or set model.qconfig"
        )
    if isinstance(work, GraphModule):  # traced already, by fxq or another FX tracer
        gm = adopt_graph_module(work)
    else:
        gm = symbolic_trace(work, concrete_args, example_inputs=example_inputs)
    functionalize_inplace(gm)  # quantized ops compute out of place: readers take their result
    modularize_functional_layers(  # a functional layer with a qconfig of None stays as it is
        gm, keep=lambda node: resolver.resolve(owner_path(node), node.target).qconfig is None
    )
    fuse_graph_module(gm, spec)
    preparer = _Preparer(gm, resolver, spec, example_inputs)
    preparer.run()
    if not any(isinstance(m, FakeQuantize) for m in gm.modules()):
        raise ValueError(
            "prepare_qat_fx: the qconfig_dict selects no op that fxq can quantize"
            + _float_op_list(preparer.float_ops)
            + ". Check the qconfig_dict, or quantize ops that have an integer implementation "
            "(conv, linear, add, pooling, ...; see fxq.registry.ROWS)"
        )
    _report_float_ops(preparer.float_ops, float_ops)
    fuse_norm_inputs(gm, spec)
    _follow_model_device(gm)
    set_fake_quantize(gm, FakeQuantState.QAT)
    return guard_loads(gm)  # a failed load_state_dict leaves it as it was


_FLOAT_OPS_CHOICES = ("warn", "error", "ignore")


def _is_sum(module: nn.Module) -> bool:
    """An add, or a conv / linear with its residual add fused (``conv_add``, ``linear_add``)."""
    from fxq.qat.elementwise import Add

    return (isinstance(module, Add) or bool(getattr(module, "add", False))) and (
        getattr(module, "activation", None) is None
    )


def fuse_norm_inputs(gm: GraphModule, spec: MarchSpec) -> list[str]:
    """Widen the residual sums that only a normalization reads to ``spec.norm_input_dtype``.

    On a march that runs a sum and the LayerNorm / GroupNorm reading it as one op
    (``MarchSpec.norm_input_dtype``), the sum never leaves the chip, so its grid is the
    wider dtype's whatever the qconfig says: an int8 sum before a LayerNorm is what costs
    an int8 post-norm transformer most (``docs/transformers.md``). A sum qualifies when it
    is an add or a conv / linear with a fused add and no activation after it, its output is
    int8 on a symmetric grid (not a fixed scale, not high precision), and its only reader is
    one call of a normalization (not a standalone one). Its fake quant records the
    normalization (``FakeQuantize.on_chip_with``). Returns the sums' module paths.
    """
    from fxq.qat.normalization import GroupNorm, LayerNorm

    wide = spec.norm_input_dtype
    if wide is None:
        return []
    modules = dict(gm.named_modules())
    fused = []
    for node in gm.graph.nodes:
        norm = modules.get(node.target) if node.op == "call_module" else None
        if not isinstance(norm, (LayerNorm, GroupNorm)) or norm.standalone or not node.args:
            continue
        source = node.args[0]
        if not isinstance(source, Node) or source.op != "call_module" or len(source.users) != 1:
            continue
        producer = modules.get(source.target)
        if not isinstance(producer, QATModule) or not _is_sum(producer):
            continue
        fq = producer.activation_post_process if producer.has_output_quant else None
        if (
            not isinstance(fq, FakeQuantize)
            or fq.dtype.bits >= wide.bits
            or fq.is_high_precision
            or fq.is_fixed_scale
            or fq.offset
        ):
            continue
        fq.set_dtype(wide)
        fq.on_chip_with = node.target
        fused.append(source.target)
    return fused


def _float_op_list(entries: list[str]) -> str:
    if not entries:
        return ""
    shown = entries[:20] + ([f"... and {len(entries) - 20} more"] if len(entries) > 20 else [])
    return " (float ops: " + "; ".join(shown) + ")"


def _report_float_ops(entries: list[str], policy: str) -> None:
    """One warning (or error) listing every op that has a qconfig but stays float."""
    if not entries or policy == "ignore":
        return
    lines = "\n".join(f"  - {e}" for e in entries)
    message = (
        f"fxq.prepare_qat_fx: {len(entries)} op(s) have a qconfig but no integer implementation; "
        f"they run in float, off the accelerator:\n{lines}\n"
        "To keep them in float on purpose, give them a qconfig of None (e.g. "
        "{'module_name': {'<path>': None}} or {'module_type': {<op>: None}}), which silences "
        "this; prepare_qat_fx(..., float_ops='error') makes this an error, 'ignore' silences it."
    )
    if policy == "error":
        raise ValueError(message)
    warnings.warn(message, FloatOpWarning, stacklevel=3)


def _unquantized_inputs(node: Node, qat: QATModule | None) -> set[Node]:
    """The nodes passed as the arguments ``qat.unquantized_args`` names (by position or keyword)."""
    found: set[Node] = set()
    for index, name in getattr(qat, "unquantized_args", ()):
        value = node.args[index] if len(node.args) > index else node.kwargs.get(name)
        if isinstance(value, Node):
            found.add(value)
    return found


class FloatOpWarning(UserWarning):
    """Ops with a qconfig that stay float (``prepare_qat_fx(float_ops="warn")``)."""


def _follow_model_device(gm: GraphModule) -> None:
    """Put every module prepare created on the device of the weights it serves.

    Fake quants and observers are built on the default device; a module with
    weights moves its own fake quants to its weights' device, every other one
    follows the model's first parameter or buffer (nothing moves for a model
    without tensors).
    """
    default = next((t.device for t in itertools.chain(gm.parameters(), gm.buffers())), None)
    for module in gm.modules():
        if isinstance(module, QATModule):
            weight = getattr(module, "weight", None)
            device = weight.device if isinstance(weight, Tensor) else default
            if device is None:
                continue
            for child in module.modules():
                if isinstance(child, FakeQuantize):
                    child.to(device)


class _Preparer:
    def __init__(
        self,
        gm: GraphModule,
        resolver: QConfigResolver,
        spec: MarchSpec,
        example_inputs: Sequence[Any] | None,
    ) -> None:
        self.gm = gm
        self.resolver = resolver
        self.spec = spec
        self.modules = dict(gm.named_modules())
        self.is_tensor = infer_tensor_nodes(gm, example_inputs)
        self.data_dependent = data_dependent_nodes(gm)
        self.sites = call_sites(gm)
        self.site_count: dict[str, int] = {}
        self.fq_of: dict[Node, FakeQuantize | None] = {}
        self.border: dict[tuple[Node, str], Node] = {}
        self.swapped_first: dict[str, QATModule] = {}
        self.float_ops: list[str] = []  # "node (target, where): reason" of ops that stay float
        self.mask_ops = additive_mask_ops(gm)

    # -- qconfig ---------------------------------------------------------------
    def choice_for(self, node: Node, module: nn.Module | None) -> QConfigChoice:
        if node.op == "call_module":
            type_key = type(module.op) if isinstance(module, Fused) else type(module)
            return self.resolver.resolve(node.target, type_key)
        return self.resolver.resolve(owner_path(node), node.target)

    # -- main walk ---------------------------------------------------------------
    def run(self) -> None:
        for node in list(self.gm.graph.nodes):
            self.fq_of[node] = None
            if node.op in ("placeholder", "get_attr", "output"):
                continue
            if not self.is_tensor.get(node, True):
                node.meta["fxq_status"] = "value"  # a Python value or an integer / bool tensor
                continue
            if node.op == "call_module" and node.target in self.swapped_first:
                self._install_call_site(node)
                continue
            rule, module = row_for(node, self.modules)
            if node in self.mask_ops:
                rule = rule.as_float(self.mask_ops[node])
            if rule.kind in (Kind.NONTENSOR, Kind.DEQUANT_STUB):
                continue
            choice = self.choice_for(node, module)
            qconfig = choice.qconfig
            node.meta["fxq_qconfig"] = f"{choice.source}: {choice.key}"
            if rule.kind is Kind.FLOAT:
                node.meta["fxq_status"] = "float fallback" if qconfig is not None else "float"
                # a float op computes on float tensors, or on its own weights (an nn.Embedding
                # looking up integer token ids)
                computes = bool(tensor_inputs(node, self.is_tensor)) or (
                    module is not None and self._has_weights(module)
                )
                if qconfig is None or not computes or is_opaque_call(node, module):
                    continue
                if node not in self.data_dependent:
                    # computed from weights, constants and input shapes only (a shifted-window
                    # mask, a position encoding): a constant of the deployed model
                    node.meta["fxq_status"] = "constant"
                    continue
                node.meta["fxq_float_reason"] = rule.reason
                self.float_ops.append(_describe_float_op(node, rule))
                continue
            if qconfig is None:
                node.meta["fxq_status"] = "float"
                continue
            node.meta["fxq_status"] = rule.kind.value
            if rule.kind is Kind.PASSTHROUGH:
                inputs = tensor_inputs(node, self.is_tensor)
                self.fq_of[node] = self.fq_of.get(inputs[0]) if inputs else None
            elif rule.kind is Kind.QUANT_STUB:
                scale = getattr(module, "scale", None)
                qat = QuantStub(qconfig, scale=scale if isinstance(scale, float) else None)
                self._install_module(node, qat, choice)
            else:  # WEIGHTED or COMPUTE
                if rule.kind is Kind.WEIGHTED:
                    qat = rule.qat_class.from_float(module, qconfig)
                elif module is not None:
                    qat = rule.qat_class(qconfig, module=module)
                else:
                    qat = rule.qat_class(qconfig, fn=functional_target(node))
                qat.set_input_quants(self._quantize_inputs(node, qconfig, qat))
                self._install_module(node, qat, choice)
        self._swap_opaque_modules()
        self.gm.graph.lint()
        self.gm.recompile()

    def _install_module(self, node: Node, qat: QATModule, choice: QConfigChoice) -> None:
        qat.qconfig_source = f"{choice.source}: {choice.key}"
        if node.op == "call_module":
            path = node.target
            set_submodule(self.gm, path, qat)
            self.swapped_first[path] = qat
            self.site_count[path] = 1
        else:
            owner = owner_path(node)
            try:
                self.gm.get_submodule(owner)
            except AttributeError:
                owner = ""
            key = canonical_key(node.target)
            path = unique_name(self.gm, owner, key if isinstance(key, str) else node.name)
            set_submodule(self.gm, path, qat)
            node.op = "call_module"
            node.target = path
        self._register(node, path, qat)

    def _install_call_site(self, node: Node) -> None:
        """Another call of an already swapped module: share weights, own output fake quant."""
        first = self.swapped_first[node.target]
        index = self.site_count[node.target]
        self.site_count[node.target] = index + 1
        clone = _clone_for_call_site(first)
        if not isinstance(first, QuantStub):
            clone.set_input_quants(self._quantize_inputs(node, first.qconfig, first))
        path = unique_name(self.gm, "", f"{node.target}_call{index}")
        self.gm.add_module(path, clone)
        node.target = path
        self._register(node, path, clone)

    def _register(self, node: Node, path: str, qat: QATModule) -> None:
        self.modules[path] = qat
        _name_fake_quants(qat, path)
        self.fq_of[node] = None if qat.high_precision_output else qat.activation_post_process

    def _quantize_inputs(
        self, node: Node, qconfig: QConfig, qat: QATModule | None = None
    ) -> list[FakeQuantize]:
        """Fake quants of the node's tensor inputs, inserting stubs for float ones; the
        arguments the QAT class names in ``unquantized_args`` (attention masks) are left alone."""
        quants: list[FakeQuantize] = []
        inserted: list[FakeQuantize] = []
        skip = _unquantized_inputs(node, qat)
        for inp in tensor_inputs(node, self.is_tensor):
            if inp in skip:
                continue
            fq = self.fq_of.get(inp)
            if fq is None:
                stub_node = self._border_quantizer(inp, node, qconfig)
                node.replace_input_with(inp, stub_node)
                fq = self.fq_of[stub_node]
                inserted.append(fq)
            quants.append(fq)
        for fq in inserted:
            # a float value that was all zeros during calibration (BERT's additive attention
            # mask on unpadded batches, made by a float op) takes the largest scale of the
            # other inputs it meets, so later non-zero values are not crushed to the floor
            others = tuple(q for q in quants if q is not fq and q not in fq.zero_range_inputs)
            fq.zero_range_inputs = tuple(fq.zero_range_inputs) + others
        return quants

    def _border_quantizer(self, producer: Node, consumer: Node, qconfig: QConfig) -> Node:
        key = (producer, qconfig.activation_dtype.name)
        if key in self.border:
            return self.border[key]
        stub = QuantStub(qconfig)
        path = unique_name(self.gm, "", f"{producer.name}_quant")
        self.gm.add_module(path, stub)
        stub.qconfig_source = "inserted: float value entering a quantized op"
        self.modules[path] = stub
        with self.gm.graph.inserting_before(consumer):
            new = self.gm.graph.call_module(path, (producer,))
        new.meta = {"nn_module_stack": consumer.meta.get("nn_module_stack", {})}
        self.is_tensor[new] = True
        self.fq_of[new] = stub.activation_post_process
        _name_fake_quants(stub, path)
        self.border[key] = new
        return new

    def _swap_opaque_modules(self) -> None:
        """Standalone QAT modules for modules that only opaque code calls.

        Opaque code (``@fx_wrap()`` methods and functions, wrapped classes)
        reaches modules the graph does not call: at any depth, inside
        containers (``nn.Sequential``, torchvision blocks) and inside wrapped
        classes. Each weighted or compute module there becomes a standalone
        QAT module (it quantizes its own inputs). Registry ops are not entered
        (their forward uses their children's weights directly); those that
        stay float are added to the float-op list. In a graph without opaque
        code, modules the graph does not call are unused and left alone.
        """
        in_graph = {n.target for n in self.gm.graph.nodes if n.op == "call_module"}
        has_opaque = any(
            is_opaque_call(n, self.modules.get(n.target) if n.op == "call_module" else None)
            for n in self.gm.graph.nodes
            if n.op in ("call_module", "call_function")
        )

        if not has_opaque:
            return  # modules the graph does not call are unused: nothing else can reach them

        def visit(module: nn.Module, prefix: str) -> None:
            for name, child in list(module.named_children()):
                path = f"{prefix}.{name}" if prefix else name
                if isinstance(child, (QATModule, FakeQuantize)) or name == "_fxq_self":
                    continue
                if getattr(child, "_fxq_absorbed", False):
                    continue  # fused into a conv / linear by fuse_fx
                if path in in_graph:
                    if _opaque_container(child):
                        visit(child, path)
                    continue
                if registry_class(type(child)) is not None or isinstance(child, Fused):
                    qat = self._standalone_for(child, path)
                    if qat is not None:
                        setattr(module, name, qat)
                    else:
                        self._list_opaque_float(child, path)
                    continue
                if _is_torch_nn_layer(child):
                    if self._has_weights(child):
                        self._list_opaque_float(child, path)
                    continue
                visit(child, path)

        visit(self.gm, "")

    def _standalone_for(self, child: nn.Module, path: str) -> QATModule | None:
        """The standalone QAT module for a registry module, or None when it stays float."""
        rule = row_for_module(type(child))
        if rule.kind not in (Kind.WEIGHTED, Kind.COMPUTE):
            return None
        choice = self.resolver.resolve(
            path, type(child.op) if isinstance(child, Fused) else type(child)
        )
        if choice.qconfig is None:
            return None
        resolved = rule.resolve(None, child)
        if resolved.kind not in (Kind.WEIGHTED, Kind.COMPUTE) or resolved.qat is None:
            return None
        qat = self._make_standalone(resolved, child, choice)
        _name_fake_quants(qat, path)
        return qat

    @staticmethod
    def _has_weights(module: nn.Module) -> bool:
        return any(True for _ in module.parameters())

    def _list_opaque_float(self, child: nn.Module, path: str) -> None:
        """A module opaque code may call that stays float: list it (unless float on purpose)."""
        rule = row_for_module(type(child)).resolve(None, child)
        if rule.kind is not Kind.FLOAT:
            return
        if self.resolver.resolve(path, type(child)).qconfig is None:
            return
        reason = rule.reason or "no integer implementation"
        self.float_ops.append(
            f"{path} ({target_name(type(child))}, not in the traced graph; runs in float "
            f"wherever @fx_wrap() code calls it): {reason}"
        )

    def _make_standalone(self, rule, child: nn.Module, choice: QConfigChoice) -> QATModule:
        if rule.kind is Kind.WEIGHTED:
            qat = rule.qat_class.from_float(child, choice.qconfig)
            inputs = 2 if getattr(qat, "add", False) else 1
        else:
            qat = rule.qat_class(choice.qconfig, module=child)
            inputs = 1
        qat.make_standalone(inputs)
        qat.qconfig_source = f"{choice.source}: {choice.key} (standalone: called from opaque code)"
        return qat


def _opaque_container(module: nn.Module) -> bool:
    """A leaf in the graph whose forward is user code (so its children are opaque)."""
    return is_fx_wrapped(type(module)) and registry_class(type(module)) is None


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _is_torch_nn_layer(module: nn.Module) -> bool:
    """A torch.nn layer that is not a container (its forward may use its children's weights).

    Bare ``nn.Module``s are containers: GraphModule builds them for the paths
    of traced-through modules.
    """
    if type(module) is nn.Module or isinstance(module, _CONTAINERS):
        return False
    return type(module).__module__.startswith("torch.")


def _describe_float_op(node: Node, row: OpRow) -> str:
    target = node.target if node.op != "call_module" else None
    what = row.name if target is None else target_name(target)
    where = owner_path(node)
    location = f", in {where!r}" if where and where != node.target else ""
    frame = _source_line(node)
    location += f", {frame}" if frame else ""
    return f"{node.name} ({what}{location}): {row.reason or 'no integer implementation'}"


def _source_line(node: Node) -> str:
    """``file:line`` of the user's code that made ``node`` (recorded by fxq's tracer)."""
    return node.meta.get("fxq_source", "")


_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _clone_for_call_site(qat: QATModule) -> QATModule:
    """A QAT module sharing ``qat``'s parameters and submodules, with a fresh output fake quant.

    The clone owns its hook dictionaries (``copy.copy`` would share them, so a
    hook registered on one call site would fire on every one); hooks present
    on the original when it is cloned are carried over.
    """
    clone = copy.copy(qat)
    clone._parameters = dict(qat._parameters)
    clone._buffers = dict(qat._buffers)
    clone._modules = dict(qat._modules)
    for name in _HOOK_DICTS:
        hooks = qat.__dict__.get(name)
        if hooks is not None:
            clone.__dict__[name] = type(hooks)(hooks)
    if qat.has_output_quant:
        clone.activation_post_process = qat.qconfig.activation()
    return clone


def _name_fake_quants(qat: QATModule, path: str) -> None:
    qat.name = path
    if qat.has_output_quant:
        qat.activation_post_process.set_name(f"the output of '{path}'")
    wfq = getattr(qat, "weight_fake_quant", None)
    if isinstance(wfq, FakeQuantize):
        wfq.set_name(f"the weight of '{path}'")
        wfq.holds_weight = True
    for i, fq in enumerate(getattr(qat, "input_quant", []) or []):
        fq.set_name(f"input {i} of '{path}'")


_ADDS = {operator.add, operator.iadd, torch.add}
_SOFTMAXES = {torch.softmax, torch.nn.functional.softmax}
_MASK_REASON = (
    "adds an additive attention mask (0 / <= -1e4, built by torch.where): quantized like an "
    "activation its scale would round every score to 0, so this add and the softmax after it "
    "stay float; attn_implementation='sdpa' (scaled_dot_product_attention) takes the mask "
    "unquantized and runs attention in integers"
)


def _is_mask_where(node: Node) -> bool:
    if node.op != "call_function" or node.target is not torch.where or len(node.args) < 3:
        return False
    return is_mask_fill(node.args[1]) or is_mask_fill(node.args[2])


def _is_add(node: Node) -> bool:
    return (node.op == "call_function" and node.target in _ADDS) or (
        node.op == "call_method" and node.target in ("add", "add_", "__add__")
    )


def _is_softmax(node: Node, gm: GraphModule) -> bool:
    if node.op == "call_function":
        return node.target in _SOFTMAXES
    if node.op == "call_method":
        return node.target == "softmax"
    return node.op == "call_module" and isinstance(gm.get_submodule(node.target), nn.Softmax)


def additive_mask_ops(gm: GraphModule) -> dict[Node, str]:
    """The adds of an additive attention mask (eager attention: ``scores + mask`` where the
    mask is ``torch.where(keep, 0, finfo.min)``, reached through shape ops) and the softmaxes
    of their sums, with the reason they stay float."""
    found: dict[Node, str] = {}
    todo = [n for n in gm.graph.nodes if _is_mask_where(n)]
    seen = set(todo)
    while todo:
        node = todo.pop()
        for user in node.users:
            if _is_add(user):
                found[user] = _MASK_REASON
                found.update((s, _MASK_REASON) for s in user.users if _is_softmax(s, gm))
            elif user not in seen and user.op in ("call_function", "call_method"):
                seen.add(user)  # a slice, expand or .to of the mask
                todo.append(user)
    return found
