"""Quantized data types.

fxq quantizes symmetrically with zero point 0, so a quantized dtype is fully
described by its bit width: the integer range and the torch storage dtype
follow from it.

>>> qint8.qmin, qint8.qmax, qint8.storage
(-128, 127, torch.int8)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["QDType", "qint8", "qint16", "qint32", "as_qdtype"]


@dataclass(frozen=True)
class QDType:
    """A signed integer quantization type.

    Attributes:
        name: ``"qint8"``, ``"qint16"`` or ``"qint32"``.
        bits: bit width.
        storage: the torch integer dtype that holds the values.
    """

    name: str
    bits: int
    storage: torch.dtype

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def __repr__(self) -> str:
        return f"fxq.{self.name}"

    def __reduce__(self):
        # Pickle by name so that loading a saved model gives the module-level
        # singletons back (identity comparisons keep working).
        return (as_qdtype, (self.name,))


qint8 = QDType("qint8", 8, torch.int8)
qint16 = QDType("qint16", 16, torch.int16)
qint32 = QDType("qint32", 32, torch.int32)

_BY_NAME = {d.name: d for d in (qint8, qint16, qint32)}
_BY_TORCH = {
    torch.int8: qint8,
    torch.qint8: qint8,
    torch.int16: qint16,
    torch.int32: qint32,
    torch.qint32: qint32,
}


def as_qdtype(value: QDType | str | torch.dtype) -> QDType:
    """Normalise ``value`` (a QDType, its name, or a torch dtype) to a QDType.

    Raises:
        ValueError: if ``value`` names no supported quantized dtype.
    """
    if isinstance(value, QDType):
        return value
    if isinstance(value, str) and value in _BY_NAME:
        return _BY_NAME[value]
    if isinstance(value, torch.dtype) and value in _BY_TORCH:
        return _BY_TORCH[value]
    raise ValueError(
        f"unsupported quantized dtype {value!r}; use one of fxq.qint8, fxq.qint16, fxq.qint32"
    )
