"""Calibration observers: each range is what its definition says on known distributions."""

import math

import pytest
import torch

import fxq
from fxq.calibration.observers import (
    KLObserver,
    MixObserver,
    MSEObserver,
    PercentileObserver,
    PerChannelMSEObserver,
    expected_quantization_error,
    uniform_counts,
)


def _observe(cls, x, qmax=127, chunks=10, **kw):
    obs = cls(**kw)
    obs.qmax = qmax
    for part in x.split(max(1, x.numel() // chunks)):
        obs(part)
    return obs


def _empirical_error(x, clip, qmax=127):
    step = clip / qmax
    q = torch.floor(x / step + 0.5).clamp(-qmax - 1, qmax) * step
    return float(((x - q) ** 2).sum())


@pytest.fixture
def gaussian():
    return torch.randn(
        1_000_000, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    ).float()


def test_percentile_on_a_gaussian(gaussian):
    obs = _observe(PercentileObserver, gaussian, percentile=99.99)
    # P(|x| > t) = 1e-4 for a standard normal at t = 3.8906
    assert obs.clip() == pytest.approx(3.8906, rel=0.01)
    assert _observe(PercentileObserver, gaussian, percentile=99.0).clip() == pytest.approx(
        2.5758, rel=0.01
    )


def test_mse_finds_the_error_minimum(gaussian):
    obs = _observe(MSEObserver, gaussian)
    clip = obs.clip()
    # the known MSE-optimal clip of an 8-bit uniform quantizer on N(0, 1) is about 3.9 sigma
    assert 3.6 < clip < 4.3
    best = min(_empirical_error(gaussian, c) for c in torch.linspace(2.5, 5.0, 101).tolist())
    assert _empirical_error(gaussian, clip) <= best * 1.01
    assert (
        _empirical_error(gaussian, clip)
        < _empirical_error(gaussian, float(gaussian.abs().max())) * 0.9
    )


def test_expected_error_matches_the_empirical_error(gaussian):
    obs = _observe(MSEObserver, gaussian)
    clips = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    predicted = expected_quantization_error(obs.histogram, float(obs.upper), clips, 127)
    measured = torch.tensor(
        [_empirical_error(gaussian, c) for c in clips.tolist()], dtype=torch.float64
    )
    # bins are taken as uniform inside: within a few percent of the truth
    assert torch.allclose(predicted, measured, rtol=0.05)


@pytest.mark.parametrize("threshold", [3.0, 5.0])
def test_kl_on_a_clipped_laplacian(threshold):
    x = torch.distributions.Laplace(0.0, 1.0).sample((1_000_000,)).clamp(-threshold, threshold)
    obs = _observe(KLObserver, x)
    width = float(obs.upper) / obs.histogram.numel()
    assert abs(obs.clip() - threshold) <= 2 * width


def test_kl_ignores_a_relu_spike_of_zeros(gaussian):
    x = torch.relu(gaussian)  # half of the values are exact zeros
    clip = _observe(KLObserver, x).clip()
    assert clip > 0.6 * float(x.max())


def test_every_kl_clip_leaves_the_zeros_out(gaussian):
    """KL needs the count of exact zeros, which only the observers that compute it keep (a
    full pass over each tensor); auto_calibrate's candidates include kl."""
    from fxq.calibration.auto import _Collector

    x = torch.relu(gaussian)
    expected = _observe(KLObserver, x).clip()
    assert _observe(MixObserver, x).kl_clip() == expected
    assert _observe(_Collector, x).clips(["kl"]) == {"kl": expected}
    with pytest.raises(RuntimeError, match="needs the count of exact zeros"):
        _observe(PercentileObserver, x).kl_clip()


def test_mix_picks_the_least_error_candidate(gaussian):
    heavy = torch.distributions.StudentT(3.0).sample((200_000,))
    for x in (gaussian, heavy):
        obs = _observe(MixObserver, x)
        clip = obs.clip()
        candidates = obs.candidates()
        errors = obs.errors(torch.tensor(list(candidates.values()), dtype=torch.float64))
        assert obs.chosen in MixObserver.CANDIDATES
        assert clip == candidates[obs.chosen]
        assert float(obs.errors(torch.tensor([clip], dtype=torch.float64))) == pytest.approx(
            float(errors.min())
        )


def test_int16_ranges(gaussian):
    mse = _observe(MSEObserver, gaussian, qmax=32767)
    assert mse.histogram.numel() == 32768
    # with 65536 levels clipping never pays: the clip stays at the maximum
    assert mse.clip() >= 0.99 * float(gaussian.abs().max())
    assert _observe(
        PercentileObserver, gaussian, qmax=32767, percentile=99.99
    ).clip() == pytest.approx(3.8906, rel=0.01)


def test_histogram_merges_exactly_when_the_range_grows():
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randn(10_000, generator=gen) * s for s in (0.1, 0.5, 3.0, 40.0)]
    obs = _observe(MSEObserver, torch.zeros(1))
    obs.reset()
    for b in batches:
        obs(b)
    every = torch.cat(batches)
    assert obs.histogram.numel() == 2048  # memory stays bounded
    reference = torch.histc(every.abs(), 2048, 0, float(obs.upper)).to(torch.float64)
    # merged bins are the bins of the final range (up to values on a bin edge, where the
    # float edge computations of the two histograms may differ)
    assert float(obs.histogram.sum()) == every.numel()
    assert float((obs.histogram - reference).abs().sum()) <= 0.001 * every.numel()
    assert float(obs.upper) >= float(every.abs().max())


def test_uniform_counts_bin_like_histc():
    # values at bin centres land in the same bin as histc's; 0 and the upper edge count
    bins, upper = 2048, 3.7
    gen = torch.Generator().manual_seed(0)
    which = torch.randint(0, bins, (50_000,), generator=gen)
    centres = (which.double() + 0.5) * upper / bins
    values = torch.cat([centres.float(), torch.tensor([0.0, upper])])
    counts = uniform_counts(values, bins, upper)
    assert counts.dtype == torch.float64
    assert torch.equal(counts, torch.histc(values, bins, 0.0, upper).double())
    assert counts[0] >= 1 and counts[-1] >= 1
    # a channels_last activation's permuted view counts as the tensor itself
    x = torch.rand(2, 8, 5, 5, generator=gen).contiguous(memory_format=torch.channels_last)
    assert torch.equal(
        uniform_counts(x.permute(0, 2, 3, 1), 64, 1.0), uniform_counts(x.contiguous(), 64, 1.0)
    )


def test_weight_mse_per_channel():
    gen = torch.Generator().manual_seed(0)
    w = torch.distributions.Laplace(0.0, 1.0).sample(
        (4, 256)
    )  # heavy tails: clipping pays at 4 bits
    obs = PerChannelMSEObserver(ch_axis=0, num_channels=4)
    obs.qmax = 7
    obs(w)
    amax = obs.amax()
    top = w.abs().amax(1)
    assert (amax < top).all()
    for c in range(4):
        grid = [float(top[c]) * f for f in torch.linspace(0.5, 1.0, 51).tolist()]
        best = min(_empirical_error(w[c], g, qmax=7) for g in grid)
        assert _empirical_error(w[c], float(amax[c]), qmax=7) == pytest.approx(best)
    _ = gen


def test_calibration_observers_are_deferred_and_finalized(bayes):
    fq = fxq.FakeQuantize(observer=MSEObserver)
    fq.set_fake_quant_state("calibration")
    fq(torch.randn(10_000))
    before = fq.scale.clone()
    fq(torch.randn(10_000) * 4)
    assert torch.equal(fq.scale, before)  # no search after every batch
    state = fq.state_dict()  # saving finalizes the search
    assert not torch.equal(state["scale"], before)
    fq.set_fake_quant_state("validation")
    assert torch.equal(fq.scale, state["scale"])


def test_names_and_errors(bayes):
    qc = fxq.qconfig.get_default_qconfig(activation_observer="kl", weight_observer="mse")
    assert type(qc.activation().observer) is KLObserver
    assert type(qc.weight(num_channels=2).observer) is PerChannelMSEObserver
    with pytest.raises(ValueError, match="observer 'kl' has no version for weights"):
        fxq.qconfig.get_default_qconfig(weight_observer="kl")
    obs = MSEObserver()
    obs.name = "the output of 'conv'"
    with pytest.raises(ValueError, match="observer of the output of 'conv' saw NaN"):
        obs(torch.tensor([1.0, math.nan]))


def test_mean_min_max_is_the_mean_of_per_sample_ranges():
    from fxq.calibration.observers import MeanMinMaxObserver

    obs = MeanMinMaxObserver()
    a = torch.tensor([[-1.0, 2.0], [-3.0, 4.0]])  # samples: (-1, 2), (-3, 4)
    b = torch.tensor([[-5.0, 0.5, 6.0]])  # one sample: (-5, 6)
    obs(a)
    obs(torch.empty(0, 2))  # carries no sample
    obs(b)
    assert obs.min_val.item() == pytest.approx((-1 - 3 - 5) / 3)
    assert obs.max_val.item() == pytest.approx((2 + 4 + 6) / 3)
    assert obs.amax().item() == pytest.approx(4.0)
    with pytest.raises(ValueError, match="whole tensors"):
        MeanMinMaxObserver(ch_axis=0)


def test_mean_min_max_state_dict_starts_a_qat_model(bayes):
    from fxq.qconfig import default_qat_8bit_fake_quant_qconfig, get_default_qconfig
    from tests.helpers import ResidualNet, calibrate

    calib = fxq.prepare_qat_fx(
        ResidualNet(), {"": get_default_qconfig(activation_observer="mean_min_max")}
    )
    calibrate(calib, [torch.randn(4, 3, 8, 8)])
    qat = fxq.prepare_qat_fx(ResidualNet(), {"": default_qat_8bit_fake_quant_qconfig})
    qat.load_state_dict(calib.state_dict())  # strict: the running sums are not saved
    assert torch.equal(
        qat.stem.activation_post_process.scale, calib.stem.activation_post_process.scale
    )
