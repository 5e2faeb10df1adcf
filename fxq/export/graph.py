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
import sys
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

try:  # package import (fxq.export.graph)
    from .runtime import DTYPES, kernel
    from .runtime_float import FLOAT_KERNELS, FLOAT_OPS
    from .validate import DEFAULT_MAX_BYTES, IntegerGraphFormatError, check_graph, read_members
except ImportError:  # pragma: no cover - loaded as a standalone file
    from runtime import DTYPES, kernel  # type: ignore[no-redef]
    from runtime_float import FLOAT_KERNELS, FLOAT_OPS  # type: ignore[no-redef]
    from validate import (  # type: ignore[no-redef]
        DEFAULT_MAX_BYTES,
        IntegerGraphFormatError,
        check_graph,
        read_members,
    )

__all__ = [
    "FORMAT",
    "VERSION",
    "DEFAULT_MAX_BYTES",
    "TensorInfo",
    "Node",
    "IntegerGraph",
    "GraphInputError",
    "GraphRunError",
    "IntegerGraphFormatError",
    "load",
]

#: the format name, and the newest schema version this fxq reads and writes; a graph is written
#: with the lowest version that holds it (``IntegerGraph.format_version``), so that a graph
#: without version-2 features still loads in an fxq that reads version 1 only
FORMAT = "fxq.integer_graph"
VERSION = 4

#: ops that version 2 added (``docs/integer_graph.md``, 1): plain tensors from graph inputs
VERSION_2_OPS = frozenset({"constant", "cast", "compare", "logical"})
#: ops that version 3 added: the float ops of float regions (``fxq.export.runtime_float``)
VERSION_3_OPS = FLOAT_OPS

#: what version 4 added: declared dynamic dimensions besides the batch (``IntegerGraph.dims``), with
#: their node forms (``constant`` ``dynamic``, ``axis_matmul`` ``ones``, ``requantize``
#: ``count_axes``)
VERSION_4_ATTRS = frozenset({"dynamic", "ones", "count_axes"})

#: op name -> numpy kernel: the integer ops and plain-tensor ops (``runtime``) and the float ops
#: (``runtime_float``)


@dataclass
class TensorInfo:
    """A tensor of the graph.

    Attributes:
        dtype: ``"int8"``, ``"int16"``, ``"int32"``, ``"int64"``, ``"float32"`` or ``"bool"``.
        shape: sizes; ``"N"`` is the batch dimension (any size at run time); other strings are
            the declared dynamic dimensions (``IntegerGraph.dims``), their products (``"H*W"``)
            or sizes that follow them (``"H.1"``: e.g. after a strided convolution).
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


class GraphInputError(ValueError):
    """``IntegerGraph.run`` was given an input of the wrong rank, shape or dtype, or a NaN to
    quantize (the message names the input, what the graph expects and what it got)."""


@dataclass
class IntegerGraph:
    """fxq's exported integer model.

    Attributes:
        nodes: in topological order.
        tensors: tensor name -> ``TensorInfo``.
        inputs, outputs: names of the graph's input and output tensors.
        march: the march the integer arithmetic follows (``"bayes"`` ...).
        dynamic_batch: whether dimension 0 of the inputs may take any size.
        dims: the declared dynamic dimensions besides the batch: symbol -> ``{"min": int,
            "max": int | None}`` (``to_graph(..., dynamic_dims=...)``); empty when none.
    """

    nodes: list[Node]
    tensors: dict[str, TensorInfo]
    inputs: list[str]
    outputs: list[str]
    march: str
    dynamic_batch: bool = True
    dims: dict[str, dict[str, int | None]] = field(default_factory=dict)

    # -- running -------------------------------------------------------------------------
    def run(self, *inputs: np.ndarray) -> list[np.ndarray]:
        """Execute the graph with the numpy reference kernels.

        Args:
            inputs: one numpy array per graph input: for a float input float32 images, or any
                real dtype (they are quantized as ``fxq.quantized.functional.quantize`` does);
                for an integer input (token ids, an integer mask) any integer dtype whose
                values the input's dtype holds (converted to it); for a bool input (a mask) a
                bool array.

        Returns:
            one array per graph output (float32 for dequantized outputs, the integer
            dtype for quantized ones).

        Every input is checked first: its rank, its shape (each size as exported; a symbolic
        size such as ``"N"`` takes any value, the same in every input that has it) and its
        dtype (a float input takes any real dtype, an integer input any integer dtype with
        values in its range, a bool input bool only), as onnxruntime checks them. ``±Inf`` saturates to the integer range when quantized, as in
        the integer model; a NaN to quantize is refused (``docs/integer_graph.md``, 3).

        Raises:
            ValueError: for a wrong number of inputs.
            GraphInputError: an input of the wrong rank, shape or dtype, or a NaN reaching a
                ``quantize`` node (naming the input, what was expected and what it got).
            GraphRunError: when a node fails (naming the node, its op and source line).
        """
        if len(inputs) != len(self.inputs):
            raise ValueError(f"the graph takes {len(self.inputs)} input(s), got {len(inputs)}")
        env: dict[str, np.ndarray] = {n: np.asarray(v) for n, v in zip(self.inputs, inputs)}
        self._check_inputs(env)
        for node in self.nodes:
            if node.op == "quantize":
                _refuse_nan(
                    node, node.inputs[0], env[node.inputs[0]], node.inputs[0] in self.inputs
                )
            try:
                run = FLOAT_KERNELS.get(node.op) or kernel(node.op)
                outs = run(node, [env[i] for i in node.inputs])
            except Exception as e:
                raise GraphRunError(
                    f"node {node.name!r} (op {node.op!r}, from {node.source or 'unknown source'}) "
                    f"failed: {type(e).__name__}: {e}"
                ) from e
            for name, value in zip(node.outputs, outs):
                env[name] = np.asarray(value, dtype=DTYPES[self.tensors[name].dtype])
        return [env[o] for o in self.outputs]

    def _check_inputs(self, env: dict[str, np.ndarray]) -> None:
        sizes: dict[str, tuple[str, int]] = {}  # symbol -> (first input with it, its size)
        for name in self.inputs:
            x, info = env[name], self.tensors[name]
            want = info.dtype
            kinds = {"float32": "fiu", "float64": "fiu", "bool": "b"}.get(want, "iu")
            if x.dtype.kind not in kinds:
                what = {"fiu": "a real", "b": "a bool", "iu": "an integer"}[kinds]
                raise GraphInputError(
                    f"input {name!r}: got dtype {x.dtype}, expected {want} ({what} dtype); "
                    f"convert it, e.g. x.astype(np.{want})"
                )
            if want in ("int32", "int64") and x.dtype != DTYPES[want]:
                env[name] = x = _integer_input(name, x, want)
            shape = "x".join(str(s) for s in info.shape)
            if x.ndim != len(info.shape):
                raise GraphInputError(
                    f"input {name!r}: got rank {x.ndim} (shape {list(x.shape)}), expected rank "
                    f"{len(info.shape)} (shape {shape})"
                )
            for axis, (want_d, got_d) in enumerate(zip(info.shape, x.shape)):
                if isinstance(want_d, str):
                    first, size = sizes.setdefault(want_d, (name, got_d))
                    if size != got_d:
                        raise GraphInputError(
                            f"input {name!r}: dimension {axis} ({want_d!r}) is {got_d}, but "
                            f"{want_d!r} is {size} in input {first!r}; give every input the "
                            "same size there"
                        )
                    bounds = self.dims.get(want_d)
                    if bounds is not None and not (
                        bounds["min"] <= got_d and (bounds["max"] is None or got_d <= bounds["max"])
                    ):
                        raise GraphInputError(
                            f"input {name!r}: dimension {axis} ({want_d!r}) is {got_d}, outside "
                            f"the range declared at export ({bounds['min']} to "
                            f"{bounds['max'] if bounds['max'] is not None else 'any'})"
                        )
                elif want_d != got_d:
                    fixed = (
                        "; the graph was exported with a fixed batch size (dynamic_batch "
                        "false): export it again with the batch size you run"
                        if axis == 0 and not self.dynamic_batch
                        else "; this size is fixed at export (declare it in dynamic_dims "
                        "to make it dynamic)"
                    )
                    raise GraphInputError(
                        f"input {name!r}: got shape {list(x.shape)}, expected {shape} "
                        f"(dimension {axis} is {got_d}, expected {want_d}){fixed}"
                    )

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
    def format_version(self) -> int:
        """The lowest format version that holds this graph: 4 when it declares dynamic dimensions
        besides the batch (``dims``); 3 when it has a float op of a float
        region (``VERSION_3_OPS``); 2 when it has a bool tensor, an op of ``VERSION_2_OPS``,
        integer ``float`` arithmetic, a ``where`` whose condition is an input, or a ``softmax``
        whose keep-mask is an input; 1 otherwise."""
        if self.dims or any(VERSION_4_ATTRS & n.attrs.keys() for n in self.nodes):
            return 4
        if any(n.op in VERSION_3_OPS for n in self.nodes):
            return 3
        v2 = any(t.dtype == "bool" for t in self.tensors.values()) or any(
            n.op in VERSION_2_OPS
            or (n.op == "float" and n.attrs.get("dtype", "float32") != "float32")
            or (n.op == "where" and "condition" not in n.params)
            or (n.op == "softmax" and len(n.inputs) > 1)
            for n in self.nodes
        )
        return 2 if v2 else 1

    def to_json(self) -> dict[str, Any]:
        """The graph without its arrays (parameters are named ``params/<node>/<param>.npy``)."""
        out: dict[str, Any] = {
            "format": FORMAT,
            "version": self.format_version(),
            "march": self.march,
            "dynamic_batch": self.dynamic_batch,
        }
        if self.dims:
            out["dims"] = {k: dict(v) for k, v in self.dims.items()}
        return {
            **out,
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
                    np.save(buf, np.asarray(v, order="C"), allow_pickle=False)
                    z.writestr(f"params/{n.name}/{k}.npy", buf.getvalue())


def load(path: str | Path, *, max_bytes: int = DEFAULT_MAX_BYTES) -> IntegerGraph:
    """Read a graph written by ``IntegerGraph.save``, checking everything before using it.

    The file may come from anywhere: the declared size of every zip member is checked
    against ``max_bytes`` before anything is decompressed, every ``.npy`` header against its
    member's size before its data is read (never with pickle), then ``graph.json`` against
    the schema (keys, types, format version) and every node's attributes and arrays against
    its op (dtypes, ranks, table sizes, shifts and multipliers within the march's range, axes
    within the rank; ``fxq.export.validate``).

    Args:
        path: the ``.fxq`` file.
        max_bytes: the most bytes to decompress from the file, all members together
            (default ``DEFAULT_MAX_BYTES``, 1 GiB); pass more for a larger model you trust.

    Raises:
        IntegerGraphFormatError: (a ``ValueError``) the file is not an fxq integer graph, is
            damaged, larger than ``max_bytes``, or its version is newer than this fxq reads;
            the message names the file and the member or node.
        OSError: the file cannot be opened (e.g. ``FileNotFoundError``).
    """
    meta, arrays = read_members(path, max_bytes)
    check_graph(str(path), meta, arrays, FORMAT, VERSION)
    nodes = [
        Node(
            n["name"],
            n["op"],
            list(n["inputs"]),
            list(n["outputs"]),
            n["attrs"],
            {k: arrays[p] for k, p in n["params"].items()},
            n["source"],
        )
        for n in meta["nodes"]
    ]
    tensors = {
        k: TensorInfo(v["dtype"], list(v["shape"]), v.get("scale"), v.get("offset", 0))
        for k, v in meta["tensors"].items()
    }
    dims = {k: dict(v) for k, v in meta.get("dims", {}).items()}
    return IntegerGraph(
        nodes, tensors, meta["inputs"], meta["outputs"], meta["march"], meta["dynamic_batch"], dims
    )


def _integer_input(name: str, x: np.ndarray, want: str) -> np.ndarray:
    """An integer input converted to the dtype it was exported with, when its values fit."""
    info = np.iinfo(DTYPES[want])
    if x.size and (x.min() < info.min or x.max() > info.max):
        raise GraphInputError(
            f"input {name!r}: got dtype {x.dtype} with values {x.min()}..{x.max()}, outside "
            f"{want} (the dtype it was exported with)"
        )
    return x.astype(DTYPES[want])


def _refuse_nan(node: Node, name: str, x: np.ndarray, is_input: bool) -> None:
    """NaN has no integer: refuse it where it would be quantized (``docs/integer_graph.md``, 3)."""
    if x.dtype.kind != "f":
        return
    nan = np.isnan(x)
    if nan.any():
        where = tuple(int(i) for i in np.argwhere(nan)[0])
        what = "input" if is_input else "float tensor"
        raise GraphInputError(
            f"{what} {name!r} holds {int(nan.sum())} NaN value(s) (the first at index {where}), "
            f"which node {node.name!r} (quantize) cannot quantize: an integer has no NaN; replace "
            "them before running (e.g. np.nan_to_num(x, nan=0.0)). +-Inf saturates"
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

    parser = argparse.ArgumentParser(prog="python -m fxq.export.run", description=main.__doc__)
    parser.add_argument("graph")
    parser.add_argument("inputs", nargs="+")
    parser.add_argument("-o", "--out", default=None, help="save outputs as <OUT><i>.npy")
    args = parser.parse_args(argv)
    try:  # what the files hold is the user's to fix: one line, not a traceback
        graph = load(args.graph)
        outs = graph.run(*[np.load(p, allow_pickle=False) for p in args.inputs])
    except (OSError, ValueError) as e:  # GraphInputError, IntegerGraphFormatError among them
        print(f"{parser.prog}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    for i, y in enumerate(outs):
        print(f"output {i} ({graph.outputs[i]}): {y.dtype} {list(y.shape)}")
        if args.out:
            np.save(f"{args.out}{i}.npy", y, allow_pickle=False)
    return 0
