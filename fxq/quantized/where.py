"""Integer ``torch.where(condition, input, other)`` (``docs/arithmetic.md``, "Selection").

``condition`` is a bool tensor (never quantized). Each quantized operand is requantized
to the output scale (``sat(shift_round(X M, S))``, ``M 2**-S ~ s_x / s_y``; kept as it is
when its scale and dtype are the output's), a Python number ``c`` becomes the constant
``sat(round(c / s_y))``; then the select.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fxq.primitives import requant, select
from fxq.qtensor import QTensor
from fxq.quantized import functional as qf
from fxq.quantized.ops_base import FunctionalQuantized

__all__ = ["Where", "where_operands"]


def where_operands(args: tuple, kwargs: dict) -> tuple[Any, Any, Any]:
    """``(condition, input, other)`` of a ``torch.where`` call."""
    names = ("condition", "input", "other")
    values = dict(zip(names, args))
    values.update({k: v for k, v in kwargs.items() if k in names})
    return values.get("condition"), values.get("input"), values.get("other")


class Where(FunctionalQuantized):
    """Integer ``torch.where(condition, input, other)``: both operands on the output grid,
    then the select; ``condition`` a bool tensor."""

    def operand(self, value: Any) -> Tensor | int:
        """``value`` on the output's integer grid: float32 integers, or the integer of a
        Python number."""
        s_y = self.output_scale
        if isinstance(value, QTensor):
            if torch.equal(value.scale, s_y) and value.qdtype is self.out_dtype:
                return value.values()
            (s_x,) = self.scale_values(value)
            m, s = self.derived(("operand", s_x), lambda: self.rescale(value.scale))
            return requant.requantize(
                value.values(), m, s, self.out_dtype, self.rounding, scale=s_y
            )
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return int(self.constant(float(value)))
        raise TypeError(
            f"{self.name or 'where'}: integer torch.where takes quantized tensors or Python "
            f"numbers as input / other, not {type(value).__name__}"
        )

    def constant(self, c: float) -> Tensor:
        """``sat(round(c / s_y))`` as a float32 scalar tensor."""
        value = torch.tensor(c, dtype=torch.float32, device=self.output_scale.device)
        return qf.quantize(value, self.output_scale, self.out_dtype, self.rounding).to(
            torch.float32
        )

    def forward(self, *args: Any, **kwargs: Any) -> QTensor:
        condition, a, b = where_operands(args, kwargs)
        if not isinstance(condition, Tensor) or condition.dtype is not torch.bool:
            raise TypeError(
                f"{self.name or 'where'}: the condition must be a bool tensor, "
                f"not {getattr(condition, 'dtype', type(condition).__name__)}"
            )
        a, b = self.operand(a), self.operand(b)
        return self.wrap(select.where(condition, a, b, self.out_dtype))
