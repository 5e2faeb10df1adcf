"""Integer matrix product of two activations: exact accumulation, one requantization.

``Y = clamp(shift_round((A @ B) * M, S))`` with ``M 2**-S ~ s_a s_b / s_y``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fxq.qtensor import QTensor
from fxq.quantized import functional as qf
from fxq.quantized.base import warn_if_saturated
from fxq.quantized.ops_base import FunctionalQuantized

__all__ = ["MatMul"]


def _matmul(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    return torch.matmul(x, w)


class MatMul(FunctionalQuantized):
    """Integer ``a @ b`` (``torch.matmul`` / ``torch.bmm`` / ``@``)."""

    def forward(self, a: QTensor, b: QTensor) -> QTensor:
        k = a.shape[-1]
        plan = qf.plan_accumulation(
            a.qdtype.bits, k * (1 << (b.qdtype.bits - 1)), other_bits=b.qdtype.bits
        )
        acc = qf.accumulate(_matmul, a.values(), b.values(), None, plan)
        if plan.bound >= 1 << 31 or plan.limbs > 1:
            warn_if_saturated(self, acc)
        acc = qf.saturate_int32(acc)
        real = (
            a.scale.to(torch.float64)
            * b.scale.to(torch.float64)
            / self.output_scale.to(torch.float64)
        )
        m, s = qf.quantize_multiplier(real, self.spec)
        return self.wrap(
            qf.requantize_exact(acc, m, s, self.out_dtype, self.rounding, as_float=True)
        )
