"""Integer ``F.grid_sample`` (4-d input, 2-d grid): fixed-point sampling coordinates,
integer bilinear weights, an exact int64 gather-and-sum and one requantization.

The grid (normalized coordinates, a per-tensor QTensor ``G * s_g``) becomes a pixel
coordinate with ``F = INTERP_FRACTION_BITS`` fraction bits (``docs/arithmetic.md``,
"grid_sample")::

    P = shift_round_signed(G * m_c, sh_c) + (n - 1) * 2**(F-1),
    m_c * 2**-sh_c ~ s_g * span * 2**(F-1),   span = n (align_corners=False) or n - 1

``bilinear``: ``i0 = P >> F``, ``w1 = P & (2**F - 1)``, ``w0 = 2**F - w1`` per axis;
``acc = sum X[iy, ix] * wy * wx`` (units of ``2**-2F``, neighbours outside the input
are 0 for ``padding_mode="zeros"``; ``"border"`` clamps ``P`` to ``[0, (n-1) 2**F]``
first), ``Y = clamp(shift_round(acc * M, S))`` with ``M 2**-S ~ s_x / (2**2F s_y)``.
``nearest``: ``i = shift_round(P, F)`` and ``acc = X[iy, ix]`` requantized by
``s_x / s_y`` (the identity where the output scale is the input's).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fxq.march import Rounding
from fxq.primitives import requant, window
from fxq.qtensor import QTensor
from fxq.quantized import functional as qf
from fxq.quantized.base import multiplier_for
from fxq.quantized.ops_base import FunctionalQuantized

__all__ = ["GridSample", "MODES", "PADDING_MODES", "grid_arguments", "sample_coordinates"]

#: the modes and padding modes with an integer implementation
MODES = ("bilinear", "nearest")
PADDING_MODES = ("zeros", "border")
_PARAMS = ("mode", "padding_mode", "align_corners")
_DEFAULTS = {"mode": "bilinear", "padding_mode": "zeros", "align_corners": False}


def grid_arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    """``mode`` / ``padding_mode`` / ``align_corners`` of a call ``grid_sample(x, grid, *args,
    **kwargs)`` (``align_corners=None`` is torch's default, False).

    Raises:
        ValueError: a mode or padding mode without an integer implementation.
    """
    p = dict(_DEFAULTS)
    p.update(zip(_PARAMS, args))
    p.update({k: v for k, v in kwargs.items() if k in _PARAMS})
    p["align_corners"] = bool(p["align_corners"])
    if p["mode"] not in MODES or p["padding_mode"] not in PADDING_MODES:
        raise ValueError(
            f"integer grid_sample supports mode {MODES} and padding_mode {PADDING_MODES}, got {p}"
        )
    return p


def coordinate_factor(s_g: Tensor, size: int, align_corners: bool) -> Tensor:
    """The real factor ``s_g * span * 2**(F-1)`` from grid integers to fixed-point pixels."""
    span = size - 1 if align_corners else size
    return s_g.to(torch.float64).reshape(()) * float(span << (qf.INTERP_FRACTION_BITS - 1))


def sample_coordinates(
    g: Tensor, multiplier: Tensor, shift: Tensor, size: int, rounding: Rounding
) -> Tensor:
    """Fixed-point pixel coordinates ``P`` (``F`` fraction bits) of int64 grid integers ``g``."""
    offset = (size - 1) << (qf.INTERP_FRACTION_BITS - 1)
    return qf.shift_round_signed(g * multiplier, shift, rounding) + offset


def _gather(x: Tensor, iy: Tensor, ix: Tensor, border: bool) -> Tensor:
    """``x[n, c, iy, ix]`` (int64 x: (N, C, H, W); iy / ix: (N, Ho, Wo)); 0 outside when not
    ``border``."""
    n, c, h, w = x.shape
    valid = (iy >= 0) & (iy < h) & (ix >= 0) & (ix < w)
    index = iy.clamp(0, h - 1) * w + ix.clamp(0, w - 1)
    index = index.reshape(n, 1, -1).expand(n, c, -1)
    out = x.reshape(n, c, h * w).gather(2, index).reshape(n, c, *iy.shape[1:])
    return out if border else out * valid.unsqueeze(1).to(out.dtype)


def grid_sample_sum(
    x: Tensor, px: Tensor, py: Tensor, mode: str, padding_mode: str, rounding: Rounding
) -> Tensor:
    """The exact int64 accumulator: bilinear in units of ``2**-2F``, nearest in units of 1.

    Args:
        x: int64 (N, C, H, W) input integers.
        px, py: int64 (N, Ho, Wo) fixed-point coordinates (``sample_coordinates``).
    """
    bits = qf.INTERP_FRACTION_BITS
    h, w = x.shape[-2:]
    border = padding_mode == "border"
    if border:
        px = px.clamp(0, (w - 1) << bits)
        py = py.clamp(0, (h - 1) << bits)
    if mode == "nearest":
        return _gather(
            x, qf.shift_round(py, bits, rounding), qf.shift_round(px, bits, rounding), border
        )
    one = 1 << bits
    x0, y0 = px >> bits, py >> bits
    wx1, wy1 = px & (one - 1), py & (one - 1)
    wx0, wy0 = one - wx1, one - wy1
    acc = torch.zeros((), dtype=torch.int64, device=x.device)
    for iy, wy in ((y0, wy0), (y0 + 1, wy1)):
        for ix, wx in ((x0, wx0), (x0 + 1, wx1)):
            acc = acc + _gather(x, iy, ix, border) * (wy * wx).unsqueeze(1)
    return acc


class GridSample(FunctionalQuantized):
    """Integer ``F.grid_sample`` (bilinear / nearest; zeros / border padding) on a 4-d
    QTensor input and a QTensor grid."""

    def _coordinate_factor(self, grid: QTensor, size: int, align: bool) -> tuple[Tensor, Tensor]:
        """The multiplier and shift from grid integers to fixed-point pixels of an axis of
        ``size`` (cached per grid scale)."""
        return self.derived(
            ("grid", float(grid.scale), size, align),
            lambda: multiplier_for(
                self,
                coordinate_factor(grid.scale, size, align),
                {"grid": grid.scale},
                left_shift=True,
            ),
        )

    def _coordinates(self, grid: QTensor, size: int, axis: int, align: bool) -> Tensor:
        m, s = self._coordinate_factor(grid, size, align)
        g = grid.values()[..., axis].to(torch.int64)
        return sample_coordinates(g, m.to(g.device), s.to(g.device), size, self.rounding)

    def output_factor(self, s_x: Tensor, mode: str) -> tuple[Tensor, Tensor]:
        """``M * 2**-S ~ s_x / (2**(2F) s_y)`` (bilinear) or ``s_x / s_y`` (nearest)."""
        s_y = self.output_scale.to(torch.float64)
        bits = 0 if mode == "nearest" else 2 * qf.INTERP_FRACTION_BITS
        real = s_x.to(torch.float64) / (float(1 << bits) * s_y)
        return multiplier_for(self, real, {"input": s_x, "output": s_y})

    def forward(self, x: QTensor, grid: QTensor, *args: Any, **kwargs: Any) -> QTensor:
        p = grid_arguments(args, kwargs)
        if x.dim() != 4 or grid.dim() != 4 or grid.shape[-1] != 2:
            raise ValueError(
                f"{self.name or 'grid_sample'}: integer grid_sample takes a 4-d input and an "
                f"(N, H, W, 2) grid, got {tuple(x.shape)} and {tuple(grid.shape)}"
            )
        (s_x, _) = self.scale_values(x, grid)
        h, w = x.shape[-2:]
        align = p["align_corners"]
        px = self._coordinates(grid, w, 0, align)
        py = self._coordinates(grid, h, 1, align)
        acc = grid_sample_sum(
            x.values().to(torch.int64), px, py, p["mode"], p["padding_mode"], self.rounding
        ).to(torch.float64)
        attrs = {
            "mode": p["mode"],
            "padding_mode": p["padding_mode"],
            "align_corners": align,
            "fraction_bits": qf.INTERP_FRACTION_BITS,
            "grid_scale": float(grid.scale),
            "rounding": self.rounding.value,
        }

        def coordinates() -> dict[str, Tensor]:
            out = {}
            for axis, size in (("x", w), ("y", h)):
                m, s = self._coordinate_factor(grid, size, align)
                out[f"multiplier_{axis}"], out[f"shift_{axis}"] = m.long(), s.long()
            return out

        window.record_grid_sample(x.values(), grid.values(), acc, attrs, coordinates)
        m, s = self.derived((s_x, p["mode"]), lambda: self.output_factor(x.scale, p["mode"]))
        return self.wrap(requant.requantize(acc, m, s, self.out_dtype, self.rounding))
