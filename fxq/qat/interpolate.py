"""Resampling that makes new values (bilinear); nearest resampling keeps the
input's scale and needs no module."""

from __future__ import annotations

from fxq.qat.base import FunctionalQAT

__all__ = ["Interpolate"]


class Interpolate(FunctionalQAT):
    """``F.interpolate`` / ``nn.Upsample`` in a mode that interpolates (bilinear, linear)."""
