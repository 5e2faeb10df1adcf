"""Integer add, sub, mul and cat (``docs/arithmetic.md``, "Elementwise ops").

add / sub: ``Y = clamp(shift_round(A*ma + B*mb (+ C), n))`` with one shift ``n``
and ``ma 2**-n ~ s_a / s_y``, ``mb 2**-n ~ +-alpha s_b / s_y``; a scalar operand
``c`` becomes ``C = round(c / s_y * 2**n)``.

mul: ``Y = clamp(shift_round(A*B*M, S))`` with ``M 2**-S ~ s_a s_b / s_y`` (a
scalar factor folds into ``M``; a negative one negates ``A``).

cat: every input is requantized to the output scale, then concatenated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fxq.primitives import elementwise as arithmetic
from fxq.primitives import movement, requant, select
from fxq.qtensor import QTensor
from fxq.quantized import functional as qf
from fxq.quantized.base import multiplier_for
from fxq.quantized.ops_base import FunctionalQuantized

__all__ = [
    "Add",
    "AddRequantization",
    "AddTerms",
    "Sub",
    "Mul",
    "Cat",
    "Stack",
    "Maximum",
    "Minimum",
    "binary_operands",
]


def binary_operands(args: tuple, kwargs: dict) -> tuple[Any, Any, float]:
    """``(input, other, alpha)`` of an add / sub / mul call (``alpha`` 1 where not given)."""
    a = args[0] if args else kwargs["input"]
    b = args[1] if len(args) > 1 else kwargs["other"]
    alpha = args[2] if len(args) > 2 else kwargs.get("alpha", 1)
    return a, b, float(alpha)


def _roles(scales: list[Tensor]) -> dict[str, Tensor]:
    return {f"input {i}": s for i, s in enumerate(scales)}


@dataclass(frozen=True)
class AddTerms:
    """An add / sub call as a sum: ``sum(factors[i] * tensors[i]) + scalar``."""

    tensors: list[QTensor]  # the quantized operands, in call order
    factors: list[float]  # 1.0 for ``input``, +-alpha for ``other``
    scalar: float  # the Python-number operands, times their factors, summed


@dataclass(frozen=True)
class AddRequantization:
    """What an add / sub computes with for its terms' scales:
    ``Y = clamp(shift_round(sum(Q_i * multipliers[i]) (+ constant), shift))``."""

    multipliers: list[int]  # one per quantized operand
    shift: Tensor  # the common right shift
    constant: Tensor | None  # the scalar term on the shifted grid; None without one


class Add(FunctionalQuantized):
    """Integer ``input + alpha * other``."""

    _SIGN = 1.0

    def terms(self, *args: Any, **kwargs: Any) -> AddTerms:
        """The call's operands as ``AddTerms`` (Sub negates ``other``'s factor).

        Raises:
            TypeError: an operand is a float tensor (quantize it first).
        """
        a, b, alpha = binary_operands(args, kwargs)
        tensors, factors, scalar = [], [], 0.0
        for value, factor in ((a, 1.0), (b, self._SIGN * alpha)):
            if isinstance(value, QTensor):
                tensors.append(value)
                factors.append(factor)
            elif isinstance(value, Tensor):
                raise TypeError(
                    f"{type(self).__name__} {self.name!r} got a float tensor; expected QTensors"
                )
            else:
                scalar += float(value) * factor
        return AddTerms(tensors, factors, scalar)

    def requantization(self, terms: AddTerms) -> AddRequantization:
        """Multipliers, shift and constant for the terms' scales (cached per scale).

        Raises:
            TypeError / ValueError: an operand is not a per-tensor QTensor.
            fxq.quantized.functional.MultiplierRangeError: a ratio does not fit the march.
        """
        scales = self.scale_values(*terms.tensors)
        return self.derived(
            (scales, tuple(terms.factors), terms.scalar),
            lambda: self._derive([t.scale for t in terms.tensors], terms.factors, terms.scalar),
        )

    def forward(self, *args: Any, **kwargs: Any) -> QTensor:
        terms = self.terms(*args, **kwargs)
        p = self.requantization(terms)
        y = arithmetic.add(
            [t.values() for t in terms.tensors],
            p.multipliers,
            p.constant,
            p.shift,
            self.out_dtype,
            self.rounding,
            terms.factors,
            terms.scalar,
        )
        return self.wrap(y)

    def _derive(
        self, scales: list[Tensor], factors: list[float], scalars: float
    ) -> AddRequantization:
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
        return AddRequantization([int(m.reshape(-1)[0]) for m in ms], n, constant)


class Sub(Add):
    """Integer ``input - alpha * other``."""

    _SIGN = -1.0


class Mul(FunctionalQuantized):
    """Integer ``input * other``."""

    def requantization(self, a: Any, b: Any) -> tuple[Tensor, Tensor]:
        """Multiplier and shift for operands ``a``, ``b`` (two QTensors, or a QTensor and a
        Python number ``c``): ``M 2**-S ~ s_a s_b / s_y``, or ``s_q |c| / s_y`` (the sign of
        ``c`` negates the operand). Cached per scale (and ``c``).

        Raises:
            TypeError / ValueError: a tensor operand is not a per-tensor QTensor.
            fxq.quantized.functional.MultiplierRangeError: the factor does not fit the march.
        """
        if isinstance(a, QTensor) and isinstance(b, QTensor):
            key = self.scale_values(a, b)
            return self.derived(key, lambda: self._derive([a.scale, b.scale], 1.0))
        q, c = (a, b) if isinstance(a, QTensor) else (b, a)
        c = float(c)
        key = (*self.scale_values(q), c)
        return self.derived(key, lambda: self._derive([q.scale], abs(c)))

    def forward(self, *args: Any, **kwargs: Any) -> QTensor:
        a, b, _ = binary_operands(args, kwargs)
        m, s = self.requantization(a, b)
        dt, r = self.out_dtype, self.rounding
        if isinstance(a, QTensor) and isinstance(b, QTensor):
            return self.wrap(arithmetic.mul(a.values(), b.values(), m, s, dt, r))
        q, c = (a, b) if isinstance(a, QTensor) else (b, a)
        c = float(c)
        sign = -1 if c < 0 else 1
        return self.wrap(arithmetic.mul(q.values(), None, m, s, dt, r, sign=sign, scalar=c))

    def _derive(self, scales: list[Tensor], factor: float) -> tuple[Tensor, Tensor]:
        """``M * 2**-S ~ prod(scales) * factor / s_y``."""
        s_y = self.output_scale.to(torch.float64)
        real = scales[0].to(torch.float64)
        for s in scales[1:]:
            real = real * s.to(torch.float64)
        return multiplier_for(self, real * factor / s_y, {**_roles(scales), "output": s_y})


class Cat(FunctionalQuantized):
    """Integer ``torch.cat``: inputs requantized to the output scale (``rescale``)."""

    def forward(self, tensors, dim: int = 0) -> QTensor:
        s_y = self.output_scale
        scales = self.scale_values(*tensors)
        datas = []
        for t, s in zip(tensors, scales):
            if torch.equal(t.scale, s_y) and t.qdtype is self.out_dtype:
                datas.append(t.values())
            else:
                m, n = self.derived((s,), lambda t=t: self.rescale(t.scale))
                datas.append(
                    requant.requantize(t.values(), m, n, self.out_dtype, self.rounding, scale=s_y)
                )
        return self.wrap(self.join(datas, dim))

    def join(self, values: list[Tensor], dim: int) -> Tensor:
        """The operands on the output grid, concatenated."""
        return movement.concat(values, dim, self.out_dtype)


class Stack(Cat):
    """Integer ``torch.stack``: inputs requantized to the output scale, then stacked."""

    def join(self, values: list[Tensor], dim: int) -> Tensor:
        """The operands on the output grid, each given the new axis, concatenated."""
        return movement.stack(values, dim, self.out_dtype, self.output_scale)


class Maximum(FunctionalQuantized):
    """Integer ``torch.maximum``: both inputs requantized to the output scale, then the larger."""

    FN = "maximum"

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
                requant.requantize(
                    t.values(), m, n, self.out_dtype, self.rounding, scale=self.output_scale
                )
            )
        return self.wrap(select.extremum(*values, self.FN, self.out_dtype))


class Minimum(Maximum):
    """Integer ``torch.minimum``: both inputs requantized to the output scale, then the smaller."""

    FN = "minimum"
