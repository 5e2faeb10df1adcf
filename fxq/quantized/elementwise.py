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
from fxq.quantized.base import multiplier_for
from fxq.quantized.ops_base import FunctionalQuantized

__all__ = ["Add", "Sub", "Mul", "Cat", "Stack", "Maximum", "Minimum"]


def _operands(args: tuple, kwargs: dict) -> tuple[Any, Any, float]:
    a = args[0] if args else kwargs["input"]
    b = args[1] if len(args) > 1 else kwargs["other"]
    alpha = args[2] if len(args) > 2 else kwargs.get("alpha", 1)
    return a, b, float(alpha)


def _roles(scales: list[Tensor]) -> dict[str, Tensor]:
    return {f"input {i}": s for i, s in enumerate(scales)}


class Add(FunctionalQuantized):
    """Integer ``input + alpha * other``."""

    _SIGN = 1.0

    def forward(self, *args: Any, **kwargs: Any) -> QTensor:
        a, b, alpha = _operands(args, kwargs)
        tensors, factors, scalars = [], [], 0.0
        for value, factor in ((a, 1.0), (b, self._SIGN * alpha)):
            if isinstance(value, QTensor):
                tensors.append(value)
                factors.append(factor)
            elif isinstance(value, Tensor):
                raise TypeError(
                    f"{type(self).__name__} {self.name!r} got a float tensor; expected QTensors"
                )
            else:
                scalars += float(value) * factor
        scales = self.scale_values(*tensors)
        ms, n, constant = self.derived(
            (scales, tuple(factors), scalars),
            lambda: self._derive([t.scale for t in tensors], factors, scalars),
        )
        terms = [(t.values(), m) for t, m in zip(tensors, ms)]
        return self.wrap(qf.add_requant(terms, constant, n, self.out_dtype, self.rounding))

    def _derive(
        self, scales: list[Tensor], factors: list[float], scalars: float
    ) -> tuple[list[int], Tensor, Tensor | None]:
        """Multipliers (one per tensor), the common shift and the scalar term for these scales."""
        s_y = self.output_scale.to(torch.float64)
        ratios = [qf.scale_ratio(s, s_y) * f for s, f in zip(scales, factors)]
        try:
            ms, n = qf.common_multipliers(ratios, self.spec)
        except qf.MultiplierRangeError:  # the error names the layer and the scales
            largest = torch.stack([r.abs().max() for r in ratios]).max().reshape(1)
            multiplier_for(self, largest, {**_roles(scales), "output": s_y})
            raise
        constant = None
        if scalars:
            constant = torch.floor(
                qf.ldexp(torch.tensor(scalars, dtype=torch.float64) / s_y.cpu(), n.cpu()) + 0.5
            )
        return [int(m.reshape(-1)[0]) for m in ms], n, constant


class Sub(Add):
    """Integer ``input - alpha * other``."""

    _SIGN = -1.0


class Mul(FunctionalQuantized):
    """Integer ``input * other``."""

    def forward(self, *args: Any, **kwargs: Any) -> QTensor:
        a, b, _ = _operands(args, kwargs)
        if isinstance(a, QTensor) and isinstance(b, QTensor):
            key = self.scale_values(a, b)
            m, s = self.derived(key, lambda: self._derive([a.scale, b.scale], 1.0))
            product = a.values().to(torch.float64) * b.values().to(torch.float64)
        else:
            q, c = (a, b) if isinstance(a, QTensor) else (b, a)
            c = float(c)
            key = (*self.scale_values(q), c)
            m, s = self.derived(key, lambda: self._derive([q.scale], abs(c)))
            product = q.values().to(torch.float64) * (-1.0 if c < 0 else 1.0)
        return self.wrap(
            qf.requantize_exact(product, m, s, self.out_dtype, self.rounding, as_float=True)
        )

    def _derive(self, scales: list[Tensor], factor: float) -> tuple[Tensor, Tensor]:
        """``M * 2**-S ~ prod(scales) * factor / s_y``."""
        s_y = self.output_scale.to(torch.float64)
        real = scales[0].to(torch.float64)
        for s in scales[1:]:
            real = real * s.to(torch.float64)
        return multiplier_for(self, real * factor / s_y, {**_roles(scales), "output": s_y})


class Cat(FunctionalQuantized):
    """Integer ``torch.cat``: inputs requantized to the output scale."""

    _JOIN = staticmethod(torch.cat)

    def forward(self, tensors, dim: int = 0) -> QTensor:
        s_y = self.output_scale
        scales = self.scale_values(*tensors)
        datas = []
        for t, s in zip(tensors, scales):
            if torch.equal(t.scale, s_y) and t.qdtype is self.out_dtype:
                datas.append(t.values())
            else:
                m, n = self.derived((s,), lambda t=t: self._derive(t.scale))
                datas.append(
                    qf.requantize_exact(
                        t.values(), m, n, self.out_dtype, self.rounding, as_float=True
                    )
                )
        return self.wrap(self._JOIN(datas, dim))

    def _derive(self, s_x: Tensor) -> tuple[Tensor, Tensor]:
        s_y = self.output_scale
        return multiplier_for(self, qf.scale_ratio(s_x, s_y), {"input": s_x, "output": s_y})


class Stack(Cat):
    """Integer ``torch.stack``: inputs requantized to the output scale, then stacked."""

    _JOIN = staticmethod(torch.stack)


class Maximum(FunctionalQuantized):
    """Integer ``torch.maximum``: both inputs requantized to the output scale, then the larger."""

    _PICK = staticmethod(torch.maximum)

    def forward(self, *args: Any, **kwargs: Any) -> QTensor:
        a = args[0] if args else kwargs["input"]
        b = args[1] if len(args) > 1 else kwargs["other"]
        scales = self.scale_values(a, b)
        values = []
        for t, s in zip((a, b), scales):
            if torch.equal(t.scale, self.output_scale.to(t.scale.device)) and (
                t.qdtype is self.out_dtype
            ):
                values.append(t.values())
                continue
            m, n = self.derived((s,), lambda t=t: self.rescale(t.scale))
            values.append(
                qf.requantize_exact(t.values(), m, n, self.out_dtype, self.rounding, as_float=True)
            )
        return self.wrap(self._PICK(*values))

    def rescale(self, s_x: Tensor) -> tuple[Tensor, Tensor]:
        """Multiplier and shift of ``s_x / s_y``."""
        s_y = self.output_scale
        return multiplier_for(self, qf.scale_ratio(s_x, s_y), {"input": s_x, "output": s_y})


class Minimum(Maximum):
    """Integer ``torch.minimum``: both inputs requantized to the output scale, then the smaller."""

    _PICK = staticmethod(torch.minimum)
