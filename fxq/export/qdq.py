"""``IntegerGraph`` -> QDQ ONNX (``mode="qdq"``): float ops between QuantizeLinear /
DequantizeLinear pairs, the form accelerator compilers ingest (``docs/integer_graph.md``, 4)."""

from __future__ import annotations

from typing import Any

import numpy as np

from fxq.export.graph import Node
from fxq.export.onnx_integer import OPSET, IntegerWriter

__all__ = ["QDQWriter"]


class QDQWriter(IntegerWriter):
    """The QuantizeLinear / DequantizeLinear form (``mode="qdq"``, opset 21).

    Every tensor is float32. Each quantized tensor is ``DequantizeLinear(QuantizeLinear(v))``
    at its scale (zero point 0, int8 / int16); weights are float initializers holding
    ``int8 * scale`` exactly (see ``dq_weight``), biases int32 at ``s_x * s_w``; the ops between
    compute in float (Conv, MatMul, Add, Mul, Sigmoid, ...). This is what other
    accelerator compilers ingest; onnxruntime runs it with QuantizeLinear's rounding
    (half to even) and float arithmetic, so it differs from the integer model by a few
    LSB on some elements (``docs/integer_graph.md`` gives the measured difference).
    """

    opset = 21

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

    def qdq(self, v: str, ir_name: str, out: str) -> str:
        """``DequantizeLinear(QuantizeLinear(v))`` at the scale and dtype of ``ir_name``."""
        t = self.graph.tensors[ir_name]
        if t.scale is None:
            return self.op("Identity", [v], out)
        zp = self.const(0, {"int8": np.int8, "int16": np.int16, "int32": np.int32}[t.dtype], "zp")
        s = self.const(t.scale, np.float32, "scale")
        return self.op("DequantizeLinear", [self.op("QuantizeLinear", [v, s, zp]), s, zp], out)

    def dq_weight(self, node: Node, transposed: bool = False) -> str:
        """The weight as a float initializer holding ``int8 * scale`` exactly (what a
        per-channel ``DequantizeLinear`` computes): onnxruntime 1.32 rewrites a per-channel
        int8 weight pair into its own integer kernels wrongly (conv and linear came out
        7 to 54 LSB off), so weights get no Q / DQ pair of their own."""
        p = node.params
        w, sw = p["weight"], p["weight_scale"].astype(np.float32)
        wf = w.astype(np.float32) * sw.reshape(-1, *[1] * (w.ndim - 1))
        if transposed:  # per-channel axis moves with the groups
            g = node.attrs["groups"]
            k = w.shape[2:]
            wt = wf.reshape(g, w.shape[0] // g, w.shape[1], *k).swapaxes(1, 2)
            return self.const(wt.reshape(g * w.shape[1], w.shape[0] // g, *k), hint="weight")
        return self.const(wf, hint="weight")

    def dq_bias(self, node: Node) -> str | None:
        p = node.params
        if "bias" not in p:
            return None
        s = np.float32(self.fscale(node.inputs[0])) * p["weight_scale"].astype(np.float32)
        zp = self.const(np.zeros(s.shape, np.int32), hint="zp")
        return self.op(
            "DequantizeLinear",
            [self.const(p["bias"], hint="bias"), self.const(s, hint="bscale"), zp],
            axis=0,
        )

    def _finish_float(self, node: Node, y: str, rank: int, axis: int, out: str) -> None:
        a = node.attrs
        if len(node.inputs) > 1:
            y = self.op("Add", [y, self.name(node.inputs[1])])
        t = self.graph.tensors[node.outputs[0]]
        s = 1.0 if t.scale is None else t.scale
        if a["lo"] is not None or a["hi"] is not None:
            lo = -np.inf if a["lo"] is None else a["lo"] * s
            hi = a.get("float_max") or (np.inf if a["hi"] is None else a["hi"] * s)
            y = self.op("Clip", [y, self.const(lo, np.float32), self.const(hi, np.float32)])
        self.qdq(y, node.outputs[0], out)

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
        getattr(self, f"op_{node.op}")(node, [tmp])
        self.qdq(tmp, out, self.name(out))

    def op_quantize(self, node: Node, outs: list[str]) -> None:
        self.qdq(self.name(node.inputs[0]), node.outputs[0], outs[0])

    def op_dequantize(self, node: Node, outs: list[str]) -> None:
        self.op("Identity", [self.name(node.inputs[0])], outs[0])

    def op_requantize(self, node: Node, outs: list[str]) -> None:
        a, p = node.attrs, node.params
        t = self.graph.tensors[node.outputs[0]]
        r = np.ldexp(p["multiplier"].astype(np.float64), -p["shift"].astype(np.int64))
        factor = r * t.scale / self.fscale(node.inputs[0])
        v = self.name(node.inputs[0])
        if np.abs(factor - 1).max() > 1e-3:  # averaging (1 / count) or resampling weights
            v = self.op("Mul", [v, self.const(factor.astype(np.float32), hint="factor")])
        if a["lo"] is not None or a["hi"] is not None:
            lo = -np.inf if a["lo"] is None else a["lo"] * t.scale
            hi = np.inf if a["hi"] is None else a["hi"] * t.scale
            v = self.op("Clip", [v, self.const(lo, np.float32), self.const(hi, np.float32)])
        self.qdq(v, node.outputs[0], outs[0])

    def op_conv(self, node: Node, outs: list[str]) -> None:
        a = node.attrs
        d = a["dim"]
        x = self.name(node.inputs[0])
        inputs = [x, self.dq_weight(node, a["transposed"])]
        bias = self.dq_bias(node)
        if a["transposed"]:
            attrs = dict(
                strides=a["stride"],
                pads=a["padding"] + a["padding"],
                dilations=a["dilation"],
                group=a["groups"],
                output_padding=a["output_padding"],
            )
            y = self.op("ConvTranspose", inputs + ([bias] if bias else []), **attrs)
        else:
            # an input with an offset: its dequantized stored 0 is -offset * scale
            value = a.get("pad_value", 0)
            if value:
                value = float(np.float32(value) * np.float32(self.fscale(node.inputs[0])))
            inputs[0], pads = self.explicit_pad(x, a, value)
            y = self.op(
                "Conv",
                inputs + ([bias] if bias else []),
                strides=a["stride"],
                pads=[p[0] for p in pads] + [p[1] for p in pads],
                dilations=a["dilation"],
                group=a["groups"],
            )
        self._finish_float(node, y, d + 2, 1, outs[0])

    def op_linear(self, node: Node, outs: list[str]) -> None:
        w = self.op("Transpose", [self.dq_weight(node)], perm=[1, 0])
        x = self.name(node.inputs[0])
        shape = self.graph.tensors[node.inputs[0]].shape
        if len(shape) > 2:
            # a 2-d MatMul between Reshapes, the rows with their own Q / DQ pair: onnxruntime
            # 1.32's MatMul + Add -> Gemm rewrite of a rank-3 input of static shape (a batch
            # size fixed by a constant mask) inserts a QuantizeLinear it cannot type
            rows = self.const(np.array([-1, shape[-1]], np.int64))
            x = self.qdq(self.op("Reshape", [x, rows]), node.inputs[0], self.fresh("rows"))
        y = self.op("MatMul", [x, w])
        bias = self.dq_bias(node)
        if bias:
            y = self.op("Add", [y, bias])
        if len(shape) > 2:
            n = node.params["weight"].shape[0]
            lead = self.op(
                "Slice",
                [
                    self.op("Shape", [self.name(node.inputs[0])]),
                    self.const(np.array([0], np.int64)),
                    self.const(np.array([-1], np.int64)),
                ],
            )
            dims = self.op("Concat", [lead, self.const(np.array([n], np.int64))], axis=0)
            y = self.op("Reshape", [y, dims])
        self._finish_float(node, y, self.rank(node.inputs[0]), -1, outs[0])

    def op_channel_affine(self, node: Node, outs: list[str]) -> None:
        rank = self.rank(node.inputs[0])
        c = node.params["weight"].shape[0]
        dims = self.const(np.array([c] + [1] * (rank - 2), np.int64))
        w = self.op("Reshape", [self.dq_weight(node), dims])
        y = self.op("Mul", [self.name(node.inputs[0]), w])
        y = self.op("Add", [y, self.op("Reshape", [self.dq_bias(node), dims])])
        self._finish_float(node, y, rank, 1, outs[0])

    def op_add(self, node: Node, outs: list[str]) -> None:
        a = node.attrs
        terms = []
        for i, f in zip(node.inputs, a["factors"]):
            x = self.name(i)
            terms.append(x if f == 1.0 else self.op("Mul", [x, self.const(f, np.float32)]))
        if a["scalar"]:
            terms.append(self.const(a["scalar"], np.float32))
        y = terms[0] if len(terms) == 1 else self.op("Sum", terms)
        self.qdq(y, node.outputs[0], outs[0])

    def op_mul(self, node: Node, outs: list[str]) -> None:
        a = node.attrs
        xs = [self.name(i) for i in node.inputs]
        if a["scalar"] is not None:
            xs.append(self.const(a["scalar"], np.float32))
        self.qdq(self.op("Mul", xs), node.outputs[0], outs[0])

    def op_where(self, node: Node, outs: list[str]) -> None:
        a = node.attrs
        scale = self.graph.tensors[node.outputs[0]].scale
        if scale is None:  # plain tensors (a mask): as in the integer form
            super().op_where(node, outs)
            return
        cond, inputs = self.condition(node)
        tensors = iter(inputs)
        xs = [
            self.name(next(tensors)) if c is None else self.const(np.float32(c * scale))
            for c in a["constants"]
        ]
        self.qdq(self.op("Where", [cond, *xs]), node.outputs[0], outs[0])

    def op_matmul(self, node: Node, outs: list[str]) -> None:
        y = self.op("MatMul", [self.name(i) for i in node.inputs])
        factor = node.attrs.get("factor", 1.0)
        if factor != 1.0:  # attention's scale, folded into the integer multiplier
            y = self.op("Mul", [y, self.const(np.float32(factor))])
        self.qdq(y, node.outputs[0], outs[0])

    def op_clip(self, node: Node, outs: list[str]) -> None:
        a, s = node.attrs, self.fscale(node.inputs[0])
        lo, hi = self.const(a["lo"] * s, np.float32), self.const(a["hi"] * s, np.float32)
        self.op("Clip", [self.name(node.inputs[0]), lo, hi], outs[0])

    def _function(self, node: Node, x: str) -> str:
        a = node.attrs
        fn, args = a.get("function"), a.get("function_args", {})
        c = lambda v: self.const(v, np.float32)  # noqa: E731
        simple = {
            "sigmoid": "Sigmoid",
            "tanh": "Tanh",
            "exp": "Exp",
            "mish": "Mish",
            "abs": "Abs",
        }
        if fn in simple:
            return self.op(simple[fn], [x])
        if fn == "hardswish":
            return self.op("HardSwish", [x])
        if fn == "hardsigmoid":
            return self.op("HardSigmoid", [x], alpha=1 / 6, beta=0.5)
        if fn == "silu":
            return self.op("Mul", [x, self.op("Sigmoid", [x])])
        if fn == "gelu" and args.get("approximate", "none") == "none":  # Gelu is opset 20
            half = self.op("Mul", [x, c(0.5)])
            erf = self.op("Erf", [self.op("Mul", [x, c(1 / np.sqrt(2.0))])])
            return self.op("Mul", [half, self.op("Add", [erf, c(1.0)])])
        if fn == "leaky_relu":
            return self.op("LeakyRelu", [x], alpha=float(args.get("negative_slope", 0.01)))
        if fn == "elu":
            return self.op("Elu", [x], alpha=float(args.get("alpha", 1.0)))
        if fn == "softplus" and float(args.get("beta", 1.0)) == 1.0:
            return self.op("Softplus", [x])
        raise ValueError(
            f"node {node.name!r} ({node.source}): no QDQ form of the table of {fn!r} {args}; "
            "export with mode='integer'"
        )

    def op_lut(self, node: Node, outs: list[str]) -> None:
        self.qdq(self._function(node, self.name(node.inputs[0])), node.outputs[0], outs[0])

    op_segment_lut = op_lut

    def op_axis_matmul(self, node: Node, outs: list[str]) -> None:
        self._sum_scales[node.outputs[0]] = self.fscale(node.inputs[0])
        rank = self.rank(node.inputs[0])
        x = self.name(node.inputs[0])
        axes = node.attrs["axes"]
        for i, axis in enumerate(axes):
            m = self.const(node.params[f"matrix_{i}"].astype(np.float32), hint="matrix")
            last = i == len(axes) - 1
            if axis == rank - 1:
                x = self.op("MatMul", [x, m], outs[0] if last else None)
                continue
            perm = list(range(rank))
            perm[axis], perm[-1] = perm[-1], perm[axis]
            moved = self.op("MatMul", [self.op("Transpose", [x], perm=perm), m])
            x = self.op("Transpose", [moved], outs[0] if last else None, perm=perm)

    def op_grid_sample(self, node: Node, outs: list[str]) -> None:
        """ONNX GridSample on the dequantized input and grid; bilinear sums are in units of
        ``2**-2F`` of the input's scale (the requantize that follows divides them out)."""
        a = node.attrs
        self._sum_scales[node.outputs[0]] = self.fscale(node.inputs[0])
        bilinear = a["mode"] == "bilinear"
        if len(node.inputs) > 1:
            grid = self.name(node.inputs[1])
        else:  # a constant grid: its dequantized values
            grid = self.const(node.params["grid"].astype(np.float32) * np.float32(a["grid_scale"]))
        y = self.op(
            "GridSample",
            [self.name(node.inputs[0]), grid],
            None if bilinear else outs[0],
            mode="bilinear" if bilinear else "nearest",  # onnxruntime 1.x: not "linear"
            padding_mode=a["padding_mode"],
            align_corners=int(node.attrs.get("align_corners", 0)),
        )
        if bilinear:
            one = np.float32(1 << (2 * a["fraction_bits"]))
            self.op("Mul", [y, self.const(one, np.float32)], outs[0])

    def op_reshape(self, node: Node, outs: list[str]) -> None:
        if node.inputs[0] in self._sum_scales:
            self._sum_scales[node.outputs[0]] = self._sum_scales[node.inputs[0]]
        super().op_reshape(node, outs)

    def op_normalize(self, node: Node, outs: list[str]) -> None:
        """The float normalization (mean, variance, ``1 / sqrt``) with the int8 affine weight and
        the int32 bias dequantized."""
        a, p = node.attrs, node.params
        x = self.name(node.inputs[0])
        axes = self.const([-1], np.int64)
        if a["groups"] is None:
            rows = self.op("Reshape", [x, self.const(np.array([-1, a["n"]], np.int64))])
        else:
            rows = self.op("Reshape", [x, self.const(np.array([0, a["groups"], -1], np.int64))])
        d = self.op("Sub", [rows, self.op("ReduceMean", [rows, axes], keepdims=1)])
        var = self.op("ReduceMean", [self.op("Mul", [d, d]), axes], keepdims=1)
        eps = self.const(np.float32(a["eps"]))
        y = self.op("Div", [d, self.op("Sqrt", [self.op("Add", [var, eps])])])
        if a["groups"] is not None:
            channels = p["bias"].shape[0]
            y = self.op("Reshape", [y, self.const(np.array([0, channels, -1], np.int64))])
        s_w = p["weight_scale"].astype(np.float64)
        w = (p["weight"].astype(np.float64) * s_w).astype(np.float32)
        b = (p["bias"].astype(np.float64) * s_w * 2.0 ** -a["q_bits"]).astype(np.float32)
        y = self.op(
            "Add", [self.op("Mul", [y, self.const(w, hint="weight")]), self.const(b, hint="bias")]
        )
        y = self.op("Reshape", [y, self.op("Shape", [x])])
        self.qdq(y, node.outputs[0], outs[0])

    def op_l2_normalize(self, node: Node, outs: list[str]) -> None:
        """The float ``x / max(||x||_2, eps)`` between Q / DQ pairs."""
        a = node.attrs
        x = self.name(node.inputs[0])
        axes = self.const(np.array(a["axes"], np.int64))
        norm = self.op("Sqrt", [self.op("ReduceSum", [self.op("Mul", [x, x]), axes], keepdims=1)])
        norm = self.op("Max", [norm, self.const(np.float32(a["eps"]))])
        self.qdq(self.op("Div", [x, norm]), node.outputs[0], outs[0])

    def op_softmax(self, node: Node, outs: list[str]) -> None:
        a = node.attrs
        x = self.name(node.inputs[0])
        keep = self.keep_mask(node)
        if keep is not None:
            # an additive mask with a finite fill: a row with nothing kept is uniform here and
            # zeroed below, as in fxq (Add / Mul, not Where: onnxruntime 1.32's extended graph
            # optimizations fail on a Where in this position)
            kept = self.op("Cast", [keep], to=self.types["float32"])
            one = self.const(1.0, np.float32)
            bias = self.op("Mul", [self.op("Sub", [kept, one]), self.const(1e30, np.float32)])
            x = self.op("Add", [x, bias])
        # written out (Exp, ReduceSum, Div) so that onnxruntime does not fuse the pair into its
        # own 8-bit QLinearSoftmax, whose numerics differ from both
        axes = self.const([a["axis"]], np.int64)
        shifted = self.op("Sub", [x, self.op("ReduceMax", [x, axes], keepdims=1)])
        exp = self.op("Exp", [shifted])
        total = self.op("ReduceSum", [exp, axes], keepdims=1)
        if a["log"]:
            y = self.op("Sub", [shifted, self.op("Log", [total])])
        else:
            y = self.op("Div", [exp, total])
        if keep is not None and not a["log"]:
            y = self.op("Mul", [y, kept])
        self.qdq(y, node.outputs[0], outs[0])

    def op_divide(self, node: Node, outs: list[str]) -> None:
        a = node.attrs
        if a["numerator"] is None:
            xs = [self.name(i) for i in node.inputs]
        else:
            xs = [self.const(np.float32(a["scalar"])), self.name(node.inputs[0])]
        self.qdq(self.op("Div", xs), node.outputs[0], outs[0])

    def op_prelu(self, node: Node, outs: list[str]) -> None:
        """``PRelu`` with the slopes the integer multipliers hold, between Q / DQ pairs."""
        t = self.graph.tensors[node.outputs[0]]
        r, rn, sign = self.prelu_factors(node)
        factor = t.scale / self.fscale(node.inputs[0])
        x = self.op("Mul", [self.name(node.inputs[0]), self.const(r * factor, np.float32)])
        slope = (rn * sign / r).astype(np.float32)
        self.qdq(self.op("PRelu", [x, self.const(slope, np.float32)]), node.outputs[0], outs[0])

    def op_extremum(self, node: Node, outs: list[str]) -> None:
        op_type = "Max" if node.attrs["fn"] == "maximum" else "Min"
        self.qdq(self.op(op_type, [self.name(i) for i in node.inputs]), node.outputs[0], outs[0])

    def model(self) -> Any:
        self._sum_scales: dict[str, float] = {}
        wide = any(t.dtype == "int16" and t.scale is not None for t in self.graph.tensors.values())
        self.opset = 21 if wide else OPSET  # int16 QuantizeLinear needs opset 21
        return super().model()
