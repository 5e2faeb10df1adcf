"""Export a converted fxq model: fxq's integer graph (with a numpy reference runtime)
and ONNX (``docs/integer_graph.md``).

>>> # graph = fxq.export.to_graph(integer_model, example_inputs)
>>> # graph.save("model.fxq"); fxq.export.load("model.fxq").run(x_numpy)
"""

from fxq.export.build import ExportError, to_graph
from fxq.export.graph import IntegerGraph, Node, TensorInfo, load

__all__ = ["to_graph", "load", "IntegerGraph", "Node", "TensorInfo", "ExportError"]
