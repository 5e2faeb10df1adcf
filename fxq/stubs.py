"""Float-model stubs that mark where quantization starts and ends.

``QuantStub`` marks a graph input boundary: in the QAT model it becomes a
fake quant (with a fixed scale when one is given, e.g. ``1/128`` for centered
YUV input from a camera pipeline), in the integer model a quantize op.
``DeQuantStub`` marks where the model returns to float. Both are identities
in the float model.
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["QuantStub", "DeQuantStub"]


class QuantStub(nn.Module):
    """Quantize here.

    Args:
        scale: a fixed input scale; None lets the observer choose it.
    """

    _fxq_leaf = True

    def __init__(self, scale: float | None = None) -> None:
        super().__init__()
        if scale is not None and not float(scale) > 0:
            raise ValueError(f"QuantStub scale must be positive, got {scale}")
        self.scale = None if scale is None else float(scale)

    def forward(self, x: Tensor) -> Tensor:
        return x

    def extra_repr(self) -> str:
        return "" if self.scale is None else f"scale={self.scale}"


class DeQuantStub(nn.Module):
    """Return to float here."""

    _fxq_leaf = True

    def forward(self, x: Tensor) -> Tensor:
        return x
