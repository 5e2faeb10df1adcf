"""Dynamic dimensions declared at export (``to_graph(..., dynamic_dims=...)``).

The batch dimension (axis 0, ``"N"``) is dynamic without asking. Other sizes (image height and
width, sequence length) are dynamic where the user declares them::

    to_graph(model, x, dynamic_dims={"x": {2: "H", 3: "W"}})
    to_graph(bert, {"input_ids": ids, "attention_mask": mask},
             dynamic_dims={"input_ids": {1: Dim("L", max=64)}, "attention_mask": {1: "L"}})

How it is proven: the model is exported at the example sizes and once more per declared
symbol, at a second size of that symbol only (its ``max`` when declared, else twice the example
size; inputs are tiled along the axis, so ids and masks stay valid). Every node must then be the
same op with the same inputs, attributes and arrays at both sizes; the differences that follow a
size are rewritten into a size-independent form:

* a tensor size that changes is symbolic: the symbol itself when it equals the declared size at
  both sizes, ``"H*W"`` for a product of symbols, else a derived symbol ``"H.1"``;
* ``reshape``: symbolic output sizes become ``0`` (copied from the input's same axis) or one
  ``-1`` (inferred);
* ``axis_matmul`` summing whole axes (global average pooling, ``mean``) sums whole axes at any
  size (``ones``), and the ``requantize`` after it takes its multiplier and shift from a table
  indexed by the element count (``count_axes``), computed by the integer module itself;
* a ``constant`` whose value is the prefix of a larger one along a symbolic axis (BERT's position
  embeddings ``position_ids[:, :L]``) is stored at the symbol's declared ``max`` and sliced to
  the input's size at run time (``dynamic``).

Anything else that differs (a reshape to a fixed size, adaptive pooling to a fixed size other
than 1, a gather by size-dependent indices, a constant built from a size) is refused with an
``ExportError`` naming the node, its source line and the symbol; so is a model that does not run
at the second size.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fxq.export.graph import IntegerGraph, Node

__all__ = ["Dim", "DEFAULT_COUNT_TABLE", "resolve_dims", "probe_inputs", "merge_probes"]

#: the largest element count a dynamic global pooling / mean covers when a symbol it depends on
#: has no declared ``max`` (its multipliers are a table indexed by the count)
DEFAULT_COUNT_TABLE = 4096

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class Dim:
    """A dynamic dimension, as ``torch.export.Dim``: a symbol name and optional bounds.

    Attributes:
        name: the symbol (a Python identifier; ``"N"`` is the batch dimension's).
        min: the smallest size ``IntegerGraph.run`` accepts (default 1).
        max: the largest (default: none). Needed where the graph stores something as large as
            the dimension (a position-embedding table sliced to the sequence length); also the
            size of the second export that proves the graph size-independent.
    """

    name: str
    min: int = 1
    max: int | None = None


def resolve_dims(
    dynamic_dims: Mapping[Any, Mapping[int, str | Dim]],
    names: list[str],
    example: tuple,
    error: Callable[[str], Exception],
) -> tuple[dict[int, dict[int, str]], dict[str, Dim], dict[str, int]]:
    """Check ``dynamic_dims`` against the graph's inputs.

    Returns: input position -> {axis: symbol}; symbol -> its ``Dim``; symbol -> example size.
    """
    by_input: dict[int, dict[int, str]] = {}
    dims: dict[str, Dim] = {}
    sizes: dict[str, int] = {}
    for key, axes in dynamic_dims.items():
        if isinstance(key, int) and not isinstance(key, bool) and 0 <= key < len(names):
            pos = key
        elif key in names:
            pos = names.index(key)
        else:
            raise error(
                f"dynamic_dims names input {key!r}, which the converted graph does not take "
                f"(its inputs: {', '.join(names)}; or their positions 0..{len(names) - 1})"
            )
        x = example[pos]
        if not isinstance(x, torch.Tensor) or not isinstance(axes, Mapping):
            raise error(
                f"dynamic_dims[{key!r}] must map axes to symbols, e.g. {{2: 'H', 3: 'W'}}, for "
                "a tensor input"
            )
        for axis, sym in axes.items():
            d = Dim(sym) if isinstance(sym, str) else sym
            if not isinstance(d, Dim) or not _NAME.match(d.name) or d.name == "N":
                raise error(
                    f"dynamic_dims[{key!r}][{axis!r}] is {sym!r}: give a symbol name (an "
                    "identifier other than 'N', the batch dimension's) or fxq.export.Dim"
                )
            if not isinstance(axis, int) or not -x.dim() <= axis < x.dim():
                raise error(f"dynamic_dims[{key!r}]: axis {axis!r} outside rank {x.dim()}")
            axis %= x.dim()
            if axis == 0:
                raise error(
                    f"dynamic_dims[{key!r}]: axis 0 is the batch dimension, dynamic already "
                    "('N'); declare the other axes"
                )
            size = int(x.shape[axis])
            first = sizes.setdefault(d.name, size)
            if first != size:
                raise error(
                    f"dynamic_dims: symbol {d.name!r} is {size} in input {names[pos]!r} but "
                    f"{first} elsewhere in the example inputs; one symbol is one size"
                )
            known = dims.get(d.name)
            if known is not None and isinstance(sym, Dim) and known != d and known.max is not None:
                raise error(f"dynamic_dims: symbol {d.name!r} is declared twice, differently")
            if known is None or isinstance(sym, Dim):
                dims[d.name] = d
            lo, hi = dims[d.name].min, dims[d.name].max
            if not (lo <= size and (hi is None or size <= hi)):
                raise error(
                    f"dynamic_dims: the example size of {d.name!r} ({size}) is outside [{lo}, {hi}]"
                )
            by_input.setdefault(pos, {})[axis] = d.name
    return by_input, dims, sizes


def probe_size(d: Dim, size: int) -> int:
    """The second size the export is checked at: ``max`` when declared, else twice the size."""
    return d.max if d.max is not None and d.max != size else 2 * size


def probe_inputs(example: tuple, by_input: dict[int, dict[int, str]], sym: str, size: int) -> tuple:
    """``example`` with every axis of ``sym`` tiled (or cut) to ``size``."""
    out = list(example)
    for pos, axes in by_input.items():
        for axis, s in axes.items():
            if s == sym:
                x = out[pos]
                index = torch.arange(size) % x.shape[axis]
                out[pos] = x.index_select(axis, index)
    return tuple(out)


# -- merging the exports ---------------------------------------------------------------------
class _Merge:
    def __init__(
        self,
        base: IntegerGraph,
        probes: dict[str, IntegerGraph],
        dims: dict[str, Dim],
        sizes: dict[str, int],
        where: dict[str, str],
        counts: dict[str, Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]],
        error: Callable[[str], Exception],
    ) -> None:
        self.g, self.probes, self.dims, self.sizes = base, probes, dims, sizes
        self.where, self.counts, self.error = where, counts, error
        self.psize = {s: probe_size(dims[s], sizes[s]) for s in probes}
        self.labels: dict[str, list[int | str]] = {}
        self.deps: dict[str, list[list[str]]] = {}
        self.derived: dict[tuple, str] = {}

    def fail(self, node: Node, sym: str, reason: str) -> Exception:
        return self.error(
            f"fxq.export: cannot keep {sym!r} ({self.where[sym]}) dynamic: node {node.name!r} "
            f"(op {node.op}, {node.source or 'unknown source'}) {reason}; export with that "
            f"size fixed (leave {sym!r} out of dynamic_dims), or change the model so that the "
            "op follows the size"
        )

    def at(self, sym: str) -> str:
        return f"{sym}={self.sizes[sym]} and {sym}={self.psize[sym]}"

    # symbols of tensor sizes
    def label(self, name: str) -> None:
        shape = self.g.tensors[name].shape
        labels: list[int | str] = []
        deps: list[list[str]] = []
        for axis, v0 in enumerate(shape):
            moved = [s for s, p in self.probes.items() if p.tensors[name].shape[axis] != v0]
            deps.append(moved)
            if isinstance(v0, str) or not moved:
                labels.append(v0)
                continue
            vals = {s: self.probes[s].tensors[name].shape[axis] for s in moved}
            if (
                moved == [moved[0]]
                and v0 == self.sizes[moved[0]]
                and vals[moved[0]] == self.psize[moved[0]]
            ):
                labels.append(moved[0])
                continue
            prod = math.prod(self.sizes[s] for s in moved)
            if v0 == prod and all(vals[s] == prod // self.sizes[s] * self.psize[s] for s in moved):
                labels.append("*".join(moved))
                continue
            key = (tuple(moved), v0, tuple(vals[s] for s in moved))
            if key not in self.derived:
                base = "*".join(moved)
                k = sum(1 for d in self.derived if d[0] == tuple(moved)) + 1
                self.derived[key] = f"{base}.{k}"
            labels.append(self.derived[key])
        self.labels[name], self.deps[name] = labels, deps

    def run(self) -> IntegerGraph:
        g = self.g
        for sym, p in self.probes.items():
            if len(p.nodes) != len(g.nodes) or p.inputs != g.inputs or p.outputs != g.outputs:
                n = next(
                    (a for a, b in zip(g.nodes, p.nodes) if (a.name, a.op) != (b.name, b.op)),
                    g.nodes[min(len(g.nodes), len(p.nodes)) - 1],
                )
                raise self.fail(n, sym, f"is not the same graph at {self.at(sym)}")
            for a, b in zip(g.nodes, p.nodes):
                if (a.name, a.op, a.inputs, a.outputs) != (b.name, b.op, b.inputs, b.outputs):
                    raise self.fail(a, sym, f"is not the same op at {self.at(sym)}")
        for name in g.tensors:
            for sym, p in self.probes.items():
                if len(p.tensors[name].shape) != len(g.tensors[name].shape):
                    raise self.error(f"fxq.export: tensor {name!r} changes rank with {sym!r}")
            self.label(name)
        for i, node in enumerate(g.nodes):
            others = {s: p.nodes[i] for s, p in self.probes.items()}
            self.node(node, others)
        for name, t in g.tensors.items():
            t.shape = list(self.labels[name])
        g.dims = {s: {"min": d.min, "max": d.max} for s, d in self.dims.items() if s in self.sizes}
        return g

    def node(self, node: Node, others: dict[str, Node]) -> None:
        changed_attrs = {s for s, o in others.items() if o.attrs != node.attrs}
        changed_params = {
            s
            for s, o in others.items()
            if o.params.keys() != node.params.keys()
            or any(not _same(v, o.params[k]) for k, v in node.params.items())
        }
        if node.op == "reshape":
            self.reshape(node)
            return
        if not changed_attrs and not changed_params:
            return
        if node.op == "constant" and not changed_attrs:
            self.constant(node, others, changed_params)
            return
        if node.op == "axis_matmul" and not changed_attrs and self.full_sums(node, others):
            node.attrs["ones"] = True
            node.params = {}
            return
        if (
            node.op == "requantize"
            and not changed_attrs
            and node.name in self.counts
            and self.count_requantize(node)
        ):
            return
        sym = sorted(changed_attrs | changed_params)[0]
        what = "attributes" if sym in changed_attrs else "arrays"
        keys = sorted(
            k
            for k in {*node.attrs, *node.params}
            if (k in node.attrs and node.attrs.get(k) != others[sym].attrs.get(k))
            or (k in node.params and not _same(node.params[k], others[sym].params.get(k)))
        )
        raise self.fail(
            node, sym, f"has {what} {keys} that depend on the size (they differ at {self.at(sym)})"
        )

    def reshape(self, node: Node) -> None:
        out = self.labels[node.outputs[0]]
        inp = self.labels[node.inputs[0]]
        shape = list(node.attrs["shape"])
        inferred = []
        for k, d in enumerate(out):
            if not isinstance(d, str) or d == "N":
                continue
            if k < len(inp) and inp[k] == d:
                shape[k] = 0
            else:
                shape[k] = -1
                inferred.append(d)
        if len(inferred) > 1:
            deps = self.deps[node.outputs[0]]
            sym = next(s for ds in deps for s in ds)
            raise self.fail(
                node,
                sym,
                f"reshapes to {len(inferred)} sizes that follow the dynamic dims ({inferred}), "
                "which a reshape cannot infer",
            )
        node.attrs["shape"] = shape

    def full_sums(self, node: Node, others: dict[str, Node]) -> bool:
        """Whether every matrix sums its whole axis (a column of ones) at every size."""
        for n in (node, *others.values()):
            for i in range(len(n.attrs["axes"])):
                m = n.params.get(f"matrix_{i}")
                if m is None or m.ndim != 2 or m.shape[1] != 1 or not (m == 1).all():
                    return False
        return True

    def count_requantize(self, node: Node) -> bool:
        """A requantize after whole-axis sums: multiplier and shift by element count."""
        producers = {o: n for n in self.g.nodes for o in n.outputs}
        src = producers.get(node.inputs[0])
        if src is not None and src.op == "reshape":
            src = producers.get(src.inputs[0])
        if src is None or src.op != "axis_matmul" or not src.attrs.get("ones"):
            return False
        if node.params["multiplier"].size != 1 or node.params["shift"].size != 1:
            return False
        counted = src.inputs[0]
        axes = list(src.attrs["axes"])
        largest = 1
        syms = {s for a in axes for s in self.deps[counted][a]}
        for a in axes:
            v0 = self.g.tensors[counted].shape[a]
            sizes = [v0] + [self.probes[s].tensors[counted].shape[a] for s in self.deps[counted][a]]
            largest *= max(int(v) for v in sizes)
        if any(self.dims[s].max is None for s in syms):
            largest = max(largest, DEFAULT_COUNT_TABLE)
        mult, shift = self.counts[node.name](np.arange(1, largest + 1, dtype=np.float64))
        node.params = {
            "multiplier": np.concatenate([[0], mult]).astype(np.int64),
            "shift": np.concatenate([[0], shift]).astype(np.int64),
        }
        node.inputs = [node.inputs[0], counted]
        node.attrs["count_axes"] = axes
        return True

    def constant(self, node: Node, others: dict[str, Node], changed: set[str]) -> None:
        out = node.outputs[0]
        labels = self.labels[out]
        value = node.params["value"]
        dynamic = []
        for sym in sorted(changed):
            axes = [a for a, ds in enumerate(self.deps[out]) if sym in ds]
            if not axes or any(labels[a] != sym for a in axes):
                raise self.fail(
                    node,
                    sym,
                    "is a constant computed from the size (not a prefix of one table): "
                    f"its value differs at {self.at(sym)}",
                )
            if len({s for a in axes for s in self.deps[out][a]}) > 1:
                raise self.fail(node, sym, "is a constant that follows two dynamic dims at once")
            big = others[sym].params["value"]
            cut = big[
                tuple(
                    slice(0, value.shape[a]) if a in axes else slice(None) for a in range(big.ndim)
                )
            ]
            if cut.shape != value.shape or not np.array_equal(cut, value):
                raise self.fail(
                    node,
                    sym,
                    "is a constant computed from the size (its value at the smaller size is not "
                    f"the start of its value at the larger one; {self.at(sym)})",
                )
            if self.dims[sym].max is None:
                raise self.fail(
                    node,
                    sym,
                    f"holds a constant as long as {sym!r} (e.g. position embeddings sliced to the "
                    f"length): declare its largest size, fxq.export.Dim({sym!r}, max=...)",
                )
            value = big if value.ndim == big.ndim else value
            source = self.symbol_input(sym)
            if source is None:
                raise self.fail(node, sym, "needs a graph input with the symbol")
            tensor, in_axis = source
            if tensor not in node.inputs:
                node.inputs.append(tensor)
            idx = node.inputs.index(tensor)
            dynamic += [[a, idx, in_axis] for a in axes]
        node.params["value"] = value
        node.attrs["dynamic"] = dynamic

    def symbol_input(self, sym: str) -> tuple[str, int] | None:
        for name in self.g.inputs:
            for a, d in enumerate(self.labels[name]):
                if d == sym:
                    return name, a
        return None


def _same(a: np.ndarray, b: np.ndarray | None) -> bool:
    return b is not None and a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)


def merge_probes(
    base: IntegerGraph,
    probes: dict[str, IntegerGraph],
    dims: dict[str, Dim],
    sizes: dict[str, int],
    where: dict[str, str],
    counts: dict[str, Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]],
    error: Callable[[str], Exception],
) -> IntegerGraph:
    """``base`` (exported at the example sizes) with its sizes made symbolic, given one export
    per symbol at its second size (``probes``); raises ``error(...)`` where a node depends on a
    size in a way the graph cannot express."""
    return _Merge(base, probes, dims, sizes, where, counts, error).run()
