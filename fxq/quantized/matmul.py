"""Integer matrix product of two activations: exact accumulation, one requantization.

``Y = clamp(shift_round((A @ B) * M, S))`` with ``M 2**-S ~ s_a s_b / s_y``.
``Einsum`` runs a two-operand einsum equation that is a batched matrix product as
transposes (which move integers) and this product.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fxq.primitives import accumulate as products
from fxq.primitives import movement
from fxq.qtensor import QTensor
from fxq.quantized import functional as qf
from fxq.quantized.base import multiplier_for, warn_if_saturated
from fxq.quantized.ops_base import FunctionalQuantized
from fxq.registry import EinsumMatmul, einsum_as_matmul, einsum_operands

__all__ = ["MatMul", "Einsum"]


class MatMul(FunctionalQuantized):
    """Integer ``a @ b`` (``torch.matmul`` / ``torch.bmm`` / ``@``)."""

    def requantization(self, a: QTensor, b: QTensor) -> tuple[qf.AccumulationPlan, Tensor, Tensor]:
        """The accumulation plan, multiplier and shift (``M 2**-S ~ s_a s_b / s_y``) for these
        operands' dtypes, scales and inner size ``k = a.shape[-1]`` (cached per them).

        Raises:
            TypeError / ValueError: an operand is not a per-tensor QTensor.
            fxq.quantized.functional.MultiplierRangeError: the factor does not fit the march.
        """
        k = a.shape[-1]
        key = (*self.scale_values(a, b), a.qdtype.bits, b.qdtype.bits, k)
        return self.derived(key, lambda: self._derive(a, b, k))

    def forward(self, a: QTensor, b: QTensor) -> QTensor:
        return self.wrap(self.product(a, b, a.values(), b.values()))

    def product(self, a: QTensor, b: QTensor, va: Tensor, vb: Tensor) -> Tensor:
        """``a @ b`` on the output grid (exact float32 integers), the operands' integers given
        as ``va``, ``vb`` (as recorded: ``Einsum`` transposes them first)."""
        k = a.shape[-1]
        plan, m, s = self.requantization(a, b)
        check = lambda acc: warn_if_saturated(self, acc, lambda: self._saturation_cause(a, b, k))  # noqa: E731
        return products.matmul(va, vb, plan, m, s, self.out_dtype, self.rounding, check)

    def _derive(self, a: QTensor, b: QTensor, k: int) -> tuple[qf.AccumulationPlan, Tensor, Tensor]:
        """Accumulation plan, multiplier and shift for these operands' dtypes and scales."""
        plan = qf.plan_accumulation(
            a.qdtype.bits, k * (1 << (b.qdtype.bits - 1)), other_bits=b.qdtype.bits
        )
        s_y = self.output_scale.to(torch.float64)
        real = a.scale.to(torch.float64) * b.scale.to(torch.float64) / s_y
        m, s = multiplier_for(self, real, {"input 0": a.scale, "input 1": b.scale, "output": s_y})
        return plan, m, s

    @staticmethod
    def _saturation_cause(a: QTensor, b: QTensor, k: int) -> str:
        worst = k * (1 << (a.qdtype.bits - 1)) * (1 << (b.qdtype.bits - 1))
        return (
            f"it sums {k} products of a {a.qdtype.name} and a {b.qdtype.name} operand (up to "
            f"{worst:,} = 2^{worst.bit_length() - 1} in magnitude; 32 bits hold 2^31). Use int8 "
            "for one operand (its producer's qconfig), or keep the op in float with a qconfig "
            "of None"
        )


class Einsum(MatMul):
    """Integer ``torch.einsum(eq, a, b)`` for a batched-matmul equation: ``a`` and ``b``
    transposed as the equation says, ``MatMul``, the output transposed if it is ``[..., j, i]``.

    Raises:
        ValueError: the equation is not a batched matrix product (the registry keeps such
            calls in float, so this means a call the model did not make at prepare).
    """

    def lowering(self, equation: str) -> EinsumMatmul:
        """How ``equation`` lowers to ``matmul``."""
        try:
            return einsum_as_matmul(equation)
        except ValueError as e:
            raise ValueError(f"Einsum {self.name!r}: torch.einsum({equation!r}): {e}") from None

    def operands(self, *args: Any, **kwargs: Any) -> tuple[EinsumMatmul, QTensor, QTensor]:
        """The lowering and the two operands, transposed to ``[..., i, k]`` and ``[..., k, j]``."""
        equation, operands = einsum_operands(args, kwargs)
        plan = self.lowering(equation)
        if len(operands) != 2:
            raise ValueError(f"Einsum {self.name!r}: {len(operands)} operand(s), not 2")
        a, b = operands
        a = a.transpose(-2, -1) if plan.transpose_a else a
        b = b.transpose(-2, -1) if plan.transpose_b else b
        return plan, a, b

    def forward(self, *args: Any, **kwargs: Any) -> QTensor:
        plan, a, b = self.operands(*args, **kwargs)
        _, (a0, b0) = einsum_operands(args, kwargs)
        va = (
            movement.swap_last(a0.values(), a0.qdtype, a0.scale) if plan.transpose_a else a.values()
        )
        vb = (
            movement.swap_last(b0.values(), b0.qdtype, b0.scale) if plan.transpose_b else b.values()
        )
        y = self.product(a, b, va, vb)
        if plan.transpose_out:  # the product stays inside, on the output grid
            y = movement.swap_last(y, self.out_dtype, self.output_scale)
        return self.wrap(y)
