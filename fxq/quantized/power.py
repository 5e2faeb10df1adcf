"""Integer ``x ** n`` for ``n`` = 2 and 3 (``docs/arithmetic.md``, "Integer powers").

* ``n = 2``: ``Y = sat(shift_round(X*X M, S))`` with ``M 2**-S ~ s_x**2 / s_y``
  (``|X*X| <= 2**30``: int32);
* ``n = 3``: ``T = shift_round(X*X, K)`` with ``K = max(0, 2 (b - 1) - 14)`` for ``b``-bit
  inputs (int8: ``K = 0``, ``T = X*X`` exactly; int16: ``K = 16``), so ``|T| <= 2**14``;
  then ``Y = sat(shift_round(T*X M, S))`` with ``M 2**-S ~ s_x**3 2**K / s_y``
  (``|T*X| <= 2**29``: int32).

Every product is exact in float64 (``|acc * M| < 2**53`` with 16-bit multipliers).
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from fxq.dtypes import qint16
from fxq.primitives import elementwise as arithmetic
from fxq.qtensor import QTensor
from fxq.quantized.base import multiplier_for
from fxq.quantized.ops_base import FunctionalQuantized

__all__ = ["Pow", "INTEGER_EXPONENTS", "power_exponent", "cube_shift"]

#: the exponents with an integer implementation
INTEGER_EXPONENTS = (2, 3)

_SQUARES = ("square", "square_")


def power_exponent(fn: Any, args: tuple, kwargs: dict) -> Any:
    """The exponent of a ``torch.pow(x, n)`` / ``x ** n`` / ``x.pow(n)`` / ``torch.square(x)``
    call, given the arguments after ``x`` (a Python number, or whatever the call passed)."""
    if getattr(fn, "__name__", "") in _SQUARES:
        return 2
    if args:
        return args[0]
    return kwargs.get("exponent", kwargs.get("other"))


def integer_exponent(value: Any) -> int | None:
    """``value`` as one of ``INTEGER_EXPONENTS`` (``3.0`` counts as 3), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value) or value != int(value) or int(value) not in INTEGER_EXPONENTS:
        return None
    return int(value)


def cube_shift(bits: int) -> int:
    """``K``: the right shift of the square inside a cube, so that ``|X*X >> K| <= 2**14``."""
    return max(0, 2 * (bits - 1) - 14)


class Pow(FunctionalQuantized):
    """Integer ``x ** 2`` and ``x ** 3`` (``torch.pow``, ``x ** n``, ``x.pow(n)``,
    ``torch.square``) by exact integer products and one requantization."""

    def exponent(self, args: tuple, kwargs: dict) -> int:
        """The call's exponent as an int.

        Raises:
            ValueError: an exponent other than 2 or 3 (the registry keeps those float).
        """
        value = power_exponent(self.fn, args, kwargs)
        n = integer_exponent(value)
        if n is None:
            raise ValueError(
                f"{self.name or 'pow'}: integer pow takes the exponents {INTEGER_EXPONENTS}, "
                f"not {value!r}"
            )
        return n

    def plan(self, x: QTensor, n: int) -> tuple[Tensor, Tensor, int]:
        """``(M, S, K)`` for inputs of ``x``'s scale and dtype (``K``: the cube's inner shift)."""
        (s_x,) = self.scale_values(x)
        k = cube_shift(x.qdtype.bits) if n == 3 else 0
        return self.derived((s_x, x.qdtype.name, n), lambda: self._derive(x.scale, n, k))

    def _derive(self, s_x: Tensor, n: int, k: int) -> tuple[Tensor, Tensor, int]:
        s_y = self.output_scale.double()
        real = s_x.double() ** n * 2.0**k / s_y
        m, s = multiplier_for(self, real, {"input": s_x, "output": s_y})
        return m, s, k

    def forward(self, x: QTensor, *args: Any, **kwargs: Any) -> QTensor:
        n = self.exponent(args, kwargs)
        m, s, k = self.plan(x, n)
        v = x.values()
        first = v
        if n == 3:  # the square on an int16 grid first: |X*X >> K| <= 2**14
            inner = x.scale.reshape(1).double() ** 2 * 2.0**k
            first = arithmetic.mul(v, v, 1, k, qint16, self.rounding, scale=inner)
        return self.wrap(arithmetic.mul(first, v, m, s, self.out_dtype, self.rounding))
