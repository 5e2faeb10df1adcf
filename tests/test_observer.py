import pytest
import torch

from fxq.observer import (
    FixedScaleObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    PerChannelMinMaxObserver,
)


def test_min_max_is_running_extreme():
    obs = MinMaxObserver()
    obs(torch.tensor([-1.0, 2.0]))
    obs(torch.tensor([-3.0, 1.0]))
    assert obs.min_val.item() == -3.0 and obs.max_val.item() == 2.0
    assert obs.amax().item() == 3.0


def test_moving_average_follows_its_formula():
    obs = MovingAverageMinMaxObserver(averaging_constant=0.25)
    obs(torch.tensor([-4.0, 8.0]))  # first batch initialises
    obs(torch.tensor([0.0, 0.0]))
    assert obs.min_val.item() == pytest.approx(-4.0 + 0.25 * (0.0 + 4.0))
    assert obs.max_val.item() == pytest.approx(8.0 + 0.25 * (0.0 - 8.0))


def test_per_channel_weight_observer_tracks_latest_weights():
    obs = PerChannelMinMaxObserver(ch_axis=0, num_channels=2)
    obs(torch.tensor([[1.0, -5.0], [2.0, 3.0]]))
    obs(torch.tensor([[1.0, -0.5], [0.25, 0.5]]))
    assert obs.min_val.tolist() == [-0.5, 0.25]
    assert obs.max_val.tolist() == [1.0, 0.5]
    assert obs.amax().tolist() == [1.0, 0.5]


def test_per_channel_axis_one():
    obs = PerChannelMinMaxObserver(ch_axis=1)
    obs(torch.arange(12.0).reshape(2, 3, 2) - 6)
    assert obs.max_val.tolist() == [1.0, 3.0, 5.0]
    assert obs.min_val.tolist() == [-6.0, -4.0, -2.0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_raise_naming_the_layer(bad):
    obs = MinMaxObserver()
    obs.name = "the output of 'layer3.conv'"
    with pytest.raises(ValueError, match=r"observer of the output of 'layer3.conv' saw NaN or Inf"):
        obs(torch.tensor([1.0, bad]))


def test_fixed_scale_observer_validates_scale():
    assert FixedScaleObserver(scale=0.5).fixed_scale.item() == 0.5
    with pytest.raises(ValueError, match="positive"):
        FixedScaleObserver(scale=0.0)


def test_lazily_sized_per_channel_buffers_load_from_state_dict():
    src = PerChannelMinMaxObserver(ch_axis=0)
    src(torch.randn(4, 3))
    dst = PerChannelMinMaxObserver(ch_axis=0)
    assert dst.min_val.shape == (0,)
    dst.load_state_dict(src.state_dict())
    assert torch.equal(dst.min_val, src.min_val) and torch.equal(dst.max_val, src.max_val)
