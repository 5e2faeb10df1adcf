"""Functional conv / linear / norm layers with parameters from the model become modules.

A layer class that overrides ``forward`` (timm's ``BatchNormAct2d`` and
``Linear``, ``Conv2dSame``...) is traced through, so the graph holds
``F.batch_norm(x, self.running_mean, ...)`` / ``F.conv2d(x, self.weight, ...)``
/ ``F.linear(x, self.weight, self.bias)`` with ``get_attr`` parameters, and
Hugging Face's ``Conv1D`` (GPT-2) ``torch.addmm(self.bias, x, self.weight)``,
timm's ``LayerNorm`` / ``LayerNorm2d`` and torchvision ConvNeXt's ``LayerNorm2d``
``F.layer_norm(x, shape, self.weight, self.bias, eps)`` (likewise ``F.group_norm``).
Such calls are one ``nn.BatchNorm*d`` / ``nn.Conv*d`` / ``nn.Linear`` /
``nn.LayerNorm`` / ``nn.GroupNorm`` computing
the same thing on the same tensors (for ``addmm``: a linear holding the
transposed weight, a new parameter); ``modularize_functional_layers`` replaces each
by that module, so that fusion, QAT and convert treat it as any other layer
(conv + batch_norm functional patterns fuse like the modules).

Rewritten only when every weight, bias and statistic is a ``get_attr`` tensor
and every hyperparameter is a Python constant; anything else (a weight
computed in the graph, e.g. weight standardisation) stays as it is. In the new
module, ``training`` follows the module's mode (as in the layer's own
forward), not the mode the model was traced in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx import GraphModule, Node

from fxq.fx.graph_utils import unique_name
from fxq.registry import registry_class

__all__ = ["modularize_functional_layers"]

_CONVS = {F.conv1d: nn.Conv1d, F.conv2d: nn.Conv2d, F.conv3d: nn.Conv3d}
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_BN_AFTER = {nn.Conv1d: nn.BatchNorm1d, nn.Conv2d: nn.BatchNorm2d, nn.Conv3d: nn.BatchNorm3d}


def _arg(node: Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _tensor_attr(gm: GraphModule, value: Any) -> Tensor | None:
    """The tensor a ``get_attr`` node names (None for anything else)."""
    if not isinstance(value, Node) or value.op != "get_attr":
        return None
    obj: Any = gm
    for part in value.target.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, Tensor) else None


def _constants(*values: Any) -> bool:
    return not any(isinstance(v, Node) for v in values)


def _owner_class(node: Node) -> type | None:
    """The class of the module whose forward made ``node`` (from torch.fx's module stack)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    last = list(stack.values())[-1]
    return last[1] if isinstance(last, tuple) and isinstance(last[1], type) else None


def _conv(gm: GraphModule, node: Node) -> nn.Module | None:
    weight, bias = _tensor_attr(gm, _arg(node, 1, "weight")), _arg(node, 2, "bias")
    bias_t = _tensor_attr(gm, bias)
    stride, padding = _arg(node, 3, "stride", 1), _arg(node, 4, "padding", 0)
    dilation, groups = _arg(node, 5, "dilation", 1), _arg(node, 6, "groups", 1)
    if weight is None or (bias is not None and bias_t is None):
        return None
    if not _constants(stride, padding, dilation, groups):
        return None
    cls = _CONVS[node.target]
    conv = cls(
        weight.shape[1] * groups,
        weight.shape[0],
        tuple(weight.shape[2:]),
        stride=stride,
        padding=padding,
        dilation=dilation,
        groups=groups,
        bias=bias_t is not None,
        device="meta",
    )
    return _take(conv, weight=weight, bias=bias_t)


def _linear(gm: GraphModule, node: Node) -> nn.Module | None:
    weight, bias = _tensor_attr(gm, _arg(node, 1, "weight")), _arg(node, 2, "bias")
    bias_t = _tensor_attr(gm, bias)
    if weight is None or weight.dim() != 2 or (bias is not None and bias_t is None):
        return None
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias_t is not None, device="meta")
    return _take(linear, weight=weight, bias=bias_t)


def _addmm(gm: GraphModule, node: Node) -> nn.Module | None:
    """``torch.addmm(bias, x, weight)`` (Hugging Face's ``Conv1D``): a linear with weight ``weight.T``."""
    bias, weight = _tensor_attr(gm, _arg(node, 0, "input")), _tensor_attr(gm, _arg(node, 2, "mat2"))
    beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
    if weight is None or bias is None or weight.dim() != 2 or bias.dim() != 1:
        return None
    if beta != 1 or alpha != 1 or bias.shape[0] != weight.shape[1]:
        return None
    linear = nn.Linear(weight.shape[0], weight.shape[1], device="meta")
    transposed = weight.detach().t().contiguous()
    if isinstance(weight, nn.Parameter):
        transposed = nn.Parameter(transposed, requires_grad=weight.requires_grad)
    return _take(linear, weight=transposed, bias=bias)


def _batch_norm(gm: GraphModule, node: Node, modules: dict[str, nn.Module]) -> nn.Module | None:
    mean, var = (
        _tensor_attr(gm, _arg(node, 1, "running_mean")),
        _tensor_attr(gm, _arg(node, 2, "running_var")),
    )
    weight_arg, bias_arg = _arg(node, 3, "weight"), _arg(node, 4, "bias")
    weight, bias = _tensor_attr(gm, weight_arg), _tensor_attr(gm, bias_arg)
    momentum, eps = _arg(node, 6, "momentum", 0.1), _arg(node, 7, "eps", 1e-5)
    if mean is None or var is None or not _constants(momentum, eps):
        return None
    if (weight_arg is None) != (bias_arg is None) or (weight_arg is not None and weight is None):
        return None
    cls = _batch_norm_class(node, modules)
    if cls is None:
        return None
    bn = cls(mean.numel(), eps=eps, momentum=momentum, affine=weight is not None, device="meta")
    bn = _take(bn, weight=weight, bias=bias)
    bn.running_mean, bn.running_var = mean, var
    owner = _arg(node, 1, "running_mean").target.rpartition(".")[0]
    tracked = getattr(gm.get_submodule(owner), "num_batches_tracked", None) if owner else None
    bn.num_batches_tracked = (
        tracked
        if isinstance(tracked, Tensor)
        else torch.zeros((), dtype=torch.long, device=mean.device)
    )
    return bn


def _layer_norm(gm: GraphModule, node: Node) -> nn.Module | None:
    """``F.layer_norm(x, shape, self.weight, self.bias, eps)`` (timm's ``LayerNorm``, ``LayerNorm2d``)."""
    shape, eps = _arg(node, 1, "normalized_shape"), _arg(node, 4, "eps", 1e-5)
    weight_arg, bias_arg = _arg(node, 2, "weight"), _arg(node, 3, "bias")
    weight, bias = _tensor_attr(gm, weight_arg), _tensor_attr(gm, bias_arg)
    if weight is None or (bias_arg is not None and bias is None) or not _constants(shape, eps):
        return None
    norm = nn.LayerNorm(shape, eps=eps, bias=bias is not None, device="meta")
    if tuple(norm.normalized_shape) != tuple(weight.shape):
        return None
    return _take(norm, weight=weight, bias=bias)


def _group_norm(gm: GraphModule, node: Node) -> nn.Module | None:
    """``F.group_norm(x, groups, self.weight, self.bias, eps)`` (timm's ``GroupNorm``, ``GroupNorm1``)."""
    groups, eps = _arg(node, 1, "num_groups"), _arg(node, 4, "eps", 1e-5)
    weight, bias = (
        _tensor_attr(gm, _arg(node, 2, "weight")),
        _tensor_attr(gm, _arg(node, 3, "bias")),
    )
    if weight is None or bias is None or weight.dim() != 1 or not _constants(groups, eps):
        return None
    norm = nn.GroupNorm(groups, weight.numel(), eps=eps, device="meta")
    return _take(norm, weight=weight, bias=bias)


def _batch_norm_class(node: Node, modules: dict[str, nn.Module]) -> type | None:
    """BatchNorm1d/2d/3d: the owner layer's base class, else the one after the conv before it."""
    owner = _owner_class(node)
    if owner is not None:
        for base in owner.__mro__:
            if base in _BATCH_NORMS:
                return base
    source = node.args[0] if node.args else None
    if isinstance(source, Node) and source.op == "call_module":
        module = modules.get(source.target)
        return _BN_AFTER.get(registry_class(type(module))) if module is not None else None
    return None


def _take(module: nn.Module, **tensors: Tensor | None) -> nn.Module:
    """Give a module built on the meta device the model's own tensors."""
    for name, value in tensors.items():
        if value is None:
            setattr(module, name, None)
        elif isinstance(value, nn.Parameter):
            setattr(module, name, value)
        else:  # a buffer used as a weight: keep it a tensor, shared
            delattr(module, name)
            module.register_buffer(name, value)
    return module


_BUILDERS: dict[Any, Callable[..., nn.Module | None]] = {
    **{fn: lambda gm, node, modules: _conv(gm, node) for fn in _CONVS},
    F.linear: lambda gm, node, modules: _linear(gm, node),
    F.batch_norm: _batch_norm,
    torch.addmm: lambda gm, node, modules: _addmm(gm, node),
    F.layer_norm: lambda gm, node, modules: _layer_norm(gm, node),
    F.group_norm: lambda gm, node, modules: _group_norm(gm, node),
}
#: the argument that is the layer's input, where it is not the first
_INPUT_ARGUMENT = {torch.addmm: (1, "mat1")}
#: the new module's name, where it is not the function's
_MODULE_NAME = {torch.addmm: "linear"}


def modularize_functional_layers(
    gm: GraphModule, keep: Callable[[Node], bool] | None = None
) -> list[str]:
    """Replace functional conv / linear / norm calls on model tensors by modules, in place.

    Also drops ``nn.Identity`` calls (timm puts one between a BatchNorm and
    its activation), ``torch._assert`` checks on the rank or shape of an
    intermediate value (timm's ``_assert(x.ndim == 4)``: a second reader of
    the conv output that would stop fusion) and the
    ``num_batches_tracked.add_(1)`` of a rewritten batch norm (the module
    counts its own batches).

    Args:
        gm: the traced model (changed in place).
        keep: calls for which it returns True stay functional (prepare keeps
            those whose qconfig is None: float on purpose).

    Returns:
        the paths of the new modules (next to the layer that made the call:
        ``bn1.batch_norm``).
    """
    modules = dict(gm.named_modules())
    created: list[str] = []
    _drop_shape_asserts(gm)
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and type(modules.get(node.target)) is nn.Identity:
            if len(node.args) == 1 and not node.kwargs and isinstance(node.args[0], Node):
                node.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(node)
            continue
        builder = _BUILDERS.get(node.target) if node.op == "call_function" else None
        if builder is None or (keep is not None and keep(node)):
            continue
        module = builder(gm, node, modules)
        if module is None:
            continue
        params = [a for a in node.all_input_nodes if a.op == "get_attr"]
        owner = params[0].target.rpartition(".")[0] if params else ""
        name = _MODULE_NAME.get(node.target, node.target.__name__)
        path = unique_name(gm, owner, name)
        gm.get_submodule(owner).add_module(path.rpartition(".")[2], module)
        modules[path] = module
        index, keyword = _INPUT_ARGUMENT.get(node.target, (0, "input"))
        source = node.args[index] if len(node.args) > index else node.kwargs[keyword]
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(path, (source,))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        if name == "batch_norm":
            _drop_batch_counter(gm, owner)
        for p in params:
            if not p.users:
                gm.graph.erase_node(p)
                _forget_attribute(gm, p.target)
        created.append(path)
    if created:
        gm.graph.lint()
        gm.recompile()
    return created


def _drop_batch_counter(gm: GraphModule, owner: str) -> None:
    """Erase ``<owner>.num_batches_tracked.add_(1)`` (the new BatchNorm counts for itself)."""
    target = f"{owner}.num_batches_tracked" if owner else "num_batches_tracked"
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and node.target == target:
            for user in list(node.users):
                if user.op == "call_method" and user.target == "add_" and not user.users:
                    gm.graph.erase_node(user)
            if not node.users:
                gm.graph.erase_node(node)
                _forget_attribute(gm, target)


def _forget_attribute(gm: GraphModule, target: str) -> None:
    """Remove a tensor the graph no longer reads from the bare module GraphModule made for it.

    The new module holds it now; keeping both would list it twice in the state_dict.
    """
    if any(n.op == "get_attr" and n.target == target for n in gm.graph.nodes):
        return
    owner, _, name = target.rpartition(".")
    module = gm.get_submodule(owner) if owner else None
    if type(module) is nn.Module and hasattr(module, name):
        delattr(module, name)


_SHAPE_ATTRS = ("ndim", "shape", "dtype", "device")
_SHAPE_METHODS = ("dim", "size")


def _reads_shape_of_intermediate(node: Node) -> bool:
    """Whether a condition reads the rank / shape of a value computed in the graph."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        reads = (n.op == "call_function" and n.target is getattr and n.args[1] in _SHAPE_ATTRS) or (
            n.op == "call_method" and n.target in _SHAPE_METHODS
        )
        if reads:
            source = n.args[0]
            if isinstance(source, Node) and source.op not in ("placeholder", "get_attr"):
                return True
        if n.op == "placeholder":
            return False  # a check on an input (concrete_args): kept
        stack.extend(n.all_input_nodes)
    return False


def _drop_shape_asserts(gm: GraphModule) -> None:
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch._assert or node.users:
            continue
        condition = node.args[0] if node.args else None
        if not isinstance(condition, Node) or not _reads_shape_of_intermediate(condition):
            continue
        gm.graph.erase_node(node)
        pending = [condition]
        while pending:  # the condition's own pure nodes, now unused
            n = pending.pop()
            if n.users or n.op not in ("call_function", "call_method"):
                continue
            inputs = n.all_input_nodes
            gm.graph.erase_node(n)
            pending.extend(inputs)
    for node in list(gm.graph.nodes):  # rank / shape reads nobody uses (an assert's message)
        unused_read = (node.op == "call_function" and node.target is getattr) or (
            node.op == "call_method" and node.target in _SHAPE_METHODS
        )
        if unused_read and not node.users:
            gm.graph.erase_node(node)
