"""Base of the integer twins of functional ops (``+``, cat, pooling, LUTs...)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from fxq.dtypes import QDType, as_qdtype
from fxq.qtensor import QTensor
from fxq.quantized import functional as qf
from fxq.quantized.base import QuantizedModule, check_input, multiplier_for, warn_rescaled

__all__ = ["FunctionalQuantized"]


class FunctionalQuantized(QuantizedModule):
    """Holds the output scale / dtype and the float op (module or function) of its QAT twin.

    The forward signature is that of the original op, with QTensors where it
    took quantized tensors. Every factor is derived from the scales the input
    QTensors carry (and cached per scale), so an input at another scale than
    at convert computes what a model converted for that scale computes; the
    first such input warns once, naming the layer and both scales.

    Buffers:
        output_scale: the output scale.
        input_scales: the per-tensor scale of each tensor input at convert (in
            flattened argument order; NaN where unknown), used only for that
            warning. A state_dict without it (saved by an older fxq) loads.
    """

    def __init__(self, qat: nn.Module) -> None:
        super().__init__(qat.march, getattr(qat, "name", ""))
        fq = qat.activation_post_process
        self.register_buffer("output_scale", fq.scale.detach().clone().reshape(1))
        self.out_dtype_name = fq.dtype.name
        self.fn = qat.fn
        self.op = qat.op
        self.input_dtype_names = [q.dtype.name if q is not None else None for q in qat.input_quants]
        scales = [
            float("nan") if q.is_high_precision or q.scale.numel() != 1 else float(q.scale)
            for q in qat.input_quants
            if q is not None
        ]
        self.register_buffer("input_scales", torch.tensor(scales, dtype=torch.float32))

    @classmethod
    def from_qat(cls, qat: nn.Module) -> FunctionalQuantized:
        return cls(qat)

    @property
    def out_dtype(self) -> QDType:
        return as_qdtype(self.out_dtype_name)

    def float_op(self) -> Callable[..., Any]:
        return self.op if self.op is not None else self.fn

    def scale_values(self, *inputs: QTensor) -> tuple[float, ...]:
        """The per-tensor scales of the QTensor inputs as floats (cache keys).

        Warns once (``warn_rescaled``) when one differs from its scale at convert.

        Raises:
            TypeError / ValueError: an input is not a per-tensor QTensor.
        """
        values = tuple(qf.host_float(check_input(self, t, i).scale) for i, t in enumerate(inputs))
        if self.__dict__.get("_warned_rescaled"):
            return values
        expected = self.derived(("input_scales",), lambda: tuple(self.input_scales.tolist()))
        if len(expected) == len(values):
            for i, (was, now) in enumerate(zip(expected, values)):
                if was == was and was != now:  # NaN: unknown
                    warn_rescaled(self, i, was, now)
                    break
        return values

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ) -> None:
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
        )
        if prefix + "input_scales" in missing_keys:  # saved before fxq recorded them
            missing_keys.remove(prefix + "input_scales")

    def wrap(self, q: Tensor) -> QTensor:
        return QTensor(q, self.output_scale, self.out_dtype)

    def rescale(self, s_x: Tensor) -> tuple[Tensor, Tensor]:
        """Multiplier and shift that move an input of scale ``s_x`` onto the output grid
        (``M 2**-S ~ s_x / s_y``): what cat, stack, maximum / minimum and where do to each
        operand whose scale or dtype is not the output's, and what their export rules emit.

        Raises:
            fxq.quantized.functional.MultiplierRangeError: the ratio does not fit the march's
                multiplier (the message names the layer and both scales).
        """
        s_y = self.output_scale
        return multiplier_for(self, qf.scale_ratio(s_x, s_y), {"input": s_x, "output": s_y})

    def extra_repr(self) -> str:
        name = getattr(self.fn, "__name__", None)
        fn = f"fn={name}, " if name else ""
        return f"{fn}out={self.out_dtype_name} at {self.output_scale.item():.6g}"
