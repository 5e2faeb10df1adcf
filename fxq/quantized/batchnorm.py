"""A standalone BatchNorm as an integer per-channel affine op.

``Y[c] = clamp(shift_round((X * W[c] + B[c]) * M[c], S[c]), lo, hi)`` with
``W = round(a / s_w)`` (int8, ``a = gamma / std``), ``B = round(b / (s_x s_w))``.
"""

from __future__ import annotations

import torch
from torch import nn

from fxq.dtypes import QDType, as_qdtype, qint8, qint32
from fxq.qtensor import QTensor
from fxq.quantized import functional as qf
from fxq.quantized.base import QuantizedModule, check_input

__all__ = ["BatchNorm"]


class BatchNorm(QuantizedModule):
    """Integer per-channel affine op (a BatchNorm that no conv absorbed)."""

    def __init__(self, qat: nn.Module) -> None:
        super().__init__(qat.march)
        rounding = qat.spec.rounding
        s_x = qat.input_scale(0)
        if s_x is None:
            raise ValueError(
                "BatchNorm: the scale of its input is unknown; convert needs a prepared model"
            )
        s_w = qat.weight_fake_quant.scale.detach()
        with torch.no_grad():
            w = qf.quantize(qat.factor().detach(), s_w, qint8, rounding, ch_axis=0)
            b = qf.quantize(
                qat.folded_bias().detach().double(),
                s_x.double() * s_w.double(),
                qint32,
                rounding,
                ch_axis=0,
            )
        fq = qat.activation_post_process
        self.register_buffer("weight", w)
        self.register_buffer("bias", b)
        self.register_buffer("input_scale", s_x.detach().clone().reshape(1))
        self.register_buffer("output_scale", fq.scale.detach().clone().reshape(1))
        m, s = qf.quantize_multiplier(s_x.double() * s_w.double() / fq.scale.double(), qat.spec)
        self.register_buffer("multiplier", m)
        self.register_buffer("shift", s)
        self.out_dtype_name = fq.dtype.name
        self.activation = qat.activation
        self.lo = 0 if self.activation in ("relu", "relu6") else None
        self.hi = None
        if self.activation == "relu6":
            self.hi = int(
                qf.round_float(
                    torch.tensor([6.0], dtype=torch.float64) / fq.scale.double().cpu(), rounding
                ).item()
            )

    @classmethod
    def from_qat(cls, qat: nn.Module) -> BatchNorm:
        return cls(qat)

    @property
    def out_dtype(self) -> QDType:
        return as_qdtype(self.out_dtype_name)

    def forward(self, x: QTensor) -> QTensor:
        check_input(self, x, self.input_scale)
        shape = [1] * x.dim()
        shape[1] = -1
        acc = x.values().to(torch.float64) * self.weight.to(torch.float64).reshape(shape)
        acc = qf.saturate_int32(acc + self.bias.to(torch.float64).reshape(shape))
        q = qf.requantize_exact(
            acc,
            self.multiplier,
            self.shift,
            self.out_dtype,
            self.rounding,
            1,
            self.lo,
            self.hi,
            as_float=True,
        )
        return QTensor(q, self.output_scale, self.out_dtype)
