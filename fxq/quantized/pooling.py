"""Integer average pooling and mean / sum reductions.

Window sums are exact; each output divides by its window's element count
``d`` (as torch counts it, padding rules included) through the multiplier
``M_d 2**-S_d ~ s_x / (d s_y)``: ``Y = clamp(shift_round(sum * M_d, S_d))``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fxq.primitives import window
from fxq.primitives.core import is_recording
from fxq.qtensor import QTensor
from fxq.quantized import functional as qf
from fxq.quantized.base import multiplier_for
from fxq.quantized.ops_base import FunctionalQuantized

__all__ = [
    "AVG_POOL_PARAMS",
    "AvgPool",
    "AdaptiveAvgPool",
    "Mean",
    "Sum",
    "reduce_dims",
    "window_sums_adaptive",
]

_AVG = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
_AVG_MODULES = {1: nn.AvgPool1d, 2: nn.AvgPool2d, 3: nn.AvgPool3d}
_ADAPTIVE = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}
_ADAPTIVE_MODULES = {1: nn.AdaptiveAvgPool1d, 2: nn.AdaptiveAvgPool2d, 3: nn.AdaptiveAvgPool3d}


def _requant_by_count(
    module: FunctionalQuantized, sums: Tensor, counts: Tensor, x: QTensor
) -> QTensor:
    """``clamp(shift_round(sums * M_d, S_d))`` with one multiplier per distinct count ``d``
    (``fxq.primitives.window.requantize_by_count``).

    ``counts`` broadcasts against ``sums`` and depends on shapes only, never on the
    input's values (under ``torch.export`` it is a constant; see ``fxq.quantized.base``).
    """
    (s_x,) = module.scale_values(x)
    counts = counts.to(torch.float64).cpu()  # on the host already where it is made

    def plan() -> tuple[Tensor, Tensor]:
        distinct, inverse = torch.unique(counts, return_inverse=True)
        m, s = _count_plan(module, x.scale, distinct)
        if distinct.numel() > 1:
            return m[inverse], s[inverse]
        # one count: one factor, of no more axes than ``counts`` (a whole-tensor sum's is
        # 0-d, which keeps its output 0-d, as the float op's)
        one = [1] * counts.dim()
        return m.reshape(one), s.reshape(one)

    # one factor per output element, kept on the device (no copy to it per call)
    key = ("counts", s_x, str(sums.device), tuple(counts.shape), counts.numpy().tobytes())

    def factor() -> Tensor:
        m, s = plan()
        return qf.ldexp(m, -s).to(sums.device)

    def by_count(n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The multiplier and shift for other element counts (a mean over dynamic dims)."""
        m, s = _count_plan(module, x.scale, torch.from_numpy(n))
        return m.numpy().astype(np.int64).reshape(-1), s.numpy().astype(np.int64).reshape(-1)

    r = module.derived(key, factor)
    # an export reads the count table only where one count serves every output
    one_count = is_recording() and bool((counts == counts.reshape(-1)[0]).all())
    q = window.requantize_by_count(
        sums, r, module.out_dtype, module.rounding, plan, by_count if one_count else None
    )
    return module.wrap(q)


def _count_plan(module: FunctionalQuantized, s_x: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """The multiplier and shift (``M_d 2**-S_d ~ s_x / (d s_y)``) for each window element
    count ``d`` (float64 counts on the host)."""
    s_y = module.output_scale.to(torch.float64).cpu()
    real = s_x.to(torch.float64).cpu() / (counts.to(torch.float64) * s_y)
    return multiplier_for(module, real, {"input": s_x, "output": s_y})


def _pool_dims(module: FunctionalQuantized, ops: dict[int, Any], modules: dict[int, type]) -> int:
    """1, 2 or 3: how many spatial dims the pooling op works on (0 when unknown)."""
    for dims, cls in modules.items():
        if isinstance(module.op, cls):
            return dims
    for dims, fn in ops.items():
        if module.fn is fn:
            return dims
    return 0


#: torch's ``avg_pool1d/2d/3d`` arguments after the input, in order
AVG_POOL_PARAMS = (
    "kernel_size",
    "stride",
    "padding",
    "ceil_mode",
    "count_include_pad",
    "divisor_override",
)
_AVG_DEFAULTS = {
    "stride": None,
    "padding": 0,
    "ceil_mode": False,
    "count_include_pad": True,
    "divisor_override": None,
}


def _as_2d(value: Any) -> Any:
    """A 1-d pooling parameter as the matching 2-d one (height 1)."""
    if value is None or isinstance(value, bool):
        return value
    v = value[0] if isinstance(value, (tuple, list)) else value
    return (1, v)


def _params_2d(params: dict[str, Any]) -> dict[str, Any]:
    """1-d ``avg_pool`` arguments as those of a 2-d pooling of a height-1 image."""
    out = {
        k: (_as_2d(v) if k in ("kernel_size", "stride", "padding") else v)
        for k, v in params.items()
    }
    if out["padding"] is not None:
        out["padding"] = (0, out["padding"][1])
    return out


class AvgPool(FunctionalQuantized):
    """Integer ``avg_pool1d/2d/3d`` with torch's padding and ``ceil_mode`` counting."""

    def arguments(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The pooling arguments (``AVG_POOL_PARAMS``, torch's defaults filled in) of a call
        with ``args`` / ``kwargs`` after the input, or of the wrapped ``nn.AvgPool*d``."""
        if self.op is not None:
            m = self.op
            params = {k: getattr(m, k, _AVG_DEFAULTS.get(k)) for k in AVG_POOL_PARAMS}
        else:
            params = dict(_AVG_DEFAULTS)
            params.update(zip(AVG_POOL_PARAMS, args))
            params.update(kwargs)
        return params

    def pool_dims(self, x: QTensor) -> int:
        """1, 2 or 3: the spatial dims pooled (from the op; else ``x.dim() - 2``)."""
        return _pool_dims(self, _AVG, _AVG_MODULES) or x.dim() - 2

    @staticmethod
    def window_counts(in_sizes: list[int], params: dict[str, Any]) -> Tensor:
        """torch's divisor of every output position (padding, ``ceil_mode`` and
        ``count_include_pad`` as torch counts them) for spatial input sizes ``in_sizes`` and
        the pooling arguments ``params`` (``arguments``): float64 on the host, shaped
        ``(1, 1, *output_sizes)``. Depends on shapes only.
        """
        one_d = len(in_sizes) == 1
        if one_d:  # avg_pool1d has no divisor_override: a height-1 image
            in_sizes, params = [1, *in_sizes], _params_2d(params)
        fn = _AVG[len(in_sizes)]
        ones = torch.ones((1, 1, *in_sizes), dtype=torch.float64)
        counts = torch.round(fn(ones, **dict(params, divisor_override=1)) / fn(ones, **params))
        return counts.squeeze(2) if one_d else counts

    def forward(self, x: QTensor, *args: Any, **kwargs: Any) -> QTensor:
        params = given = self.arguments(args, kwargs)
        data = x.values()
        dims = self.pool_dims(x)
        unbatched = data.dim() == dims + 1  # (C, *spatial), as torch's pooling accepts
        if unbatched:
            data = data.unsqueeze(0)
        counts = self.window_counts(list(data.shape[2:]), params)  # shapes only: host
        one_d = dims == 1
        if one_d:  # avg_pool1d has no divisor_override: pool a height-1 image instead
            data = data.unsqueeze(2)
            params = _params_2d(params)
        fn = _AVG[data.dim() - 2]
        sums = fn(data.to(torch.float64), **dict(params, divisor_override=1))
        if one_d:
            sums = sums.squeeze(2)
        if unbatched:
            sums, counts = sums.squeeze(0), counts.squeeze(0)
        window.record_window_sums(
            x.values(),
            sums,
            range(x.dim() - dims, x.dim()),
            lambda: self._matrices(x, sums, dims, given),
        )
        return _requant_by_count(self, sums, counts, x)

    @staticmethod
    def _matrices(x: QTensor, sums: Tensor, dims: int, params: dict[str, Any]) -> list:
        """The 0 / 1 window matrix of each pooled axis (``axis_matmul``)."""
        k = window.per_axis(params["kernel_size"], dims)
        stride = params["stride"]
        st = k if stride is None or stride == [] or stride == () else window.per_axis(stride, dims)
        pad = window.per_axis(params["padding"], dims)
        return [
            window.window_matrix(n, o, [(j * s - p, j * s - p + kk) for j in range(o)])
            for n, o, s, p, kk in zip(x.shape[-dims:], sums.shape[-dims:], st, pad, k)
        ]


def window_sums_adaptive(
    x: Tensor, output_size: tuple[int, ...], expand: bool = True
) -> tuple[Tensor, Tensor]:
    """Exact window sums and counts of adaptive average pooling (float64).

    Window ``i`` of a dimension of size ``n`` pooled to ``o`` spans
    ``[floor(i n / o), ceil((i + 1) n / o))``, as in torch. The counts have the
    sums' shape, or (``expand=False``) a shape that broadcasts against it.
    """
    sums = x.to(torch.float64)
    counts = torch.ones((), dtype=torch.float64)  # shapes only: on the host
    dims = len(output_size)
    for d, o in enumerate(output_size):
        axis = x.dim() - dims + d
        n = sums.shape[axis]
        o = n if o is None else o
        starts, ends = zip(*window.adaptive_windows(n, o))
        if o == 1:  # the global average (exact: integers, any order)
            sums = sums.sum(axis, keepdim=True)
        elif o != n:
            c = torch.cumsum(sums, axis)
            c = torch.cat([torch.zeros_like(c.narrow(axis, 0, 1)), c], axis)
            first, last = (torch.tensor(v, device=x.device) for v in (starts, ends))
            sums = c.index_select(axis, last) - c.index_select(axis, first)
        shape = [1] * x.dim()
        shape[axis] = o
        sizes = [e - s for s, e in zip(starts, ends)]
        counts = counts * torch.tensor(sizes, dtype=torch.float64).reshape(shape)
    return sums, counts.expand_as(sums) if expand else counts


class AdaptiveAvgPool(FunctionalQuantized):
    """Integer ``adaptive_avg_pool1d/2d/3d`` (batched or unbatched input, as in torch)."""

    def pool_dims(self, x: QTensor) -> int:
        """1, 2 or 3: the spatial dims pooled (from the op; else ``x.dim() - 2``)."""
        return _pool_dims(self, _ADAPTIVE, _ADAPTIVE_MODULES) or x.dim() - 2

    def forward(self, x: QTensor, *args: Any, **kwargs: Any) -> QTensor:
        if self.op is not None:
            size = self.op.output_size
        else:
            size = args[0] if args else kwargs["output_size"]
        dims = self.pool_dims(x)
        size = (size,) * dims if isinstance(size, int) or size is None else tuple(size)
        sums, counts = window_sums_adaptive(x.values(), size, expand=False)

        def matrices() -> list:
            sizes = zip(x.shape[-dims:], sums.shape[-dims:])
            return [window.window_matrix(n, o, window.adaptive_windows(n, o)) for n, o in sizes]

        window.record_window_sums(x.values(), sums, range(x.dim() - dims, x.dim()), matrices)
        return _requant_by_count(self, sums, counts, x)


def reduce_dims(x: QTensor, dim: Any) -> list[int]:
    """The non-negative dims a ``mean`` / ``sum`` over ``dim`` (an int, a sequence, or None
    for all) of ``x`` reduces."""
    if dim is None:
        return list(range(x.dim()))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return [d % x.dim() for d in dims]


class Mean(FunctionalQuantized):
    """Integer ``mean(dim, keepdim)``."""

    def forward(self, x: QTensor, dim: Any = None, keepdim: bool = False, **kwargs: Any) -> QTensor:
        dims = reduce_dims(x, kwargs.pop("axis", dim))
        count = math.prod(x.shape[d] for d in dims)
        sums = _whole_axes_sums(x, dims, keepdim)
        return _requant_by_count(self, sums, torch.tensor(float(count), dtype=torch.float64), x)


class Sum(FunctionalQuantized):
    """Integer ``sum(dim, keepdim)``."""

    def forward(self, x: QTensor, dim: Any = None, keepdim: bool = False, **kwargs: Any) -> QTensor:
        dims = reduce_dims(x, kwargs.pop("axis", dim))
        sums = _whole_axes_sums(x, dims, keepdim)
        return _requant_by_count(self, sums, torch.ones((), dtype=torch.float64), x)


def _whole_axes_sums(x: QTensor, dims: list[int], keepdim: bool) -> Tensor:
    """Exact float64 sums of ``x``'s integers over ``dims`` (recorded: ``axis_matmul`` with
    a column of ones per axis, then a ``reshape`` without them unless ``keepdim``)."""
    dims = sorted(dims)
    sums = x.values().to(torch.float64).sum(dims, keepdim=True)
    window.record_window_sums(x.values(), sums, dims, None)
    return sums if keepdim else window.drop_axes(sums, dims)
