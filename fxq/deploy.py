"""Graph surgery for deployment: insert nodes into a converted model safely.

The by-hand way (torch.fx) works on fxq models as on any GraphModule::

    for n in traced.graph.nodes:
        if n.target == "quant":
            with traced.graph.inserting_after(n):
                new = traced.graph.call_function(centered_yuv2rgb, (n,), {"swing": "full"})
            n.replace_all_uses_with(new)
            new.args = (n,)
    traced.quant.scale.fill_(1.0)
    traced.recompile()

``insert_after`` does the same in one call, checks that the node exists (and
says which nodes do), lints the graph and recompiles. ``"quant"`` also finds
the input quantize stub that ``prepare_qat_fx`` inserts in a model without a
``QuantStub`` (``input_1_quant``) when the model has one input. ``yuv_input`` is the
whole camera-input recipe: keep the quantize stub's scale as the
``q_scale`` of the inserted ``centered_yuv2rgb``, then set the stub to scale
1.0 so it passes the camera's integers through.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from typing import Any

from torch.fx import GraphModule, Node

from fxq.functional import centered_yuv2bgr, centered_yuv2rgb
from fxq.quantized.stubs import Quantize

__all__ = ["NodeNotFoundError", "find_node", "input_stubs", "insert_after", "yuv_input"]


class NodeNotFoundError(KeyError):
    """No node of the graph has the requested name."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def input_stubs(gm: GraphModule) -> list[Node]:
    """The quantize stubs of a converted model that read a model input, in graph order.

    A ``fxq.QuantStub`` of the model (node ``quant`` when the attribute is
    ``self.quant``) or one that ``prepare_qat_fx`` inserted because the model
    had none (``x_quant``, ``input_1_quant``, ...).
    """
    return [
        node
        for node in gm.graph.nodes
        if node.op == "call_module"
        and isinstance(gm.get_submodule(node.target), Quantize)
        and any(arg.op == "placeholder" for arg in node.all_input_nodes)
    ]


def find_node(gm: GraphModule, name: str = "quant") -> Node:
    """The node called ``name`` (its name or its module target).

    ``"quant"`` (the default), when no node has that name, is the model's
    input quantize stub if it has exactly one (``input_stubs``): the stub
    ``prepare_qat_fx`` inserts when the model has no ``QuantStub`` is called
    after the input (``input_1_quant``).

    Raises:
        NodeNotFoundError (a KeyError): naming the closest existing nodes;
            for a name that asks for a quantize stub (``"quant"``, ``"x_quant"``)
            the input quantize stubs.
    """
    for node in gm.graph.nodes:
        if node.name == name or (node.op in ("call_module", "get_attr") and node.target == name):
            return node
    stubs = input_stubs(gm)
    if name == "quant" and len(stubs) == 1:
        return stubs[0]
    raise NodeNotFoundError(_not_found(gm, name, stubs, stubs_only=False))


def _not_found(gm: GraphModule, name: str, stubs: list[Node], stubs_only: bool) -> str:
    """The message for a missing node ``name``: suggestions, then the graph's nodes.

    Suggested are the input quantize stubs when the caller needs one
    (``stubs_only``) or ``name`` asks for one; otherwise the closest names.
    """
    names = [n.name for n in gm.graph.nodes]
    asks_for_stub = stubs_only or ("quant" in name and "dequant" not in name)
    if stubs and asks_for_stub:
        which = "stub" if len(stubs) == 1 else "stubs"
        hint = (
            f"; did you mean {', '.join(repr(n.name) for n in stubs)} (the input quantize {which})?"
        )
        if name == "quant":
            hint += f" The model has {len(stubs)} inputs: name the stub of the one to change."
    else:
        close = difflib.get_close_matches(name, names, n=3)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return f"no node named {name!r} in the graph{hint} Nodes: {', '.join(names[:12])}" + (
        " ..." if len(names) > 12 else ""
    )


def insert_after(
    gm: GraphModule, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> Node:
    """Insert ``fn(<node>, *args, **kwargs)`` after node ``name``; its users read the new node.

    Args:
        gm: a GraphModule (typically from ``fxq.convert_fx``); modified in place.
        name: the node's name or module target (e.g. ``"quant"``, which also
            finds the only input quantize stub: see ``find_node``).
        fn: a function (e.g. ``fxq.functional.centered_yuv2rgb``).

    Returns:
        the new node (the graph is linted and recompiled).

    Raises:
        KeyError: when no node is called ``name``.
    """
    node = find_node(gm, name)
    users = list(node.users)
    with gm.graph.inserting_after(node):
        new = gm.graph.call_function(fn, (node, *args), kwargs)
    for user in users:
        user.replace_input_with(node, new)
    gm.graph.lint()
    gm.recompile()
    return new


def yuv_input(
    gm: GraphModule,
    name: str = "quant",
    swing: str = "studio",
    mean: float | Sequence[float] = (128.0,),
    std: float | Sequence[float] = (128.0,),
    bgr: bool = False,
) -> Node:
    """Make a converted model take centered YUV444 camera input at stub ``name``.

    Inserts ``centered_yuv2rgb`` (``centered_yuv2bgr`` when ``bgr``) after the
    quantize stub with ``q_scale`` = the stub's current scale and the
    model's march, then sets the stub's scale to 1.0.

    Args:
        gm: a converted model (``fxq.convert_fx``); modified in place.
        name: the quantize stub's node name or module target. The default
            ``"quant"`` is the model's ``self.quant`` stub or, when no node has
            that name, its only input quantize stub (the one ``prepare_qat_fx``
            inserts in a model without ``QuantStub``, e.g. ``input_1_quant``).

    Raises:
        KeyError: no such node (the message lists the input quantize stubs);
        TypeError: the node is not a quantize stub of a converted model.
    """
    try:
        node = find_node(gm, name)
    except NodeNotFoundError:
        raise NodeNotFoundError(_not_found(gm, name, input_stubs(gm), stubs_only=True)) from None
    stub = gm.get_submodule(node.target) if node.op == "call_module" else None
    if not isinstance(stub, Quantize):
        raise TypeError(
            f"node {name!r} is not the quantize stub of a converted model (got "
            f"{type(stub).__name__ if stub is not None else node.op}); call fxq.convert_fx first"
        )
    q_scale = float(stub.scale.item())
    fn = centered_yuv2bgr if bgr else centered_yuv2rgb
    new = insert_after(
        gm,
        node.name,
        fn,
        swing=swing,
        mean=mean,
        std=std,
        q_scale=q_scale,
        march=stub.march.value,
    )
    stub.scale.fill_(1.0)
    return new
