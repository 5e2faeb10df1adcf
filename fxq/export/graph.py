"""``IntegerGraph``: fxq's integer IR, its file format and its reference runtime.

The format is specified in ``docs/integer_graph.md``. This module imports
numpy and the standard library only (no torch): a saved graph loads and runs
on a machine without torch.

A graph is a list of nodes in topological order. Each node has an op name,
input and output tensor names, JSON attributes and numpy parameters; each
tensor has a dtype, a shape (``"N"`` for the symbolic batch dimension) and a
scale (None for float tensors).
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

try:  # package import (fxq.export.graph)
    from .runtime import DTYPES, KERNELS
except ImportError:  # pragma: no cover - loaded as a standalone file
    from runtime import DTYPES, KERNELS  # type: ignore[no-redef]

__all__ = ["FORMAT", "VERSION", "TensorInfo", "Node", "IntegerGraph", "load"]

#: the format name and schema version written into every file
FORMAT = "fxq.integer_graph"
VERSION = 1


@dataclass
class TensorInfo:
    """A tensor of the graph.

    Attributes:
        dtype: ``"int8"``, ``"int16"``, ``"int32"``, ``"int64"`` or ``"float32"``.
        shape: sizes; ``"N"`` is the batch dimension (any size at run time).
        scale: the quantization scale (value = (integer + offset) * scale), None for floats.
        offset: not 0 on an unsigned range stored shifted (``QTensor.offset``); the
            convolutions and linear layers that read it undo the shift (their
            ``pad_value`` and bias).
    """

    dtype: str
    shape: list[int | str]
    scale: float | None = None
    offset: int = 0

    def to_json(self) -> dict[str, Any]:
        out = {"dtype": self.dtype, "shape": list(self.shape), "scale": self.scale}
        if self.offset:
            out["offset"] = self.offset
        return out


@dataclass
class Node:
    """One op of the graph.

    Attributes:
        name: unique node name (the FX node it comes from, with a suffix when one
            FX node gives several IR nodes).
        op: the op (``docs/integer_graph.md`` has one section per op).
        inputs, outputs: tensor names.
        attrs: JSON values (ints, floats, strings, lists, None).
        params: numpy arrays (weights, biases, multipliers, shifts, tables).
        source: ``file:line`` of the user code the node comes from ("" if unknown).
    """

    name: str
    op: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    params: dict[str, np.ndarray] = field(default_factory=dict)
    source: str = ""


class GraphRunError(RuntimeError):
    """A node failed while running (the message names the node and its op)."""


@dataclass
class IntegerGraph:
    """fxq's exported integer model.

    Attributes:
        nodes: in topological order.
        tensors: tensor name -> ``TensorInfo``.
        inputs, outputs: names of the graph's input and output tensors.
        march: the march the integer arithmetic follows (``"bayes"`` ...).
        dynamic_batch: whether dimension 0 of the inputs may take any size.
    """

    nodes: list[Node]
    tensors: dict[str, TensorInfo]
    inputs: list[str]
    outputs: list[str]
    march: str
    dynamic_batch: bool = True

    # -- running -------------------------------------------------------------------------
    def run(self, *inputs: np.ndarray) -> list[np.ndarray]:
        """Execute the graph with the numpy reference kernels.

        Args:
            inputs: one numpy array per graph input (float32 images, or any real
                dtype: they are quantized as ``fxq.quantized.functional.quantize`` does).

        Returns:
            one array per graph output (float32 for dequantized outputs, the integer
            dtype for quantized ones).

        Raises:
            ValueError: for a wrong number of inputs.
            GraphRunError: when a node fails (naming the node, its op and source line).
        """
        if len(inputs) != len(self.inputs):
            raise ValueError(f"the graph takes {len(self.inputs)} input(s), got {len(inputs)}")
        env: dict[str, np.ndarray] = {n: np.asarray(v) for n, v in zip(self.inputs, inputs)}
        for node in self.nodes:
            try:
                outs = KERNELS[node.op](node, [env[i] for i in node.inputs])
            except Exception as e:
                raise GraphRunError(
                    f"node {node.name!r} (op {node.op!r}, from {node.source or 'unknown source'}) "
                    f"failed: {type(e).__name__}: {e}"
                ) from e
            for name, value in zip(node.outputs, outs):
                env[name] = np.asarray(value, dtype=DTYPES[self.tensors[name].dtype])
        return [env[o] for o in self.outputs]

    # -- inspection -------------------------------------------------------------------------
    def print_tabular(self) -> str:
        """Print (and return) a table of the nodes, like ``torch.fx.Graph.print_tabular``:
        op, name, inputs, outputs with dtype, shape and scale, and the main attributes."""
        rows = [("op", "name", "inputs", "outputs", "attrs")]
        for n in self.nodes:
            outs = ", ".join(f"{o}: {self._describe(o)}" for o in n.outputs)
            attrs = ", ".join(f"{k}={_short(v)}" for k, v in n.attrs.items() if v is not None)
            params = ", ".join(f"{k}{list(v.shape)}:{v.dtype}" for k, v in n.params.items())
            rows.append(
                (
                    n.op,
                    n.name,
                    ", ".join(n.inputs),
                    outs,
                    "; ".join(x for x in (attrs, params) if x),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = []
        for i, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4])
            if i == 0:
                lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 5)
        head = [
            f"IntegerGraph (march {self.march}, {len(self.nodes)} nodes)",
            "inputs: " + ", ".join(f"{i}: {self._describe(i)}" for i in self.inputs),
            "outputs: " + ", ".join(f"{o}: {self._describe(o)}" for o in self.outputs),
        ]
        text = "\n".join(head + lines)
        print(text)
        return text

    def _describe(self, name: str) -> str:
        t = self.tensors[name]
        shape = "x".join(str(s) for s in t.shape)
        scale = "" if t.scale is None else f" @ {t.scale:.6g}"
        return f"{t.dtype}[{shape}]{scale}"

    # -- files ---------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The graph without its arrays (parameters are named ``params/<node>/<param>.npy``)."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "march": self.march,
            "dynamic_batch": self.dynamic_batch,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "tensors": {k: v.to_json() for k, v in self.tensors.items()},
            "nodes": [
                {
                    "name": n.name,
                    "op": n.op,
                    "inputs": n.inputs,
                    "outputs": n.outputs,
                    "attrs": n.attrs,
                    "params": {k: f"params/{n.name}/{k}.npy" for k in n.params},
                    "source": n.source,
                }
                for n in self.nodes
            ],
        }

    def save(self, path: str | Path) -> None:
        """Write the graph to one zip file: ``graph.json`` and one ``.npy`` per parameter
        (no pickle; readable with ``zipfile``, ``json`` and ``numpy``)."""
        with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
            z.writestr("graph.json", json.dumps(self.to_json(), indent=1))
            for n in self.nodes:
                for k, v in n.params.items():
                    buf = io.BytesIO()
                    np.save(buf, np.ascontiguousarray(v), allow_pickle=False)
                    z.writestr(f"params/{n.name}/{k}.npy", buf.getvalue())


def load(path: str | Path) -> IntegerGraph:
    """Read a graph written by ``IntegerGraph.save``.

    Raises:
        ValueError: the file is not an fxq integer graph, or its version is newer
            than this fxq reads.
    """
    with zipfile.ZipFile(path) as z:
        meta = json.loads(z.read("graph.json"))
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: not an fxq integer graph (format {meta.get('format')!r})")
        if meta["version"] > VERSION:
            raise ValueError(
                f"{path}: integer graph version {meta['version']} is newer than this fxq reads "
                f"({VERSION}); upgrade fxq"
            )
        nodes = []
        for n in meta["nodes"]:
            params = {
                k: np.load(io.BytesIO(z.read(p)), allow_pickle=False)
                for k, p in n["params"].items()
            }
            nodes.append(
                Node(n["name"], n["op"], n["inputs"], n["outputs"], n["attrs"], params, n["source"])
            )
    tensors = {
        k: TensorInfo(v["dtype"], v["shape"], v["scale"], v.get("offset", 0))
        for k, v in meta["tensors"].items()
    }
    return IntegerGraph(
        nodes, tensors, meta["inputs"], meta["outputs"], meta["march"], meta["dynamic_batch"]
    )


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, Sequence) and not isinstance(v, str) and len(v) > 6:
        return f"[{', '.join(map(str, v[:4]))}, ... ({len(v)})]"
    return str(v)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fxq.export.run graph.fxq input.npy [more.npy ...] [-o out_prefix]``:
    run a saved graph on ``.npy`` inputs, print each output's dtype, shape and values
    summary, and save them as ``<out_prefix><i>.npy``."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("graph")
    parser.add_argument("inputs", nargs="+")
    parser.add_argument("-o", "--out", default=None, help="save outputs as <OUT><i>.npy")
    args = parser.parse_args(argv)
    graph = load(args.graph)
    outs = graph.run(*[np.load(p, allow_pickle=False) for p in args.inputs])
    for i, y in enumerate(outs):
        print(f"output {i} ({graph.outputs[i]}): {y.dtype} {list(y.shape)}")
        if args.out:
            np.save(f"{args.out}{i}.npy", y, allow_pickle=False)
    return 0
