"""Elementwise arithmetic with one requantization (``docs/arithmetic.md``, sections 5, 6, 17).

* ``add``: ``sat(shift_round(sum_i X_i m_i + c, S))``: every term on a common shift ``S``,
  with an optional integer constant ``c`` (a scalar operand); attributes ``factors`` and
  ``scalar`` name the float sum for the QDQ form.
* ``mul``: ``sat(shift_round(A B M, S))`` of two operands, or ``sat(shift_round(A sign M, S))``
  of one operand times a number (``scalar``, whose magnitude is in ``M``).
* ``divide``: ``sat(round(N / (B 2**S)))`` exactly, ``N = A m`` (two operands) or the constant
  ``numerator``; ``B = 0`` gives the saturated value of ``N``'s sign (0 for ``0 / 0``).

Traced by ``torch.export`` / ``torch.compile``, each call is one ``torch.library`` op
(``fxq::add``, ``fxq::mul``, ``fxq::divide``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from fxq.primitives.arith import DTYPES, RANGES, requant
from fxq.primitives.core import Call, Primitive, ir_dtype, is_recording, record, register, traced
from fxq.primitives.schema import RESULT_ATTRS, Ctx, OpSpec

try:
    import torch
except ImportError:  # the numpy runtime without torch
    torch = None

__all__ = ["add", "mul", "divide", "divide_exact"]


# -- numpy --------------------------------------------------------------------------------------
def _numpy_add(node, inputs):
    a = node.attrs
    total = np.zeros((), dtype=np.int64)
    for x, m in zip(inputs, a["multipliers"]):
        total = total + x.astype(np.int64) * np.int64(m)
    if a["constant"] is not None:
        total = total + np.int64(a["constant"])
    return [requant(total, 1, a["shift"], a["dtype"], a["rounding"])]


def _numpy_mul(node, inputs):
    a = node.attrs
    if len(inputs) == 2:
        prod = inputs[0].astype(np.int64) * inputs[1].astype(np.int64)
    else:
        prod = inputs[0].astype(np.int64) * np.int64(a["sign"])
    return [requant(prod, a["multiplier"], a["shift"], a["dtype"], a["rounding"])]


def _numpy_divide(node, inputs):
    a = node.attrs
    lo, hi = RANGES[a["dtype"]]
    if a["numerator"] is None:
        num, den = inputs[0].astype(np.int64) * np.int64(a["multiplier"]), inputs[1]
    else:
        num, den = np.int64(a["numerator"]), inputs[0]
    num, den = np.broadcast_arrays(num, den.astype(np.int64))
    shift = a["shift"]
    if shift < 0:
        num = num << -shift
    sign = np.where(den < 0, -1, 1)
    n, d = num * sign, np.abs(den) << max(shift, 0)
    safe = np.where(d == 0, 1, d)
    q = (2 * n + safe) // (2 * safe)
    q = np.where(d == 0, np.where(n > 0, hi, np.where(n < 0, lo, 0)), q)
    return [np.clip(q, lo, hi).astype(DTYPES[a["dtype"]])]


# -- integer ONNX -------------------------------------------------------------------------------
def _onnx_add(w, node, outs: list[str]) -> None:
    a = node.attrs
    total = None
    for i, m in zip(node.inputs, a["multipliers"]):
        term = w.op("Mul", [w.as_int(i), w.int_const(m)])
        total = term if total is None else w.op("Add", [total, term])
    constant = 0 if a["constant"] is None else a["constant"]
    w.requant(total, 1, a["shift"], a["dtype"], a["rounding"], None, None, outs[0], constant)


def _onnx_mul(w, node, outs: list[str]) -> None:
    a = node.attrs
    m = a["multiplier"]
    if len(node.inputs) == 2:
        prod = w.op("Mul", [w.as_int(node.inputs[0]), w.as_int(node.inputs[1])])
    else:
        prod, m = w.as_int(node.inputs[0]), a["sign"] * m
    w.requant(prod, m, a["shift"], a["dtype"], a["rounding"], None, None, outs[0])


def _onnx_divide(w, node, outs: list[str]) -> None:
    a = node.attrs
    lo, hi = RANGES[a["dtype"]]
    if a["numerator"] is None:
        num = w.op("Mul", [w.as_int(node.inputs[0]), w.int_const(a["multiplier"])])
        den = w.as_int(node.inputs[1])
    else:
        num, den = w.int_const(a["numerator"]), w.as_int(node.inputs[0])
    shift = a["shift"]
    if shift < 0:
        num = w.op("Mul", [num, w.int_const(1 << -shift)])
    zero = w.int_const(0)
    sign = w.op("Where", [w.op("Less", [den, zero]), w.int_const(-1), w.int_const(1)])
    n = w.op("Mul", [num, sign])
    d = w.op("Mul", [w.op("Abs", [den]), w.int_const(1 << max(shift, 0))])
    is_zero = w.op("Equal", [d, zero])
    safe = w.op("Where", [is_zero, w.int_const(1), d])
    # floor((2n + d) / 2d) with a possibly negative numerator: Mod (divisor's sign) first
    two = w.int_const(2)
    top = w.op("Add", [w.op("Mul", [n, two]), safe])
    bottom = w.op("Mul", [safe, two])
    q = w.op("Div", [w.op("Sub", [top, w.op("Mod", [top, bottom])]), bottom])
    less = w.op("Where", [w.op("Less", [n, zero]), w.int_const(lo), zero])
    saturated = w.op("Where", [w.op("Greater", [n, zero]), w.int_const(hi), less])
    q = w.op("Clip", [w.op("Where", [is_zero, saturated, q]), w.int_const(lo), w.int_const(hi)])
    w.cast(q, a["dtype"], outs[0])


# -- QDQ ONNX: the float op between Q / DQ pairs ------------------------------------------------
def _qdq_add(w, node, outs: list[str]) -> None:
    a = node.attrs
    terms = []
    for i, f in zip(node.inputs, a["factors"]):
        x = w.name(i)
        terms.append(x if f == 1.0 else w.op("Mul", [x, w.const(f, np.float32)]))
    if a["scalar"]:
        terms.append(w.const(a["scalar"], np.float32))
    y = terms[0] if len(terms) == 1 else w.op("Sum", terms)
    w.qdq(y, node.outputs[0], outs[0])


def _qdq_mul(w, node, outs: list[str]) -> None:
    a = node.attrs
    xs = [w.name(i) for i in node.inputs]
    if a["scalar"] is not None:
        xs.append(w.const(a["scalar"], np.float32))
    w.qdq(w.op("Mul", xs), node.outputs[0], outs[0])


def _qdq_divide(w, node, outs: list[str]) -> None:
    a = node.attrs
    if a["numerator"] is None:
        xs = [w.name(i) for i in node.inputs]
    else:
        xs = [w.const(np.float32(a["scalar"])), w.name(node.inputs[0])]
    w.qdq(w.op("Div", xs), node.outputs[0], outs[0])


# -- file schema --------------------------------------------------------------------------------
def _check_add(c: Ctx) -> None:
    if len(c.attrs["multipliers"]) != len(c.node["inputs"]):
        raise c.fail(
            f"{len(c.attrs['multipliers'])} multipliers for {len(c.node['inputs'])} inputs"
        )


def _check_mul(c: Ctx) -> None:
    if len(c.node["inputs"]) == 1 and c.attrs.get("sign") not in (1, -1):
        raise c.fail(f"sign {c.attrs.get('sign')!r} (one input needs sign 1 or -1)")


def _check_divide(c: Ctx) -> None:
    want = 2 if c.attrs["numerator"] is None else 1
    if len(c.node["inputs"]) != want:
        raise c.fail(f"{len(c.node['inputs'])} inputs with numerator {c.attrs['numerator']!r}")


register(
    Primitive(
        "add",
        _numpy_add,
        _onnx_add,
        OpSpec(
            (1, 2, 3, 4, 5, 6, 7, 8),
            {"multipliers": "ints", "shift": "int", "constant": "int?", **RESULT_ATTRS},
            {},
            _check_add,
        ),
        _qdq_add,
        "`sat(shift_round(sum_i x_i m_i + c, shift))`",
    )
)
register(
    Primitive(
        "mul",
        _numpy_mul,
        _onnx_mul,
        OpSpec(
            (1, 2),
            {"multiplier": "int", "shift": "int", "sign": "int?", **RESULT_ATTRS},
            {},
            _check_mul,
        ),
        _qdq_mul,
        "`sat(shift_round(a * b * m, shift))`, or of `a * sign`",
    )
)
register(
    Primitive(
        "divide",
        _numpy_divide,
        _onnx_divide,
        OpSpec(
            (1, 2),
            {"multiplier": "int", "shift": "int", "numerator": "int?", **RESULT_ATTRS},
            {},
            _check_divide,
        ),
        _qdq_divide,
        "`sat(round(n / (b 2**shift)))` exactly, `n = a m` or a constant",
    )
)


# -- torch --------------------------------------------------------------------------------------
if torch is not None:
    from torch import Tensor

    from fxq.dtypes import QDType, as_qdtype
    from fxq.march import Rounding
    from fxq.quantized import functional as qf

    def _int(t: Any) -> int:
        return int(t.reshape(-1)[0]) if isinstance(t, Tensor) else int(t)

    def _mul_kernel(
        a: Tensor,
        b: Tensor | None,
        m: Tensor,
        s: Tensor,
        sign: int | None,
        dtype: QDType,
        rounding: Rounding,
    ) -> Tensor:
        x = a.to(torch.float64)
        product = x * (b.to(torch.float64) if b is not None else float(sign))
        return qf.requantize_exact(product, m, s, dtype, rounding, as_float=True)

    def _divide_kernel(
        a: Tensor | None,
        b: Tensor,
        multiplier: int,
        shift: int,
        numerator: int | None,
        dtype: QDType,
    ) -> Tensor:
        den = b.to(torch.int64)
        if a is not None:
            num = a.to(torch.int64) * multiplier
        else:
            num = torch.full((), numerator, dtype=torch.int64, device=den.device)
        num, den = torch.broadcast_tensors(num, den)
        return divide_exact(num, den, shift, dtype.qmin, dtype.qmax).to(torch.float32)

    @torch.library.custom_op("fxq::add", mutates_args=())
    def _add_op(
        values: list[Tensor],
        multipliers: list[int],
        constant: Optional[Tensor],  # noqa: UP045 (torch.library reads the annotation)
        shift: Tensor,
        dtype: str,
        rounding: str,
    ) -> Tensor:
        terms = list(zip(values, multipliers))
        return qf.add_requant(terms, constant, shift, as_qdtype(dtype), Rounding(rounding))

    @_add_op.register_fake
    def _(values, multipliers, constant, shift, dtype, rounding):
        shape = torch.broadcast_shapes(*(v.shape for v in values))
        return values[0].new_empty(shape, dtype=as_qdtype(dtype).storage)

    @torch.library.custom_op("fxq::mul", mutates_args=())
    def _mul_op(
        a: Tensor,
        b: Optional[Tensor],  # noqa: UP045
        multiplier: Tensor,
        shift: Tensor,
        sign: int,
        dtype: str,
        rounding: str,
    ) -> Tensor:
        return _mul_kernel(a, b, multiplier, shift, sign, as_qdtype(dtype), Rounding(rounding))

    @_mul_op.register_fake
    def _(a, b, multiplier, shift, sign, dtype, rounding):
        shape = a.shape if b is None else torch.broadcast_shapes(a.shape, b.shape)
        return a.new_empty(shape, dtype=torch.float32)

    @torch.library.custom_op("fxq::divide", mutates_args=())
    def _divide_op(
        a: Optional[Tensor],  # noqa: UP045
        b: Tensor,
        multiplier: int,
        shift: int,
        numerator: int,
        dtype: str,
    ) -> Tensor:
        return _divide_kernel(a, b, multiplier, shift, numerator, as_qdtype(dtype))

    @_divide_op.register_fake
    def _(a, b, multiplier, shift, numerator, dtype):
        shape = b.shape if a is None else torch.broadcast_shapes(a.shape, b.shape)
        return b.new_empty(shape, dtype=torch.float32)

    def add(
        values: Sequence[Tensor],
        multipliers: Sequence[int],
        constant: Tensor | None,
        shift: Tensor,
        dtype: QDType,
        rounding: Rounding,
        factors: Sequence[float],
        scalar: float = 0.0,
    ) -> Tensor:
        """``sat(shift_round(sum_i values_i * multipliers_i + constant, shift))`` in ``dtype``
        storage; ``factors`` and ``scalar`` (the float sum ``sum_i f_i x_i + scalar``) are
        recorded for the QDQ form."""
        if traced():  # one fxq::add op in the traced graph
            multipliers = [int(m) for m in multipliers]
            y = _add_op(list(values), multipliers, constant, shift, dtype.name, rounding.value)
        else:
            y = qf.add_requant(list(zip(values, multipliers)), constant, shift, dtype, rounding)
        if is_recording():
            d = ir_dtype(dtype)
            attrs = {
                "multipliers": [int(m) for m in multipliers],
                "shift": _int(shift),
                "constant": None if constant is None else _int(constant),
                "factors": [float(f) for f in factors],
                "scalar": float(scalar),
                "dtype": d,
                "rounding": rounding.value,
            }
            record(Call("add", list(values), [y], [d], attrs))
        return y

    def mul(
        a: Tensor,
        b: Tensor | None,
        multiplier: Tensor | int,
        shift: Tensor | int,
        dtype: QDType,
        rounding: Rounding,
        sign: int | None = None,
        scalar: float | None = None,
        scale: Tensor | None = None,
    ) -> Tensor:
        """``sat(shift_round(a * b * multiplier, shift))``, or ``a * sign`` without ``b``, as
        exact float32 values of ``dtype``.

        Args:
            scalar: the number ``a`` is multiplied by (its sign is ``sign``, its magnitude in
                the multiplier), for the QDQ form.
            scale: the output grid's scale where the result stays inside a module (the
                square inside a cube).
        """
        m = torch.as_tensor(multiplier, dtype=torch.int64).reshape(1)
        s = torch.as_tensor(shift, dtype=torch.int64).reshape(1)
        if traced():  # one fxq::mul op in the traced graph
            sign_ = 0 if sign is None else int(sign)
            y = _mul_op(a, b, m, s, sign_, dtype.name, rounding.value)
        else:
            y = _mul_kernel(a, b, m, s, sign, dtype, rounding)
        if is_recording():
            d = ir_dtype(dtype)
            attrs = {
                "multiplier": _int(m),
                "shift": _int(s),
                "sign": None if b is not None else int(sign),
                "scalar": scalar,
                "dtype": d,
                "rounding": rounding.value,
            }
            inputs = [a] if b is None else [a, b]
            scales = [None if scale is None else float(scale)]
            record(Call("mul", inputs, [y], [d], attrs, {}, scales))
        return y

    def divide_exact(num: Tensor, den: Tensor, shift: int, lo: int, hi: int) -> Tensor:
        """``sat(floor(num / (den 2**shift) + 1/2))`` of int64 tensors, exactly; ``den = 0``
        gives ``hi`` / ``lo`` by the sign of ``num`` (0 for ``0 / 0``)."""
        if shift < 0:
            num = num * (1 << -shift)
        sign = torch.where(den < 0, -1, 1)
        n, d = num * sign, den.abs() << max(shift, 0)
        safe = torch.where(d == 0, torch.ones_like(d), d)
        q = torch.div(2 * n + safe, 2 * safe, rounding_mode="floor")
        zero_den = torch.where(n > 0, hi, torch.where(n < 0, lo, 0))
        return torch.where(d == 0, zero_den, q).clamp_(lo, hi)

    def divide(
        a: Tensor | None,
        b: Tensor,
        multiplier: int,
        shift: int,
        dtype: QDType,
        rounding: Rounding,
        numerator: int | None = None,
        scalar: float | None = None,
    ) -> Tensor:
        """``sat(round(N / (b 2**shift)))`` with ``N = a * multiplier``, or ``numerator``
        without ``a``, as exact float32 values of ``dtype``; ``scalar`` (the number over
        ``b``) is recorded for the QDQ form."""
        if traced():  # one fxq::divide op in the traced graph
            n = 0 if numerator is None else int(numerator)
            y = _divide_op(a, b, int(multiplier), int(shift), n, dtype.name)
        else:
            y = _divide_kernel(a, b, multiplier, shift, numerator, dtype)
        if is_recording():
            d = ir_dtype(dtype)
            attrs = {
                "multiplier": int(multiplier),
                "shift": int(shift),
                "numerator": numerator,
                "dtype": d,
                "rounding": rounding.value,
            }
            if scalar is not None:
                attrs["scalar"] = float(scalar)
            inputs = [b] if a is None else [a, b]
            record(Call("divide", inputs, [y], [d], attrs))
        return y
