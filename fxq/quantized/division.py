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

from torch import Tensor

from fxq.primitives import elementwise as arithmetic
from fxq.primitives.elementwise import divide_exact
from fxq.qtensor import QTensor
from fxq.quantized.base import multiplier_for
from fxq.quantized.ops_base import FunctionalQuantized

__all__ = ["Div", "divide_operands", "divide_exact"]


def divide_operands(args: tuple, kwargs: dict) -> tuple[Any, Any]:
    a = args[0] if args else kwargs["input"]
    b = args[1] if len(args) > 1 else kwargs["other"]
    return a, b


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
        dt, r = self.out_dtype, self.rounding
        if form == "divisor":  # a multiplication by s_a / (|c| s_y), negated for c < 0
            y = arithmetic.mul(a.values(), None, m, s, dt, r, sign=sign, scalar=1.0 / float(b))
            return self.wrap(y)
        mult, shift = int(m.reshape(-1)[0]), int(s.reshape(-1)[0])
        if form == "tensor":
            return self.wrap(arithmetic.divide(a.values(), b.values(), mult, shift, dt, r))
        y = arithmetic.divide(
            None, b.values(), mult, shift, dt, r, numerator=sign * mult, scalar=float(a)
        )
        return self.wrap(y)
