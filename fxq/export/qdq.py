"""``IntegerGraph`` -> QDQ ONNX (``mode="qdq"``): float ops between QuantizeLinear /
DequantizeLinear pairs, the form accelerator compilers ingest (``docs/integer_graph.md``, 4).

Weights are int8 initializers behind a per-output-channel ``DequantizeLinear``, biases int32
behind one at ``s_x * s_w``; the file has the lowest opset that expresses it (``lowest_opset``:
13, or 21 where an int16 Q / DQ pair is needed), and it carries the Q / DQ pairs around shape
ops that onnxruntime's QDQ propagation would otherwise insert itself (``close_propagation``)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from fxq.export.graph import Node
from fxq.export.onnx_integer import OPSET, IntegerWriter
from fxq.primitives import Primitive

__all__ = [
    "INT16_OPSET",
    "LOWEST_OPSET",
    "PROPAGATING",
    "QDQWriter",
    "close_propagation",
    "lowest_opset",
]

LOWEST_OPSET = 13  # a per-axis DequantizeLinear (weights per output channel) needs opset 13
INT16_OPSET = 21  # an int16 QuantizeLinear / DequantizeLinear needs opset 21

# the ops onnxruntime's QDQ propagation (ORT_ENABLE_BASIC and above) wraps in Q / DQ pairs of
# their neighbour's scale (onnxruntime/core/optimizer/qdq_transformer/qdq_propagation.cc)
PROPAGATING = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Slice", "MaxPool"})

# reductions whose axes are an attribute before opset 18 (ReduceSum's: an input since 13)
_AXES_ATTRIBUTE = frozenset(
    {
        "ReduceMax",
        "ReduceMin",
        "ReduceMean",
        "ReduceProd",
        "ReduceL1",
        "ReduceL2",
        "ReduceLogSum",
        "ReduceLogSumExp",
        "ReduceSumSquare",
    }
)


class QDQWriter(IntegerWriter):
    """The QuantizeLinear / DequantizeLinear form (``mode="qdq"``, opset 13; 21 with int16).

    Every tensor is float32. Each quantized tensor is ``DequantizeLinear(QuantizeLinear(v))``
    at its scale (zero point 0, int8 / int16); weights are int8 initializers with a
    per-output-channel ``DequantizeLinear`` (``dq_const``), biases int32 at ``s_x * s_w``; the
    ops between compute in float (Conv, MatMul, Add, Mul, Sigmoid, ...). This is what other
    accelerator compilers ingest; onnxruntime runs it with QuantizeLinear's rounding
    (half to even) and float arithmetic, or fuses it into its own integer kernels, so it
    differs from the integer model by a few LSB on some elements (``docs/integer_graph.md``
    gives the measured difference).
    """

    opset = INT16_OPSET

    def store(self, ir_name: str) -> str:
        # tensors that are not quantized values (token ids, masks) keep their dtype
        t = self.graph.tensors[ir_name]
        plain = t.dtype in ("int64", "bool") or (t.dtype == "int32" and t.scale is None)
        return t.dtype if plain else "float32"

    def cast(self, x: str, dtype: str, out: str | None = None) -> str:
        if dtype != "float32":
            return super().cast(x, dtype, out)
        return x if out is None else self.op("Identity", [x], out)

    def as_float(self, ir_name: str) -> str:
        return self.name(ir_name)

    def fscale(self, ir_name: str) -> float:
        """What one unit of the tensor's integers is worth (its scale; sums: their input's)."""
        t = self.graph.tensors[ir_name]
        if t.scale is not None:
            return t.scale
        if t.dtype == "float32":
            return 1.0
        return self._sum_scales[ir_name]

    def set_unit(self, ir_name: str, unit: float) -> None:
        """Say what one unit of an unscaled tensor (exact sums) is worth: ``fscale``'s answer
        for it and for reshapes of it."""
        self._sum_scales[ir_name] = unit

    def qdq(self, v: str, ir_name: str, out: str) -> str:
        """``DequantizeLinear(QuantizeLinear(v))`` at the scale and dtype of ``ir_name``."""
        t = self.graph.tensors[ir_name]
        if t.scale is None:
            return self.op("Identity", [v], out)
        zp = self.const(0, {"int8": np.int8, "int16": np.int16, "int32": np.int32}[t.dtype], "zp")
        s = self.const(t.scale, np.float32, "scale")
        return self.op("DequantizeLinear", [self.op("QuantizeLinear", [v, s, zp]), s, zp], out)

    def own(self, value: np.ndarray, hint: str) -> str:
        """An initializer of its own (not shared like ``const``'s): onnxruntime 1.32's int8 ->
        uint8 weight rewrite (``session.x64quantprecision``) fails on a weight, scale or zero
        point that two ``DequantizeLinear`` nodes share (``Attempt to replace the existing
        tensor``)."""
        name = self.fresh(hint)
        self.inits.append(self.nh.from_array(np.asarray(value, order="C"), name))
        return name

    def dq_const(
        self,
        q: np.ndarray,
        scale: Any,
        axis: int = 0,
        hint: str = "weight",
        out: str | None = None,
    ) -> str:
        """``DequantizeLinear`` of the integer initializer ``q`` (int8, int16 or int32) at
        ``scale``: a number (per tensor) or a 1-d array (one scale per slice of ``q`` along
        ``axis``). The zero point is 0: int8 / int16 zeros, none for int32 (ONNX: an int32
        input has no zero point). Its output is ``q * scale`` rounded once to float32, the
        float values fxq's integers stand for."""
        scale = np.asarray(scale, np.float32)
        inputs = [self.own(q, hint), self.own(scale, f"{hint}_scale")]
        if q.dtype != np.int32:
            inputs.append(self.own(np.zeros(scale.shape, q.dtype), f"{hint}_zp"))
        attrs = {"axis": axis} if scale.ndim else {}
        return self.op("DequantizeLinear", inputs, out, **attrs)

    _MOVES = (
        "reshape",
        "transpose",
        "gather",
        "concat",
        "max_pool",
        "adaptive_max_pool",
        "clip",
        "embedding",
        "reduce_extreme",
    )

    def write(self, node: Node) -> None:
        """Ops that move integers get their own Q / DQ pair (the usual QDQ form; it also
        keeps onnxruntime's QDQ propagation from inserting pairs of its own)."""
        out = node.outputs[0]
        if node.op not in self._MOVES or self.graph.tensors[out].scale is None:
            super().write(node)
            return
        tmp = self.fresh(node.name)
        self.write_op(node, [tmp])
        self.qdq(tmp, out, self.name(out))

    def lower(self, primitive: Primitive) -> Any:
        """The primitive's QDQ lowering, else its integer one."""
        return primitive.qdq or primitive.onnx

    def op_clip(self, node: Node, outs: list[str]) -> None:
        a, s = node.attrs, self.fscale(node.inputs[0])
        lo, hi = self.const(a["lo"] * s, np.float32), self.const(a["hi"] * s, np.float32)
        self.op("Clip", [self.name(node.inputs[0]), lo, hi], outs[0])

    def op_reshape(self, node: Node, outs: list[str]) -> None:
        if node.inputs[0] in self._sum_scales:
            self._sum_scales[node.outputs[0]] = self._sum_scales[node.inputs[0]]
        super().op_reshape(node, outs)

    def op_constant(self, node: Node, outs: list[str]) -> None:
        """A quantized constant (e.g. a matmul's constant operand) as its int8 / int16
        initializer behind a per-tensor ``DequantizeLinear``; other constants as in the
        integer form."""
        t, value = self.graph.tensors[node.outputs[0]], node.params["value"]
        if t.scale is None or value.dtype not in (np.int8, np.int16):
            super().op_constant(node, outs)
            return
        if not node.attrs["batch"]:
            self.dq_const(value, t.scale, hint="constant", out=outs[0])
            return
        c = self.dq_const(value, t.scale, hint="constant")
        batch = self.op("Shape", [self.name(node.inputs[0])], start=0, end=1)
        rest = self.const(np.array(value.shape[1:], np.int64), hint="shape")
        self.op("Expand", [c, self.op("Concat", [batch, rest], axis=0)], outs[0])

    def model(self) -> Any:
        """The checked ``onnx.ModelProto``: written at opset 19 (21 with int16 Q / DQ pairs),
        Q / DQ pairs added around shape ops (``close_propagation``), then lowered to the
        lowest opset that expresses it (``lowest_opset``)."""
        self._sum_scales: dict[str, float] = {}
        wide = any(t.dtype == "int16" and t.scale is not None for t in self.graph.tensors.values())
        self.opset = INT16_OPSET if wide else OPSET
        model = super().model()
        close_propagation(model.graph)
        opset = lowest_opset(model.graph)
        _lower(model.graph, opset)
        _drop_unused_initializers(model.graph)
        model.opset_import[0].version = opset
        model.ir_version = self.h.find_min_ir_version_for(list(model.opset_import))
        model.doc_string = (
            f"fxq QDQ graph, march {self.graph.march}: float ops between QuantizeLinear / "
            "DequantizeLinear, int8 weights per output channel (within a few LSB of the "
            "integer model)"
        )
        self.onnx.checker.check_model(model, full_check=True)
        return model


# -- post-passes on the written graph ---------------------------------------------------------
def _initializers(graph: Any) -> dict[str, Any]:
    return {i.name: i for i in graph.initializer}


def _per_tensor(node: Any, op_type: str, inits: dict[str, Any]) -> bool:
    """``node`` is a ``op_type`` (QuantizeLinear / DequantizeLinear) with one constant scale
    and zero point: the pairs onnxruntime propagates."""
    if node is None or node.op_type != op_type:
        return False
    params = [inits.get(name) for name in node.input[1:] if name]
    return all(p is not None and int(np.prod(p.dims)) == 1 for p in params)


def _drop_identities(graph: Any) -> None:
    """Remove ``Identity`` nodes that do not produce a graph output (onnxruntime removes them
    too, so what is next to a Q / DQ node is seen as onnxruntime sees it)."""
    outputs = {o.name for o in graph.output}
    alias: dict[str, str] = {}
    kept = []
    for n in graph.node:
        if n.op_type == "Identity" and n.output[0] not in outputs:
            alias[n.output[0]] = alias.get(n.input[0], n.input[0])
            continue
        for i, name in enumerate(n.input):
            if name in alias:
                n.input[i] = alias[name]
        kept.append(n)
    del graph.node[:]
    graph.node.extend(kept)


def close_propagation(graph: Any) -> int:
    """Add the Q / DQ pairs that onnxruntime's QDQ propagation would insert, so that it
    inserts none: after a shape op (``PROPAGATING``) whose input comes from a per-tensor
    ``DequantizeLinear``, a pair at that scale unless every reader is a ``QuantizeLinear``;
    before a shape op whose one reader is a per-tensor ``QuantizeLinear``, a pair at that
    scale unless its input comes from a ``DequantizeLinear``. Each pair is exact (the values
    are already on that grid; a shape op only moves values, and max pooling commutes with
    rounding). onnxruntime 1.32's own pairs carry an ``output_dtype`` attribute that its
    int8 -> uint8 rewrite later contradicts: at opset 21 a session above ORT_ENABLE_BASIC
    then fails to load (``output_dtype INT8 does not match y_zero_point type UINT8``).
    Identity nodes that are not graph outputs are removed first. Returns the pairs added."""
    from onnx import helper

    _drop_identities(graph)
    inits = _initializers(graph)
    outputs = {o.name for o in graph.output}
    names = {o for n in graph.node for o in [*n.output, n.name]} | set(inits)
    names |= {i.name for i in graph.input}
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, list[Any]] = defaultdict(list)
    for n in graph.node:
        for name in n.input:
            readers[name].append(n)
    added = 0

    def fresh(base: str) -> str:
        k = 0
        while f"{base}__qdq{k}" in names:
            k += 1
        names.add(f"{base}__qdq{k}")
        return f"{base}__qdq{k}"

    def pair(x: str, like: Any, out: str) -> list[Any]:
        q = fresh(x)
        params = list(like.input[1:])
        return [
            helper.make_node("QuantizeLinear", [x, *params], [q], name=q),
            helper.make_node("DequantizeLinear", [q, *params], [out], name=fresh(out)),
        ]

    nodes: list[Any] = []
    for n in graph.node:  # forward, in topological order: DQ -> shape op -> Q
        nodes.append(n)
        dq = producer.get(n.input[0]) if n.op_type in PROPAGATING else None
        if not _per_tensor(dq, "DequantizeLinear", inits):
            continue
        y = n.output[0]
        quantizers = [r for r in readers[y] if r.op_type == "QuantizeLinear"]
        others = [r for r in readers[y] if r.op_type != "QuantizeLinear"]
        if not others and y not in outputs:
            continue
        raw = fresh(y)
        n.output[0] = raw
        for r in quantizers:
            r.input[0] = raw
        q, d = pair(raw, dq, y)
        nodes += [q, d]
        producer[raw], producer[y] = n, d
        readers[raw], readers[y] = quantizers + [q], others
        added += 1
    for i in range(len(nodes) - 1, -1, -1):  # backward: a shape op's one reader is a Q
        n = nodes[i]
        if n.op_type not in PROPAGATING or n.output[0] in outputs:
            continue
        (q_node, *rest) = readers[n.output[0]] or [None]
        if rest or not _per_tensor(q_node, "QuantizeLinear", inits):
            continue
        x = n.input[0]
        src = producer.get(x)
        if src is not None and src.op_type == "DequantizeLinear":
            continue
        moved = fresh(x)
        q, d = pair(x, q_node, moved)
        n.input[0] = moved
        nodes[i:i] = [q, d]
        readers[x] = [r for r in readers[x] if r is not n] + [q]
        readers[moved] = [n]
        producer[moved] = d
        added += 1
    del graph.node[:]
    graph.node.extend(nodes)
    return added


def _drop_unused_initializers(graph: Any) -> None:
    used = {name for n in graph.node for name in n.input} | {o.name for o in graph.output}
    kept = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def _node_opset(n: Any, inits: dict[str, Any], most: int) -> int:
    """The lowest opset (from ``LOWEST_OPSET``) whose schema of ``n`` takes its inputs and
    attributes with the same meaning (``_lower`` rewrites constant reduction axes)."""
    import onnx

    if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
        zp = inits.get(n.input[2]) if len(n.input) > 2 and n.input[2] else None
        wide = zp is not None and zp.data_type in (onnx.TensorProto.INT16, onnx.TensorProto.UINT16)
        return INT16_OPSET if wide else LOWEST_OPSET
    if n.op_type in _AXES_ATTRIBUTE and len(n.input) > 1:
        return LOWEST_OPSET if n.input[1] in inits else 18
    if n.op_type == "Shape":  # start / end (opset 15) become a Slice
        return LOWEST_OPSET
    attrs = {a.name: a for a in n.attribute}
    if n.op_type == "Pad" and attrs.get("mode") and attrs["mode"].s == b"wrap":
        return 19
    for version in range(LOWEST_OPSET, most + 1):
        try:
            schema = onnx.defs.get_schema(n.op_type, version, n.domain)
        except onnx.defs.SchemaError:
            continue
        if set(attrs) <= set(schema.attributes) and len(n.input) <= schema.max_input:
            return version
    return most


def lowest_opset(graph: Any, most: int = INT16_OPSET) -> int:
    """The lowest opset, at least ``LOWEST_OPSET``, that expresses every node of ``graph``:
    13 for int8 Q / DQ pairs and per-channel weights; 21 where a Q / DQ pair is int16 (or
    the op an opset introduced: ``LayerNormalization`` 17, ``Mish`` 18, ...)."""
    inits = _initializers(graph)
    return max([LOWEST_OPSET] + [_node_opset(n, inits, most) for n in graph.node])


def _lower(graph: Any, opset: int) -> None:
    """Rewrite the nodes whose form changed after ``opset``: below opset 18 reductions take
    constant axes as an attribute; below 15 a ``Shape`` with ``start`` / ``end`` is a
    ``Shape`` and a ``Slice``."""
    from onnx import helper, numpy_helper

    inits = _initializers(graph)
    nodes = []
    for n in graph.node:
        nodes.append(n)
        if opset < 18 and n.op_type in _AXES_ATTRIBUTE and len(n.input) > 1:
            axes = numpy_helper.to_array(inits[n.input[1]]).astype(np.int64).tolist()
            del n.input[1:]
            n.attribute.append(helper.make_attribute("axes", axes))
        if opset < 15 and n.op_type == "Shape" and n.attribute:
            bounds = {a.name: a.i for a in n.attribute}
            del n.attribute[:]
            out, n.output[0] = n.output[0], f"{n.output[0]}__shape"
            name, n.name = n.name, n.output[0]
            args = []
            for key, default in (("start", 0), ("end", np.iinfo(np.int64).max), ("axis", 0)):
                value = np.array([bounds.get(key, default)], np.int64)
                graph.initializer.append(numpy_helper.from_array(value, f"{out}__{key}"))
                args.append(f"{out}__{key}")
            nodes.append(helper.make_node("Slice", [n.output[0], *args], [out], name=name))
    del graph.node[:]
    graph.node.extend(nodes)
