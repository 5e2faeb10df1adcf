"""QAT quantize stub: the fake quant at a float -> quantized boundary."""

from __future__ import annotations

from torch import Tensor

from fxq.dtypes import qint32
from fxq.qat.base import QATModule
from fxq.qconfig import QConfig

__all__ = ["QuantStub"]


class QuantStub(QATModule):
    """Fake-quantizes a float input (a model input or a float region's output).

    Args:
        qconfig: its activation factory gives the dtype and observer.
        scale: a fixed scale (``fxq.QuantStub(scale=...)``); None observes.
    """

    def __init__(self, qconfig: QConfig, scale: float | None = None) -> None:
        if qconfig.activation_dtype is qint32:
            raise ValueError(
                "a quantize stub cannot use a high-precision (int32) qconfig; "
                "give the stub an 8- or 16-bit qconfig"
            )
        if scale is not None:
            qconfig = QConfig(
                activation=qconfig.activation.with_args(scale=float(scale)), weight=qconfig.weight
            )
        super().__init__(qconfig)
        self.fixed_scale = scale

    def forward(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor):  # a Python number taken for a tensor: nothing to quantize
            return x
        return self.quantize_output(x)

    def extra_repr(self) -> str:
        fixed = f"scale={self.fixed_scale}, " if self.fixed_scale is not None else ""
        return fixed + super().extra_repr()
