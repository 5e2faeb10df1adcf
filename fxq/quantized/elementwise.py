"""Integer add, sub, mul and cat (``docs/arithmetic.md``, "Elementwise ops").

add / sub: ``Y = clamp(shift_round(A*ma + B*mb (+ C), n))`` with one shift ``n``
and ``ma 2**-n ~ s_a / s_y``, ``mb 2**-n ~ +-alpha s_b / s_y``; a scalar operand
``c`` becomes ``C = round(c / s_y * 2**n)``.

mul: ``Y = clamp(shift_round(A*B*M, S))`` with ``M 2**-S ~ s_a s_b / s_y`` (a
scalar factor folds into ``M``; a negative one negates ``A``).

cat: every input is requantized to the output scale, then concatenated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fxq.qtensor import QTensor
from fxq.quantized import functional as qf
from fxq.quantized.ops_base import FunctionalQuantized

__all__ = ["Add", "Sub", "Mul", "Cat"]


def _operands(args: tuple, kwargs: dict) -> tuple[Any, Any, float]:
    a = args[0] if args else kwargs["input"]
    b = args[1] if len(args) > 1 else kwargs["other"]
    alpha = args[2] if len(args) > 2 else kwargs.get("alpha", 1)
    return a, b, float(alpha)


class Add(FunctionalQuantized):
    """Integer ``input + alpha * other``."""

    _SIGN = 1.0

    def forward(self, *args: Any, **kwargs: Any) -> QTensor:
        a, b, alpha = _operands(args, kwargs)
        s_y = self.output_scale.to(torch.float64)
        tensors, scalars = [], 0.0
        for value, factor in ((a, 1.0), (b, self._SIGN * alpha)):
            if isinstance(value, QTensor):
                tensors.append((value, qf.scale_ratio(value.scale, s_y) * factor))
            elif isinstance(value, Tensor):
                raise TypeError(
                    f"{type(self).__name__} {self.name!r} got a float tensor; expected QTensors"
                )
            else:
                scalars += float(value) * factor
        ms, n = qf.common_multipliers([r for _, r in tensors], self.spec)
        constant = None
        if scalars:
            constant = torch.floor(
                torch.ldexp(
                    torch.tensor(scalars, dtype=torch.float64) / s_y.cpu(), n.to(torch.float64)
                )
                + 0.5
            )
        terms = [(t.values(), int(m.reshape(-1)[0])) for (t, _), m in zip(tensors, ms)]
        return self.wrap(qf.add_requant(terms, constant, n, self.out_dtype, self.rounding))


class Sub(Add):
    """Integer ``input - alpha * other``."""

    _SIGN = -1.0


class Mul(FunctionalQuantized):
    """Integer ``input * other``."""

    def forward(self, *args: Any, **kwargs: Any) -> QTensor:
        a, b, _ = _operands(args, kwargs)
        s_y = self.output_scale.to(torch.float64)
        if isinstance(a, QTensor) and isinstance(b, QTensor):
            real = a.scale.to(torch.float64) * b.scale.to(torch.float64) / s_y
            product = a.values().to(torch.float64) * b.values().to(torch.float64)
        else:
            q, c = (a, b) if isinstance(a, QTensor) else (b, a)
            real = q.scale.to(torch.float64) * abs(float(c)) / s_y
            product = q.values().to(torch.float64) * (-1.0 if float(c) < 0 else 1.0)
        m, s = qf.quantize_multiplier(real, self.spec)
        return self.wrap(
            qf.requantize_exact(product, m, s, self.out_dtype, self.rounding, as_float=True)
        )


class Cat(FunctionalQuantized):
    """Integer ``torch.cat``: inputs requantized to the output scale."""

    def forward(self, tensors, dim: int = 0) -> QTensor:
        s_y = self.output_scale
        datas = []
        for t in tensors:
            if torch.equal(t.scale, s_y) and t.qdtype is self.out_dtype:
                datas.append(t.values())
            else:
                m, n = qf.quantize_multiplier(qf.scale_ratio(t.scale, s_y), self.spec)
                datas.append(
                    qf.requantize_exact(
                        t.values(), m, n, self.out_dtype, self.rounding, as_float=True
                    )
                )
        return self.wrap(torch.cat(datas, dim))
