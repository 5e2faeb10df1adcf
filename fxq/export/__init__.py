"""Export a converted fxq model (``docs/integer_graph.md``).

* ``to_graph(quantized, example_inputs) -> IntegerGraph``: fxq's integer IR;
  ``IntegerGraph.run`` is the numpy reference runtime (no torch), ``.save`` writes
  one file (JSON + ``.npy`` in a zip) that ``load`` reads without torch or pickle, checking
  it first (``IntegerGraphFormatError`` for a damaged or crafted file).
* ``to_onnx(quantized, example_inputs, path, mode="integer")``: standard ONNX that
  onnxruntime runs bit for bit like the integer model.

Both equal ``quantized(*example_inputs)`` bit for bit; float regions (a qconfig of None) agree
within the tolerance ``docs/integer_graph.md`` states.

Without torch installed only ``load``, ``IntegerGraph`` and its runtime are here
(``python -m fxq.export.run``): ``fxq.export.graph`` and ``fxq.export.runtime``
import numpy and the standard library only.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from fxq.export.graph import (
    DEFAULT_MAX_BYTES,
    GraphInputError,
    GraphRunError,
    IntegerGraph,
    IntegerGraphFormatError,
    Node,
    TensorInfo,
    load,
)

__all__ = [
    "load",
    "IntegerGraph",
    "Node",
    "TensorInfo",
    "IntegerGraphFormatError",
    "GraphInputError",
    "GraphRunError",
    "DEFAULT_MAX_BYTES",
]

if importlib.util.find_spec("torch") is not None:
    from fxq.export.build import ExportError, to_graph
    from fxq.export.dynamic import Dim

    __all__ += ["to_graph", "to_onnx", "ExportError", "Dim"]


def to_onnx(
    quantized: Any,
    example_inputs: Any,
    path: str | Path | None = None,
    mode: str = "integer",
    input_names: list[str] | None = None,
    output_names: list[str] | None = None,
    outputs: list[Any] | None = None,
    dynamic_dims: Any = None,
) -> Any:
    """Export a converted fxq model to ONNX (dynamic batch axis ``"N"``, and the dimensions
    ``dynamic_dims`` declares as ``dim_param`` symbols).

    Args:
        quantized: the model returned by ``fxq.convert_fx``.
        example_inputs: a tensor or a tuple of tensors (batch of 2 or more).
        path: the ``.onnx`` file to write (None: only return the model).
        mode: ``"integer"``: integer tensors and exact integer arithmetic, equal to
            the integer model bit for bit in onnxruntime (opset 19). ``"qdq"``: float
            ops between QuantizeLinear / DequantizeLinear pairs (zero point 0,
            int8 weights behind a per-channel DequantizeLinear, int8 / int16 activations;
            opset 13, 21 where an int16 pair is needed), the form other compilers ingest;
            within a few LSB of the integer model (not bit-exact).
        input_names, output_names: names of the ONNX graph's inputs and outputs.
        outputs: FX nodes (or names) whose values are the outputs (see ``to_graph``).
        dynamic_dims: dynamic dimensions besides the batch (see ``to_graph``), e.g.
            ``{"x": {2: "H", 3: "W"}}``; the integer ONNX runs at other sizes there (a QDQ file
            may keep them fixed).

    Returns:
        the ``onnx.ModelProto`` (checked with ``onnx.checker`` full checking).

    Raises:
        ValueError: an unknown ``mode``.
        ExportError: a node of the model has no export rule (naming it and its source line).
    """
    if mode not in ("integer", "qdq"):
        raise ValueError(f"fxq.export.to_onnx: unknown mode {mode!r}; use 'integer' or 'qdq'")
    from fxq.export.onnx import graph_to_onnx

    graph = to_graph(quantized, example_inputs, outputs, dynamic_dims)
    return graph_to_onnx(graph, path, input_names, output_names, mode)
