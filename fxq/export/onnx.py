"""Write an ``IntegerGraph`` as ONNX: ``mode="integer"`` (bit-exact in onnxruntime,
``fxq.export.onnx_integer``) or ``mode="qdq"`` (``fxq.export.qdq``); ``docs/integer_graph.md``, 4."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fxq.export.graph import IntegerGraph
from fxq.export.onnx_integer import OPSET, IntegerWriter
from fxq.export.qdq import QDQWriter

__all__ = ["graph_to_onnx", "OPSET"]


def graph_to_onnx(
    graph: IntegerGraph,
    path: str | Path | None = None,
    input_names: list[str] | None = None,
    output_names: list[str] | None = None,
    mode: str = "integer",
) -> Any:
    """Write ``graph`` as an ONNX model (and return the ``onnx.ModelProto``).

    Args:
        graph: the integer graph.
        path: where to save it (not saved when None).
        input_names, output_names: names of the ONNX inputs / outputs (default: the
            graph's tensor names).

    Raises:
        ValueError: a wrong number of names, or an op the writer cannot express exactly.
    """
    names: dict[str, str] = {}
    for given, ir in ((input_names, graph.inputs), (output_names, graph.outputs)):
        if given is None:
            continue
        if len(given) != len(ir):
            raise ValueError(f"expected {len(ir)} names, got {len(given)}: {given}")
        for a, b in zip(ir, given):
            if a in names and names[a] != b:
                raise ValueError(f"tensor {a!r} is both an input and an output; it has one name")
            names[a] = b
    if mode not in ("integer", "qdq"):
        raise ValueError(f"unknown ONNX mode {mode!r}; use 'integer' or 'qdq'")
    writer = IntegerWriter if mode == "integer" else QDQWriter
    model = writer(graph, names).model()
    if path is not None:
        import onnx

        onnx.save(model, str(path))
    return model
