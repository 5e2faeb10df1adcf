"""Integer LayerNorm and GroupNorm (``docs/arithmetic.md``, section 14).

Both normalize rows of integers with ``fxq.quantized.functional.normalize_rows``
(int64 sums, an rsqrt table, one rounding shift) into ``Z`` with ``Q``
fraction bits (int16 on marches with int16 activations, else int8), then apply
the per-channel affine like a standalone BatchNorm:
``Y[c] = sat(shift_round(sat32(Z * W[c] + B[c]) * M[c], S[c]))`` with ``W`` the
int8 weight at scale ``s_w[c]``, ``B[c] = round(beta[c] / (2**-Q s_w[c]))`` and
``M[c] 2**-S[c] ~ 2**-Q s_w[c] / s_y``. Without an affine, ``W = 1`` and ``s_w = 1``.

``F.normalize(x, p=2, dim, eps)`` (``L2Normalize``, section 27) shares the rsqrt table:
``Z = sat(shift_round(X R, F + e - Q))`` with ``(R, e) = integer_rsqrt(max(sum X**2, E))``,
then ``Y = sat(shift_round(Z M, S))`` with ``M 2**-S ~ 2**-Q / s_y``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fxq.dtypes import QDType, as_qdtype, qint8, qint16, qint32
from fxq.march import MarchSpec
from fxq.march.spec import ScaleConstraint
from fxq.primitives.core import record_built
from fxq.qtensor import QTensor
from fxq.quantized import functional as qf
from fxq.quantized.base import check_input, multiplier_for, require_finite
from fxq.quantized.ops_base import FunctionalQuantized

__all__ = [
    "Normalization",
    "LayerNorm",
    "GroupNorm",
    "L2Normalize",
    "NormPlan",
    "L2Plan",
    "norm_z_dtype",
    "layer_norm_arguments",
    "normalize_arguments",
    "unit_range_scale",
]


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


def normalize_arguments(args: tuple, kwargs: dict) -> tuple[float, int | tuple[int, ...], float]:
    """``(p, dim, eps)`` of an ``F.normalize`` call (after its input)."""
    names = ("p", "dim", "eps")
    defaults = (2.0, 1, 1e-12)
    values = [
        args[i] if len(args) > i else kwargs.get(name, default)
        for i, (name, default) in enumerate(zip(names, defaults))
    ]
    if kwargs.get("out") is not None:
        raise ValueError("F.normalize with out= has no integer form")
    p, dim, eps = values
    return float(p), (int(dim) if isinstance(dim, int) else tuple(int(d) for d in dim)), float(eps)


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


class Normalization(FunctionalQuantized):
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

    def ir_node(
        self, plan: NormPlan, eps: float, n: int, groups: int | None = None, channels: int = 0
    ) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """The exported ``normalize`` node's attributes and arrays for a call that computed
        with ``plan`` (rows of ``n``; GroupNorm: ``groups`` per sample of ``channels``)."""
        shape = [n] if groups is None else [channels, 1]

        def per_channel(t: Tensor, dtype: torch.dtype) -> Tensor:
            return t.detach().to(dtype).reshape(shape if t.numel() > 1 else [1])

        attrs = {"n": n, "groups": groups, **rsqrt_attrs(self, plan, eps)}
        params = {
            "rsqrt_table": qf.rsqrt_table().long(),
            "weight": per_channel(self.weight, torch.int8),
            "weight_scale": per_channel(self.weight_scale, torch.float32),
            "bias": per_channel(plan.bias, torch.int32),
            "multiplier": per_channel(plan.multiplier, torch.int64),
            "shift": per_channel(plan.shift, torch.int64),
        }
        return attrs, params

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


class LayerNorm(Normalization):
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
        y = self.normalize(rows, plan, [n], x.shape)
        record_built(
            "normalize",
            [x.values()],
            y,
            self.out_dtype_name[1:],
            lambda: self.ir_node(plan, eps, n),
        )
        return self.wrap(y)


class GroupNorm(Normalization):
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
        y = self.affine(z, plan, [c, 1]).reshape(x.shape)
        record_built(
            "normalize",
            [x.values()],
            y,
            self.out_dtype_name[1:],
            lambda: self.ir_node(plan, eps, n, groups, c),
            axis0="batch",
        )
        return self.wrap(y)


def rsqrt_attrs(module: FunctionalQuantized, plan: Any, eps: float) -> dict[str, Any]:
    """The attributes of an exported node that scales by the rsqrt table (``normalize``,
    ``l2_normalize``) for a call that computed with ``plan``."""
    return {
        "eps": eps,
        "eps_term": plan.eps_term,
        "q_bits": plan.q_bits,
        "index_bits": qf.RSQRT_INDEX_BITS,
        "fraction_bits": qf.RSQRT_FRACTION_BITS,
        "z_dtype": module.z_dtype.name[1:],
        "dtype": module.out_dtype_name[1:],
        "rounding": module.rounding.value,
    }


def unit_range_scale(dtype: QDType, spec: MarchSpec) -> float:
    """The fixed output scale of ``F.normalize`` (values in ``[-1, 1]``): ``1 / qmax``, or
    ``2**-(bits - 1)`` on marches with power-of-two scales (1.0 then saturates to
    ``qmax 2**-(bits-1)``, one step below)."""
    if spec.scale_constraint is ScaleConstraint.POWER_OF_TWO:
        return 2.0 ** -(dtype.bits - 1)
    return 1.0 / dtype.qmax


@dataclass(frozen=True)
class L2Plan:
    """What ``F.normalize`` computes with for one input scale.

    Attributes:
        eps_term: ``E = round(eps**2 / s_x**2)``.
        q_bits: fraction bits ``Q`` of ``Z``.
        multiplier, shift: ``M 2**-S ~ 2**-Q / s_y``.
    """

    eps_term: int
    q_bits: int
    multiplier: Tensor
    shift: Tensor


class L2Normalize(FunctionalQuantized):
    """Integer ``F.normalize(x, p=2, dim, eps)``: ``x / max(||x||_2, eps)`` over ``dim``
    (an int or a tuple of ints); the registry keeps other ``p`` in float.

    Raises:
        ValueError: ``p`` other than 2, ``out=``, or sums of squares too wide for int64.
    """

    def __init__(self, qat: nn.Module) -> None:
        super().__init__(qat)
        self.z_dtype_name = norm_z_dtype(self.spec).name

    @property
    def z_dtype(self) -> QDType:
        return as_qdtype(self.z_dtype_name)

    def plan(self, x: QTensor, eps: float) -> L2Plan:
        """The plan for ``x``'s scale (cached per scale and ``eps``)."""
        (s_x,) = self.scale_values(x)
        return self.derived(("l2", s_x, eps), lambda: self._derive(x.scale, eps))

    def _derive(self, s_x: Tensor, eps: float) -> L2Plan:
        q = qf.l2_fraction_bits(self.z_dtype.bits)
        s_y = self.output_scale.double()
        m, s = multiplier_for(self, 2.0**-q / s_y, {"normalized (2**-Q)": 2.0**-q, "output": s_y})
        return L2Plan(qf.l2_eps_term(eps, s_x), q, m, s)

    def arguments(self, x: QTensor, args: tuple, kwargs: dict) -> tuple[tuple[int, ...], float]:
        """The normalized axes (non-negative, sorted) and eps of this call."""
        p, dim, eps = normalize_arguments(args, kwargs)
        if p != 2.0:
            raise ValueError(f"L2Normalize {self.name!r}: p={p} (only p=2 is integer)")
        dims = (dim,) if isinstance(dim, int) else dim
        return tuple(sorted({d % max(x.dim(), 1) for d in dims})), eps

    def forward(self, x: QTensor, *args: Any, **kwargs: Any) -> QTensor:
        check_input(self, x, 0, self.input_dtype_names[0] if self.input_dtype_names else None)
        dims, eps = self.arguments(x, args, kwargs)
        plan = self.plan(x, eps)
        z = qf.l2_normalize(
            x.values(), dims, plan.eps_term, plan.q_bits, self.z_dtype, self.rounding
        )
        m, s = plan.multiplier.to(z.device), plan.shift.to(z.device)
        y = qf.shift_round(z * m, s, self.rounding)
        dt = self.out_dtype
        y = y.clamp_(dt.qmin, dt.qmax).to(torch.float32)
        record_built(
            "l2_normalize", [x.values()], y, dt.name[1:], lambda: self.ir_node(plan, eps, dims)
        )
        return self.wrap(y)

    def ir_node(
        self, plan: L2Plan, eps: float, dims: Any
    ) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """The exported ``l2_normalize`` node's attributes and arrays for a call that computed
        with ``plan`` over ``dims``."""
        attrs = {"axes": list(dims), **rsqrt_attrs(self, plan, eps)}
        params = {
            "rsqrt_table": qf.rsqrt_table().long(),
            "multiplier": plan.multiplier.long().reshape(1),
            "shift": plan.shift.long().reshape(1),
        }
        return attrs, params
