"""Integer softmax and log-softmax over any dim (``docs/arithmetic.md``, section 15).

Subtract the row maximum, ``E = round(2**15 exp(-u s_x))`` by an exp2 table
(``fxq.quantized.functional.softmax_exp``), an exact int sum, then

* softmax: ``Y = round(E * A / (sum E * 2**G))`` with ``A 2**-G ~ 1 / s_y`` (one exact
  integer division per element; the hardware form is a reciprocal table, whose
  rounding this avoids);
* log-softmax: ``Y = shift_round(-(V + L) My, Sy)`` with ``L ~ ln(sum E / 2**15) 2**16``
  from a log table, ``V = shift_round(u Mx, Sx)`` the distance ``u s_x`` in the same
  units (``Mx 2**-Sx ~ s_x 2**16``) and ``My 2**-Sy ~ 2**-16 / s_y``.

The intermediates ``E`` are 16-bit (``2**15`` for the maximum), the sum 32-bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fxq.dtypes import QDType
from fxq.march import Rounding
from fxq.primitives.core import record_built
from fxq.qtensor import QTensor
from fxq.quantized import functional as qf
from fxq.quantized.base import QuantizedModule, multiplier_for
from fxq.quantized.ops_base import FunctionalQuantized

__all__ = ["Softmax", "SoftmaxPlan", "softmax_plan", "integer_softmax", "softmax_dim", "is_log"]

_LOG_FUNCTIONS = (F.log_softmax, torch.log_softmax)


def is_log(op: nn.Module | None, fn: Any) -> bool:
    """Whether the float op is a log-softmax."""
    if op is not None:
        return isinstance(op, nn.LogSoftmax)
    return fn in _LOG_FUNCTIONS or getattr(fn, "__name__", "") == "log_softmax"


def softmax_dim(op: nn.Module | None, args: tuple, kwargs: dict, ndim: int) -> int:
    """The (non-negative) dim of a softmax call; torch's legacy choice when none is given."""
    if op is not None:
        dim = op.dim
    else:
        dim = args[0] if args else kwargs.get("dim")
    if dim is None:  # torch.nn.functional._get_softmax_dim
        dim = 0 if ndim in (0, 1, 3) else 1
    return int(dim) % max(ndim, 1)


@dataclass(frozen=True)
class SoftmaxPlan:
    """Constants of one (log-)softmax for one input scale.

    Attributes:
        exp_multiplier, exp_shift: ``m 2**-S ~ s_x / ln 2 * 2**P`` (the shift may be negative).
        out_multiplier, out_shift: softmax: ``A 2**-G ~ 1 / s_y`` (``G`` may be negative);
            log-softmax: ``My 2**-Sy ~ 2**-16 / s_y``.
        log_multiplier, log_shift: log-softmax only: ``Mx 2**-Sx ~ s_x 2**16``.
    """

    exp_multiplier: int
    exp_shift: int
    out_multiplier: int
    out_shift: int
    log_multiplier: int | None = None
    log_shift: int | None = None


def softmax_plan(module: QuantizedModule, s_x: Tensor, s_y: Tensor, log: bool) -> SoftmaxPlan:
    """The plan for input scale ``s_x`` and output scale ``s_y`` (errors name ``module``)."""
    s_x64 = s_x.detach().double().cpu().reshape(1)
    s_y64 = s_y.detach().double().cpu().reshape(1)
    real = s_x64 / torch.log(torch.tensor(2.0, dtype=torch.float64)) * 2.0**qf.EXP_FRACTION_BITS
    m_e, k_e = qf.quantize_multiplier(real, module.spec, left_shift=True)
    if not log:
        a, g = multiplier_for(module, 1.0 / s_y64, {"output": s_y64}, left_shift=True)
        return SoftmaxPlan(int(m_e), int(k_e), int(a), int(g))
    unit = 2.0**qf.LOG_FRACTION_BITS
    m_x, k_x = qf.quantize_multiplier(s_x64 * unit, module.spec, left_shift=True)
    m_y, k_y = multiplier_for(module, 1.0 / (s_y64 * unit), {"output": s_y64})
    return SoftmaxPlan(int(m_e), int(k_e), int(m_y), int(k_y), int(m_x), int(k_x))


def integer_softmax(
    x: Tensor,
    dim: int,
    plan: SoftmaxPlan,
    out_dtype: QDType,
    rounding: Rounding,
    log: bool = False,
    keep: Tensor | None = None,
) -> Tensor:
    """(Log-)softmax of the integers ``x`` along ``dim``; returns int64 in ``out_dtype``'s range.

    Args:
        keep: optional bool mask broadcastable against ``x``: False entries are left out
            (probability 0; a row with no entry left gives 0 everywhere).
    """
    xi = x.to(torch.int64)
    if keep is not None:
        low = torch.full((), torch.iinfo(torch.int64).min // 4, dtype=torch.int64, device=x.device)
        xi = torch.where(keep, xi, low)
    mx = xi.amax(dim, keepdim=True)
    u = mx - xi
    if keep is not None:
        u = torch.where(keep, u, torch.zeros((), dtype=torch.int64, device=x.device))
    e = qf.softmax_exp(u, plan.exp_multiplier, plan.exp_shift, rounding)
    if keep is not None:
        e = torch.where(keep, e, torch.zeros((), dtype=torch.int64, device=x.device))
    total = e.sum(dim, keepdim=True)
    if log:
        lg = qf.integer_log(total, rounding) - qf.EXP_ONE_BITS * qf.LN2_FIXED
        v = qf.shift_round_signed(u * plan.log_multiplier, plan.log_shift, rounding)
        y = qf.shift_round(-(v + lg) * plan.out_multiplier, plan.out_shift, rounding)
    else:
        num = e * (plan.out_multiplier << max(-plan.out_shift, 0))
        den = total.clamp(min=1) << max(plan.out_shift, 0)
        y = qf.divide_round(num, den)
    return y.clamp_(out_dtype.qmin, out_dtype.qmax)


def softmax_node(
    plan: SoftmaxPlan, log: bool, axis: int, rounding: str, dtype: str
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The attributes and arrays of an exported ``softmax`` node computing with ``plan``
    (``fxq.primitives.normalization``)."""
    attrs: dict[str, Any] = {
        "axis": axis,
        "log": log,
        "causal": False,
        "exp_multiplier": plan.exp_multiplier,
        "exp_shift": plan.exp_shift,
        "exp_fraction_bits": qf.EXP_FRACTION_BITS,
        "out_multiplier": plan.out_multiplier,
        "out_shift": plan.out_shift,
        "log_multiplier": plan.log_multiplier,
        "log_shift": plan.log_shift,
        "dtype": dtype,
        "rounding": rounding,
    }
    params = {"exp2_table": qf.exp2_table().long()}
    if log:
        attrs.update(
            log_index_bits=qf.LOG_INDEX_BITS,
            log_offset=-qf.EXP_ONE_BITS * qf.LN2_FIXED,
            ln2=qf.LN2_FIXED,
        )
        params["log_table"] = qf.log_table().long()
    return attrs, params


class Softmax(FunctionalQuantized):
    """Integer ``softmax`` / ``log_softmax`` over any dim (module, function or method)."""

    @property
    def log(self) -> bool:
        return is_log(self.op, self.fn)

    def plan(self, x: QTensor) -> SoftmaxPlan:
        (s_x,) = self.scale_values(x)
        log = self.log
        return self.derived((s_x, log), lambda: softmax_plan(self, x.scale, self.output_scale, log))

    def forward(self, x: QTensor, *args: Any, **kwargs: Any) -> QTensor:
        dim = softmax_dim(self.op, args, kwargs, x.dim())
        plan = self.plan(x)
        y = integer_softmax(x.values(), dim, plan, self.out_dtype, self.rounding, self.log)
        y = y.to(torch.float32)
        dt, r = self.out_dtype_name[1:], self.rounding.value
        record_built(
            "softmax",
            [x.values()],
            y,
            dt,
            lambda: softmax_node(plan, self.log, dim, r, dt),
            axis0="not_batch" if dim == 0 else "any",
        )
        return self.wrap(y)
