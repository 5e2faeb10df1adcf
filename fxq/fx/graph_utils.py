"""Small graph helpers shared by the passes."""

from __future__ import annotations

import builtins
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Interpreter, Node
from torch.fx.node import map_arg

from fxq.fx.inplace import is_inplace
from fxq.fx.tracer import bind_root
from fxq.registry import NONTENSOR_METHODS

__all__ = [
    "owner_path",
    "tensor_inputs",
    "infer_tensor_nodes",
    "set_submodule",
    "unique_name",
    "call_sites",
    "take_name",
    "positional_inputs",
    "data_dependent_nodes",
    "reads_metadata_only",
]

# attributes of a tensor that are Python values; any other attribute of a tensor (or of
# torch's named-tuple results, e.g. ``torch.sort(x).values``) is a tensor
_METADATA_ATTRS = frozenset(
    {
        "shape",
        "dtype",
        "device",
        "ndim",
        "layout",
        "is_cuda",
        "is_sparse",
        "is_quantized",
        "requires_grad",
        "names",
        "grad_fn",
        "is_leaf",
    }
)
_SCALAR_ANNOTATIONS = (int, float, bool, str)


def owner_path(node: Node) -> str:
    """Dotted path of the module whose forward created ``node`` ("" for the root)."""
    if node.op == "call_module":
        return node.target
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    last = list(stack.values())[-1]
    path = last[0] if isinstance(last, tuple) else str(last)
    return path


def _flatten_nodes(value: Any) -> Iterator[Node]:
    found: list[Node] = []
    map_arg(value, lambda n: found.append(n) or n)
    return iter(found)


def tensor_inputs(node: Node, is_tensor: dict[Node, bool]) -> list[Node]:
    """The node's inputs that carry tensors, in flattened argument order (duplicates kept)."""
    return [n for n in _flatten_nodes((node.args, node.kwargs)) if is_tensor.get(n, True)]


def _is_torch_function(target: Any) -> bool:
    mod = getattr(target, "__module__", None) or ""
    return mod.startswith("torch") and not mod.startswith("torch.fx")


def infer_tensor_nodes(
    gm: GraphModule, example_inputs: Sequence[Any] | Mapping[str, Any] | None = None
) -> dict[Node, bool]:
    """Which nodes hold tensors (or containers of tensors) rather than Python values.

    Static rules cover the common cases (``x.size()``, ``x.shape[0] * 2``,
    annotated int arguments, ``concrete_args``). With ``example_inputs``
    (positional, or a dict of keyword inputs) the float graph is also run once
    (in eval mode, without gradients) and the observed types win; there an
    integer or bool tensor (token ids, index arithmetic, masks) counts as a
    Python value, never quantized, unless a module returns it (a ``QuantStub``
    on uint8 frames).
    """
    is_tensor: dict[Node, bool] = {}
    for node in gm.graph.nodes:
        inputs = list(_flatten_nodes((node.args, node.kwargs)))
        any_tensor_input = any(is_tensor.get(n, False) for n in inputs)
        if node.op == "placeholder":
            ann = node.type
            is_tensor[node] = not node.meta.get("fxq_concrete") and not (
                isinstance(ann, type) and issubclass(ann, _SCALAR_ANNOTATIONS)
            )
        elif node.op == "get_attr":
            try:
                value = _get_attr(gm, node.target)
            except AttributeError:
                value = None
            is_tensor[node] = isinstance(value, torch.Tensor)
        elif node.op == "call_method":
            is_tensor[node] = node.target not in NONTENSOR_METHODS and any_tensor_input
        elif node.op == "call_module":
            is_tensor[node] = True
        elif node.op == "call_function":
            target = node.target
            if target is builtins.getattr:
                is_tensor[node] = (
                    len(node.args) > 1 and node.args[1] not in _METADATA_ATTRS and any_tensor_input
                )
            elif target in (
                builtins.len,
                math.floor,
                math.ceil,
                math.sqrt,
                builtins.int,
                builtins.float,
                torch._assert,
            ):
                is_tensor[node] = False
            elif getattr(target, "__module__", None) in ("_operator", "operator"):
                is_tensor[node] = any_tensor_input
            elif any_tensor_input:
                is_tensor[node] = True
            else:
                is_tensor[node] = _is_torch_function(target)
        else:
            is_tensor[node] = False
    if example_inputs is not None:
        is_tensor.update(_observed_tensor_nodes(gm, example_inputs))
    return is_tensor


#: methods that read only their tensor's metadata (shape, dtype, device), not its data
_METADATA_METHODS = frozenset(
    {"size", "dim", "numel", "new_zeros", "new_ones", "new_full", "new_empty", "new_tensor"}
)
#: functions that read only their first argument's metadata
_METADATA_FUNCTIONS = frozenset(
    {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.numel}
)


def reads_metadata_only(node: Node) -> bool:
    """Whether ``node`` reads its first argument for its metadata only (shape, dtype, device),
    never its data: ``x.size()``, ``x.new_zeros(shape)``, ``torch.zeros_like(x)``,
    ``x.shape``. Its value is then a constant of the model wherever its other arguments are.

    >>> import torch
    >>> gm = torch.fx.symbolic_trace(lambda x: x.new_zeros(3) + torch.ones_like(x))
    >>> [reads_metadata_only(n) for n in gm.graph.nodes if n.op.startswith("call")]
    [True, True, False]
    """
    if not node.args:
        return False
    if node.op == "call_method":
        return node.target in _METADATA_METHODS
    if node.op != "call_function":
        return False
    if node.target is builtins.getattr:
        return len(node.args) > 1 and node.args[1] in _METADATA_ATTRS
    return node.target in _METADATA_FUNCTIONS


def data_dependent_nodes(gm: GraphModule) -> set[Node]:
    """The nodes whose value depends on the data of the model's inputs.

    The others are computed from weights, buffers, Python values and the
    inputs' metadata alone (shapes, dtypes, devices): torchvision swin's
    shifted-window mask (``x.new_zeros((H, W))`` filled by slices), sinusoidal
    position encodings built with ``torch.arange`` on the feature map's size,
    relative position biases gathered from a table. A deployed model has
    static input shapes, so these are constants that its compiler folds;
    ``prepare_qat_fx`` does not list them as float ops on activations.

    >>> import torch
    >>> class M(torch.nn.Module):
    ...     def forward(self, x):
    ...         mask = torch.zeros(x.shape[-1]).cumsum(0)
    ...         return x + mask
    >>> gm = torch.fx.symbolic_trace(M())
    >>> sorted(n.name for n in data_dependent_nodes(gm))
    ['add', 'output', 'x']
    """
    # a buffer written in place (a cache, a counter) may hold input data wherever it is read
    written = {
        n.args[0].target
        for n in gm.graph.nodes
        if is_inplace(n) and isinstance(n.args[0], Node) and n.args[0].op == "get_attr"
    }
    dependent: set[Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if not node.meta.get("fxq_concrete"):
                dependent.add(node)
            continue
        if node.op == "get_attr" and node.target in written:
            dependent.add(node)
            continue
        inputs = list(_flatten_nodes((node.args, node.kwargs)))
        if reads_metadata_only(node) and inputs and node.args[0] is inputs[0]:
            inputs = inputs[1:]  # the first argument is read for its metadata only
        if any(n in dependent for n in inputs):
            dependent.add(node)
    return dependent


def _get_attr(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _holds_tensor(value: Any, floating_only: bool = False) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_floating_point() or not floating_only
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v, floating_only) for v in value)
    if isinstance(value, dict):
        return any(_holds_tensor(v, floating_only) for v in value.values())
    return False


def positional_inputs(gm: GraphModule, example_inputs: Mapping[str, Any]) -> list[Any]:
    """Keyword inputs in the graph's placeholder order (defaults fill the rest)."""
    values = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        if node.target in example_inputs:
            values.append(example_inputs[node.target])
        elif str(node.target).startswith("*"):
            break
        elif node.args:
            values.append(node.args[0])
        else:
            raise ValueError(f"example_inputs gives no value for the model input {node.target!r}")
    return values


def _observed_tensor_nodes(
    gm: GraphModule, example_inputs: Sequence[Any] | Mapping[str, Any]
) -> dict[Node, bool]:
    seen: dict[Node, bool] = {}
    if isinstance(example_inputs, Mapping):
        example_inputs = positional_inputs(gm, example_inputs)

    class _Recorder(Interpreter):
        def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
            return super().call_function(target, bind_root(self.module, args), kwargs)

        def run_node(self, n: Node) -> Any:
            out = super().run_node(n)
            # integer and bool tensors (token ids, index arithmetic, masks) are never quantized,
            # unless a module takes them in (a QuantStub on uint8 camera frames)
            seen[n] = _holds_tensor(out, floating_only=n.op != "call_module")
            return out

    modes = {m: m.training for m in gm.modules()}
    gm.eval()
    try:
        with torch.no_grad():
            _Recorder(gm).run(*example_inputs)
    finally:
        for m, mode in modes.items():
            m.training = mode
    return seen


def set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    """Replace (or add) the submodule at dotted ``path``."""
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, module)


def unique_name(root: nn.Module, parent_path: str, base: str) -> str:
    """A free attribute name under ``parent_path`` starting with ``base``; returns the full path."""
    parent = root.get_submodule(parent_path) if parent_path else root
    base = base.replace(".", "_")
    name, i = base, 1
    while hasattr(parent, name) or name in parent._modules:
        name = f"{base}_{i}"
        i += 1
    return f"{parent_path}.{name}" if parent_path else name


def call_sites(gm: GraphModule) -> dict[str, list[Node]]:
    """call_module nodes per target."""
    sites: dict[str, list[Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            sites.setdefault(node.target, []).append(node)
    return sites


def take_name(node: Node, name: str) -> None:
    """Rename ``node`` to ``name`` once no live node of its graph uses that name.

    Passes that replace a node by a new one use this so printed graphs keep
    the user's names (``layer1_0_conv1``, not ``layer1_0_conv1_3``).
    """
    graph = node.graph
    if node.name == name or any(n.name == name for n in graph.nodes):
        return
    graph._graph_namespace._used_names.discard(name)
    node._rename(name)
