import pytest
import torch

import fxq
from fxq.fake_quantize import FakeQuantize, FakeQuantState, set_fake_quantize
from fxq.observer import MinMaxObserver


def _fq(**kw):
    return FakeQuantize(observer=MinMaxObserver, **kw)


def test_rounds_half_up_on_ties(bayes):
    fq = _fq()
    fq.scale.fill_(0.5)
    fq.observed.fill_(True)
    fq.set_fake_quant_state(FakeQuantState.VALIDATION)
    x = torch.tensor([0.25, -0.25, 0.75, -0.75, 0.2499, 1.25])
    # x / s = 0.5, -0.5, 1.5, -1.5, 0.4998, 2.5  -> floor(v + 1/2)
    assert (fq(x) / 0.5).tolist() == [1.0, 0.0, 2.0, -1.0, 0.0, 3.0]


def test_saturates_at_int8_and_int16_bounds(bayes):
    for dtype, lo, hi in ((fxq.qint8, -128, 127), (fxq.qint16, -32768, 32767)):
        fq = _fq(dtype=dtype)
        fq.scale.fill_(1.0)
        fq.observed.fill_(True)
        fq.set_fake_quant_state("validation")
        assert fq(torch.tensor([-1e6, 1e6])).tolist() == [lo, hi]


def test_straight_through_gradient_is_zero_where_clipped(bayes):
    fq = _fq()
    fq.scale.fill_(1.0)
    fq.observed.fill_(True)
    fq.set_fake_quant_state("validation")
    x = torch.tensor([0.3, 126.9, 127.6, -128.4, -129.0], requires_grad=True)
    fq(x).sum().backward()
    assert x.grad.tolist() == [1.0, 1.0, 0.0, 1.0, 0.0]


def test_states(bayes):
    fq = _fq()
    x = torch.tensor([-1.0, 0.3333, 2.54])
    fq.set_fake_quant_state(FakeQuantState.CALIBRATION)
    assert torch.equal(fq(x), x)  # observes, does not round
    assert fq.scale.item() == pytest.approx(2.54 / 127)
    fq.set_fake_quant_state(FakeQuantState.VALIDATION)
    y = fq(torch.tensor([100.0]))  # frozen: no observation
    assert fq.scale.item() == pytest.approx(2.54 / 127)
    assert y.item() == pytest.approx(127 * 2.54 / 127)
    fq.set_fake_quant_state(FakeQuantState.QAT)
    fq(torch.tensor([5.08]))
    assert fq.scale.item() == pytest.approx(5.08 / 127)


def test_validation_before_any_observation_is_an_error(bayes):
    fq = _fq()
    fq.set_name("the output of 'conv1'")
    fq.set_fake_quant_state("validation")
    with pytest.raises(
        RuntimeError, match=r"fake quant the output of 'conv1' has never observed data"
    ):
        fq(torch.ones(2))


def test_power_of_two_scales_on_bernoulli2():
    fxq.set_march("bernoulli2")
    fq = _fq()
    fq.set_fake_quant_state("calibration")
    fq(torch.tensor([3.0]))
    assert fq.scale.item() == 2.0**-5  # 3/127 = 0.0236 -> 2**-5 = 0.03125 covers it
    with pytest.raises(ValueError, match="not a power of two"):
        FakeQuantize(scale=0.01)


def test_int16_is_refused_on_bernoulli2():
    fxq.set_march("bernoulli2")
    with pytest.raises(
        ValueError, match=r"qint16 is not available on march bernoulli2 \(it runs: qint8\)"
    ):
        _fq(dtype=fxq.qint16)


def test_fixed_scale_ignores_data(bayes):
    fq = FakeQuantize(scale=1 / 128)
    fq.set_fake_quant_state("qat")
    fq(torch.tensor([1000.0]))
    assert fq.scale.item() == 1 / 128


def test_set_fake_quantize_needs_a_prepared_model():
    with pytest.raises(ValueError, match="no fxq fake quant"):
        set_fake_quantize(torch.nn.Linear(2, 2), "qat")
    with pytest.raises(ValueError, match="unknown fake-quant state"):
        set_fake_quantize(torch.nn.Linear(2, 2), "training")
