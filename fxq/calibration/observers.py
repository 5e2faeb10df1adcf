"""Calibration observers: percentile, mse, kl and mix on a histogram; mse for weights.

Activation observers keep a histogram of ``|x|`` (symmetric quantization only
needs magnitudes) with a fixed number of bins over ``[0, range)``. When a
batch exceeds the range, the range doubles as often as needed and groups of
adjacent bins merge exactly, so memory stays fixed however long calibration
runs. int16 tensors get 16x more bins.

From the histogram, every observer picks a clipping magnitude ``c`` (the
scale is ``c / qmax``):

* ``percentile``: the given percentile of ``|x|``;
* ``mse``: the ``c`` minimising the expected squared quantization error, with
  values in each bin taken as uniform: clipped values cost ``(x - c)**2``,
  values inside cost the exact mean of the rounding error over the bin;
* ``kl``: TensorRT-style entropy calibration: the ``c`` minimising the KL
  divergence between the clipped histogram and its quantized version
  (``qmax + 1`` levels);
* ``mix``: per tensor, the best of min/max, three percentiles, kl and mse by
  the same expected squared error (so never worse than any of them by it).

The search runs once when calibration ends (``FakeQuantize.finalize``), not
after every batch.

``mean_min_max`` keeps no histogram: it is the mean over samples (entries
along dim 0) of each sample's min and max.

Importing this module registers the names ``percentile``, ``mse``, ``kl``,
``mix`` and ``mean_min_max`` with ``fxq.observer.register_observer`` (so that
``get_default_qconfig(activation_observer="mse")`` finds them);
``import fxq.calibration`` imports it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fxq.observer import ObserverBase, memory_order, register_observer, rowwise_minmax

__all__ = [
    "HistogramObserver",
    "PercentileObserver",
    "MSEObserver",
    "KLObserver",
    "MixObserver",
    "PerChannelMSEObserver",
    "expected_quantization_error",
    "CALIBRATION_OBSERVERS",
]


def _sawtooth_integral(x: Tensor, step: Tensor) -> Tensor:
    """``integral_0^x (t - step * round(t / step))**2 dt`` (round half up), elementwise."""
    u = x / step + 0.5
    k = torch.floor(u)
    f = u - k
    return step**3 * (k / 12.0 + (f - 0.5) ** 3 / 3.0 + 1.0 / 24.0)


def expected_quantization_error(hist: Tensor, upper: float, clips: Tensor, qmax: int) -> Tensor:
    """Expected total squared error of quantizing the histogram's values with each clip.

    Args:
        hist: counts of ``|x|`` in equal bins over ``[0, upper)``.
        clips: candidate clipping magnitudes ``c`` (the grid step is ``c / qmax``).

    Returns:
        one error per candidate.
    """
    hist = hist.to(torch.float64)
    bins = hist.numel()
    width = upper / bins
    lo = torch.arange(bins, dtype=torch.float64, device=hist.device) * width
    hi = lo + width
    c = clips.to(torch.float64).reshape(-1, 1)
    step = c / qmax
    # inside the range: the mean rounding error over the part of the bin below c
    top = torch.minimum(hi, c)
    inside = (
        _sawtooth_integral(top, step) - _sawtooth_integral(torch.minimum(lo, c), step)
    ) / width
    # beyond c: values clamp to c; mean of (x - c)**2 over the part of the bin above c
    bottom = torch.maximum(lo, c)
    beyond = ((hi - c).clamp(min=0) ** 3 - (bottom - c) ** 3) / (3.0 * width)
    return ((inside + beyond) * hist).sum(1)


# elements counted at a time by ``uniform_counts``: its temporaries stay small enough for
# the allocator to reuse (a temporary the size of an activation is mapped fresh each time,
# and on a virtual machine its page faults cost as much as the counting)
_COUNTED_AT_ONCE = 1 << 18


def uniform_counts(values: Tensor, bins: int, upper: float, absolute: bool = False) -> Tensor:
    """The counts of ``values`` (of ``|values|`` with ``absolute``; in ``[0, upper]``,
    ``upper > 0``) in ``bins`` equal bins from 0 to ``upper`` (``upper`` itself in the
    last), float64.

    The bin indices are counted with ``bincount``, a slice of the values at a time: on CPU
    ``histc`` takes about four times as long (2 threads, ``|x|`` of 16 samples of a
    96x112x112 activation: 145-175 ms with ``abs`` against 38-41 ms). A value within a
    float32 rounding of a bin edge may land in the bin beside ``histc``'s.
    """
    flat = values.reshape(-1)
    counts = torch.zeros(bins, dtype=torch.int64, device=values.device)
    scaled = torch.empty(min(flat.numel(), _COUNTED_AT_ONCE), dtype=flat.dtype, device=flat.device)
    index = torch.empty(scaled.shape, dtype=torch.int32, device=flat.device)
    for part in flat.split(_COUNTED_AT_ONCE):
        n = part.numel()
        out, idx = scaled[:n], index[:n]
        if absolute:
            torch.abs(part, out=out).mul_(bins / upper)
        else:
            torch.mul(part, bins / upper, out=out)
        idx.copy_(out).clamp_(0, bins - 1)  # truncation: the bin of a non-negative value
        counts += torch.bincount(idx, minlength=bins)
    return counts.to(torch.float64)


class HistogramObserver(ObserverBase):
    """Base: a histogram of ``|x|`` with exact merging on range growth.

    Args:
        bins: number of bins (default 2048, or 32768 for int16 tensors: chosen
            on first use from ``qmax``).
    """

    immediate_check = True  # reads its statistics on the host at every batch

    deferred = True
    #: whether ``zeros`` counts the exact zeros seen (only the KL clip reads it)
    counts_zeros = False

    def __init__(
        self, bins: int | None = None, ch_axis: int | None = None, num_channels: int | None = None
    ) -> None:
        if ch_axis is not None:
            raise ValueError(
                f"{type(self).__name__} observes whole tensors (per-tensor activations)"
            )
        super().__init__(None, None)
        self.bins = bins
        self.register_buffer("histogram", torch.zeros(0, dtype=torch.float64), persistent=False)
        self.register_buffer("upper", torch.zeros((), dtype=torch.float64), persistent=False)
        # exact zeros (ReLU outputs), counted where counts_zeros: quantized exactly by any
        # clip, so KL leaves them out
        self.register_buffer("zeros", torch.zeros((), dtype=torch.float64), persistent=False)

    def _num_bins(self) -> int:
        if self.bins is not None:
            return self.bins
        return 2048 if self.qmax <= 127 else 32768

    def forward(self, x: Tensor) -> Tensor:
        """Add ``|x|`` to the histogram and return ``x`` (an empty ``x`` adds nothing)."""
        self._observe(x.detach())
        return x

    def _observe(self, x: Tensor) -> None:
        # min / max over every rank when synchronized (``fxq.observer.synchronized``); the
        # counts below are then summed over the ranks in the range they all share
        stats = self._observed_minmax(x)
        if stats is None:
            return
        mn, mx = stats
        torch.minimum(self.min_val, mn, out=self.min_val)
        torch.maximum(self.max_val, mx, out=self.max_val)
        amax = float(torch.maximum(-mn, mx))
        if amax == 0.0:
            if self.histogram.numel() == 0:
                self.histogram = torch.zeros(self._num_bins(), dtype=torch.float64, device=x.device)
            count = self._sum_over_ranks(
                torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)
            )
            self.histogram[0] += count
            self.zeros += count
            return
        if self.histogram.numel() == 0 or float(self.upper) == 0.0:
            bins = self._num_bins()
            old = self.histogram.sum() if self.histogram.numel() else 0.0
            self.histogram = torch.zeros(bins, dtype=torch.float64, device=x.device)
            self.histogram[0] = old
            self.upper = torch.tensor(amax, dtype=torch.float64, device=x.device)
        elif amax > float(self.upper):
            self._grow(amax)
        x = memory_order(x)
        counts = uniform_counts(
            x.float(), self.histogram.numel(), float(self.upper), absolute=float(mn.min()) < 0
        )
        if self.counts_zeros:
            zeros = (x.numel() - torch.count_nonzero(x)).reshape(1).to(torch.float64)
        else:  # a pass over the tensor (a third of the histogram's time) that only KL reads
            zeros = torch.zeros(1, dtype=torch.float64, device=counts.device)
        counts = self._sum_over_ranks(torch.cat([counts.to(torch.float64), zeros]))
        self.histogram += counts[:-1]
        self.zeros += counts[-1]

    def _grow(self, amax: float) -> None:
        bins = self.histogram.numel()
        factor = 1
        while float(self.upper) * factor < amax:
            factor *= 2
        if factor >= bins:
            merged = torch.zeros_like(self.histogram)
            merged[0] = self.histogram.sum()
        else:
            merged = torch.zeros_like(self.histogram)
            merged[: bins // factor] = self.histogram.reshape(bins // factor, factor).sum(1)
        self.histogram = merged
        self.upper = self.upper * factor

    def has_statistics(self) -> bool:
        return self.histogram.numel() > 0 and float(self.histogram.sum()) > 0

    def reset(self) -> None:
        super().reset()
        self.histogram = torch.zeros(0, dtype=torch.float64, device=self.histogram.device)
        self.upper.zero_()
        self.zeros.zero_()

    # -- clips ---------------------------------------------------------------------------
    def _observed_max(self) -> float:
        return float(torch.maximum(-self.min_val, self.max_val).clamp(min=0))

    def percentile_clip(self, percentile: float) -> float:
        """The ``percentile`` of ``|x|`` (linear within a bin)."""
        hist = self.histogram
        total = float(hist.sum())
        if total == 0:
            return self._observed_max()
        cdf = torch.cumsum(hist, 0)
        target = total * percentile / 100.0
        i = int(
            torch.searchsorted(
                cdf, torch.tensor([target], dtype=cdf.dtype, device=cdf.device)
            ).item()
        )
        i = min(i, hist.numel() - 1)
        width = float(self.upper) / hist.numel()
        before = float(cdf[i - 1]) if i > 0 else 0.0
        inside = float(hist[i])
        frac = (target - before) / inside if inside > 0 else 1.0
        return min((i + frac) * width, self._observed_max())

    def candidate_clips(self, count: int = 1024) -> Tensor:
        """Clips to search: up to ``count`` bin edges from 1/64 of the range to the max."""
        top = self._observed_max()
        bins = self.histogram.numel()
        width = float(self.upper) / bins
        edges = torch.arange(max(bins // 64, 1), bins + 1, dtype=torch.float64) * width
        if edges.numel() > count:
            edges = edges[torch.linspace(0, edges.numel() - 1, count).round().long()]
        edges = edges[edges < top]
        return torch.cat([edges, torch.tensor([top], dtype=torch.float64)])

    def errors(self, clips: Tensor) -> Tensor:
        return expected_quantization_error(
            self.histogram.cpu(), float(self.upper), clips, self.qmax
        )

    def mse_clip(self) -> float:
        clips = self.candidate_clips()
        return float(clips[int(torch.argmin(self.errors(clips)))])

    def kl_clip(self) -> float:
        """TensorRT's entropy calibration on the ``|x|`` histogram.

        For each candidate threshold bin ``i``: ``P`` is the histogram up to
        ``i`` with the outliers added to its last bin; ``Q`` merges the same
        ``i`` bins (without the outliers) into ``qmax + 1`` levels and spreads
        each level's count back over its non-empty bins. The threshold with
        the smallest ``KL(P || Q)`` wins. Exact zeros are left out: they are
        quantized exactly by any threshold, and a ReLU's spike of zeros would
        otherwise drag the threshold far too low.
        """
        if not self.counts_zeros:
            raise RuntimeError(
                f"{type(self).__name__}.kl_clip needs the count of exact zeros: set "
                "counts_zeros = True on the class"
            )
        hist = self.histogram.cpu().clone()
        hist[0] = (hist[0] - self.zeros.cpu()).clamp(min=0)
        bins = hist.numel()
        levels = self.qmax + 1
        if bins < 2 * levels:  # too few bins to compare distributions: fall back to mse
            return self.mse_clip()
        width = float(self.upper) / bins
        suffix = torch.flip(
            torch.cumsum(torch.flip(hist, [0]), 0), [0]
        )  # counts at or above each bin
        stride = max((bins - levels) // 512, 1)
        # every candidate threshold at once: row r compares the first thresholds[r] bins
        thresholds = torch.arange(levels, bins + 1, stride)
        index = torch.arange(bins)
        inside = index < thresholds[:, None]
        p = hist * inside
        tail = torch.cat([suffix, torch.zeros(1, dtype=suffix.dtype)])[thresholds]
        p[torch.arange(len(thresholds)), thresholds - 1] += tail  # outliers into the last bin
        level = torch.div(index * levels, thresholds[:, None], rounding_mode="floor")
        level = torch.where(inside, level, 0)
        nonzero = (hist > 0).to(torch.float64) * inside
        mass = torch.zeros(len(thresholds), levels, dtype=torch.float64).scatter_add_(
            1, level, hist * inside
        )
        count = torch.zeros(len(thresholds), levels, dtype=torch.float64).scatter_add_(
            1, level, nonzero
        )
        q = nonzero * torch.gather(mass / count.clamp(min=1), 1, level)
        pn = p / p.sum(1, keepdim=True)
        qn = q / q.sum(1, keepdim=True).clamp(min=1e-30)
        terms = torch.where(pn > 0, pn * torch.log(pn / qn.clamp(min=1e-12)), 0.0)
        best_i = int(thresholds[int(torch.argmin(terms.sum(1)))])
        return min(best_i * width, self._observed_max())

    def clip(self) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def amax(self) -> Tensor:
        if not self.has_statistics():
            return torch.maximum(-self.min_val, self.max_val).clamp(min=0)
        return torch.tensor([self.clip()], dtype=torch.float32, device=self.min_val.device)


class PercentileObserver(HistogramObserver):
    """Clip at a percentile of ``|x|`` (default 99.99)."""

    def __init__(
        self, percentile: float = 99.99, bins: int | None = None, ch_axis=None, num_channels=None
    ) -> None:
        super().__init__(bins, ch_axis, num_channels)
        if not 0.0 < percentile <= 100.0:
            raise ValueError(f"percentile must be in (0, 100], got {percentile}")
        self.percentile = percentile

    def clip(self) -> float:
        return self.percentile_clip(self.percentile)


class MSEObserver(HistogramObserver):
    """Clip where the expected squared quantization error is smallest."""

    def clip(self) -> float:
        return self.mse_clip()


class KLObserver(HistogramObserver):
    """Clip where the KL divergence between the clipped and quantized histograms is smallest."""

    counts_zeros = True

    def clip(self) -> float:
        return self.kl_clip()


class MixObserver(HistogramObserver):
    """Per tensor, the best of several methods by the expected squared error.

    Candidates: min/max, percentiles 99.9 / 99.99 / 99.999, kl and mse.
    ``chosen`` records which one won (for reports).
    """

    counts_zeros = True
    CANDIDATES = (
        "min_max",
        "percentile_99.9",
        "percentile_99.99",
        "percentile_99.999",
        "kl",
        "mse",
    )

    def __init__(self, bins: int | None = None, ch_axis=None, num_channels=None) -> None:
        super().__init__(bins, ch_axis, num_channels)
        self.chosen = ""

    def candidates(self) -> dict[str, float]:
        return {
            "min_max": self._observed_max(),
            "percentile_99.9": self.percentile_clip(99.9),
            "percentile_99.99": self.percentile_clip(99.99),
            "percentile_99.999": self.percentile_clip(99.999),
            "kl": self.kl_clip(),
            "mse": self.mse_clip(),
        }

    def clip(self) -> float:
        options = self.candidates()
        errors = self.errors(torch.tensor(list(options.values()), dtype=torch.float64))
        best = int(torch.argmin(errors))
        self.chosen = list(options)[best]
        return list(options.values())[best]


class PerChannelMSEObserver(ObserverBase):
    """Weights: per output channel, the clip with the smallest squared rounding error.

    Searches ``c = amax * k / 100`` for ``k = 50..100`` on the actual weights
    (exact, no histogram), once per set of weights.
    """

    immediate_check = True  # reads its statistics on the host at every batch

    deferred = True

    def __init__(self, ch_axis: int = 0, num_channels: int | None = None, steps: int = 51) -> None:
        super().__init__(ch_axis, num_channels)
        self.steps = steps
        self.register_buffer("best_amax", torch.zeros(0), persistent=False)
        self._latest: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        if x.numel() == 0:  # no statistics in an empty tensor
            return x
        mn, mx = self._batch_minmax(x)
        self._check_finite(mn, mx)
        self._resize_to(mn)
        self.min_val.copy_(mn)
        self.max_val.copy_(mx)
        self._latest = x.detach()
        return x

    def amax(self) -> Tensor:
        amax = torch.maximum(-self.min_val, self.max_val).clamp(min=0)
        if self._latest is None:
            return amax
        w = (
            self._latest.transpose(0, self.ch_axis % self._latest.dim())
            .reshape(amax.numel(), -1)
            .to(torch.float64)
        )
        fractions = torch.linspace(0.5, 1.0, self.steps, dtype=torch.float64, device=w.device)
        clips = amax.to(torch.float64).reshape(-1, 1) * fractions  # [C, steps]
        step = (clips / self.qmax).clamp(min=1e-30).unsqueeze(-1)  # [C, steps, 1]
        q = torch.floor(w.unsqueeze(1) / step + 0.5).clamp(-self.qmax - 1, self.qmax) * step
        errors = ((q - w.unsqueeze(1)) ** 2).sum(-1)  # [C, steps]
        best = clips.gather(1, errors.argmin(1, keepdim=True)).squeeze(1)
        self._latest = None
        return best.to(torch.float32)


class MeanMinMaxObserver(ObserverBase):
    """The mean over calibration samples of each sample's min and max.

    A sample is one entry along dim 0 (the batch); its min and max are taken
    over everything else, and the observer keeps the running mean of both
    (NNCF's default range estimator for activations). Rare extremes that a
    global min / max would let stretch the range count only as much as the
    samples they occur in, which suits activations whose range varies from
    image to image.
    """

    immediate_check = True  # reads its statistics on the host at every batch

    def __init__(self, ch_axis: int | None = None, num_channels: int | None = None) -> None:
        if ch_axis is not None:
            raise ValueError("MeanMinMaxObserver observes whole tensors (per-tensor activations)")
        super().__init__(None, None)
        # running sums: not saved (like the histograms), so a calibrated state_dict, whose
        # min_val / max_val hold the means, loads into a QAT model with other observers
        self.register_buffer("count", torch.zeros((), dtype=torch.float64), persistent=False)
        self.register_buffer("sums", torch.zeros(2, dtype=torch.float64), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        """Add the per-sample minima and maxima of ``x`` (an empty ``x`` adds nothing)."""
        x = x.detach()
        local = torch.zeros(3, dtype=torch.float64, device=x.device)
        if x.numel():
            flat = (
                memory_order(x, keep_batch=True).reshape(x.shape[0], -1)
                if x.dim() > 1
                else x.reshape(1, -1)
            )
            mn, mx = rowwise_minmax(flat.float())
            self._check_finite(mn, mx)
            local = torch.stack(
                [
                    mn.double().sum(),
                    mx.double().sum(),
                    torch.tensor(float(len(mn)), device=x.device),
                ]
            ).to(torch.float64)
        local = self._sum_over_ranks(local)
        if float(local[2]) == 0:
            return x
        self.sums += local[:2]
        self.count += local[2]
        self.min_val.copy_((self.sums[0] / self.count).reshape(1).float())
        self.max_val.copy_((self.sums[1] / self.count).reshape(1).float())
        return x

    def reset(self) -> None:
        super().reset()
        self.count.zero_()
        self.sums.zero_()


# name: (per-tensor class, per-channel class), registered in fxq.observer's registry
CALIBRATION_OBSERVERS: dict[str, tuple[type[ObserverBase] | None, type[ObserverBase] | None]] = {
    "percentile": (PercentileObserver, None),
    "mse": (MSEObserver, PerChannelMSEObserver),
    "kl": (KLObserver, None),
    "mix": (MixObserver, None),
    "mean_min_max": (MeanMinMaxObserver, None),
}

for _name, (_per_tensor, _per_channel) in CALIBRATION_OBSERVERS.items():
    register_observer(_name, _per_tensor, _per_channel)
