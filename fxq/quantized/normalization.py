"""Integer LayerNorm and GroupNorm (``docs/arithmetic.md``, section 14).

Both normalize rows of integers with ``fxq.quantized.functional.normalize_rows``
(int64 sums, an rsqrt table, one rounding shift) into ``Z`` with ``Q``
fraction bits (int16 on marches with int16 activations, else int8), then apply
the per-channel affine like a standalone BatchNorm:
``Y[c] = sat(shift_round(sat32(Z * W[c] + B[c]) * M[c], S[c]))`` with ``W`` the
int8 weight at scale ``s_w[c]``, ``B[c] = round(beta[c] / (2**-Q s_w[c]))`` and
``M[c] 2**-S[c] ~ 2**-Q s_w[c] / s_y``. Without an affine, ``W = 1`` and ``s_w = 1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fxq.dtypes import QDType, as_qdtype, qint8, qint16, qint32
from fxq.march import MarchSpec
from fxq.qtensor import QTensor
from fxq.quantized import functional as qf
from fxq.quantized.base import check_input, multiplier_for, require_finite
from fxq.quantized.ops_base import FunctionalQuantized

__all__ = ["LayerNorm", "GroupNorm", "NormPlan", "norm_z_dtype", "layer_norm_arguments"]


def norm_z_dtype(spec: MarchSpec) -> QDType:
    """The dtype of the normalized intermediate: int16 where the march has int16."""
    return qint16 if spec.supports_activation(qint16) else qint8


def layer_norm_arguments(op: nn.Module | None, args: tuple, kwargs: dict) -> tuple[tuple, float]:
    """``(normalized_shape, eps)`` of an ``nn.LayerNorm`` or an ``F.layer_norm`` call."""
    if op is not None:
        return tuple(op.normalized_shape), float(op.eps)
    shape = args[0] if args else kwargs["normalized_shape"]
    eps = args[3] if len(args) > 3 else kwargs.get("eps", 1e-5)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return shape, float(eps)


def group_norm_arguments(op: nn.Module | None, args: tuple, kwargs: dict) -> tuple[int, float]:
    """``(num_groups, eps)`` of an ``nn.GroupNorm`` or an ``F.group_norm`` call."""
    if op is not None:
        return int(op.num_groups), float(op.eps)
    groups = args[0] if args else kwargs["num_groups"]
    eps = args[3] if len(args) > 3 else kwargs.get("eps", 1e-5)
    return int(groups), float(eps)


@dataclass(frozen=True)
class NormPlan:
    """What a normalization computes with for one input scale and row length.

    Attributes:
        eps_term: ``E = round(eps n**2 / s_x**2)``.
        q_bits: fraction bits ``Q`` of ``Z``.
        bias: int32 bias per channel (int64 storage) at ``2**-Q s_w``.
        multiplier, shift: per channel, ``~ 2**-Q s_w / s_y``.
    """

    eps_term: int
    q_bits: int
    bias: Tensor
    multiplier: Tensor
    shift: Tensor


class _Normalization(FunctionalQuantized):
    """Shared by LayerNorm and GroupNorm: the int8 affine weight, its scale and the float bias."""

    def __init__(self, qat: nn.Module) -> None:
        super().__init__(qat)
        weight, bias = qat.affine_parameters()
        require_finite(qat, {"weight": weight, "bias": bias})
        if weight is not None:
            s_w = qat.weight_fake_quant.scale.detach().clone().reshape(-1)
            w = qf.quantize(weight, s_w, qint8, self.rounding, ch_axis=0)
        else:
            s_w = torch.ones(1)
            w = torch.ones(1, dtype=torch.int8)
        channels = w.numel()
        float_bias = (
            bias.double() if bias is not None else torch.zeros(channels, dtype=torch.float64)
        )
        self.register_buffer("weight", w)
        self.register_buffer("weight_scale", s_w.float())
        self.register_buffer("float_bias", float_bias)
        self.z_dtype_name = qat.z_dtype.name
        self.input_dtype_name = qat.input_quants[0].dtype.name if qat.input_quants else None

    @property
    def z_dtype(self) -> QDType:
        return as_qdtype(self.z_dtype_name)

    def plan(self, x: QTensor, n: int, eps: float) -> NormPlan:
        """The plan for ``x``'s scale and rows of ``n`` elements (cached per scale and ``n``)."""
        (s_x,) = self.scale_values(x)
        return self.derived((s_x, n, eps), lambda: self._derive(x.scale, n, eps))

    def _derive(self, s_x: Tensor, n: int, eps: float) -> NormPlan:
        q = qf.norm_fraction_bits(n, self.z_dtype.bits)
        acc_scale = self.weight_scale.double() * 2.0**-q
        bias = qf.quantize(self.float_bias, acc_scale, qint32, self.rounding, ch_axis=0)
        s_y = self.output_scale.double()
        m, s = multiplier_for(
            self,
            acc_scale / s_y,
            {"normalized (2**-Q)": 2.0**-q, "weight": self.weight_scale, "output": s_y},
        )
        eps_term = qf.norm_eps_term(eps, n, s_x)
        return NormPlan(eps_term, q, bias.to(torch.int64), m, s)

    def normalize(
        self, rows: Tensor, plan: NormPlan, channel_shape: list[int], out_shape: torch.Size
    ) -> Tensor:
        """``normalize_rows`` then the affine and requantization; float32 integers."""
        z = qf.normalize_rows(rows, plan.eps_term, plan.q_bits, self.z_dtype, self.rounding)
        return self.affine(z, plan, channel_shape).reshape(out_shape)

    def affine(self, z: Tensor, plan: NormPlan, channel_shape: list[int]) -> Tensor:
        """``sat(shift_round(sat32(Z W + B) M, S))`` with per-channel ``W, B, M, S`` shaped
        ``channel_shape`` (broadcast against ``z``)."""
        w = self.weight.to(torch.int64).reshape(channel_shape if self.weight.numel() > 1 else [1])
        shape = channel_shape if plan.bias.numel() > 1 else [1]
        acc = z * w + plan.bias.to(z.device).reshape(shape)
        acc = qf.saturate_int32(acc)
        m = plan.multiplier.reshape(shape if plan.multiplier.numel() > 1 else [1])
        s = plan.shift.reshape(m.shape)
        out = qf.shift_round(acc * m.to(acc.device), s.to(acc.device), self.rounding)
        dt = self.out_dtype
        return out.clamp_(dt.qmin, dt.qmax).to(torch.float32)


class LayerNorm(_Normalization):
    """Integer ``nn.LayerNorm`` / ``F.layer_norm`` (the float affine of ``F.layer_norm`` must be
    absent: the registry keeps a functional call with weight tensors in float)."""

    def forward(self, x: QTensor, *args: Any, **kwargs: Any) -> QTensor:
        check_input(self, x, 0, self.input_dtype_name)
        shape, eps = layer_norm_arguments(self.op, args, kwargs)
        if tuple(x.shape[len(x.shape) - len(shape) :]) != shape:
            raise ValueError(
                f"LayerNorm {self.name!r}: input shape {tuple(x.shape)} does not end with the "
                f"normalized shape {shape}"
            )
        n = math.prod(shape)
        plan = self.plan(x, n, eps)
        rows = x.values().reshape(*x.shape[: x.dim() - len(shape)], n)
        return self.wrap(self.normalize(rows, plan, [n], x.shape))


class GroupNorm(_Normalization):
    """Integer ``nn.GroupNorm`` / ``F.group_norm`` (no weight tensors in the functional form)."""

    def forward(self, x: QTensor, *args: Any, **kwargs: Any) -> QTensor:
        check_input(self, x, 0, self.input_dtype_name)
        groups, eps = group_norm_arguments(self.op, args, kwargs)
        b, c = x.shape[0], x.shape[1]
        n = (x.numel() // b) // groups
        plan = self.plan(x, n, eps)
        rows = x.values().reshape(b, groups, n)
        z = qf.normalize_rows(rows, plan.eps_term, plan.q_bits, self.z_dtype, self.rounding)
        z = z.reshape(b, c, -1)
        return self.wrap(self.affine(z, plan, [c, 1]).reshape(x.shape))
