"""The integer ONNX writer: ``IntegerGraph`` -> ONNX that onnxruntime runs bit for bit
(``mode="integer"``; ``fxq.export.onnx.graph_to_onnx`` is the entry point).

Every IR op becomes standard ONNX ops (opset 19) chosen to be exact, with integer
tensors and float32 only (``docs/integer_graph.md``, "ONNX"):

* integer tensors keep their dtype (int8 / int16 / int32) between ops; arithmetic
  on them runs in int64 (``Mul``, ``Add``, ``Div``, ``Mod``: no value comes near
  ``2**62``, so nothing wraps);
* conv / transposed conv run as float32 ``Conv`` / ``ConvTranspose`` on
  integer values, where every partial sum is proven below ``2**24`` from the
  integer weights (float32 is exact on integers below ``2**24``); when it is not,
  the input is split into limbs (``q = sum_i limb_i * 2**(i w)``) that are
  convolved separately and combined in int64, as
  ``fxq.quantized.functional.accumulate`` does; linear, matmul and window sums
  are a float32 ``MatMul`` under the same bound, an int64 ``MatMul`` above it;
* a conv whose float32 accumulator (bias included) is proven below ``2**24``
  requantizes in float32 where ``fxq.primitives.onnx_requant`` finds an exact plan
  (a clamp, a split of the accumulator, ``QuantizeLinear`` at a power-of-two
  scale for int8 outputs), a residual input rescaled in float32 below ``2**23``;
* every other requantization is ``floor((acc * m + 2**(s-1)) / 2**s)`` in int64: ONNX's
  integer ``Div`` truncates toward zero, so the numerator is first made
  non-negative by adding ``2**62`` (a multiple of ``2**s``), taken off after
  (``floor_shift``); then ``Clip`` and ``Cast``.

The one float64 step left is the high-precision (float32) output of a conv /
linear, ``float32(float64(acc) * accumulator_scale)`` as the integer model
computes it: a float64 product rounded to float32 (two roundings) that float32
arithmetic does not reproduce (``docs/integer_graph.md``, 4).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fxq.primitives import PRIMITIVES, Primitive
from fxq.primitives.arith import bounds as _bounds

from .graph import IntegerGraph, Node
from .onnx_float import FLOAT_WRITERS

__all__ = ["IntegerWriter", "OPSET"]

OPSET = 19

_F32_EXACT = 1 << 24  # float32 holds every integer below 2**24 exactly
_BIAS = 1 << 62  # added before a Div so that the numerator is non-negative


class IntegerWriter:
    opset = OPSET

    def __init__(self, graph: IntegerGraph, names: dict[str, str]) -> None:
        import onnx
        from onnx import TensorProto, helper, numpy_helper

        self.onnx, self.h, self.T, self.nh = onnx, helper, TensorProto, numpy_helper
        self.graph = graph
        self.names = names  # IR tensor name -> ONNX name (inputs / outputs renamed)
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self.count = 0
        self.consts: dict[tuple, str] = {}
        self.types = {
            "int8": TensorProto.INT8,
            "int16": TensorProto.INT16,
            "int32": TensorProto.INT32,
            "int64": TensorProto.INT64,
            "float32": TensorProto.FLOAT,
            "float64": TensorProto.DOUBLE,
            "bool": TensorProto.BOOL,
        }

    # -- helpers ---------------------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        self.count += 1
        return f"{hint}__{self.count}"

    def name(self, ir_name: str) -> str:
        return self.names.get(ir_name, ir_name)

    def const(self, value: Any, dtype: Any = None, hint: str = "c") -> str:
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key in self.consts:
            return self.consts[key]
        name = self.fresh(hint)
        # (``np.ascontiguousarray`` would make a 0-d constant 1-d, and a scalar output 1-d)
        self.inits.append(self.nh.from_array(np.asarray(arr, order="C"), name))
        self.consts[key] = name
        return name

    def op(self, op_type: str, inputs: list[str], out: str | None = None, **attrs: Any) -> str:
        out = out or self.fresh(op_type.lower())
        self.nodes.append(self.h.make_node(op_type, inputs, [out], name=out, **attrs))
        return out

    def cast(self, x: str, dtype: str, out: str | None = None) -> str:
        return self.op("Cast", [x], out, to=self.types[dtype])

    def requant(
        self,
        acc: str,
        multiplier: Any,
        shift: Any,
        dtype: str,
        rounding: str,
        lo: int | None,
        hi: int | None,
        out: str | None,
        offset: Any = 0,
    ) -> str:
        """``clamp(shift_round((acc + offset) * multiplier, shift), lo, hi)`` cast to ``dtype``
        (``out`` None: the clamped int64 tensor, not cast),
        for an int64 tensor ``acc`` and integer constants that broadcast against it (as the
        numpy runtime's ``_requant``); ``|(acc + offset) * multiplier| < 2**61``.

        A left shift (``shift < 0``) is folded into the multiplier (the same product modulo
        ``2**64`` as numpy's ``(acc * m) << -shift``)."""
        lo, hi = _bounds(dtype, lo, hi)
        s = np.asarray(shift, np.int64)
        m = np.left_shift(np.asarray(multiplier, np.int64), np.maximum(-s, 0))
        v = acc if (m == 1).all() else self.op("Mul", [acc, self.const(m)])
        offset = np.asarray(offset, np.int64) * m
        v = self.shift_round(v, np.maximum(s, 0), rounding, offset, clamped_at=lo)
        v = self.op("Clip", [v, self.int_const(lo), self.int_const(hi)])
        return v if out is None else self.cast(v, dtype, out)

    def floor_shift(
        self, v: str, right: Any, offset: Any = 0, clamped_at: int | None = None
    ) -> str:
        """``floor((v + offset) / 2**right)`` of an int64 tensor ``v`` for constant
        ``0 <= right <= 62`` (broadcasting against ``v``), with ``|v + offset| < 2**61``.

        ONNX's integer ``Div`` truncates toward zero: where ``right > 0`` the numerator gets
        ``2**62`` added (a multiple of ``2**right``, so the quotient is exact floor plus
        ``2**(62 - right)``, taken off after). ``clamped_at``: a lower bound ``>= 0`` the
        caller clamps the result to; then truncation gives the same clamped result (a
        negative numerator truncates to a value ``<= 0``, floors to one ``< 0``) and no bias
        is written."""
        right = np.asarray(right, np.int64)
        offset = np.asarray(offset, np.int64)
        if not right.any():
            return self.op("Add", [v, self.const(offset)]) if offset.any() else v
        trunc = clamped_at is not None and clamped_at >= 0
        bias = np.where(right > 0, np.int64(0 if trunc else _BIAS), np.int64(0))
        add = offset + bias
        t = self.op("Add", [v, self.const(add)]) if add.any() else v
        q = self.op("Div", [t, self.const(np.left_shift(np.int64(1), right))])
        if bias.any():
            q = self.op("Sub", [q, self.const(np.right_shift(bias, right))])
        return q

    def shift_round(
        self,
        v: str,
        shift: Any,
        rounding: str,
        offset: Any = 0,
        clamped_at: int | None = None,
    ) -> str:
        """``shift_round(v + offset, shift)`` (``runtime.shift_round``) of an int64 tensor for
        constant shifts (either sign; ``|v + offset| < 2**61`` after a left shift)."""
        s = np.asarray(shift, np.int64)
        offset = np.asarray(offset, np.int64)
        if (s < 0).any():
            left = np.left_shift(np.int64(1), np.maximum(-s, 0))
            v = self.op("Mul", [v, self.const(left)])
            offset = offset * left
            s = np.maximum(s, 0)
        half = np.where(s > 0, np.left_shift(np.int64(1), np.maximum(s - 1, 0)), np.int64(0))
        if rounding == "half_up":
            return self.floor_shift(v, s, offset + half, clamped_at)
        if rounding != "half_even":
            raise ValueError(f"unknown rounding {rounding!r}")
        if offset.any():
            v = self.op("Add", [v, self.const(offset)])
        q = self.floor_shift(v, s, half)
        # a tie (v mod 2**s == 2**(s-1), s > 0) that rounded up to an odd result goes down
        d = np.left_shift(np.int64(1), s)
        tie = self.op(
            "Equal", [self.op("Mod", [v, self.const(d)]), self.const(np.where(s > 0, half, -1))]
        )
        odd = self.op("Equal", [self.op("Mod", [q, self.int_const(2)]), self.int_const(1)])
        return self.op("Sub", [q, self.cast(self.op("And", [tie, odd]), "int64")])

    def sat32(self, x: str) -> str:
        """int32 saturation of an int64 tensor."""
        return self.op("Clip", [x, self.int_const(-(1 << 31)), self.int_const((1 << 31) - 1)])

    def convert(self, ir_name: str, dtype: str) -> str:
        """The IR tensor ``ir_name`` converted to ``dtype`` (a ``Cast`` unless it has it), for
        the plain-tensor ops (``cast``, ``compare``, integer ``float``): its stored dtype is
        its own in both ONNX modes."""
        name = self.name(ir_name)
        if self.store(ir_name) == dtype:
            return name
        return self.op("Cast", [name], to=self.types[dtype])

    def as_int(self, ir_name: str) -> str:
        return self.cast(self.name(ir_name), "int64")

    def as_float(self, ir_name: str) -> str:
        return self.cast(self.name(ir_name), "float32")

    def store(self, ir_name: str) -> str:
        """The ONNX element type of an IR tensor (its own dtype in integer mode)."""
        return self.graph.tensors[ir_name].dtype

    def rank(self, ir_name: str) -> int:
        return len(self.graph.tensors[ir_name].shape)

    def channel(self, arr: np.ndarray, rank: int, axis: int) -> np.ndarray:
        shape = [1] * rank
        shape[axis % rank] = arr.size
        return arr.reshape(shape)

    # -- ops ---------------------------------------------------------------------------------
    def write(self, node: Node) -> None:
        outs = [self.name(o) for o in node.outputs]
        if node.op in FLOAT_WRITERS:  # float regions: fxq.export.onnx_float
            return FLOAT_WRITERS[node.op](self, node, outs)
        self.write_op(node, outs)

    def write_op(self, node: Node, outs: list[str]) -> None:
        """Write ``node``'s op into the ONNX tensors ``outs``: a primitive's lowering
        (``fxq.primitives``), else this writer's ``op_<op>`` method."""
        primitive = PRIMITIVES.get(node.op)
        if primitive is not None:
            self.lower(primitive)(self, node, outs)
        else:
            getattr(self, f"op_{node.op}")(node, outs)

    def lower(self, primitive: Primitive) -> Any:
        """The primitive's lowering for this writer's form (integer ONNX)."""
        return primitive.onnx

    def bits(self, ir_name: str) -> int:
        """The bit width of an IR tensor's dtype."""
        return {"int8": 8, "int16": 16, "int32": 32, "int64": 64}[self.graph.tensors[ir_name].dtype]

    def dot(self, a: str, b: str, bound: int) -> str:
        """``a @ b`` (ONNX ``MatMul``) of two integer tensors as int64: float32 when ``bound``
        (on every partial sum) is below ``2**24``, so exact in any summation order; else an
        int64 ``MatMul`` (exact: the bounds here stay far below ``2**63``)."""
        dtype = "float32" if bound < _F32_EXACT else "int64"
        return self.cast(self.op("MatMul", [self.cast(a, dtype), self.cast(b, dtype)]), "int64")

    def op_clip(self, node: Node, outs: list[str]) -> None:
        a = node.attrs
        dtype = self.store(node.inputs[0])
        v = self.op(
            "Clip",
            [
                self.as_float(node.inputs[0]),
                self.const(float(a["lo"]), np.float32),
                self.const(float(a["hi"]), np.float32),
            ],
        )
        self.cast(v, dtype, outs[0])

    def op_max_pool(self, node: Node, outs: list[str]) -> None:
        a = node.attrs
        t = self.graph.tensors[node.inputs[0]]
        dims = len(a["kernel"])
        from .runtime import pool_end_pads

        sizes = t.shape[-dims:]
        if all(isinstance(n, int) for n in sizes):
            right = pool_end_pads(a, sizes)
        elif not a["ceil_mode"]:  # ONNX's floor count with torch's padding is torch's count
            right = list(a["padding"])
        else:
            raise ValueError(
                f"node {node.name!r} ({node.source}): max pooling with ceil_mode over a dynamic "
                f"size ({sizes}) has no fixed ONNX padding; export with that size fixed"
            )
        x = self.as_float(node.inputs[0])
        if len(t.shape) == dims + 1:  # unbatched (C, *spatial)
            x = self.op("Unsqueeze", [x, self.const([0], np.int64)])
        y = self.op(
            "MaxPool",
            [x],
            kernel_shape=a["kernel"],
            strides=a["stride"],
            pads=list(a["padding"]) + right,
            dilations=a["dilation"],
        )
        if len(t.shape) == dims + 1:
            y = self.op("Squeeze", [y, self.const([0], np.int64)])
        self.cast(y, self.store(node.inputs[0]), outs[0])

    def op_adaptive_max_pool(self, node: Node, outs: list[str]) -> None:
        from .runtime import adaptive_windows

        t = self.graph.tensors[node.inputs[0]]
        size = node.attrs["output_size"]
        x = self.as_float(node.inputs[0])
        for i, o in enumerate(size):
            axis = len(t.shape) - len(size) + i
            parts = []
            for s, e in adaptive_windows(t.shape[axis], o):
                sl = self.op(
                    "Slice",
                    [
                        x,
                        self.const([s], np.int64),
                        self.const([e], np.int64),
                        self.const([axis], np.int64),
                    ],
                )
                parts.append(self.op("ReduceMax", [sl, self.const([axis], np.int64)], keepdims=1))
            x = parts[0] if len(parts) == 1 else self.op("Concat", parts, axis=axis)
        self.cast(x, self.store(node.inputs[0]), outs[0])

    def op_reshape(self, node: Node, outs: list[str]) -> None:
        shape = self.const(np.array(node.attrs["shape"], np.int64), hint="shape")
        self.op("Reshape", [self.name(node.inputs[0]), shape], outs[0])

    def op_transpose(self, node: Node, outs: list[str]) -> None:
        self.op("Transpose", [self.name(node.inputs[0])], outs[0], perm=node.attrs["perm"])

    def op_gather(self, node: Node, outs: list[str]) -> None:
        a = node.attrs
        idx = node.params["index"].astype(np.int64)
        x = self.name(node.inputs[0])
        flat = self.op(
            "Reshape", [x, self.const(np.array([0 if a["per_sample"] else 1, -1], np.int64))]
        )
        if (idx < 0).any():
            t = self.graph.tensors[node.inputs[0]]
            size = int(np.prod([s for s in (t.shape[1:] if a["per_sample"] else t.shape)]))
            pads = self.const(np.array([0, 0, 0, 1], np.int64))
            if self.store(node.inputs[0]) in ("int32", "int64", "bool"):  # Pad takes them as is
                flat = self.op("Pad", [flat, pads])
            else:  # onnxruntime's Pad has no int16: exact float32 values
                flat = self.cast(
                    self.op("Pad", [self.as_float_name(flat), pads]), self.store(node.inputs[0])
                )
            idx = np.where(idx < 0, size, idx)
        y = self.op("Gather", [flat, self.const(idx, hint="index")], axis=1)
        shape = [0, *a["shape"]] if a["per_sample"] else list(a["shape"])
        self.op("Reshape", [y, self.const(np.array(shape, np.int64))], outs[0])

    def as_float_name(self, onnx_name: str) -> str:
        return self.cast(onnx_name, "float32")

    def op_concat(self, node: Node, outs: list[str]) -> None:
        self.op("Concat", [self.name(i) for i in node.inputs], outs[0], axis=node.attrs["axis"])

    def op_float(self, node: Node, outs: list[str]) -> None:
        a = node.attrs
        dtype = a.get("dtype") or "float32"
        xs = [self.convert(i, dtype) for i in node.inputs]
        if a["fn"] == "neg":
            self.op("Neg", xs, outs[0])
            return
        if a.get("scalar") is not None:
            s = self.const(a["scalar"], dtype)
            xs = [s, xs[0]] if a.get("scalar_first") else [xs[0], s]
        op_type = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div"}[a["fn"]]
        self.op(op_type, xs, outs[0])

    # -- plain tensors: constants, casts, comparisons, logical ops -------------------------------
    def op_constant(self, node: Node, outs: list[str]) -> None:
        value = node.params["value"]
        if self.store(node.outputs[0]) == "float32" and value.dtype != np.float32:  # QDQ
            value = value.astype(np.float32) * np.float32(self.graph.tensors[node.outputs[0]].scale)
        c = self.const(value, hint="constant")
        dynamic = node.attrs.get("dynamic") or []
        for axis, i, in_axis in dynamic:  # cut to the input's size along the axis
            end = self.op("Shape", [self.name(node.inputs[i])], start=in_axis, end=in_axis + 1)
            zero, at = self.const(np.array([0], np.int64)), self.const(np.array([axis], np.int64))
            c = self.op("Slice", [c, zero, end, at])
        if dynamic and node.attrs["batch"]:
            batch = self.op("Shape", [self.name(node.inputs[0])], start=0, end=1)
            ones = self.const(np.ones(value.ndim - 1, np.int64), hint="shape")
            self.op("Expand", [c, self.op("Concat", [batch, ones], axis=0)], outs[0])
            return
        if not node.attrs["batch"]:
            self.op("Identity", [c], outs[0])
            return
        batch = self.op("Shape", [self.name(node.inputs[0])], start=0, end=1)
        rest = self.const(np.array(value.shape[1:], np.int64), hint="shape")
        self.op("Expand", [c, self.op("Concat", [batch, rest], axis=0)], outs[0])

    def op_cast(self, node: Node, outs: list[str]) -> None:
        self.op("Cast", [self.name(node.inputs[0])], outs[0], to=self.types[node.attrs["dtype"]])

    def op_compare(self, node: Node, outs: list[str]) -> None:
        a = node.attrs
        dtype = a["compute_dtype"]
        if dtype == "bool" and a["fn"] not in ("eq", "ne"):
            dtype = "int64"  # ONNX orders numbers only: False < True as 0 < 1
        xs = [self.convert(i, dtype) for i in node.inputs]
        if a.get("scalar") is not None:
            s = self.const(np.asarray(a["scalar"]).astype(dtype), hint="scalar")
            xs = [s, xs[0]] if a.get("scalar_first") else [xs[0], s]
        ops = {"eq": "Equal", "ne": "Equal", "lt": "Less", "le": "LessOrEqual"}
        ops.update(gt="Greater", ge="GreaterOrEqual")
        if a["fn"] == "ne":
            self.op("Not", [self.op("Equal", xs)], outs[0])
        else:
            self.op(ops[a["fn"]], xs, outs[0])

    def op_logical(self, node: Node, outs: list[str]) -> None:
        op_type = {"and": "And", "or": "Or", "xor": "Xor", "not": "Not"}[node.attrs["fn"]]
        self.op(op_type, [self.name(i) for i in node.inputs], outs[0])

    # -- normalization and softmax -------------------------------------------------------------
    def pow2_int(self, k: str) -> str:
        """``2**k`` (int64) for an int64 tensor ``k`` in ``[0, 62]``."""
        table = self.const(np.array([1 << i for i in range(63)], np.int64), hint="pow2")
        return self.op("Gather", [table, k], axis=0)

    def int_const(self, v: int) -> str:
        return self.const(np.int64(v))

    def shift_round_var(self, v: str, shift: str, rounding: str) -> str:
        """``shift_round(v, shift)`` of an int64 ``v`` (either sign, ``|v| < 2**61`` after a
        left shift) by an int64 tensor ``shift`` (either sign) -> int64. A right shift is
        ``floor(t / d)`` with ``t = v + d / 2``, ``d = 2**shift``, written
        ``(t - Mod(t, d)) / d``: integer ``Mod`` takes the divisor's sign (Python's
        floor modulo), so the ``Div`` is exact. Shifts beyond 62 act as 62 (the result is 0
        for ``|v| < 2**61``, as the exact shift gives)."""
        lo, hi = self.int_const(0), self.int_const(62)
        v = self.op("Mul", [v, self.pow2_int(self.op("Clip", [self.op("Neg", [shift]), lo, hi]))])
        right = self.op("Clip", [shift, lo, hi])
        d = self.pow2_int(right)
        half = self.op("Div", [d, self.int_const(2)])
        t = self.op("Add", [v, half])
        q = self.op("Div", [self.op("Sub", [t, self.op("Mod", [t, d])]), d])
        if rounding == "half_up":
            return q
        if rounding != "half_even":
            raise ValueError(f"unknown rounding {rounding!r}")
        tie = self.op(
            "And",
            [
                self.op("Equal", [self.op("Mod", [v, d]), half]),
                self.op("Greater", [right, self.int_const(0)]),
            ],
        )
        odd = self.op("Equal", [self.op("Mod", [q, self.int_const(2)]), self.int_const(1)])
        return self.op("Sub", [q, self.cast(self.op("And", [tie, odd]), "int64")])

    def op_reduce_extreme(self, node: Node, outs: list[str]) -> None:
        a = node.attrs
        op_type = "ReduceMax" if a["fn"] == "amax" else "ReduceMin"
        axes = self.const(np.array(a["axes"], np.int64), hint="axes")
        x = self.as_float(node.inputs[0])  # exact: int8 / int16 values
        y = self.op(op_type, [x, axes], keepdims=int(a["keepdim"]))
        self.cast(y, self.store(node.outputs[0]), outs[0])

    def op_arg_extreme(self, node: Node, outs: list[str]) -> None:
        a = node.attrs
        op_type = "ArgMax" if a["fn"] == "argmax" else "ArgMin"
        x = self.as_float(node.inputs[0])  # exact: int8 / int16 values
        keep = int(a["keepdim"])
        if a["axis"] is None:
            flat = self.op("Reshape", [x, self.const(np.array([-1], np.int64), hint="shape")])
            y = self.op(op_type, [flat], axis=0, keepdims=0)
            shape = [1] * self.rank(node.inputs[0]) if keep else []
            self.op("Reshape", [y, self.const(np.array(shape, np.int64), hint="shape")], outs[0])
            return
        self.op(op_type, [x], outs[0], axis=a["axis"], keepdims=keep)

    # -- model ---------------------------------------------------------------------------------
    def value_info(self, ir_name: str) -> Any:
        t = self.graph.tensors[ir_name]
        return self.h.make_tensor_value_info(
            self.name(ir_name), self.types[self.store(ir_name)], list(t.shape)
        )

    def model(self) -> Any:
        g = self.graph
        for node in g.nodes:
            try:
                self.write(node)
            except AttributeError as e:
                if f"op_{node.op}" in str(e):
                    raise ValueError(
                        f"node {node.name!r} ({node.source}): op {node.op!r} has no ONNX writer"
                    ) from None
                raise
        # an output that is also an input or another output's tensor gets its own name
        outputs = []
        seen = set(self.name(i) for i in g.inputs)
        for o in g.outputs:
            name = self.name(o)
            if name in seen:
                alias = self.op("Identity", [self.name(o)])
                t = g.tensors[o]
                outputs.append(
                    self.h.make_tensor_value_info(alias, self.types[self.store(o)], list(t.shape))
                )
            else:
                outputs.append(self.value_info(o))
            seen.add(name)
        onnx_graph = self.h.make_graph(
            self.nodes, "fxq_integer", [self.value_info(i) for i in g.inputs], outputs, self.inits
        )
        model = self.h.make_model(
            onnx_graph,
            opset_imports=[self.h.make_opsetid("", self.opset)],
            producer_name="fxq",
            doc_string=f"fxq integer graph, march {g.march}: bit-exact integer arithmetic",
        )
        model.ir_version = 10 if self.opset >= 21 else 9
        self.onnx.checker.check_model(model, full_check=True)
        return model
