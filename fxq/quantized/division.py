"""Integer division (``docs/arithmetic.md``, section 17).

* ``a / b`` (two QTensors) and ``c / b`` (a number over a QTensor): one exact integer
  division, ``Y = sat(round(N / (B 2**S)))`` with ``N = A m`` (or ``sign(c) m``) and
  ``m 2**-S ~ s_a / (s_b s_y)`` (``|c| / (s_b s_y)``), rounded half up; ``B = 0`` gives the
  saturated value of the numerator's sign (0 for ``0 / 0``).
* ``a / c`` (by a number): a multiplication, ``Y = sat(shift_round(A M, S)) * sign(c)`` with
  ``M 2**-S ~ s_a / (|c| s_y)``.

The hardware form of a tensor division is a reciprocal table and a multiply; the exact
division is what that form approximates, and is as cheap to state in every runtime.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fxq.qtensor import QTensor
from fxq.quantized import functional as qf
from fxq.quantized.base import multiplier_for
from fxq.quantized.ops_base import FunctionalQuantized

__all__ = ["Div", "divide_operands", "divide_exact"]


def divide_operands(args: tuple, kwargs: dict) -> tuple[Any, Any]:
    a = args[0] if args else kwargs["input"]
    b = args[1] if len(args) > 1 else kwargs["other"]
    return a, b


def divide_exact(num: Tensor, den: Tensor, shift: int, lo: int, hi: int) -> Tensor:
    """``sat(floor(num / (den 2**shift) + 1/2))`` of int64 tensors, exactly; ``den = 0`` gives
    ``hi`` / ``lo`` by the sign of ``num`` (0 for ``0 / 0``)."""
    if shift < 0:
        num = num * (1 << -shift)
    sign = torch.where(den < 0, -1, 1)
    n, d = num * sign, den.abs() << max(shift, 0)
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.div(2 * n + safe, 2 * safe, rounding_mode="floor")
    zero_den = torch.where(n > 0, hi, torch.where(n < 0, lo, 0))
    return torch.where(d == 0, zero_den, q).clamp_(lo, hi)


class Div(FunctionalQuantized):
    """Integer ``a / b``, ``a / c`` and ``c / b`` (``/``, ``/=``, ``torch.div``, ``Tensor.div``)."""

    def plan(self, a: Any, b: Any) -> tuple[str, Tensor, Tensor, int]:
        """``(form, m, S, sign)`` for these operands: form ``"tensor"``, ``"numerator"`` (a
        number over a QTensor) or ``"divisor"`` (a QTensor over a number)."""
        s_y = self.output_scale.double()
        if isinstance(a, QTensor) and isinstance(b, QTensor):
            key = ("tensor", *self.scale_values(a, b))
            real = lambda: a.scale.double() / (b.scale.double() * s_y)  # noqa: E731
            roles = lambda: {"input 0": a.scale, "input 1": b.scale, "output": s_y}  # noqa: E731
            form, sign = "tensor", 1
        elif isinstance(b, QTensor):
            c = float(a)
            key = ("numerator", *self.scale_values(b), c)
            real = lambda: abs(c) / (b.scale.double() * s_y)  # noqa: E731
            roles = lambda: {"input 1": b.scale, "output": s_y}  # noqa: E731
            form, sign = "numerator", (c > 0) - (c < 0)
        else:
            c = float(b)
            if c == 0:
                raise ZeroDivisionError(f"Div {self.name!r}: division of a QTensor by 0")
            key = ("divisor", *self.scale_values(a), c)
            real = lambda: a.scale.double() / (abs(c) * s_y)  # noqa: E731
            roles = lambda: {"input 0": a.scale, "output": s_y}  # noqa: E731
            form, sign = "divisor", 1 if c > 0 else -1

        def build() -> tuple[Tensor, Tensor]:
            left = form != "divisor"
            return multiplier_for(self, real().reshape(1), roles(), left_shift=left)

        m, s = self.derived(key, build)
        return form, m, s, sign

    def forward(self, *args: Any, **kwargs: Any) -> QTensor:
        a, b = divide_operands(args, kwargs)
        form, m, s, sign = self.plan(a, b)
        dt = self.out_dtype
        if form == "divisor":
            q = qf.requantize_exact(
                a.values().to(torch.float64) * sign, m, s, dt, self.rounding, as_float=True
            )
            return self.wrap(q)
        mult, shift = int(m.reshape(-1)[0]), int(s.reshape(-1)[0])
        den = b.values().to(torch.int64)
        if form == "tensor":
            num = a.values().to(torch.int64) * mult
        else:
            num = torch.full((), sign * mult, dtype=torch.int64, device=den.device)
        num, den = torch.broadcast_tensors(num, den)
        return self.wrap(divide_exact(num, den, shift, dt.qmin, dt.qmax).to(torch.float32))
