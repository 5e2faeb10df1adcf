"""Helpers shared by fxq.export's rule tables (``moves``, ``plain``, ``float_ops``).

Integer modules have no rules: ``to_graph`` records the primitive calls their ``forward``
makes (``fxq.export.build.record_calls``). The tables here cover what is not an integer
module: pass-through ops that move integers, plain tensors (ids, masks) and float regions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from torch import Tensor

from fxq.qtensor import QTensor

#: the exporter (``fxq.export.build._Exporter``; not imported: build imports this module)
_Exporter = Any

__all__ = ["rule_in", "depends_on_inputs"]


def _dtype(q: QTensor) -> str:
    return {"qint8": "int8", "qint16": "int16", "qint32": "int32"}[q.qdtype.name]


def _np(t: Tensor, dtype: Any = None) -> np.ndarray:
    a = t.detach().cpu().numpy()
    return a.astype(dtype) if dtype is not None else a.copy()


def rule_in(table: dict, target: Any) -> Callable[..., None] | None:
    """``table``'s rule for an FX call ``target`` (a module class, a function or a ``Tensor``
    method name; an in-place method ``x.relu_`` as its out-of-place twin); None when it has
    none."""
    try:
        rule = table.get(target)
    except TypeError:  # an unhashable target
        return None
    if rule is None and isinstance(target, str) and target.endswith("_"):
        rule = table.get(target.rstrip("_"))
    return rule


def depends_on_inputs(arg: Any) -> bool:
    """Whether an FX argument is computed from a graph input (placeholder)."""
    from torch.fx import Node

    seen: set = set()
    stack = [arg] if isinstance(arg, Node) else []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            return True
        stack.extend(node.all_input_nodes)
    return False
