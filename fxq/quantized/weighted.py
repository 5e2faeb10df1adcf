"""Integer conv, transposed conv and linear (optionally with a folded BatchNorm,
a fused residual add and ReLU / ReLU6).

Per output channel ``c`` (``docs/arithmetic.md``, "Conv and linear")::

    acc[c] = sat32( sum X * W[c] + B[c] )                 exact, int32 saturation
    acc[c] = sat32( acc[c] + shift_round(R * mr[c], kr[c]) )          fused add
    Y[c]   = clamp( shift_round(acc[c] * M[c], S[c]), lo, hi )

with ``W = round(w_folded / s_w)`` (int8), ``B = round(b_folded / (s_x s_w))``
(int32), ``M[c] 2**-S[c] ~ s_x s_w[c] / s_y``, ``mr[c] 2**-kr[c] ~ g[c] s_r / (s_x s_w[c])``
(``g``: the residual factor that ``fxq.calibration.smooth_activations`` may set, else 1),
and ``lo = 0`` for ReLU, ``hi = round(6 / s_y)`` for ReLU6. A high-precision
(qint32) output returns ``float32(acc * s_x * s_w)`` instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fxq.dtypes import QDType, as_qdtype, qint8, qint32
from fxq.primitives.core import NotExportable, record_built
from fxq.qtensor import QTensor
from fxq.quantized import functional as qf
from fxq.quantized.base import (
    QuantizedModule,
    check_input,
    multiplier_for,
    require_finite,
    same_scale,
    warn_if_saturated,
    warn_rescaled,
)

__all__ = [
    "ConvNd",
    "Requantization",
    "Weighted",
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
def integer_weight_params(qat: nn.Module) -> dict[str, Tensor | None]:
    """Integer weight (op layout), int32 bias and scales of a QAT weighted module.

    Returns:
        ``weight`` (int8, op layout), ``weight_out_major``, ``bias`` (int32 at
        ``input_scale * weight_scale``, or None), ``float_bias`` (the folded float
        bias in float64 that ``bias`` is quantized from, or None),
        ``input_scale`` and ``weight_scale``.

    Raises:
        ValueError: the input scale is unknown, or a weight, bias, BatchNorm
            statistic or scale is NaN / Inf (the message names the layer).
    """
    rounding = qat.spec.rounding
    s_x = qat.input_scale(0)
    if s_x is None:
        raise ValueError(
            f"{type(qat).__name__} {qat.name!r}: the scale of its input is unknown (no linked "
            "input fake quant); convert needs a prepared model"
        )
    bn = getattr(qat, "bn", None)
    require_finite(
        qat,
        {
            "weight": qat.weight,
            "bias": qat.bias,
            "BatchNorm weight": None if bn is None else bn.weight,
            "BatchNorm bias": None if bn is None else bn.bias,
            "BatchNorm running_mean": None if bn is None else bn.running_mean,
            "BatchNorm running_var": None if bn is None else bn.running_var,
        },
    )
    s_w = qat.weight_fake_quant.scale
    w_folded = qat.folded_weight().detach()
    b = qat.folded_bias()
    float_bias = None if b is None else b.detach().to(torch.float64)
    require_finite(
        qat,
        {
            "BatchNorm-folded weight": w_folded,
            "BatchNorm-folded bias": float_bias,
            "weight scale": s_w,
            "input scale": s_x,
        },
    )
    w_om = qf.quantize(w_folded, s_w, qint8, rounding, ch_axis=0)
    return {
        "weight": qat.weight_from_out_major(w_om),
        "weight_out_major": w_om,
        "bias": None if float_bias is None else _integer_bias(float_bias, s_x, s_w, rounding),
        "float_bias": float_bias,
        "input_scale": s_x.detach().clone(),
        "weight_scale": s_w.detach().clone(),
    }


def _integer_bias(float_bias: Tensor, s_x: Tensor, s_w: Tensor, rounding) -> Tensor:
    """``sat32(round(b / (s_x * s_w)))`` per output channel, in float64 (arithmetic.md, 5.2)."""
    bias_scale = s_x.to(torch.float64) * s_w.to(torch.float64)
    return qf.quantize(float_bias, bias_scale, qint32, rounding, ch_axis=0)


@dataclass(frozen=True)
class Requantization:
    """Everything a weighted layer derives from its input scale(s).

    At the scales it was converted for these are the module's buffers; for
    other input scales ``Weighted.requantization`` derives them again, the same
    way, and caches them per scale.
    """

    bias: Tensor | None  # int32 at accumulator_scale
    accumulator_scale: Tensor  # float64, s_x * s_w per output channel
    multiplier: Tensor | None  # None for a high-precision (int32) output
    shift: Tensor | None
    residual_multiplier: Tensor | None  # None without a fused add
    residual_shift: Tensor | None
    plan: qf.AccumulationPlan
    may_saturate: bool


def _magnitude(v: float) -> str:
    return f"{v:,.0f} (2^{math.log2(v):.1f})" if v >= 1 else f"{v:g}"


class Weighted(QuantizedModule):
    """Base of the integer Linear and convolutions; subclasses provide ``_op`` and
    ``_channel_axis``. What forward computes with for given inputs is ``requantization``."""

    _channel_axis = 1

    def __init__(self, qat: nn.Module) -> None:
        super().__init__(qat.march, getattr(qat, "name", ""))
        params = integer_weight_params(qat)
        out_fq = qat.activation_post_process
        self.register_buffer("weight", params["weight"])
        self.register_buffer("float_bias", params["float_bias"])
        self.register_buffer("input_scale", params["input_scale"].reshape(1))
        self.register_buffer("weight_scale", params["weight_scale"])
        self.register_buffer("output_scale", out_fq.scale.detach().clone().reshape(1))
        self.out_dtype_name = out_fq.dtype.name
        self.input_dtype_name = qat.input_quants[0].dtype.name
        self.input_bits = qat.input_quants[0].dtype.bits
        self.activation = qat.activation
        self.add = qat.add
        # unsigned ranges stored shifted (fxq.calibration.offset_activations): this output's
        # integers are q - output_offset (the bias is lowered by that many output steps and
        # the clamps move); the input's are q - input_offset (the bias adds it back through
        # the weights, and a padded border holds -input_offset, the stored form of 0)
        self.output_offset = int(getattr(out_fq, "offset", 0))
        self.input_offset = int(getattr(qat.input_quants[0], "offset", 0))
        if self.input_offset:
            self._check_offset_input()
        residual_scale = None
        if self.add:
            residual_scale = qat.input_quants[1].scale.detach().clone().reshape(1)
            self.residual_dtype_name = qat.input_quants[1].dtype.name
            self.residual_bits = qat.input_quants[1].dtype.bits
        self.register_buffer("residual_scale", residual_scale)
        factor = getattr(qat, "residual_factor", None)
        self.register_buffer(
            "residual_factor", None if factor is None else factor.detach().clone().float()
        )
        self._weight_statistics()
        p = self._derive(self.input_scale, residual_scale)
        self.register_buffer("bias", p.bias)
        self.register_buffer("accumulator_scale", p.accumulator_scale)
        self.register_buffer("multiplier", p.multiplier)
        self.register_buffer("shift", p.shift)
        self.register_buffer("residual_multiplier", p.residual_multiplier)
        self.register_buffer("residual_shift", p.residual_shift)
        self.plan, self.may_saturate = p.plan, p.may_saturate
        self._set_bounds()

    # -- derived state ---------------------------------------------------------------
    @property
    def out_dtype(self) -> QDType:
        return as_qdtype(self.out_dtype_name)

    @property
    def high_precision(self) -> bool:
        return self.out_dtype is qint32

    def _set_bounds(self) -> None:
        k = self.output_offset
        self.lo = -k if self.activation in ("relu", "relu6") else None
        self.hi = None
        if self.activation == "relu6" and not self.high_precision:
            six = (
                torch.tensor([6.0], dtype=torch.float64) / self.output_scale.to(torch.float64).cpu()
            )
            self.hi = int(qf.round_float(six, self.rounding).item()) - k

    def _check_offset_input(self) -> None:  # what takes a shifted input: see ConvNd
        pass

    def _input_values(self, x: QTensor) -> Tensor:
        """The input's integers as the kernel reads them (a conv pads them here)."""
        return x.values()

    def _offset_bias(self, bias: Tensor | None) -> Tensor | None:
        """``bias + input_offset * sum_k W[c, k]``: the stored input is ``q - input_offset``."""
        if not self.input_offset:
            return bias
        w = self.weight_out_major().to(torch.int64)
        term = w.reshape(w.shape[0], -1).sum(1) * self.input_offset
        total = term if bias is None else bias.to(torch.int64) + term
        if bool((total.abs() > _INT32_MAX).any()):
            raise ValueError(
                f"{type(self).__name__} {self.name!r}: its input is stored with offset "
                f"{self.input_offset}, and the bias that undoes it does not fit in int32; "
                "leave its producer without an offset (fxq.calibration.offset_activations(..., "
                "skip=[...]))"
            )
        return total.to(torch.int32)

    def _weight_statistics(self) -> None:
        """``max_c sum_k |W[c, k]|``, which bounds every partial sum of the accumulation."""
        w = self.weight_out_major().to(torch.int64).abs()
        self.weight_l1 = int(w.reshape(w.shape[0], -1).sum(1).max().item()) if w.numel() else 0

    def _plan(
        self, bias: Tensor | None, residual_multiplier: Tensor | None, residual_shift: Tensor | None
    ) -> tuple[qf.AccumulationPlan, bool]:
        """The accumulation plan and whether int32 saturation is possible."""
        b = int(bias.abs().max().item()) if bias is not None and bias.numel() else 0
        plan = qf.plan_accumulation(self.input_bits, self.weight_l1, b)
        worst = (1 << (self.input_bits - 1)) * self.weight_l1 + b
        if self.add:
            worst += int(self._residual_bound(residual_multiplier, residual_shift))
        return plan, worst > _INT32_MAX

    def _residual_bound(self, multiplier: Tensor, shift: Tensor) -> float:
        r = qf.ldexp(multiplier, -shift)
        return float(((1 << (self.residual_bits - 1)) * r).max().item())

    def _derive(self, s_x: Tensor, s_r: Tensor | None) -> Requantization:
        """What convert derives for input scale ``s_x`` (and residual scale ``s_r``)."""
        s_w = self.weight_scale
        acc_scale = s_x.to(torch.float64) * s_w.to(torch.float64)
        bias = None
        float_bias = self.float_bias
        if self.output_offset:  # the output is stored output_offset steps lower
            lowered = self.output_offset * self.output_scale.to(torch.float64)
            if float_bias is None:
                float_bias = torch.zeros(s_w.numel(), dtype=torch.float64, device=s_w.device)
            float_bias = float_bias - lowered
            if bool((float_bias.abs() / acc_scale >= _INT32_MAX).any()):
                raise ValueError(
                    f"{type(self).__name__} {self.name!r}: its output is stored with offset "
                    f"{self.output_offset} (an unsigned range), and lowering its int32 bias by "
                    f"that many output steps overflows int32 (output scale "
                    f"{float(self.output_scale):.3g} against input x weight scales down to "
                    f"{float(acc_scale.min()):.3g}); leave it without an "
                    "offset (fxq.calibration.offset_activations(..., skip=[...]); ptq does so "
                    "by itself)"
                )
        if float_bias is not None:
            bias = _integer_bias(float_bias, s_x, s_w, self.rounding)
        bias = self._offset_bias(bias)
        m = s = mr = kr = None
        if not self.high_precision:
            real = acc_scale / self.output_scale.to(torch.float64)
            m, s = multiplier_for(
                self, real, {"input": s_x, "weight": s_w, "output": self.output_scale}
            )
        if self.add:
            real = s_r.to(torch.float64) / acc_scale
            if self.residual_factor is not None:  # op(x) + g * residual, g per output channel
                real = real * self.residual_factor.to(torch.float64)
            mr, kr = multiplier_for(
                self, real, {"residual": s_r, "input": s_x, "weight": s_w}, left_shift=True
            )
        plan, may_saturate = self._plan(bias, mr, kr)
        return Requantization(bias, acc_scale, m, s, mr, kr, plan, may_saturate)

    def requantization(
        self, x: QTensor, residual: QTensor | None = None
    ) -> Weighted | Requantization:
        """The parameters for the inputs' scales: the module itself (its buffers) at the
        scales it was converted for, else ``Requantization`` derived for them (cached).

        Raises:
            TypeError / ValueError: an input is not a per-tensor QTensor of (at most) the
                dtype the module was converted for.
        """
        check_input(self, x, 0, self.input_dtype_name, offset_ok=bool(self.input_offset))
        if x.offset != self.input_offset:
            raise TypeError(
                f"{type(self).__name__} {self.name!r} was converted for an input stored with "
                f"offset {self.input_offset}, got one with offset {x.offset}; convert the model "
                "again after changing its producers' offsets"
            )
        same = same_scale(x, self.input_scale)
        if self.add:
            check_input(self, residual, 1, self.residual_dtype_name)
            same = same and same_scale(residual, self.residual_scale)
        if same:
            return self
        s_r = residual.scale if self.add else None
        key = (float(x.scale), None if s_r is None else float(s_r))
        if not same_scale(x, self.input_scale):
            warn_rescaled(self, 0, self.input_scale, x.scale)
        else:
            warn_rescaled(self, 1, self.residual_scale, s_r)
        return self.derived(key, lambda: self._derive(x.scale, s_r))

    def weight_out_major(self) -> Tensor:
        return self.weight

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._set_bounds()
        self._weight_statistics()
        self.plan, self.may_saturate = self._plan(
            self.bias, self.residual_multiplier, self.residual_shift
        )

    # -- compute -----------------------------------------------------------------------
    def _op(self, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:  # pragma: no cover
        raise NotImplementedError

    def accumulator(self, x: QTensor, residual: QTensor | None = None) -> Tensor:
        """The exact (saturated) int32 accumulator, as a float tensor of integers."""
        return self._accumulator(x, residual, self.requantization(x, residual))

    def _accumulator(
        self, x: QTensor, residual: QTensor | None, p: Weighted | Requantization
    ) -> Tensor:
        acc = qf.accumulate(
            self._op, self._input_values(x), self.weight, p.bias, p.plan, self._channel_axis
        )
        if p.may_saturate:
            acc = qf.saturate_int32(acc)
        if self.add:
            term = qf.rescale_term(
                residual.values(),
                p.residual_multiplier,
                p.residual_shift,
                self.rounding,
                self._channel_axis,
            )
            acc = qf.saturate_int32(acc.to(torch.float64) + term)
        return acc

    def forward(self, x: QTensor, residual: QTensor | None = None) -> QTensor | Tensor:
        # p: this module (its buffers) at the scales it was converted for, else the same
        # parameters derived for the scales the inputs carry
        p = self.requantization(x, residual)
        if self.high_precision:
            acc = self._accumulator(x, residual, p)
            if self.lo is not None:
                acc = acc.clamp(min=0)
            scale = qf.broadcast_scale(p.accumulator_scale, acc.dim(), self._channel_axis)
            y = acc.to(torch.float64) * scale
            if self.activation == "relu6":
                y = y.clamp(max=6.0)
            y = y.to(torch.float32)
            self._record(x, residual, p, y, "float32")
            return y
        acc = qf.accumulate(
            self._op, self._input_values(x), self.weight, p.bias, p.plan, self._channel_axis
        )
        if p.may_saturate:
            warn_if_saturated(self, acc, lambda: self._saturation_cause(p, x))
            acc = qf.saturate_int32(acc)
        args = (self.out_dtype, self.rounding, self._channel_axis, self.lo, self.hi)
        if self.add:
            q = qf.requantize_residual(
                acc,
                residual.values(),
                p.residual_multiplier,
                p.residual_shift,
                p.multiplier,
                p.shift,
                *args,
            )
        else:
            q = qf.requantize_exact(acc, p.multiplier, p.shift, *args, as_float=True)
        self._record(x, residual, p, q, self.out_dtype_name[1:])
        return QTensor(q, self.output_scale, self.out_dtype, offset=self.output_offset)

    def _record(self, x: QTensor, residual: QTensor | None, p, y: Tensor, dtype: str) -> None:
        """Report this call to an export that records it (``fxq.primitives.weighted``)."""
        r = residual.values() if self.add else None
        inputs = [x.values()] if r is None else [x.values(), r]
        record_built(self.IR_OP, inputs, y, dtype, lambda: self.ir_node(x, p))

    def ir_node(self, x: QTensor, p) -> tuple[dict, dict]:
        """The exported node's attributes and arrays for a call on ``x`` that computed with
        ``p`` (``requantization(x, residual)``)."""
        params: dict[str, Tensor] = {
            "weight": self.weight_out_major().to(torch.int8),
            "weight_scale": self.weight_scale.float().reshape(-1),
        }
        if p.bias is not None:
            params["bias"] = p.bias.to(torch.int32)
        hp = self.high_precision
        if hp:
            params["accumulator_scale"] = p.accumulator_scale.double()
        else:
            params["multiplier"] = p.multiplier.to(torch.int32)
            params["shift"] = p.shift.to(torch.int32)
        if self.add:
            params["residual_multiplier"] = p.residual_multiplier.to(torch.int32)
            params["residual_shift"] = p.residual_shift.to(torch.int32)
        attrs = {
            "out_dtype": "float32" if hp else self.out_dtype_name[1:],
            "rounding": self.rounding.value,
            "lo": self.lo,
            "hi": self.hi,
            "float_max": 6.0 if hp and self.activation == "relu6" else None,
            "activation": self.activation,
        }
        return attrs, params

    def _saturation_cause(self, p: Weighted | Requantization, x: QTensor) -> str:
        """What the accumulator sums (operand dtypes, worst cases) and what to do."""
        products = (1 << (self.input_bits - 1)) * self.weight_l1
        bias = float(p.bias.abs().max()) if p.bias is not None and p.bias.numel() else 0.0
        residual = self._residual_bound(p.residual_multiplier, p.residual_shift) if self.add else 0
        text = (
            f"it sums {x.qdtype.name} inputs times int8 weights (|X| * sum|W| up to "
            f"{_magnitude(products)})"
        )
        if bias:
            text += (
                f", plus an int32 bias of up to {_magnitude(bias)} (the float bias divided by "
                f"input scale {float(x.scale):.6g} times the weight scale)"
            )
        if residual:
            text += (
                f", plus the residual rescaled to the accumulator (up to {_magnitude(residual)})"
            )
        text += "; 32 bits hold 2^31. "
        largest = max(products, bias, residual)
        if largest == bias:
            text += (
                "The bias is what overflows: the input scale is too small for it (calibrate the "
                "input on its real range, or fix a larger input scale)"
            )
        elif largest == residual:
            text += (
                "The residual is what overflows: its scale is too large next to the input and "
                "weight scales (calibrate both inputs on their real ranges)"
            )
        else:
            text += "Use int8 inputs (the producer's qconfig) or smaller weights"
        return text + ", or keep the layer in float with a qconfig of None"

    @classmethod
    def from_qat(cls, qat: nn.Module) -> Weighted:
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
        if self.output_offset:
            out += f" stored less {self.output_offset}"
        if self.input_offset:
            out += f", input stored less {self.input_offset}"

        return (
            f"{self._hyper()}, in_scale={self.input_scale.item():.6g}, out={out}"
            + (f", fused={'+'.join(fused)}" if fused else "")
            + f", accumulate={self.plan.describe()}"
        )

    def _hyper(self) -> str:  # pragma: no cover
        return ""


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONVT = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _tuple(v, d: int) -> tuple[int, ...]:
    if isinstance(v, (tuple, list)):
        return tuple(int(x) for x in (list(v) * d if len(v) == 1 else v))
    return (int(v),) * d


class ConvNd(Weighted):
    """Base of the integer convolutions and transposed convolutions.

    Attributes:
        spatial_dims: 1, 2 or 3 (set by each subclass); a batched input has
            ``spatial_dims + 2`` dims.
        transposed: whether it is a ``ConvTranspose*d`` (its weight is stored in torch's
            transposed layout; ``weight_out_major`` gives it output channel first).
    """

    spatial_dims: int = 2
    transposed: bool = False
    IR_OP = "conv"

    @property
    def _channel_axis(self) -> int:
        """The output channel axis counted from the end, so unbatched inputs work too."""
        return -(self.spatial_dims + 1)

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
        if self.transposed:
            return _CONVT[self.spatial_dims](
                x, w, b, self.stride, self.padding, self.output_padding, self.groups, self.dilation
            )
        if self.padding_mode != "zeros":
            x = F.pad(x, self.reversed_padding, mode=self.padding_mode)
            padding = 0
        else:
            padding = 0 if self.input_offset else self.padding  # padded in _input_values
        depthwise = self.groups > 1 and w.shape[1] == 1  # torch's CUDA kernel: direct, exact
        if x.device.type == "cuda" and x.dim() == self.spatial_dims + 2 and not depthwise:
            d = self.spatial_dims
            pads = [[0, 0]] * d if padding == 0 else self.zero_padding()
            return qf.conv_as_gemm(
                x, w, b, _tuple(self.stride, d), pads, _tuple(self.dilation, d), self.groups
            )
        return _CONV[self.spatial_dims](x, w, b, self.stride, padding, self.dilation, self.groups)

    def _check_offset_input(self) -> None:
        if self.transposed or self.padding_mode != "zeros":
            raise ValueError(
                f"{type(self).__name__} {self.name!r}: an input stored with an offset needs a "
                f"convolution that pads with zeros (this one is "
                f"{'transposed' if self.transposed else self.padding_mode})"
            )

    def zero_padding(self) -> list[list[int]]:
        """``[before, after]`` per spatial axis of the zero padding (first axis first)."""
        d = self.spatial_dims
        if isinstance(self.padding, str):
            if self.padding == "valid":
                return [[0, 0]] * d
            # "same": torch puts the odd pixel on the right
            total = [
                di * (ki - 1) for di, ki in zip(_tuple(self.dilation, d), self.weight.shape[2:])
            ]
            return [[t // 2, t - t // 2] for t in total]
        return [[p, p] for p in _tuple(self.padding, d)]

    def _input_values(self, x: QTensor) -> Tensor:
        v = x.values()
        if not self.input_offset:
            return v
        pads = [p for pair in reversed(self.zero_padding()) for p in pair]
        if not any(pads):
            return v
        # the stored form of a real 0 (a zero-padded border) is -input_offset
        return F.pad(v, pads, value=float(-self.input_offset))

    def weight_out_major(self) -> Tensor:
        return qf.swap_group_axes(self.weight, self.groups) if self.transposed else self.weight

    def ir_node(self, x: QTensor, p) -> tuple[dict, dict]:
        """The ``conv`` node: ``Weighted.ir_node`` and the convolution's geometry.

        Raises:
            fxq.primitives.core.NotExportable: an unbatched input.
        """
        d = self.spatial_dims
        if x.dim() != d + 2:
            raise NotExportable(
                "unbatched convolution inputs are not exported; add a batch dimension"
            )
        attrs, params = super().ir_node(x, p)
        attrs.update(
            dim=d,
            transposed=self.transposed,
            stride=list(_tuple(self.stride, d)),
            dilation=list(_tuple(self.dilation, d)),
            groups=int(self.groups),
            pad_mode="zeros",
        )
        if self.transposed:
            attrs.update(
                padding=list(_tuple(self.padding, d)),
                output_padding=list(_tuple(self.output_padding, d)),
            )
        elif self.padding_mode != "zeros":
            rp = list(self.reversed_padding)
            attrs["pads"] = [[rp[2 * i], rp[2 * i + 1]] for i in range(d)][::-1]
            attrs["pad_mode"] = self.padding_mode
        else:
            attrs["pads"] = self.zero_padding()
        if not self.transposed:
            # an input stored with an offset pads with the stored form of 0
            attrs["pad_value"] = -self.input_offset
        return attrs, params

    def _hyper(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, kernel_size={tuple(self.weight.shape[2:])}, stride={self.stride}, groups={self.groups}"


class Conv1d(ConvNd):
    """Integer Conv1d."""

    spatial_dims = 1


class Conv2d(ConvNd):
    """Integer Conv2d."""

    spatial_dims = 2


class Conv3d(ConvNd):
    """Integer Conv3d."""

    spatial_dims = 3


class ConvTranspose1d(ConvNd):
    """Integer ConvTranspose1d."""

    spatial_dims = 1
    transposed = True


class ConvTranspose2d(ConvNd):
    """Integer ConvTranspose2d."""

    spatial_dims = 2
    transposed = True


class ConvTranspose3d(ConvNd):
    """Integer ConvTranspose3d."""

    spatial_dims = 3
    transposed = True


class Linear(Weighted):
    """Integer Linear."""

    _channel_axis = -1
    IR_OP = "linear"

    def __init__(self, qat: nn.Module) -> None:
        self.in_features = qat.in_features
        self.out_features = qat.out_features
        super().__init__(qat)

    def _op(self, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        return F.linear(x, w, b)

    def _hyper(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
