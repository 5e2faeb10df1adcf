"""Integer conv, transposed conv and linear (optionally with a folded BatchNorm,
a fused residual add and ReLU / ReLU6).

Per output channel ``c`` (``docs/arithmetic.md``, "Conv and linear")::

    acc[c] = sat32( sum X * W[c] + B[c] )                 exact, int32 saturation
    acc[c] = sat32( acc[c] + shift_round(R * mr[c], kr[c]) )          fused add
    Y[c]   = clamp( shift_round(acc[c] * M[c], S[c]), lo, hi )

with ``W = round(w_folded / s_w)`` (int8), ``B = round(b_folded / (s_x s_w))``
(int32), ``M[c] 2**-S[c] ~ s_x s_w[c] / s_y``, ``mr[c] 2**-kr[c] ~ s_r / (s_x s_w[c])``,
and ``lo = 0`` for ReLU, ``hi = round(6 / s_y)`` for ReLU6. A high-precision
(qint32) output returns ``float32(acc * s_x * s_w)`` instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fxq.dtypes import QDType, as_qdtype, qint8, qint32
from fxq.qat.weighted import swap_group_axes
from fxq.qtensor import QTensor
from fxq.quantized import functional as qf
from fxq.quantized.base import QuantizedModule, check_input, warn_if_saturated

__all__ = [
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
    "Linear",
    "integer_weight_params",
]

_INT32_MAX = (1 << 31) - 1


@torch.no_grad()
def integer_weight_params(qat: nn.Module) -> dict[str, Tensor]:
    """Integer weight (op layout), int32 bias and scales of a QAT weighted module."""
    rounding = qat.spec.rounding
    s_x = qat.input_scale(0)
    if s_x is None:
        raise ValueError(
            f"{type(qat).__name__}: the scale of its input is unknown (no linked input fake quant); "
            "convert needs a prepared model"
        )
    s_w = qat.weight_fake_quant.scale
    w_om = qf.quantize(qat.folded_weight().detach(), s_w, qint8, rounding, ch_axis=0)
    b = qat.folded_bias()
    bias = None
    if b is not None:
        bias_scale = s_x.to(torch.float64) * s_w.to(torch.float64)
        bias = qf.quantize(b.detach().to(torch.float64), bias_scale, qint32, rounding, ch_axis=0)
    return {
        "weight": qat.weight_from_out_major(w_om),
        "weight_out_major": w_om,
        "bias": bias,
        "input_scale": s_x.detach().clone(),
        "weight_scale": s_w.detach().clone(),
    }


class _Weighted(QuantizedModule):
    """Shared implementation; subclasses provide ``_op`` and ``_channel_axis``."""

    _channel_axis = 1

    def __init__(self, qat: nn.Module) -> None:
        super().__init__(qat.march)
        params = integer_weight_params(qat)
        spec = qat.spec
        out_fq = qat.activation_post_process
        self.register_buffer("weight", params["weight"])
        self.register_buffer("bias", params["bias"])
        self.register_buffer("input_scale", params["input_scale"].reshape(1))
        self.register_buffer("weight_scale", params["weight_scale"])
        self.register_buffer("output_scale", out_fq.scale.detach().clone().reshape(1))
        self.out_dtype_name = out_fq.dtype.name
        self.input_bits = qat.input_quants[0].dtype.bits
        self.activation = qat.activation
        self.add = qat.add
        acc_scale = self.input_scale.to(torch.float64) * self.weight_scale.to(torch.float64)
        self.register_buffer("accumulator_scale", acc_scale)
        if self.high_precision:
            self.register_buffer("multiplier", None)
            self.register_buffer("shift", None)
        else:
            m, s = qf.quantize_multiplier(acc_scale / self.output_scale.to(torch.float64), spec)
            self.register_buffer("multiplier", m)
            self.register_buffer("shift", s)
        if self.add:
            s_r = qat.input_quants[1].scale.detach().clone().reshape(1)
            self.register_buffer("residual_scale", s_r)
            mr, kr = qf.quantize_multiplier(
                s_r.to(torch.float64) / acc_scale, spec, left_shift=True
            )
            self.register_buffer("residual_multiplier", mr)
            self.register_buffer("residual_shift", kr)
            self.residual_bits = qat.input_quants[1].dtype.bits
        self._set_bounds()
        self._plan()

    # -- derived state ---------------------------------------------------------------
    @property
    def out_dtype(self) -> QDType:
        return as_qdtype(self.out_dtype_name)

    @property
    def high_precision(self) -> bool:
        return self.out_dtype is qint32

    def _set_bounds(self) -> None:
        self.lo = 0 if self.activation in ("relu", "relu6") else None
        self.hi = None
        if self.activation == "relu6" and not self.high_precision:
            six = (
                torch.tensor([6.0], dtype=torch.float64) / self.output_scale.to(torch.float64).cpu()
            )
            self.hi = int(qf.round_float(six, self.rounding).item())

    def _plan(self) -> None:
        w = self.weight_out_major().to(torch.int64).abs()
        l1 = int(w.reshape(w.shape[0], -1).sum(1).max().item()) if w.numel() else 0
        b = int(self.bias.abs().max().item()) if self.bias is not None and self.bias.numel() else 0
        self.plan = qf.plan_accumulation(self.input_bits, l1, b)
        worst = (1 << (self.input_bits - 1)) * l1 + b
        if self.add:
            mr = self.residual_multiplier.to(torch.float64)
            worst += int(
                (
                    (1 << (self.residual_bits - 1))
                    * torch.ldexp(mr, -self.residual_shift.to(torch.float64))
                )
                .max()
                .item()
            )
        self.may_saturate = worst > _INT32_MAX

    def weight_out_major(self) -> Tensor:
        return self.weight

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._set_bounds()
        self._plan()

    # -- compute -----------------------------------------------------------------------
    def _op(self, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:  # pragma: no cover
        raise NotImplementedError

    def accumulator(self, x: QTensor, residual: QTensor | None = None) -> Tensor:
        """The exact (saturated) int32 accumulator, as a float tensor of integers."""
        acc = qf.accumulate(
            self._op, x.values(), self.weight, self.bias, self.plan, self._channel_axis
        )
        if self.may_saturate:
            acc = qf.saturate_int32(acc)
        if self.add:
            term = qf.rescale_term(
                residual.values(),
                self.residual_multiplier,
                self.residual_shift,
                self.rounding,
                self._channel_axis,
            )
            acc = qf.saturate_int32(acc.to(torch.float64) + term)
        return acc

    def forward(self, x: QTensor, residual: QTensor | None = None) -> QTensor | Tensor:
        check_input(self, x, self.input_scale)
        if self.add:
            check_input(self, residual, self.residual_scale, 1)
        if self.high_precision:
            acc = self.accumulator(x, residual)
            if self.lo is not None:
                acc = acc.clamp(min=0)
            scale = qf.broadcast_scale(self.accumulator_scale, acc.dim(), self._channel_axis)
            y = acc.to(torch.float64) * scale
            if self.activation == "relu6":
                y = y.clamp(max=6.0)
            return y.to(torch.float32)
        acc = qf.accumulate(
            self._op, x.values(), self.weight, self.bias, self.plan, self._channel_axis
        )
        if self.may_saturate:
            warn_if_saturated(self, acc)
            acc = qf.saturate_int32(acc)
        args = (self.out_dtype, self.rounding, self._channel_axis, self.lo, self.hi)
        if self.add:
            q = qf.requantize_residual(
                acc,
                residual.values(),
                self.residual_multiplier,
                self.residual_shift,
                self.multiplier,
                self.shift,
                *args,
            )
        else:
            q = qf.requantize_exact(acc, self.multiplier, self.shift, *args, as_float=True)
        return QTensor(q, self.output_scale, self.out_dtype)

    @classmethod
    def from_qat(cls, qat: nn.Module) -> _Weighted:
        return cls(qat)

    def fused_description(self) -> str:
        """``Conv2d``, ``Conv2d+add+relu``, ... (BatchNorm is folded into the weights)."""
        return "+".join(
            [type(self).__name__]
            + (["add"] if self.add else [])
            + ([self.activation] if self.activation else [])
        )

    def extra_repr(self) -> str:
        fused = [n for n, on in (("add", self.add), (self.activation, bool(self.activation))) if on]
        out = (
            "int32 accumulator"
            if self.high_precision
            else f"{self.out_dtype_name} at {self.output_scale.item():.6g}"
        )
        return (
            f"{self._hyper()}, in_scale={self.input_scale.item():.6g}, out={out}"
            + (f", fused={'+'.join(fused)}" if fused else "")
            + f", accumulate={self.plan.describe()}"
        )

    def _hyper(self) -> str:  # pragma: no cover
        return ""


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONVT = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


class _Conv(_Weighted):
    _DIM = 2
    _TRANSPOSED = False

    def __init__(self, qat: nn.Module) -> None:
        self.stride = qat.stride
        self.padding = qat.padding
        self.dilation = qat.dilation
        self.groups = qat.groups
        self.padding_mode = qat.padding_mode
        self.output_padding = qat.output_padding
        self.reversed_padding = qat._reversed_padding_repeated_twice
        self.in_channels = qat.in_channels
        self.out_channels = qat.out_channels
        super().__init__(qat)

    def _op(self, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        if self._TRANSPOSED:
            return _CONVT[self._DIM](
                x, w, b, self.stride, self.padding, self.output_padding, self.groups, self.dilation
            )
        if self.padding_mode != "zeros":
            x = F.pad(x, self.reversed_padding, mode=self.padding_mode)
            return _CONV[self._DIM](x, w, b, self.stride, 0, self.dilation, self.groups)
        return _CONV[self._DIM](x, w, b, self.stride, self.padding, self.dilation, self.groups)

    def weight_out_major(self) -> Tensor:
        return swap_group_axes(self.weight, self.groups) if self._TRANSPOSED else self.weight

    def _hyper(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, kernel_size={tuple(self.weight.shape[2:])}, stride={self.stride}, groups={self.groups}"


class Conv1d(_Conv):
    """Integer Conv1d."""

    _DIM = 1


class Conv2d(_Conv):
    """Integer Conv2d."""

    _DIM = 2


class Conv3d(_Conv):
    """Integer Conv3d."""

    _DIM = 3


class ConvTranspose1d(_Conv):
    """Integer ConvTranspose1d."""

    _DIM = 1
    _TRANSPOSED = True


class ConvTranspose2d(_Conv):
    """Integer ConvTranspose2d."""

    _DIM = 2
    _TRANSPOSED = True


class ConvTranspose3d(_Conv):
    """Integer ConvTranspose3d."""

    _DIM = 3
    _TRANSPOSED = True


class Linear(_Weighted):
    """Integer Linear."""

    _channel_axis = -1

    def __init__(self, qat: nn.Module) -> None:
        self.in_features = qat.in_features
        self.out_features = qat.out_features
        super().__init__(qat)

    def _op(self, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        return F.linear(x, w, b)

    def _hyper(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
