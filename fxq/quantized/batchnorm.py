"""A standalone BatchNorm as an integer per-channel affine op.

``Y[c] = clamp(shift_round((X * W[c] + B[c]) * M[c], S[c]), lo, hi)`` with
``W = round(a / s_w)`` (int8, ``a = gamma / std``), ``B = round(b / (s_x s_w))``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fxq.dtypes import QDType, as_qdtype, qint8, qint32
from fxq.primitives.core import record_built
from fxq.qtensor import QTensor
from fxq.quantized import functional as qf
from fxq.quantized.base import (
    QuantizedModule,
    check_input,
    multiplier_for,
    require_finite,
    same_scale,
    warn_rescaled,
)

__all__ = ["BatchNorm", "AffineRequantization"]


@dataclass(frozen=True)
class AffineRequantization:
    """What a BatchNorm computes with for one input scale:
    ``Y[c] = clamp(shift_round((X W[c] + bias[c]) multiplier[c], shift[c]))``."""

    bias: Tensor  # int32 at s_x s_w[c]
    multiplier: Tensor
    shift: Tensor


class BatchNorm(QuantizedModule):
    """Integer per-channel affine op (a BatchNorm that no conv absorbed).

    The folded float bias is kept (``float_bias``, float64) so that an input at
    another scale than at convert gets the int32 bias convert would give it.

    Raises:
        ValueError (at construction): the input scale is unknown, or the
            BatchNorm's parameters or statistics hold NaN / Inf.
    """

    def __init__(self, qat: nn.Module) -> None:
        super().__init__(qat.march, getattr(qat, "name", ""))
        s_x = qat.input_scale(0)
        if s_x is None:
            raise ValueError(
                f"BatchNorm {qat.name!r}: the scale of its input is unknown; convert needs a "
                "prepared model"
            )
        bn = qat.bn
        require_finite(
            qat,
            {
                "BatchNorm weight": bn.weight,
                "BatchNorm bias": bn.bias,
                "BatchNorm running_mean": bn.running_mean,
                "BatchNorm running_var": bn.running_var,
            },
        )
        s_w = qat.weight_fake_quant.scale.detach()
        with torch.no_grad():
            factor = qat.factor().detach()
            float_bias = qat.folded_bias().detach().double()
        require_finite(
            qat,
            {
                "BatchNorm factor gamma / std": factor,
                "BatchNorm-folded bias": float_bias,
                "weight scale": s_w,
                "input scale": s_x,
            },
        )
        fq = qat.activation_post_process
        self.register_buffer("weight", qf.quantize(factor, s_w, qint8, self.rounding, ch_axis=0))
        self.register_buffer("float_bias", float_bias)
        self.register_buffer("input_scale", s_x.detach().clone().reshape(1))
        self.register_buffer("weight_scale", s_w.clone())
        self.register_buffer("output_scale", fq.scale.detach().clone().reshape(1))
        self.input_dtype_name = qat.input_quants[0].dtype.name
        self.out_dtype_name = fq.dtype.name
        p = self._derive(self.input_scale)
        self.register_buffer("bias", p.bias)
        self.register_buffer("multiplier", p.multiplier)
        self.register_buffer("shift", p.shift)
        self.activation = qat.activation
        self.lo = 0 if self.activation in ("relu", "relu6") else None
        self.hi = None
        if self.activation == "relu6":
            six = torch.tensor([6.0], dtype=torch.float64) / fq.scale.double().cpu()
            self.hi = int(qf.round_float(six, self.rounding).item())

    @classmethod
    def from_qat(cls, qat: nn.Module) -> BatchNorm:
        return cls(qat)

    @property
    def out_dtype(self) -> QDType:
        return as_qdtype(self.out_dtype_name)

    def _derive(self, s_x: Tensor) -> AffineRequantization:
        """The int32 bias, multiplier and shift convert gives for input scale ``s_x``."""
        acc_scale = s_x.double() * self.weight_scale.double()
        bias = qf.quantize(self.float_bias, acc_scale, qint32, self.rounding, ch_axis=0)
        real = acc_scale / self.output_scale.double()
        m, s = multiplier_for(
            self, real, {"input": s_x, "weight": self.weight_scale, "output": self.output_scale}
        )
        return AffineRequantization(bias, m, s)

    def requantization(self, x: QTensor) -> AffineRequantization:
        """The bias, multipliers and shifts for ``x``'s scale: the module's buffers at the
        scale it was converted for, else derived for ``x``'s scale as convert would (cached;
        warns once, ``warn_rescaled``).

        Raises:
            fxq.quantized.functional.MultiplierRangeError: a factor does not fit the march.
        """
        if same_scale(x, self.input_scale):
            return AffineRequantization(self.bias, self.multiplier, self.shift)
        warn_rescaled(self, 0, self.input_scale, x.scale)
        return self.derived((qf.host_float(x.scale),), lambda: self._derive(x.scale))

    def forward(self, x: QTensor) -> QTensor:
        check_input(self, x, 0, self.input_dtype_name)
        p = self.requantization(x)
        bias, multiplier, shift = p.bias, p.multiplier, p.shift
        shape = [1] * x.dim()
        shape[1] = -1
        acc = x.values().to(torch.float64) * self.weight.to(torch.float64).reshape(shape)
        acc = qf.saturate_int32(acc + bias.to(torch.float64).reshape(shape))
        q = qf.requantize_exact(
            acc,
            multiplier,
            shift,
            self.out_dtype,
            self.rounding,
            1,
            self.lo,
            self.hi,
            as_float=True,
        )
        record_built(
            "channel_affine", [x.values()], q, self.out_dtype_name[1:], lambda: self.ir_node(p)
        )
        return QTensor(q, self.output_scale, self.out_dtype)

    def ir_node(self, p: AffineRequantization) -> tuple[dict, dict]:
        """The exported ``channel_affine`` node's attributes and arrays for a call that computed
        with ``p``."""
        attrs = {
            "out_dtype": self.out_dtype_name[1:],
            "rounding": self.rounding.value,
            "lo": self.lo,
            "hi": self.hi,
        }
        params = {
            "weight": self.weight.to(torch.int8),
            "weight_scale": self.weight_scale.float().reshape(-1),
            "bias": p.bias.to(torch.int32),
            "multiplier": p.multiplier.to(torch.int32),
            "shift": p.shift.to(torch.int32),
        }
        return attrs, params
