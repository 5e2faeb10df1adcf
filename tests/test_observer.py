import ast
from pathlib import Path

import pytest
import torch

import fxq.observer
from fxq.calibration.observers import (
    HistogramObserver,
    MeanMinMaxObserver,
    MSEObserver,
    PercentileObserver,
    PerChannelMSEObserver,
)
from fxq.observer import (
    FixedScaleObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    PerChannelMinMaxObserver,
    get_observer_class,
    observer_registry,
    register_observer,
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


# -- empty tensors ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        MinMaxObserver,
        MovingAverageMinMaxObserver,
        lambda: PerChannelMinMaxObserver(ch_axis=0),
        lambda: PerChannelMinMaxObserver(ch_axis=1, num_channels=2),
        lambda: HistogramObserver(),
        lambda: PerChannelMSEObserver(ch_axis=0),
    ],
    ids=["min_max", "moving_average", "per_channel", "per_channel_sized", "histogram", "mse_w"],
)
def test_an_empty_first_tensor_is_skipped_not_reported_as_nan(make):
    """torch.ao's observers skip empty tensors too: there are no statistics in them."""
    obs = make()
    empty = torch.empty(0, 2)
    assert obs(empty) is empty
    assert not obs.has_statistics()
    x = torch.tensor([[-1.0, 2.0], [0.5, -3.0]])
    obs(x)
    reference = make()
    reference(x)
    assert torch.equal(obs.min_val, reference.min_val)
    assert torch.equal(obs.max_val, reference.max_val)


# -- dtypes ----------------------------------------------------------------------------------
def test_statistics_keep_their_dtypes_and_follow_the_device():
    obs = MinMaxObserver()
    obs(torch.tensor([-1.0, 0.1]))
    hist = HistogramObserver()
    hist(torch.tensor([0.5, -0.25, 3.0]))
    for module in (obs, hist):
        before = {n: (t.dtype, t.clone()) for n, t in module.named_buffers()}
        module.half().float().double().to("cpu")
        for name, t in module.named_buffers():
            assert t.dtype == before[name][0] and torch.equal(t, before[name][1]), name
    assert hist.histogram.dtype is torch.float64  # .float() does not truncate the counts
    meta = MinMaxObserver().to("meta")
    assert meta.min_val.is_meta and meta.min_val.dtype is torch.float32
    repr(meta)


def test_lazily_sized_buffers_keep_their_dtype_when_loading():
    src = PerChannelMinMaxObserver(ch_axis=0)
    src(torch.randn(4, 3))
    dst = PerChannelMinMaxObserver(ch_axis=0)
    dst.load_state_dict({k: v.double() for k, v in src.state_dict().items()})
    assert dst.min_val.dtype is torch.float32 and torch.equal(dst.min_val, src.min_val)


# -- the registry ------------------------------------------------------------------------------
def test_registered_observers_are_found_by_name():
    class Halved(MinMaxObserver):
        pass

    register_observer("halved_test", Halved)
    assert get_observer_class("halved_test", per_channel=False) is Halved
    with pytest.raises(ValueError, match="'halved_test' has no version for weights"):
        get_observer_class("halved_test", per_channel=True)
    register_observer("halved_test", Halved)  # the same classes again: fine
    with pytest.raises(ValueError, match="'halved_test' is already registered"):
        register_observer("halved_test", MinMaxObserver)
    with pytest.raises(ValueError, match="give a per-tensor or a per-channel class"):
        register_observer("nothing")
    assert observer_registry()["mse"] == (MSEObserver, PerChannelMSEObserver)


def test_unknown_observer_names_are_listed():
    with pytest.raises(ValueError, match=r"unknown observer 'median'; known observers: .*min_max"):
        get_observer_class("median", per_channel=False)


def test_observer_module_imports_nothing_from_calibration():
    """fxq.observer is below fxq.calibration: the calibration observers register themselves."""
    tree = ast.parse(Path(fxq.observer.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    assert {m for m in imported if m.startswith("fxq")} == set()


def _channels_last_sample() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(3, 5, 7, 6, generator=torch.Generator().manual_seed(0))
    x[1, 2, 3, 4] = 9.0  # one outlier, so the statistics are not symmetric
    return x, x.contiguous(memory_format=torch.channels_last)


def test_memory_order_is_a_copy_free_view_in_memory_order():
    from fxq.observer import memory_order

    x, cl = _channels_last_sample()
    dense = memory_order(cl)
    assert dense.is_contiguous() and dense.data_ptr() == cl.data_ptr()
    assert torch.equal(dense, x.permute(0, 2, 3, 1))  # NCHW -> NHWC
    assert memory_order(x) is x  # contiguous already
    assert memory_order(cl, keep_batch=True).shape == (3, 7, 6, 5)  # the batch stays first
    odd = x.permute(1, 0, 2, 3)  # dim 0 is not the outermost in memory
    assert memory_order(odd, keep_batch=True) is odd
    assert memory_order(odd).is_contiguous()
    sliced = x[:, :, ::2]  # not dense in any order
    assert memory_order(sliced) is sliced


@pytest.mark.parametrize(
    "make",
    [MinMaxObserver, PercentileObserver, MeanMinMaxObserver, MSEObserver],
)
def test_observers_see_the_same_statistics_in_either_layout(make):
    """A channels_last tensor (what ``ptq`` runs images in on CPU) is observed without a
    copy and gives the statistics of the same values in the default layout."""
    x, cl = _channels_last_sample()
    a, b = make(), make()
    for obs, t in ((a, x), (b, cl)):
        obs(t)
        obs(t * 0.5 - 1)
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key
    assert torch.equal(a.amax(), b.amax())


def test_on_an_accelerator_the_non_finite_check_is_deferred_not_dropped(monkeypatch):
    """Off the CPU (emulated here) reading the NaN flag is a host sync, so it is read every
    NON_FINITE_CHECK_EVERY updates, and whenever the state changes or the model converts."""
    monkeypatch.setattr(fxq.observer, "IMMEDIATE_CHECK_DEVICES", ())
    obs = MovingAverageMinMaxObserver()
    obs.name = "the output of 'conv'"
    obs(torch.tensor([1.0, float("nan")]))  # no error yet
    for _ in range(fxq.observer.NON_FINITE_CHECK_EVERY - 2):
        obs(torch.tensor([1.0, 2.0]))  # still pending: a clean batch does not clear it
    with pytest.raises(ValueError, match=r"observer of the output of 'conv' saw NaN or Inf"):
        obs(torch.tensor([1.0, 2.0]))  # the 32nd update reads the flag
    assert torch.isnan(obs.min_val).all()  # the NaN is in the statistics: the error sticks
    for _ in range(5):
        obs(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="saw NaN or Inf"):
        obs.check_non_finite()
    obs.reset()
    obs(torch.tensor([1.0, 2.0]))
    obs.check_non_finite()
    assert obs.min_val.tolist() == [1.0]


def test_histogram_observers_check_at_once_on_every_device(monkeypatch):
    """They read their statistics on the host at every batch: an Inf must not reach them."""
    monkeypatch.setattr(fxq.observer, "IMMEDIATE_CHECK_DEVICES", ())
    for obs in (PercentileObserver(), MeanMinMaxObserver(), PerChannelMSEObserver(ch_axis=0)):
        obs.name = "x"
        obs(torch.randn(4, 100))
        with pytest.raises(ValueError, match="observer of x saw NaN or Inf"):
            obs(torch.tensor([[1.0, float("inf")], [2.0, 3.0], [1.0, 1.0], [0.0, 1.0]]))


def test_a_deferred_nan_is_reported_by_set_fake_quantize_and_convert(monkeypatch, bayes):
    import fxq
    from fxq.qconfig import default_qat_8bit_fake_quant_qconfig
    from tests.helpers import ResidualNet, calibrate

    monkeypatch.setattr(fxq.observer, "IMMEDIATE_CHECK_DEVICES", ())
    x = torch.randn(4, 3, 8, 8)
    bad = x.clone()
    bad[0, 0, 0, 0] = float("nan")
    for finish in (lambda m: fxq.set_fake_quantize(m, "validation"), fxq.convert_fx):
        qat = fxq.prepare_qat_fx(ResidualNet(), {"": default_qat_8bit_fake_quant_qconfig})
        calibrate(qat, [x, bad])  # no error while calibrating
        with pytest.raises(ValueError, match="saw NaN or Inf"):
            finish(qat)
        # nothing was switched, and asking again gives the error again
        assert {m.state for m in qat.modules() if isinstance(m, fxq.FakeQuantize)} == {
            fxq.FakeQuantState.CALIBRATION
        }
        with pytest.raises(ValueError, match="saw NaN or Inf"):
            finish(qat)


def test_qat_steps_make_no_host_sync_off_the_cpu(monkeypatch, bayes):
    """A host sync (``.item()``, ``bool(tensor)``) stalls a GPU until its queue drains; the
    H200 showed fxq's QAT step 1.6x torch.ao's with one per fake quant. Counted here on the
    CPU with the accelerator's deferred checks: zero per step after the first."""
    import torch.nn.functional as F
    import torchvision

    import fxq
    from fxq.qconfig import default_qat_8bit_fake_quant_qconfig
    from tests.helpers import RecordedOps

    monkeypatch.setattr(fxq.observer, "IMMEDIATE_CHECK_DEVICES", ())
    model = torchvision.models.mobilenet_v2(num_classes=10)
    qat = fxq.prepare_qat_fx(model, {"": default_qat_8bit_fake_quant_qconfig})
    fxq.set_fake_quantize(qat, "qat")
    qat.train()
    opt = torch.optim.SGD(qat.parameters(), lr=1e-3, momentum=0.9)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])

    def step():
        opt.zero_grad()
        F.cross_entropy(qat(x), y).backward()
        opt.step()

    step()  # the first step sizes the statistics
    with RecordedOps() as ops:
        step()
        step()
    assert len(ops.names) > 1000  # the steps were recorded
    assert ops.names.count("_local_scalar_dense") == 0


def test_loading_a_state_clears_the_unsaved_non_finite_flag():
    """``non_finite`` is not saved; after ``to_empty`` it holds whatever the memory held, so
    a load (the statistics are the loaded ones) clears it rather than raise on garbage."""
    saved = MovingAverageMinMaxObserver()
    saved(torch.randn(8))
    fresh = MovingAverageMinMaxObserver()
    fresh.non_finite.fill_(float("nan"))  # what uninitialized memory can hold
    fresh.load_state_dict(saved.state_dict())
    fresh.check_non_finite()  # does not raise
    assert torch.equal(fresh.min_val, saved.min_val) and float(fresh.non_finite) == 0.0
