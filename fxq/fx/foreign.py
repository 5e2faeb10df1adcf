"""Graph modules that another FX tracer produced, made ready for fxq's passes.

``prepare_qat_fx`` accepts a ``torch.fx.GraphModule`` from ``torch.fx.symbolic_trace``
(with its own ``concrete_args``) or from a user's ``torch.fx.Tracer`` subclass.
Such a graph differs from fxq's own in what its placeholders mean: torch.fx
turns a concrete argument into a placeholder renamed ``<name>_1`` followed by
a check (``_assert_is_none(mask_1, "mask has been specialized ...")``, or
``torch._assert(scale_1 == 1.0, ...)``). ``adopt_graph_module`` marks those
placeholders as Python values under their own names (as fxq's tracer does),
so the checks are not taken for float ops and keyword example inputs find
them. ATen-level graphs (``torch.export``, ``make_fx``) are refused: fxq's
op table is written for torch-level graphs.
"""

from __future__ import annotations

import operator
import re

import torch
from torch.fx import GraphModule, Node
from torch.fx._symbolic_trace import _assert_is_none

__all__ = ["adopt_graph_module"]

_SPECIALIZED = re.compile(r"^(\w+) has been specialized to have value")


def adopt_graph_module(gm: GraphModule) -> GraphModule:
    """Mark torch.fx's concrete-argument placeholders of ``gm`` as Python values (in place).

    Raises:
        ValueError: for an ATen-level graph (``torch.export`` / ``make_fx``).
    """
    aten = [
        n
        for n in gm.graph.nodes
        if isinstance(n.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
    ]
    if aten:
        raise ValueError(
            f"prepare_qat_fx: this GraphModule holds ATen ops ({aten[0].target}, ...), as "
            "torch.export and make_fx produce; fxq quantizes torch-level graphs. Pass the float "
            "nn.Module itself, or a GraphModule from torch.fx.symbolic_trace / a torch.fx.Tracer"
        )
    names = {n.target for n in gm.graph.nodes if n.op == "placeholder"}
    changed = False
    for node in gm.graph.nodes:
        if node.op != "placeholder" or node.meta.get("fxq_concrete"):
            continue
        name = _specialized_name(node)
        if name is None:
            continue
        node.meta["fxq_concrete"] = True
        if name != node.target and name not in names:
            names.discard(node.target)
            node.target = name
            names.add(name)
        changed = True
    if changed:
        gm.recompile()
    return gm


def _specialized_name(placeholder: Node) -> str | None:
    """The argument name when ``placeholder`` is only read by torch.fx's specialisation check."""
    for user in placeholder.users:
        message = _check_message(user)
        if message is not None:
            found = _SPECIALIZED.match(message)
            if found:
                return found.group(1)
    return None


def _check_message(user: Node) -> str | None:
    if user.op != "call_function":
        return None
    if user.target is _assert_is_none and len(user.args) > 1:
        return str(user.args[1])
    if (
        user.target is operator.eq
    ):  # torch._assert(scale_1 == 1.0, "scale has been specialized ...")
        for check in user.users:
            if (
                check.op == "call_function"
                and check.target is torch._assert
                and len(check.args) > 1
            ):
                return str(check.args[1])
    return None
