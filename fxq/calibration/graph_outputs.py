"""Which QAT modules quantize a prepared model's outputs (read by ``ptq`` and its steps)."""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn
from torch.fx import GraphModule, Node

from fxq.qat.base import QATModule

__all__ = ["output_quants"]


def _producer_quants(
    gm: GraphModule, node: Node, seen: set[Node]
) -> Iterator[tuple[str, QATModule]]:
    """The QAT modules whose output fake quant gives ``node``'s value (through pass-through ops)."""
    if node in seen:
        return
    seen.add(node)
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if isinstance(module, QATModule) and module.has_output_quant:
            yield node.target, module
            return
    if node.op in ("placeholder", "get_attr"):
        return
    for inp in node.all_input_nodes:
        yield from _producer_quants(gm, inp, seen)


def output_quants(model: nn.Module) -> list[tuple[str, QATModule]]:
    """The QAT modules whose output fake quant quantizes a model output (a graph output,
    reached through pass-through ops such as reshape, flatten or a DeQuantStub)."""
    if not isinstance(model, GraphModule):
        return []
    found: dict[int, tuple[str, QATModule]] = {}
    seen: set[Node] = set()
    for node in model.graph.nodes:
        if node.op == "output":
            for inp in node.all_input_nodes:
                for name, module in _producer_quants(model, inp, seen):
                    found.setdefault(id(module), (name, module))
    return list(found.values())
