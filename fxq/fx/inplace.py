"""In-place ops in a traced graph: make the value they write explicit.

``a.sub_(b)`` writes into ``a``; torch.fx records it as a node whose result is
``a`` itself, but the code after it goes on reading the node ``a``. Once
``prepare_qat_fx`` replaces the op by a QAT module (which computes out of place,
as every quantized op does) the write is lost and the model silently computes
something else. ``functionalize_inplace`` rewires every later reader of ``a`` to
the in-place node's result, which is the same tensor in the float model, so
the graph no longer depends on the write.

What it cannot rewire is a write through a view (``a[:, :2].mul_(2)`` or
``a.view(-1).add_(1)`` followed by a read of ``a``): the write reaches ``a``
only through shared memory, which a quantized op (computed out of place) or a
float op on a quantized value (given a dequantized copy) does not share. Then
``functionalize_inplace`` raises an error naming the line and the fix.

>>> import torch, operator
>>> from torch import fx
>>> class M(torch.nn.Module):
...     def forward(self, a, b):
...         a.sub_(b)
...         return a * 2
>>> gm = fx.symbolic_trace(M())
>>> functionalize_inplace(gm)
1
>>> [n.args[0].name for n in gm.graph.nodes if n.target is operator.mul]
['sub_']
"""

from __future__ import annotations

import operator

from torch import nn
from torch.fx import GraphModule, Node

__all__ = ["functionalize_inplace", "is_inplace", "InplaceViewError"]

_INPLACE_OPERATORS = frozenset(
    {
        operator.iadd,
        operator.isub,
        operator.imul,
        operator.itruediv,
        operator.ifloordiv,
        operator.imod,
        operator.ipow,
        operator.imatmul,
        operator.iand,
        operator.ior,
        operator.ixor,
        operator.ilshift,
        operator.irshift,
    }
)

#: ops whose result shares memory with their first argument
_VIEW_METHODS = frozenset(
    {
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "narrow",
        "select",
        "transpose",
        "t",
        "permute",
        "squeeze",
        "unsqueeze",
        "flatten",
        "unflatten",
        "expand",
        "expand_as",
        "unbind",
        "split",
        "chunk",
        "diagonal",
        "detach",
        "__getitem__",
        "movedim",
        "swapaxes",
        "as_strided",
    }
)


class InplaceViewError(ValueError):
    """An in-place op writes through a view, and fxq computes that op out of place."""


def is_inplace(node: Node, modules: dict[str, nn.Module] | None = None) -> bool:
    """True when ``node`` writes into its first argument.

    That is ``x.add_(y)`` and other ``Tensor`` methods ending in one underscore,
    ``x += y`` (``operator.iadd`` and the other augmented assignments),
    ``torch.relu_(x)``, a function called with ``inplace=True`` and a module with
    ``inplace=True`` (``nn.ReLU(inplace=True)``).
    """
    if not node.args or not isinstance(node.args[0], Node):
        return False
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_method":
        name = node.target
        return name.endswith("_") and not name.startswith("_")
    if node.op == "call_function":
        if node.target in _INPLACE_OPERATORS:
            return True
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.startswith("_")
    if node.op == "call_module" and modules is not None:
        return getattr(modules.get(node.target), "inplace", False) is True
    return False


def _view_base(node: Node) -> Node | None:
    """The tensor that ``node`` is a view of, or None."""
    target = node.target
    is_view = (node.op == "call_method" and target in _VIEW_METHODS) or (
        node.op == "call_function"
        and (target is operator.getitem or getattr(target, "__name__", "") in _VIEW_METHODS)
    )
    if is_view and node.args and isinstance(node.args[0], Node):
        return node.args[0]
    return None


def _later_users(value: Node, after: Node, order: dict[Node, int]) -> list[Node]:
    return [u for u in value.users if order[u] > order[after]]


def _where(node: Node) -> str:
    source = node.meta.get("fxq_source")
    return f" ({source})" if source else ""


def functionalize_inplace(gm: GraphModule, modules: dict[str, nn.Module] | None = None) -> int:
    """Rewire the readers of every value written in place to the writing node.

    Args:
        gm: a traced model (changed in place; recompiled when anything changed).
        modules: ``dict(gm.named_modules())`` (computed when None).

    Returns:
        the number of in-place nodes whose later readers were rewired.

    Raises:
        InplaceViewError: an op writes through a view of a tensor that is read
            afterwards; the message
            names the node, its source line and the rewrite to make.
    """
    modules = dict(gm.named_modules()) if modules is None else modules
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    changed = 0
    for node in list(gm.graph.nodes):
        if not is_inplace(node, modules):
            continue
        written: Node = node.args[0]
        _check_no_view_write(node, written, order)
        readers = _later_users(written, node, order)
        for user in readers:
            user.replace_input_with(written, node)
        changed += bool(readers)
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed


def _check_no_view_write(node: Node, written: Node, order: dict[Node, int]) -> None:
    view, base = written, _view_base(written)
    while base is not None:
        if _later_users(base, node, order):
            raise InplaceViewError(
                f"{node.name}{_where(node)}: the in-place op {node.target!r} writes into "
                f"{view.name}, a view of {base.name}, which is read afterwards. Quantized "
                f"ops compute out of place and a float op gets a dequantized copy, so that "
                f"write would be lost. Write it out of place and use the result, e.g. build "
                f"the tensor from its parts with torch.cat instead of `x[:, :2].mul_(2)`"
            )
        view, base = base, _view_base(base)
