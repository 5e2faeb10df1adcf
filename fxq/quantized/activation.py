"""Integer clamps and lookup-table activations.

Clamp (ReLU6 / Hardtanh / clamp): ``Y = clamp(shift_round(X * M, S), round(lo / s_y), round(hi / s_y))``
with ``M 2**-S ~ s_x / s_y``.

PReLU and LeakyReLU: ``Y = shift_round(X * M, S)`` for ``X >= 0`` and
``Y = shift_round((X sign(a[c])) * N[c], T[c])`` for ``X < 0``, with
``N[c] 2**-T[c] ~ |a[c]| s_x / s_y`` (the slope is in the multiplier; no table).

Lookup tables: int8 inputs index a 256-entry table
``T[q] = clamp(round(f(q s_x) / s_y))``; int16 inputs use a segmented table
(``fxq.primitives.table.SegmentLUT``) with fixed-point linear interpolation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fxq import registry
from fxq.primitives import requant
from fxq.primitives import table as tables
from fxq.qtensor import QTensor
from fxq.quantized import functional as qf
from fxq.quantized.base import multiplier_for, require_finite
from fxq.quantized.ops_base import FunctionalQuantized

__all__ = ["Clamp", "LookupTable", "PReLU", "PReLUPlan"]


def _clamp_bounds(op: Any, fn: Any, args: tuple, kwargs: dict) -> tuple[float | None, float | None]:
    if op is not None:
        if isinstance(op, nn.ReLU6):
            return 0.0, 6.0
        return float(op.min_val), float(op.max_val)  # Hardtanh
    import torch.nn.functional as F

    if fn is F.relu6:
        return 0.0, 6.0
    if fn is F.hardtanh:
        lo = args[0] if args else kwargs.get("min_val", -1.0)
        hi = args[1] if len(args) > 1 else kwargs.get("max_val", 1.0)
        return float(lo), float(hi)
    lo = args[0] if args else kwargs.get("min")
    hi = args[1] if len(args) > 1 else kwargs.get("max")
    return (None if lo is None else float(lo)), (None if hi is None else float(hi))


class Clamp(FunctionalQuantized):
    """Integer ReLU6 / Hardtanh / clamp with constant bounds."""

    def bounds(self, *args: Any, **kwargs: Any) -> tuple[float | None, float | None]:
        """The float bounds ``(lo, hi)`` of a call with these arguments after the input (None:
        unbounded on that side); ``inplace`` flags are ignored."""
        kwargs = {k: v for k, v in kwargs.items() if k != "inplace"}
        if args and isinstance(args[-1], bool):  # F.relu6(x, inplace) / F.hardtanh(..., inplace)
            args = args[:-1]
        return _clamp_bounds(self.op, self.fn, args, kwargs)

    def requantization(
        self, x: QTensor, lo: float | None, hi: float | None
    ) -> tuple[Tensor, Tensor, int | None, int | None]:
        """Multiplier, shift (``M 2**-S ~ s_x / s_y``) and the integer bounds of ``lo`` and
        ``hi`` on the output grid, for ``x``'s scale (cached per scale and bounds).

        Raises:
            TypeError / ValueError: ``x`` is not a per-tensor QTensor.
        """
        (s_x,) = self.scale_values(x)
        return self.derived((s_x, lo, hi), lambda: self._derive(x.scale, lo, hi))

    def forward(self, x: QTensor, *args: Any, **kwargs: Any) -> QTensor:
        m, s, q_lo, q_hi = self.requantization(x, *self.bounds(*args, **kwargs))
        return self.wrap(
            requant.requantize(x.values(), m, s, self.out_dtype, self.rounding, q_lo, q_hi)
        )

    def _derive(
        self, s_x: Tensor, lo: float | None, hi: float | None
    ) -> tuple[Tensor, Tensor, int | None, int | None]:
        """Multiplier, shift and integer bounds for input scale ``s_x``."""
        s_y = self.output_scale.to(torch.float64)
        m, s = multiplier_for(self, qf.scale_ratio(s_x, s_y), {"input": s_x, "output": s_y})

        def bound(v: float | None) -> int | None:
            if v is None:
                return None
            q = qf.round_float(torch.tensor([v], dtype=torch.float64) / s_y.cpu(), self.rounding)
            return int(q.item())

        return m, s, bound(lo), bound(hi)


class LookupTable(FunctionalQuantized):
    """A pointwise non-linear function evaluated by table lookup.

    The table depends on the input scale and dtype and on the function's
    constant arguments (e.g. a leaky ReLU's slope); it is built from the float
    function on first use for each of them and cached, so an input at another
    scale than at convert gets the table convert would have built for it.
    """

    def _function(self, args: tuple, kwargs: dict):
        op = self.float_op()
        return lambda t: op(t, *args, **kwargs)

    def table(self, x: QTensor, args: tuple = (), kwargs: dict | None = None):
        """The table for inputs of ``x``'s scale and dtype (int8: 256 entries; int16: segmented)."""
        kwargs = {k: v for k, v in (kwargs or {}).items() if k != "inplace"}
        (s_x,) = self.scale_values(x)
        key = (x.qdtype.name, s_x, args, tuple(sorted(kwargs.items())), x.device)
        return self.derived(key, lambda: self._build(x, args, kwargs))

    def _build(self, x: QTensor, args: tuple, kwargs: dict):
        fn = self._function(args, kwargs)
        scale = x.scale.detach().cpu()
        out = self.output_scale.detach().cpu()
        if x.qdtype.bits == 8:
            return tables.lut_int8(fn, scale, out, self.out_dtype, self.rounding).to(x.device)
        return tables.build_segment_lut(fn, scale, out, self.out_dtype, self.rounding)

    def function_info(self, args: tuple = (), kwargs: dict | None = None) -> dict[str, Any]:
        """The float function the table tabulates, for the exported node: its registry name
        and constant arguments (what the QDQ form computes in float)."""
        op = self.op
        row = registry.row_for_module(type(op)) if op is not None else None
        name = row.name if row is not None else registry.canonical_key(self.fn)
        if not isinstance(name, str):
            name = getattr(self.fn, "__name__", "unknown")
        names = _FUNCTION_ARGS.get(name, ())
        if op is not None:
            values = {k: getattr(op, k) for k in names if hasattr(op, k)}
        else:
            values = dict(zip(names, args))
            values.update({k: v for k, v in (kwargs or {}).items() if k != "inplace"})
        values = {k: v for k, v in values.items() if isinstance(v, (int, float, str))}
        return {"function": name, "function_args": values}

    def forward(self, x: QTensor, *args: Any, **kwargs: Any) -> QTensor:
        args = tuple(a for a in args if not isinstance(a, bool))  # inplace flags
        table = self.table(x, args, kwargs)
        info = lambda: self.function_info(args, kwargs)  # noqa: E731 (asked for on export)
        if x.qdtype.bits == 8:
            return self.wrap(tables.lut(x.values(), table, info))
        return self.wrap(tables.segment_lut(x.values(), table, self.rounding, info))


#: the constant arguments of a tabulated function that its exported node names
_FUNCTION_ARGS = {
    "leaky_relu": ("negative_slope",),
    "elu": ("alpha",),
    "softplus": ("beta", "threshold"),
    "gelu": ("approximate",),
}


@dataclass(frozen=True)
class PReLUPlan:
    """What PReLU computes with for one input scale.

    Attributes:
        multiplier, shift: the positive side, ``~ s_x / s_y``.
        neg_multiplier, neg_shift: per channel (or one), ``~ |a[c]| s_x / s_y`` (0 for ``a = 0``).
        neg_sign: per channel, ``sign(a[c])`` as -1 / 1 (float32).
    """

    multiplier: Tensor
    shift: Tensor
    neg_multiplier: Tensor
    neg_shift: Tensor
    neg_sign: Tensor


class PReLU(FunctionalQuantized):
    """Integer ``nn.PReLU`` / ``nn.LeakyReLU`` / ``F.leaky_relu``: both sides requantized to the output scale, the slope ``a[c]``
    (channel axis 1, or 0 for 1-d inputs) held in the negative side's multiplier; exact.

    Buffers:
        slope: the float slopes ``a`` (one, or one per channel).
    """

    def __init__(self, qat: nn.Module) -> None:
        super().__init__(qat)
        op = qat.op
        if isinstance(op, nn.PReLU):
            slope = op.weight.detach().reshape(-1).float()
        elif isinstance(op, nn.LeakyReLU):
            slope = torch.tensor([float(op.negative_slope)])
        else:  # F.leaky_relu: the slope is an argument of each call
            slope = torch.tensor([float("nan")])
        if op is not None:
            require_finite(qat, {"PReLU weight": slope})
        self.register_buffer("slope", slope.clone())

    def call_slope(self, args: tuple, kwargs: dict) -> float | None:
        """``F.leaky_relu``'s ``negative_slope`` (None for the module forms)."""
        if self.op is not None:
            return None
        args = tuple(a for a in args if not isinstance(a, bool))
        return float(args[0] if args else kwargs.get("negative_slope", 0.01))

    def plan(self, x: QTensor, slope: float | None = None) -> PReLUPlan:
        """The plan for ``x``'s scale (cached per scale and call slope)."""
        (s_x,) = self.scale_values(x)
        return self.derived((s_x, slope), lambda: self._derive(x.scale, slope))

    def _derive(self, s_x: Tensor, slope: float | None = None) -> PReLUPlan:
        s_y = self.output_scale.to(torch.float64)
        ratio = qf.scale_ratio(s_x, s_y).reshape(1).cpu()
        scales = {"input": s_x, "output": s_y}
        m, s = multiplier_for(self, ratio, scales)
        a = self.slope.detach().to(torch.float64).cpu()
        if slope is not None:
            a = torch.tensor([slope], dtype=torch.float64)
        zero = a == 0
        real = torch.where(zero, torch.ones_like(a), a.abs()) * ratio
        n, t = multiplier_for(self, real, {**scales, "slope": self.slope})
        n = torch.where(zero, torch.zeros_like(n), n)
        sign = torch.where(a < 0, -1.0, 1.0).to(torch.float32)
        return PReLUPlan(m, s, n, t, sign)

    @staticmethod
    def channel_axis(x: QTensor) -> int:
        return 1 if x.dim() >= 2 else 0

    def forward(self, x: QTensor, *args: Any, **kwargs: Any) -> QTensor:
        kwargs.pop("inplace", None)
        plan = self.plan(x, self.call_slope(args, kwargs))
        y = requant.prelu(
            x.values(),
            plan.multiplier,
            plan.shift,
            plan.neg_multiplier,
            plan.neg_shift,
            plan.neg_sign,
            self.channel_axis(x),
            self.out_dtype,
            self.rounding,
        )
        return self.wrap(y)
