"""Base of the integer twins of functional ops (``+``, cat, pooling, LUTs...)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from fxq.dtypes import QDType, as_qdtype
from fxq.qtensor import QTensor
from fxq.quantized.base import QuantizedModule

__all__ = ["FunctionalQuantized"]


class FunctionalQuantized(QuantizedModule):
    """Holds the output scale / dtype and the float op (module or function) of its QAT twin.

    The forward signature is that of the original op, with QTensors where it
    took quantized tensors.
    """

    def __init__(self, qat: nn.Module) -> None:
        super().__init__(qat.march)
        fq = qat.activation_post_process
        self.register_buffer("output_scale", fq.scale.detach().clone().reshape(1))
        self.out_dtype_name = fq.dtype.name
        self.fn = qat.fn
        self.op = qat.op
        self.input_dtype_names = [q.dtype.name if q is not None else None for q in qat.input_quants]

    @classmethod
    def from_qat(cls, qat: nn.Module) -> FunctionalQuantized:
        return cls(qat)

    @property
    def out_dtype(self) -> QDType:
        return as_qdtype(self.out_dtype_name)

    def float_op(self) -> Callable[..., Any]:
        return self.op if self.op is not None else self.fn

    def wrap(self, q: Tensor) -> QTensor:
        return QTensor(q, self.output_scale, self.out_dtype)

    def extra_repr(self) -> str:
        name = getattr(self.fn, "__name__", None)
        fn = f"fn={name}, " if name else ""
        return f"{fn}out={self.out_dtype_name} at {self.output_scale.item():.6g}"
