"""Average pooling and mean reductions (they make new values; max pooling does not
and needs no module: it keeps its input's scale).
"""

from __future__ import annotations

from fxq.qat.base import FunctionalQAT

__all__ = ["AvgPool", "AdaptiveAvgPool", "Mean", "Sum"]


class AvgPool(FunctionalQAT):
    """``avg_pool1d/2d/3d`` (module or functional): int32 window sums, one requantization."""


class AdaptiveAvgPool(FunctionalQAT):
    """``adaptive_avg_pool1d/2d/3d`` (module or functional)."""


class Mean(FunctionalQAT):
    """``Tensor.mean`` / ``torch.mean`` over given dims."""


class Sum(FunctionalQAT):
    """``Tensor.sum`` / ``torch.sum`` over given dims."""
