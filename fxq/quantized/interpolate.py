"""Integer (bi)linear resampling with fixed-point weights.

Source coordinates follow ``F.interpolate``; each neighbour's weight is a
multiple of ``2**-8`` (``linear_weights``). For 2-d:
``acc = sum_{a,b} X[i_a, j_b] * wy_a * wx_b`` (units of ``2**-16``), then
``Y = clamp(shift_round(acc * M, S))`` with ``M 2**-S ~ s_x / (2**16 s_y)``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fxq.primitives import requant, window
from fxq.qtensor import QTensor
from fxq.quantized import functional as qf
from fxq.quantized.base import multiplier_for
from fxq.quantized.ops_base import FunctionalQuantized

__all__ = ["Interpolate"]

_PARAMS = ("size", "scale_factor", "mode", "align_corners", "recompute_scale_factor", "antialias")


def _resample_axis(
    x: Tensor, axis: int, out_size: int, scale: float | None, align_corners: bool
) -> Tensor:
    i0, i1, w1 = qf.linear_weights(x.shape[axis], out_size, scale, align_corners, x.device)
    shape = [1] * x.dim()
    shape[axis] = out_size
    w1 = w1.to(torch.float64).reshape(shape)
    w0 = float(1 << qf.INTERP_FRACTION_BITS) - w1
    return x.index_select(axis, i0) * w0 + x.index_select(axis, i1) * w1


class Interpolate(FunctionalQuantized):
    """Integer ``F.interpolate`` / ``nn.Upsample`` in ``linear`` or ``bilinear`` mode."""

    def _arguments(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        if self.op is not None:
            m = self.op
            params = {k: getattr(m, k, None) for k in _PARAMS}
        else:
            params = dict.fromkeys(_PARAMS)
            params["mode"] = "nearest"
            params.update(zip(_PARAMS, args))
            params.update(kwargs)
        return params

    def _derive(self, s_x: Tensor, dims: int) -> tuple[Tensor, Tensor]:
        """``M * 2**-S ~ s_x / (2**(8 * dims) * s_y)``."""
        s_y = self.output_scale.to(torch.float64)
        real = s_x.to(torch.float64) / (float(1 << (qf.INTERP_FRACTION_BITS * dims)) * s_y)
        return multiplier_for(self, real, {"input": s_x, "output": s_y})

    def requantization(self, x: QTensor) -> tuple[Tensor, Tensor]:
        """Multiplier and shift of the output (``M 2**-S ~ s_x / (2**(8 d) s_y)`` for the
        ``d = x.dim() - 2`` resampled axes) for ``x``'s scale (cached per scale).

        Raises:
            TypeError / ValueError: ``x`` is not a per-tensor QTensor.
        """
        dims = x.dim() - 2
        (s_x,) = self.scale_values(x)
        return self.derived((s_x, dims), lambda: self._derive(x.scale, dims))

    def plan(
        self, in_sizes: list[int], args: tuple, kwargs: dict
    ) -> tuple[list[int], list[float | None], bool]:
        """Output sizes, the scale factor torch uses per axis (None: from the sizes) and
        ``align_corners`` for a call with these arguments (shared with ``fxq.export``).

        Raises:
            ValueError: for a mode other than linear / bilinear, or antialias.
        """
        p = self._arguments(args, kwargs)
        if p["mode"] not in ("linear", "bilinear") or p.get("antialias"):
            raise ValueError(
                f"integer interpolation supports linear / bilinear without antialias, got {p}"
            )
        dims = len(in_sizes)
        sf = p["scale_factor"]
        sfs = (
            [sf] * dims
            if isinstance(sf, (int, float))
            else (list(sf) if sf is not None else [None] * dims)
        )
        if p["size"] is not None:
            size = p["size"]
            out_sizes = [size] * dims if isinstance(size, int) else list(size)
            scales: list[float | None] = [None] * dims
        else:
            out_sizes = [int(math.floor(n * f)) for n, f in zip(in_sizes, sfs)]
            scales = [None if p["recompute_scale_factor"] else float(f) for f in sfs]
        return out_sizes, scales, bool(p["align_corners"])

    def forward(self, x: QTensor, *args: Any, **kwargs: Any) -> QTensor:
        dims = x.dim() - 2
        out_sizes, scales, align = self.plan(list(x.shape[2:]), args, kwargs)
        acc = x.values().to(torch.float64)
        for d in range(dims):
            acc = _resample_axis(acc, 2 + d, out_sizes[d], scales[d], align)
        in_sizes = list(x.shape[2:])
        window.record_window_sums(
            x.values(),
            acc,
            range(2, 2 + dims),
            lambda: [_weight_matrix(*a, align) for a in zip(in_sizes, out_sizes, scales)],
        )
        m, s = self.requantization(x)
        return self.wrap(requant.requantize(acc, m, s, self.out_dtype, self.rounding))


def _weight_matrix(n: int, o: int, scale: float | None, align_corners: bool) -> np.ndarray:
    """The ``[n, o]`` integer matrix of one axis's neighbour weights (units of ``2**-F``):
    what ``_resample_axis`` sums, as an ``axis_matmul`` matrix."""
    i0, i1, w1 = qf.linear_weights(n, o, scale, align_corners, "cpu")
    one = 1 << qf.INTERP_FRACTION_BITS
    a = np.zeros((n, o), dtype=np.int64)
    for j in range(o):
        a[int(i0[j]), j] += one - int(w1[j])
        a[int(i1[j]), j] += int(w1[j])
    return a
