"""Calibration runs, auto_calibrate and weight reconstruction on a small model."""

import copy
import io
import warnings
from contextlib import redirect_stderr

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxq
from fxq.calibration import auto_calibrate, batch_arguments, calibrate, weight_reconstruction
from fxq.debug import float_fake_quant
from fxq.fake_quantize import bypass
from fxq.qconfig import get_default_qconfig
from tests.helpers import sqnr


class OutlierNet(nn.Module):
    """Conv layers whose activations have rare large outliers (where clipping pays)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.b1 = nn.BatchNorm2d(16)
        self.c2 = nn.Conv2d(16, 16, 3, padding=1)
        self.b2 = nn.BatchNorm2d(16)
        self.c3 = nn.Conv2d(16, 16, 3, padding=1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.b1(self.c1(x)))
        x = F.relu(self.b2(self.c2(x)))
        x = self.c3(x)
        return self.fc(x.mean((2, 3)))


def _data(n, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 12, 12, generator=gen)
    spikes = torch.rand(n, 3, 12, 12, generator=gen) < 0.002
    return torch.where(spikes, x * 25, x)  # heavy tails


@pytest.fixture
def setup(bayes):
    model = OutlierNet().eval()
    calib = list(_data(64, 0).split(16))
    held = _data(64, 1)
    with torch.no_grad():
        ref = model(held)
    return model, calib, held, ref


def _integer_sqnr(prepared, held, ref):
    fxq.set_fake_quantize(prepared, "validation")
    with torch.no_grad():
        return sqnr(ref, fxq.convert_fx(prepared)(held))


def _calibrated(model, calib, observer):
    prepared = fxq.prepare_qat_fx(model, {"": get_default_qconfig(activation_observer=observer)})
    calibrate(prepared, calib, show_progress=False)
    return prepared


def test_methods_are_ordered_on_pretrained_mobilenet_v2(bayes):
    """On a real network and real photos: clipping observers beat min/max, learned rounding helps."""
    from fxq.utils.sample_data import photo_crops, pretrained_mobilenet_v2

    model = pretrained_mobilenet_v2()
    calib = list(photo_crops(16, size=128, seed=0).split(8))
    held = photo_crops(16, size=128, seed=1)
    with torch.no_grad():
        ref = model(held)
    scores = {
        obs: _integer_sqnr(_calibrated(model, calib, obs), held, ref)
        for obs in ("min_max", "percentile", "mse", "mix")
    }
    # measured here: min_max 12.5, percentile 13.9, mse 15.4, mix 15.4 dB
    assert scores["percentile"] > scores["min_max"] + 0.5
    assert scores["mse"] > scores["min_max"] + 1.5
    assert scores["mix"] >= scores["mse"] - 0.1
    learned = _calibrated(model, calib, "percentile")
    blocks = copy.deepcopy(learned)
    rows = weight_reconstruction(learned, calib, iters=20, show=False, show_progress=False)
    assert all(r["error_learned"] <= r["error_nearest"] for r in rows)
    assert _integer_sqnr(learned, held, ref) > scores["percentile"] + 1.0  # measured: 15.7 dB
    rows = weight_reconstruction(
        blocks, calib, iters=20, block_depth=2, show=False, show_progress=False
    )
    assert rows[2]["layer"] == "features.2.conv.0.0, features.2.conv.1.0, features.2.conv.2"
    assert _integer_sqnr(blocks, held, ref) > scores["percentile"] + 1.0  # measured: 15.9 dB


def test_learned_rounding_lowers_every_layer_error(setup):
    model, calib, _, _ = setup
    prepared = _calibrated(model, calib, "mse")
    rows = weight_reconstruction(prepared, calib, iters=60, show=False, show_progress=False)
    # per layer, the reconstruction error on the calibration data never grows (nearest rounding
    # is kept where learning does not help) and drops in total (a little here: this model loses
    # almost nothing to weight rounding; the pretrained test shows the real gain)
    assert all(r["error_learned"] <= r["error_nearest"] for r in rows)
    assert sum(r["error_learned"] for r in rows) < sum(r["error_nearest"] for r in rows)


def test_weight_reconstruction_keeps_the_prepared_form(setup):
    model, calib, held, ref = setup
    prepared = _calibrated(model, calib, "mse")
    keys = set(prepared.state_dict())
    scales = {
        n: m.weight_fake_quant.scale.clone()
        for n, m in prepared.named_modules()
        if hasattr(m, "weight_fake_quant")
    }
    rows = weight_reconstruction(
        prepared, calib, iters=30, bias_correction=True, show=False, show_progress=False
    )
    assert [r["layer"] for r in rows] == ["c1", "c2", "c3", "fc"]
    assert set(prepared.state_dict()) == keys
    for name, m in prepared.named_modules():
        if hasattr(m, "weight_fake_quant"):
            assert torch.equal(m.weight_fake_quant.scale, scales[name])
            w = m.folded_weight() / m.weight_fake_quant.scale.reshape(
                [-1] + [1] * (m.weight.dim() - 1)
            )
            assert (w - w.round()).abs().max() < 1e-3  # the weights now lie on their grid
    fxq.set_fake_quantize(prepared, "qat")  # QAT continues from here
    prepared.train()
    loss = prepared(held[:8]).square().mean()
    loss.backward()
    assert prepared.c1.weight.grad is not None


def test_weight_reconstruction_needs_calibration(setup):
    model, calib, _, _ = setup
    with pytest.raises(RuntimeError, match="needs a calibrated model"):
        weight_reconstruction(
            fxq.prepare_qat_fx(model, {"": get_default_qconfig()}), calib, show=False
        )


def test_auto_calibrate_reports_choices(setup, capsys):
    model, calib, held, ref = setup
    prepared = fxq.prepare_qat_fx(model, {"": get_default_qconfig()})
    observers = {
        n: type(m.observer) for n, m in prepared.named_modules() if isinstance(m, fxq.FakeQuantize)
    }
    rows = auto_calibrate(prepared, calib, eval_batches=2, show_progress=False)
    assert "chosen" in capsys.readouterr().out
    assert {r["chosen"] for r in rows} <= {"min_max", "percentile", "mse", "kl"}
    assert [r["layer"] for r in rows][:3] == ["x_quant", "c1", "c2"]
    # observers are kept (QAT can follow); only the scales were chosen
    assert {
        n: type(m.observer) for n, m in prepared.named_modules() if isinstance(m, fxq.FakeQuantize)
    } == observers
    # on its evaluation batches the greedy choice can only improve on starting from mse everywhere
    evaluation = calib[:2]
    fxq.set_fake_quantize(prepared, "validation")
    mse_model = _calibrated(model, calib, "mse")
    fxq.set_fake_quantize(mse_model, "validation")
    with torch.no_grad(), float_fake_quant(prepared), float_fake_quant(mse_model):
        with bypass(prepared):
            targets = [prepared(b) for b in evaluation]
        chosen = sum(float((prepared(b) - t).square().sum()) for b, t in zip(evaluation, targets))
        start = sum(float((mse_model(b) - t).square().sum()) for b, t in zip(evaluation, targets))
    assert chosen <= start * 1.001
    with pytest.raises(ValueError, match="unknown candidates"):
        auto_calibrate(prepared, calib, candidates=("median",), show=False)


def test_calibrate_handles_batches_limits_and_progress(bayes):
    class Takes2(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)

        def forward(self, image, mask):
            return self.conv(image) * mask

    model = fxq.prepare_qat_fx(Takes2(), {"": get_default_qconfig()})
    seen = []
    model.conv.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0]))
    image, mask, labels = torch.randn(4, 3, 2, 2), torch.ones(4, 3, 2, 2), torch.zeros(4)
    err = io.StringIO()
    with redirect_stderr(err):
        calibrate(model, [(image, mask, labels)] * 5, num_batches=3, show_progress=True)
    assert seen == [4, 4, 4]  # stopped at num_batches, labels dropped
    assert "calibrating [" in err.getvalue() and "3/3" in err.getvalue()
    assert batch_arguments(model, {"image": image, "mask": mask}) == (
        (),
        {"image": image, "mask": mask},
    )
    with pytest.raises(ValueError, match=r"keys \['img'\], none of which is an input of"):
        batch_arguments(model, {"img": image})  # data_contract tests: the whole message
    assert batch_arguments(model, {"img": image}, input_fn=lambda b: (b,)) == (
        ({"img": image},),
        {},
    )
    assert (
        batch_arguments(model, (image,), input_fn=lambda b: {"image": b[0], "mask": mask})[1][
            "mask"
        ]
        is mask
    )
    with pytest.raises(ValueError, match="yielded no batch"):
        calibrate(model, [])
    calibrated = copy.deepcopy(model)
    assert all(bool(m.observed) for m in calibrated.modules() if isinstance(m, fxq.FakeQuantize))


def test_block_wise_reconstruction(setup):
    model, calib, held, ref = setup
    prepared = _calibrated(model, calib, "mse")
    # depth 0: one block from the first conv to the classifier, with the mean in between
    rows = weight_reconstruction(
        prepared, calib, iters=30, block_depth=0, show=False, show_progress=False
    )
    assert [r["layer"] for r in rows] == ["c1, c2, c3, fc"]
    assert rows[0]["error_learned"] <= rows[0]["error_nearest"]
    fxq.set_fake_quantize(prepared, "validation")
    with torch.no_grad():
        assert torch.equal(prepared(held), fxq.convert_fx(prepared)(held))
    assert not hasattr(prepared.c1, "quantized_weight") or callable(
        type(prepared.c1).quantized_weight
    )
    with pytest.raises(ValueError, match="needs the GraphModule"):
        weight_reconstruction(
            nn.Sequential(nn.Linear(2, 2)), [torch.zeros(1, 2)], block_depth=1, show=False
        )


def test_weight_reconstruction_streams_the_model_once(setup, request):
    """On a GraphModule every layer's inputs and targets come from one run of the model (and
    one of its float copy), not one run per layer; the result is the hook-based one's."""
    model, calib, _, _ = setup
    prepared = _calibrated(model, calib, "mse")
    hooked = copy.deepcopy(prepared)
    calls = []
    prepared.c1.register_forward_hook(lambda *a: calls.append(1))
    rows = weight_reconstruction(
        prepared, calib, iters=20, bias_correction=True, show=False, show_progress=False
    )
    # one call per batch from each stream (the float reference is a copy of the model, hook
    # included); the layer order is the graph's (no run)
    assert len(calls) == 2 * len(calib)
    request.getfixturevalue("layer_by_layer")
    calls.clear()
    hooked.c1.register_forward_hook(lambda *a: calls.append(1))
    rows_hooked = weight_reconstruction(
        hooked, calib, iters=20, bias_correction=True, show=False, show_progress=False
    )
    assert len(calls) > 2 * len(calib)  # the models re-ran up to each layer
    for a, b in zip(rows, rows_hooked):
        assert a["layer"] == b["layer"]
        assert a["error_learned"] == pytest.approx(b["error_learned"], rel=1e-4)
        assert a["bias_shift"] == pytest.approx(b["bias_shift"], rel=1e-4, abs=1e-9)
    for name in ("c1", "c2", "c3", "fc"):
        assert torch.allclose(
            prepared.get_submodule(name).folded_weight(),
            hooked.get_submodule(name).folded_weight(),
            atol=1e-6,
        )


def test_weight_reconstruction_learns_from_the_first_samples(setup):
    """``num_samples`` keeps the first whole batches holding that many samples (the streams
    then run those only); the layer order is read from the graph when the graph calls every
    layer, else from a run."""
    from fxq.calibration.reconstruction import _graph_order, leading_batches
    from fxq.calibration.runner import call_order
    from fxq.qat.weighted import WeightedQAT

    model, calib, _, _ = setup  # 4 batches of 16
    prepared = _calibrated(model, calib, "min_max")
    assert leading_batches(prepared, calib, 17) == calib[:2]
    assert leading_batches(prepared, calib, 16) == calib[:1]
    assert leading_batches(prepared, calib, 1000) == calib
    assert leading_batches(prepared, [(b, 0) for b in calib], 20) == [(b, 0) for b in calib[:2]]
    with pytest.raises(ValueError, match="num_samples must be at least 1, got 0"):
        leading_batches(prepared, calib, 0)
    calls = []
    prepared.c1.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    weight_reconstruction(prepared, calib, num_samples=20, iters=2, show=False)
    assert calls == [16, 16, 16, 16]  # two batches, through the model and its float copy
    layers = [m for m in prepared.modules() if isinstance(m, WeightedQAT)]
    assert _graph_order(prepared, layers) == call_order(prepared, layers, calib[0])
    outside = copy.deepcopy(prepared.c1)  # a layer the graph does not call
    assert _graph_order(prepared, [*layers, outside]) is None


def test_auto_blocks_are_the_repeated_elements():
    """``block_depth="auto"`` cuts at the first index after the first component: the depth-2
    blocks of CNNs, one encoder layer of a BERT (depth 2 would make the whole encoder one)."""
    from fxq.calibration.reconstruction import _blocks, block_key

    assert (
        block_key("features.3.conv.0.0", "auto")
        == "features.3"
        == block_key("features.3.conv.0.0", 2)
    )
    assert block_key("layer1.0.conv1", "auto") == "layer1.0"
    assert block_key("_blocks.12._project_conv", "auto") == "_blocks.12"
    assert block_key("0.1.conv.1", "auto") == "0.1"  # a Sequential at the top
    assert block_key("bert.encoder.layer.4.attention.self.query", "auto") == (
        "bert.encoder.layer.4"
    )
    assert block_key("encoder.layer.4.output.dense", 2) == "encoder.layer"
    assert block_key("_conv_stem", "auto") == "_conv_stem"
    assert block_key("pooler.dense", "auto") == "pooler.dense"
    names = ["embeddings.x", "encoder.layer.0.q", "encoder.layer.0.o", "encoder.layer.1.q"]
    layers = [(n, None) for n in names]
    assert [[n for n, _ in g] for g in _blocks(layers, "auto")] == [
        ["embeddings.x"],
        ["encoder.layer.0.q", "encoder.layer.0.o"],
        ["encoder.layer.1.q"],
    ]
    with pytest.raises(ValueError, match="block_depth must be None, an int >= 0 or 'auto'"):
        weight_reconstruction(nn.Sequential(nn.Linear(2, 2)), [torch.zeros(1, 2)], block_depth=-1)


def test_blocks_fall_back_to_layers_when_the_model_cannot_be_streamed(setup, request):
    """Blocks are cut from the graph's streams; where the layers cannot be streamed (layers
    run inside other modules; simulated here), the learning goes layer by layer and says
    so, instead of failing."""
    model, calib, _, _ = setup
    prepared = _calibrated(model, calib, "min_max")
    request.getfixturevalue("layer_by_layer")
    with pytest.warns(UserWarning, match="cannot be cut into blocks; learning layer by layer"):
        rows = weight_reconstruction(prepared, calib, iters=5, block_depth="auto", show=False)
    assert [r["layer"] for r in rows] == ["c1", "c2", "c3", "fc"]
    assert all(r["error_learned"] <= r["error_nearest"] for r in rows)


class _Interrupt(Exception):
    pass


def test_failures_part_way_leave_the_model_as_it_was(setup):
    model, calib, _, _ = setup
    prepared = _calibrated(model, calib, "mse")
    before = {k: v.clone() for k, v in prepared.state_dict().items()}
    calls = []
    # weight_reconstruction: call 1 finds the layer order, the next ones come when the
    # streams reach fc, after c1, c2 and c3 were changed; auto_calibrate: after the statistics
    # pass (4 calls), while the scales are being chosen
    limit = [2]

    def interrupt(module, inputs):
        calls.append(1)
        if len(calls) > limit[0]:
            raise _Interrupt

    handle = prepared.fc.register_forward_pre_hook(interrupt)
    with pytest.raises(_Interrupt):
        weight_reconstruction(
            prepared, calib, iters=5, bias_correction=True, show=False, show_progress=False
        )
    with pytest.raises(_Interrupt):
        calls.clear()
        limit[0] = 12
        auto_calibrate(prepared, calib, show=False, show_progress=False)
    handle.remove()
    after = prepared.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert (
        prepared.c3.bias is not None
        and prepared.fc.weight_fake_quant.state is fxq.FakeQuantState.CALIBRATION
    )


# -- failures leave the model as it was; clear messages ---------------------------------------
def _modes(model):
    return (
        {n: m.training for n, m in model.named_modules()},
        {
            n: m.state
            for n, m in model.named_modules()
            if isinstance(getattr(m, "state", None), fxq.FakeQuantState)
        },
    )


def _training_qat_model():
    prepared = fxq.prepare_qat_fx(OutlierNet(), {"": get_default_qconfig()})
    prepared.train()
    prepared.c2.eval()  # a submodule in another mode than its parent: restored too
    fxq.set_fake_quantize(prepared, "qat")
    prepared.c1.activation_post_process.set_fake_quant_state("validation")
    return prepared


def test_calibrate_with_no_batch_names_the_argument_and_restores_the_model(bayes):
    prepared = _training_qat_model()
    before = _modes(prepared)
    for data in ([], iter([]), (b for b in [])):
        with pytest.raises(ValueError) as info:
            calibrate(prepared, data, show_progress=False)
        message = str(info.value)
        assert "calibrate: `data` (" in message and "yielded no batch" in message
        assert "Pass a non-empty iterable of batches" in message
        assert "left in the mode and fake-quant state it had" in message
        assert _modes(prepared) == before
    with pytest.raises(ValueError, match=r"num_batches must be a positive integer or None.* 0"):
        calibrate(prepared, [torch.randn(1, 3, 12, 12)], num_batches=0, show_progress=False)
    assert _modes(prepared) == before


def test_a_failing_batch_restores_modes_and_states(bayes):
    prepared = _training_qat_model()
    before = _modes(prepared)
    with pytest.raises(RuntimeError):
        calibrate(prepared, [torch.randn(1, 3, 12, 12), torch.randn(1, 5, 12, 12)])
    assert _modes(prepared) == before


def test_an_empty_first_batch_is_skipped(bayes):
    """An empty batch carries no statistics: the scales are those of the other batches."""
    model = OutlierNet().eval()
    x = _data(8, 0)
    with_empty = fxq.prepare_qat_fx(model, {"": get_default_qconfig()})
    reference = copy.deepcopy(with_empty)
    calibrate(with_empty, [x[:0], x], show_progress=False)
    calibrate(reference, [x], show_progress=False)
    assert with_empty.state_dict().keys() == reference.state_dict().keys()
    for key, value in reference.state_dict().items():
        assert torch.equal(with_empty.state_dict()[key], value), key


class _Vanishing(nn.Module):
    """Activations around 1e-9, as in a randomly initialised deep network."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.head(self.conv(x) * 1e-9)


def test_calibrating_vanishing_activations_warns_with_the_layer_and_its_range(bayes):
    prepared = fxq.prepare_qat_fx(
        _Vanishing(), {"": get_default_qconfig()}, example_inputs=(torch.randn(1, 3, 4, 4),)
    )
    x = torch.randn(2, 3, 4, 4)
    with pytest.warns(UserWarning) as record:
        calibrate(prepared, [x], show_progress=False)
    messages = [str(w.message) for w in record if "smallest scale 2**-23" in str(w.message)]
    assert len(messages) == 1, messages
    (message,) = messages
    names = {n: m.name for n, m in prepared.named_modules() if isinstance(m, fxq.FakeQuantize)}
    floored = [
        n
        for n, m in prepared.named_modules()
        if isinstance(m, fxq.FakeQuantize) and m.name in message
    ]
    assert floored, (message, names)
    fq = dict(prepared.named_modules())[floored[0]]
    low, high = float(fq.observer.min_val), float(fq.observer.max_val)
    assert abs(high) < 1e-7 and f"[{low:.3g}, {high:.3g}]" in message
    assert "quantizes to 0" in message or "levels" in message
    # the warning comes once per fake quant, not at every state switch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fxq.set_fake_quantize(prepared, "validation")
        with torch.no_grad():
            prepared(x)


class _Viewing(nn.Module):
    def __init__(self, as_other: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.as_other = as_other

    def forward(self, x):
        y = self.conv(x)
        if self.as_other:
            return y.view_as(y.flatten(1))
        return y.view(y.shape[0], -1)  # both fail on a channels_last tensor


def test_fast_layout_gives_images_channels_last_only_where_every_op_allows(bayes):
    """On CPU ``ptq`` runs 4-d images channels_last (convolutions take half the time), but
    only through models whose every op works in any layout; nothing else changes."""
    from fxq.calibration.runner import fast_layout

    prepared = fxq.prepare_qat_fx(OutlierNet().eval(), {"": get_default_qconfig()})
    x, labels = _data(4, 0), torch.arange(4)
    batches = [x, (x, labels), {"x": x}, x.to(torch.int32)]
    fast = fast_layout(prepared, batches)
    cl = torch.channels_last
    assert fast[0].is_contiguous(memory_format=cl) and torch.equal(fast[0], x)
    assert fast[1][0].is_contiguous(memory_format=cl) and fast[1][1] is labels
    assert type(fast[1]) is tuple and fast[2]["x"].is_contiguous(memory_format=cl)
    assert fast[3] is batches[3]  # integers (camera frames) keep their layout
    viewing = fxq.prepare_qat_fx(_Viewing(), {"": get_default_qconfig()})
    assert fast_layout(viewing, batches) is batches
    assert fast_layout(prepared, batches, input_fn=lambda b: b) is batches  # it may view them
    viewing_as = fxq.prepare_qat_fx(_Viewing(as_other=True), {"": get_default_qconfig()})
    assert fast_layout(viewing_as, batches) is batches
    ptq_model = fxq.calibration.ptq(viewing, [x], method="calibrate", show_progress=False)
    assert ptq_model(x).shape == (4, 400)  # the view still works: its batches kept the layout


def test_ptq_in_channels_last_gives_the_scales_of_the_default_layout(setup, monkeypatch):
    """The layout changes only the order in which the convolutions sum."""
    import importlib

    model, calib, _, _ = setup
    qconfig = {"": get_default_qconfig()}

    def scales(**kw):
        prepared = fxq.prepare_qat_fx(model, qconfig)
        fxq.calibration.ptq(prepared, calib, show_progress=False, **kw)
        return {n: b for n, b in prepared.named_buffers() if n.endswith("scale")}

    fast = scales(method="calibrate")
    monkeypatch.setattr(
        importlib.import_module("fxq.calibration.ptq"), "fast_layout", lambda m, b, f=None: b
    )
    plain = scales(method="calibrate")
    assert len(fast) == len(plain) > 6
    for name, b in fast.items():
        torch.testing.assert_close(b, plain[name], rtol=1e-5, atol=0, msg=name)
