"""fxq's integer primitives, one module per family (DESIGN.md, "Integer primitives").

``PRIMITIVES`` maps each IR op defined here to its numpy kernel, ONNX lowerings and file
schema; the torch kernels are the functions the integer modules' ``forward`` call (torch is
optional: without it only the numpy side loads). ``fxq.primitives.core`` says how export
records the calls.
"""

from fxq.primitives import (
    accumulate,
    elementwise,
    movement,
    normalization,
    requant,
    select,
    table,
    weighted,
    window,
)
from fxq.primitives.core import PRIMITIVES, Call, Primitive, is_recording, record, recording

__all__ = [
    "PRIMITIVES",
    "Primitive",
    "Call",
    "record",
    "recording",
    "is_recording",
    "accumulate",
    "elementwise",
    "movement",
    "normalization",
    "requant",
    "select",
    "table",
    "weighted",
    "window",
]
