"""Exact accumulation of integer products, then one requantization.

* ``matmul``: ``sat(shift_round(sat32(A @ B) * M, S))`` of two integer operands
  (``torch.matmul`` broadcasting); the int32 accumulator saturates as the march's does.
  Attention's score matmul records a ``factor`` attribute (the float scale folded into
  ``M``) for the QDQ form.

The torch kernel sums exactly whatever the device (``fxq.quantized.functional.accumulate``:
float32 limbs where a float32 GEMM would round); numpy and ONNX sum in float64 / float32 only
below the exactness bound of the operands, else in int64.
Traced by ``torch.export`` / ``torch.compile``, a call is one ``fxq::matmul`` op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from fxq.primitives.arith import dot_bound, exact_dot, requant, sat32
from fxq.primitives.core import Call, Primitive, ir_dtype, is_recording, record, register, traced
from fxq.primitives.schema import RESULT_ATTRS, OpSpec

try:
    import torch
except ImportError:  # the numpy runtime without torch
    torch = None

__all__ = ["matmul"]


def _numpy_matmul(node, inputs):
    a = node.attrs
    x, y = inputs
    acc = exact_dot(x, y, dot_bound(x, y, x.shape[-1]), "...ik,...kj->...ij")
    return [requant(sat32(acc), a["multiplier"], a["shift"], a["dtype"], a["rounding"])]


def _onnx_matmul(w, node, outs: list[str]) -> None:
    a = node.attrs
    x, y = node.inputs
    k = w.graph.tensors[x].shape[-1]
    k = k if isinstance(k, int) else 1 << 31  # a symbolic size: the int64 MatMul
    bound = (1 << (w.bits(x) - 1)) * (1 << (w.bits(y) - 1)) * k
    acc = w.dot(w.name(x), w.name(y), bound)
    if bound >= 1 << 31:
        acc = w.sat32(acc)
    w.requant(acc, a["multiplier"], a["shift"], a["dtype"], a["rounding"], None, None, outs[0])


def _qdq_matmul(w, node, outs: list[str]) -> None:
    y = w.op("MatMul", [w.name(i) for i in node.inputs])
    factor = node.attrs.get("factor", 1.0)
    if factor != 1.0:  # attention's scale, folded into the integer multiplier
        y = w.op("Mul", [y, w.const(np.float32(factor))])
    w.qdq(y, node.outputs[0], outs[0])


register(
    Primitive(
        "matmul",
        _numpy_matmul,
        _onnx_matmul,
        OpSpec(
            (2,),
            {"multiplier": "int", "shift": "int", **RESULT_ATTRS},
            {},
        ),
        _qdq_matmul,
        "`sat(shift_round(sat32(a @ b) * multiplier, shift))`",
    )
)


if torch is not None:
    from torch import Tensor

    from fxq.dtypes import QDType, as_qdtype
    from fxq.march import Rounding
    from fxq.quantized import functional as qf

    def _product(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        return torch.matmul(x, w)

    @torch.library.custom_op("fxq::matmul", mutates_args=())
    def _matmul_op(
        a: Tensor,
        b: Tensor,
        multiplier: Tensor,
        shift: Tensor,
        plan: list[int],
        dtype: str,
        rounding: str,
    ) -> Tensor:
        double, limbs, width, bound, in_kernel = plan
        p = qf.AccumulationPlan(
            torch.float64 if double else torch.float32, limbs, width, bound, bool(in_kernel)
        )
        return matmul(a, b, p, multiplier, shift, as_qdtype(dtype), Rounding(rounding))

    @_matmul_op.register_fake
    def _(a, b, multiplier, shift, plan, dtype, rounding):
        return torch.empty_like(torch.matmul(a.float(), b.float()))

    def matmul(
        a: Tensor,
        b: Tensor,
        plan: qf.AccumulationPlan,
        multiplier: Tensor,
        shift: Tensor,
        dtype: QDType,
        rounding: Rounding,
        check: Callable[[Tensor], Any] | None = None,
        factor: float | None = None,
        scale: Tensor | None = None,
    ) -> Tensor:
        """``sat(shift_round(sat32(a @ b) * multiplier, shift))`` of exact integers, summed
        as ``plan`` says; exact float32 values of ``dtype``.

        Args:
            check: called with the exact accumulator before it saturates, where ``plan``'s
                bound can exceed int32 (the module's saturation warning).
            factor: a float scale the multiplier holds (attention's ``1 / sqrt(d)``), recorded
                as the node's ``factor`` attribute, which the QDQ form multiplies by.
            scale: the output grid's scale, for the exported tensor (a result that stays
                inside the module: attention's scores).
        """
        if traced():  # one fxq::matmul op in the traced graph
            fields = [plan.dtype is torch.float64, plan.limbs, plan.width, plan.bound]
            fields.append(int(plan.bias_in_kernel))
            y = _matmul_op(a, b, multiplier, shift, fields, dtype.name, rounding.value)
        else:  # the kernel (also the op's implementation, which calls this function eagerly)
            acc = qf.accumulate(_product, a, b, None, plan)
            if check is not None and (plan.bound >= 1 << 31 or plan.limbs > 1):
                check(acc)
            acc = qf.saturate_int32(acc)
            y = qf.requantize_exact(acc, multiplier, shift, dtype, rounding, as_float=True)
        if is_recording():
            d = ir_dtype(dtype)
            attrs = {
                "multiplier": int(multiplier.reshape(-1)[0]),
                "shift": int(shift.reshape(-1)[0]),
                "dtype": d,
                "rounding": rounding.value,
            }
            if factor is not None:
                attrs["factor"] = float(factor)
            scales = [None if scale is None else float(scale)]
            record(Call("matmul", [a, b], [y], [d], attrs, {}, scales))
        return y
