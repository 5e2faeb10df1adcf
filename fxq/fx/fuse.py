"""``fuse_fx``: merge chains like conv -> bn -> add -> relu into one ``Fused`` module.

One table, ``PATTERNS``, lists every chain fxq fuses; the current march's
spec says which of them exist on the target (``MarchSpec.fusions``). Each
step matches modules and functionals alike (``nn.ReLU`` / ``F.relu`` /
``x.relu()``; ``+`` / ``+=`` / ``torch.add`` / ``x.add(y)``).

A chain fuses only when every intermediate value has a single user (nothing
else reads the conv output before the BN), and, for a module called at
several places, when every call site matches the same pattern.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node

from fxq.fused import Fused
from fxq.fx.functional_layers import modularize_functional_layers
from fxq.fx.graph_utils import data_dependent_nodes, take_name
from fxq.fx.tracer import symbolic_trace
from fxq.march import MarchSpec, get_march_spec
from fxq.registry import fusion_members, registry_class

__all__ = ["FusionPattern", "PATTERNS", "fuse_fx", "fuse_graph_module"]


@dataclass(frozen=True)
class FusionPattern:
    """A chain: an anchor op followed by steps, each consuming the previous value.

    Attributes:
        name: the fusion's key in ``MarchSpec.fusions``.
        anchor: ``"conv"``, ``"convtranspose"``, ``"linear"`` or ``"bn"``.
        steps: ``"bn"``, ``"add"``, ``"relu"``, ``"relu6"`` in order.
    """

    name: str
    anchor: str
    steps: tuple[str, ...]


# Longest first: the first pattern that matches at an anchor wins.
PATTERNS: tuple[FusionPattern, ...] = (
    FusionPattern("conv_bn_add_relu", "conv", ("bn", "add", "relu")),
    FusionPattern("conv_bn_add", "conv", ("bn", "add")),
    FusionPattern("conv_bn_relu", "conv", ("bn", "relu")),
    FusionPattern("conv_bn_relu6", "conv", ("bn", "relu6")),
    FusionPattern("conv_add_relu", "conv", ("add", "relu")),
    FusionPattern("conv_bn", "conv", ("bn",)),
    FusionPattern("conv_add", "conv", ("add",)),
    FusionPattern("conv_relu", "conv", ("relu",)),
    FusionPattern("conv_relu6", "conv", ("relu6",)),
    FusionPattern("linear_bn_relu", "linear", ("bn", "relu")),
    FusionPattern("linear_bn", "linear", ("bn",)),
    FusionPattern("linear_add_relu", "linear", ("add", "relu")),
    FusionPattern("linear_add", "linear", ("add",)),
    FusionPattern("linear_relu", "linear", ("relu",)),
    FusionPattern("convtranspose_bn_relu", "convtranspose", ("bn", "relu")),
    FusionPattern("convtranspose_bn", "convtranspose", ("bn",)),
    FusionPattern("convtranspose_relu", "convtranspose", ("relu",)),
    FusionPattern("bn_relu", "bn", ("relu",)),
)

# the members of each step come from the op registry's fusion roles
_ANCHOR_TYPES: dict[str, tuple[type, ...]] = {
    role: fusion_members(role)[0] for role in ("conv", "convtranspose", "linear", "bn")
}

# BatchNorm class expected after each anchor class
_BN_FOR: dict[type, type] = {
    nn.Conv1d: nn.BatchNorm1d,
    nn.Conv2d: nn.BatchNorm2d,
    nn.Conv3d: nn.BatchNorm3d,
    nn.ConvTranspose1d: nn.BatchNorm1d,
    nn.ConvTranspose2d: nn.BatchNorm2d,
    nn.ConvTranspose3d: nn.BatchNorm3d,
    nn.Linear: nn.BatchNorm1d,
}

_, _ADD_FUNCTIONS, _ADD_METHODS = fusion_members("add")
_RELU_MODULES, _RELU_FUNCTIONS, _RELU_METHODS = fusion_members("relu")


def _module(node: Node, modules: dict[str, nn.Module]) -> nn.Module | None:
    return modules.get(node.target) if node.op == "call_module" else None


def _kind(module: nn.Module | None) -> type | None:
    """The registry class a module acts as (a subclass keeping ``forward`` is its base)."""
    return None if module is None else registry_class(type(module))


def _is_relu(node: Node, modules: dict[str, nn.Module], prev: Node) -> bool:
    if node.args[:1] != (prev,):
        return False
    if node.op == "call_module":
        return _kind(modules[node.target]) in _RELU_MODULES
    if node.op == "call_function":
        return node.target in _RELU_FUNCTIONS
    return node.op == "call_method" and node.target in _RELU_METHODS


def _is_relu6(node: Node, modules: dict[str, nn.Module], prev: Node) -> bool:
    if node.args[:1] != (prev,):
        return False
    if node.op == "call_module":
        m = modules[node.target]
        if _kind(m) is nn.ReLU6:
            return True
        return _kind(m) is nn.Hardtanh and (m.min_val, m.max_val) == (0.0, 6.0)
    if node.op == "call_function":
        if node.target is F.relu6:
            return True
        if node.target is F.hardtanh:
            lo = node.args[1] if len(node.args) > 1 else node.kwargs.get("min_val", -1.0)
            hi = node.args[2] if len(node.args) > 2 else node.kwargs.get("max_val", 1.0)
            return (lo, hi) == (0.0, 6.0)
    return False


def _is_dropout(node: Node, modules: dict[str, nn.Module], prev: Node) -> bool:
    """``node`` is an ``nn.Dropout`` module called on ``prev`` (Hugging Face's
    ``dense -> dropout -> + residual``): an identity at inference, kept in the fused module
    for training."""
    return node.args[:1] == (prev,) and _kind(_module(node, modules)) is nn.Dropout


def _add_residual(node: Node, prev: Node, dependent: set[Node]) -> Node | None:
    """If ``node`` is ``prev + other`` (``other`` a tensor computed from the inputs' data, one
    of ``dependent``), return ``other``."""
    is_add = (node.op == "call_function" and node.target in _ADD_FUNCTIONS) or (
        node.op == "call_method" and node.target in _ADD_METHODS
    )
    if not is_add or len(node.args) != 2:
        return None
    if any(k != "alpha" or v != 1 for k, v in node.kwargs.items()):
        return None
    a, b = node.args
    if not (isinstance(a, Node) and isinstance(b, Node)) or a is b:
        return None
    other = b if a is prev else a if b is prev else None
    if other is None or other not in dependent:
        # a parameter or buffer added to the output (``conv(x) + self.bias_map``) may
        # broadcast: it is not a residual of the output's shape, and stays a separate add
        return None
    return other


@dataclass
class _Match:
    pattern: FusionPattern
    nodes: list[Node]  # anchor first, chain order
    bn: Node | None
    residual: Node | None
    activation: str | None
    dropout: Node | None = None


def _match(
    anchor: Node, pattern: FusionPattern, modules: dict[str, nn.Module], dependent: set[Node]
) -> _Match | None:
    anchor_mod = _module(anchor, modules)
    nodes = [anchor]
    bn = residual = dropout = None
    activation = None
    cur = anchor
    for step in pattern.steps:
        if len(cur.users) != 1:
            return None
        nxt = next(iter(cur.users))
        if step == "add" and _is_dropout(nxt, modules, cur):
            dropout, cur = nxt, nxt
            nodes.append(nxt)
            if len(cur.users) != 1:
                return None
            nxt = next(iter(cur.users))
        if step == "bn":
            m = _module(nxt, modules)
            if (
                m is None
                or _kind(m) is not _BN_FOR.get(_kind(anchor_mod))
                or nxt.args[:1] != (cur,)
                or not m.track_running_stats
            ):
                return None
            bn = nxt
        elif step == "add":
            residual = _add_residual(nxt, cur, dependent)
            if residual is None:
                return None
        elif step == "relu":
            if not _is_relu(nxt, modules, cur):
                return None
            activation = "relu"
        elif step == "relu6":
            if not _is_relu6(nxt, modules, cur):
                return None
            activation = "relu6"
        nodes.append(nxt)
        cur = nxt
    return _Match(pattern, nodes, bn, residual, activation, dropout)


def _set_module(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, module)


def _del_module(root: nn.Module, path: str) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    if isinstance(parent, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        # deleting would shift a container's contents: mark it instead, so that prepare does
        # not take it for a module that only opaque code calls
        parent.get_submodule(name)._fxq_absorbed = True
        return
    delattr(parent, name)


def fuse_graph_module(gm: GraphModule, spec: MarchSpec) -> list[tuple[str, str]]:
    """Fuse in place; returns ``(anchor module path, pattern name)`` for every fusion."""
    modules = dict(gm.named_modules())
    allowed: Callable[[FusionPattern], bool] = lambda p: p.name in spec.fusions  # noqa: E731
    call_sites: dict[str, list[Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if node.op == "call_module":
            call_sites[node.target].append(node)

    dependent = data_dependent_nodes(gm)  # a residual is one of these, not a constant
    claimed: set[Node] = set()
    matches: dict[str, list[_Match]] = defaultdict(list)
    for node in gm.graph.nodes:
        mod = _module(node, modules)
        if mod is None or node in claimed:
            continue
        for pattern in PATTERNS:
            if not allowed(pattern) or _kind(mod) not in _ANCHOR_TYPES[pattern.anchor]:
                continue
            m = _match(node, pattern, modules, dependent)
            if m is not None and not (set(m.nodes) & claimed):
                matches[node.target].append(m)
                claimed.update(m.nodes)
                break

    fused: list[tuple[str, str]] = []
    absorbed: set[str] = set()  # BatchNorm and activation modules that now live in a Fused
    replaced: dict[Node, Node] = {}  # last node of an applied chain -> its fused node
    for target, ms in matches.items():
        sites = call_sites[target]
        first = ms[0]
        consistent = len(ms) == len(sites) and all(
            m.pattern == first.pattern
            and (m.bn.target if m.bn else None) == (first.bn.target if first.bn else None)
            and (m.dropout.target if m.dropout else None)
            == (first.dropout.target if first.dropout else None)
            for m in ms
        )
        bn_shared_elsewhere = first.bn is not None and len(call_sites[first.bn.target]) != len(ms)
        if not consistent or bn_shared_elsewhere:
            continue
        bn_mod = modules[first.bn.target] if first.bn is not None else None
        fused_mod = Fused(
            modules[target],
            bn=bn_mod,
            activation=first.activation,
            add=first.residual is not None,
            pattern=first.pattern.name,
            dropout=modules[first.dropout.target] if first.dropout is not None else None,
        )
        _set_module(gm, target, fused_mod)
        for m in ms:
            last = m.nodes[-1]
            residual = replaced.get(m.residual, m.residual)
            args = (m.nodes[0].args[0],) if residual is None else (m.nodes[0].args[0], residual)
            with gm.graph.inserting_before(last):
                new = gm.graph.call_module(target, args)
            new.meta = copy.copy(m.nodes[0].meta)
            last.replace_all_uses_with(new)
            replaced[last] = new
            anchor_name = m.nodes[0].name
            for n in reversed(m.nodes):
                gm.graph.erase_node(n)
            take_name(new, anchor_name)
        for m in ms:
            absorbed.update(n.target for n in m.nodes[1:] if n.op == "call_module")
        fused.append((target, first.pattern.name))

    # modules a fusion absorbed are gone from the graph: remove them from the hierarchy too,
    # unless another node still calls them (a shared nn.ReLU used elsewhere)
    still_used = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    still_used |= {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for absorbed_target in absorbed - still_used:
        if any(t.startswith(absorbed_target + ".") for t in still_used):
            continue  # a submodule of it is still called (timm's BatchNormAct2d.act)
        _del_module(gm, absorbed_target)
    gm.graph.lint()
    gm.recompile()
    return fused


def fuse_fx(model: nn.Module) -> GraphModule:
    """Fuse conv / linear / BN / add / ReLU chains for the current march.

    The input is not modified: it is copied (and traced with
    ``fxq.symbolic_trace`` when it is not a GraphModule yet).

    Args:
        model: a float ``nn.Module`` or ``GraphModule``.

    Returns:
        a GraphModule whose fused chains are ``fxq.fused.Fused`` modules
        at the anchor op's path; it computes what ``model`` computes.

    Raises:
        RuntimeError: when no march is set.
    """
    spec = get_march_spec()
    model = copy.deepcopy(model)
    gm = model if isinstance(model, GraphModule) else symbolic_trace(model)
    modularize_functional_layers(gm)
    fuse_graph_module(gm, spec)
    return gm
