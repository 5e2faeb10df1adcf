"""``F.grid_sample`` with a quantized input and a quantized grid (bilinear / nearest)."""

from __future__ import annotations

from fxq.qat.base import FunctionalQAT

__all__ = ["GridSample"]


class GridSample(FunctionalQAT):
    """``F.grid_sample``: float in CALIBRATION / QAT (with the output fake quant), the integer
    twin (``fxq.quantized.grid_sample.GridSample``) in VALIDATION."""
