"""Integer matrix product of two activations: exact accumulation, one requantization.

``Y = clamp(shift_round((A @ B) * M, S))`` with ``M 2**-S ~ s_a s_b / s_y``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fxq.qtensor import QTensor
from fxq.quantized import functional as qf
from fxq.quantized.base import multiplier_for, warn_if_saturated
from fxq.quantized.ops_base import FunctionalQuantized

__all__ = ["MatMul"]


def _matmul(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    return torch.matmul(x, w)


class MatMul(FunctionalQuantized):
    """Integer ``a @ b`` (``torch.matmul`` / ``torch.bmm`` / ``@``)."""

    def forward(self, a: QTensor, b: QTensor) -> QTensor:
        k = a.shape[-1]
        key = (*self.scale_values(a, b), a.qdtype.bits, b.qdtype.bits, k)
        plan, m, s = self.derived(key, lambda: self._derive(a, b, k))
        acc = qf.accumulate(_matmul, a.values(), b.values(), None, plan)
        if plan.bound >= 1 << 31 or plan.limbs > 1:
            warn_if_saturated(self, acc, lambda: self._saturation_cause(a, b, k))
        acc = qf.saturate_int32(acc)
        return self.wrap(
            qf.requantize_exact(acc, m, s, self.out_dtype, self.rounding, as_float=True)
        )

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
