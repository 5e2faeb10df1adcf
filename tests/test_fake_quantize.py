import ast
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import fxq
import fxq.debug
from fxq.fake_quantize import FakeQuantize, FakeQuantState, bypass, set_fake_quantize
from fxq.observer import MinMaxObserver, PerChannelMinMaxObserver
from fxq.qconfig import default_qat_8bit_fake_quant_qconfig


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


def test_training_rounding_gives_validation_the_qat_formula_within_the_block(bayes):
    """Learned rounding's steps round as QAT training does (three passes fewer); the
    formulas differ at the float just below a half, where only the exact one rounds down."""
    from fxq.fake_quantize import training_rounding

    fq = _fq()
    fq.scale.fill_(1.0)
    fq.observed.fill_(True)
    fq.set_fake_quant_state("validation")
    x = torch.tensor([0.5 - 2**-25, 1.5, -2.5, 7.3])
    assert fq(x).tolist() == [0.0, 2.0, -2.0, 7.0]
    with training_rounding(nn.Sequential(fq)):
        assert fq(x).tolist() == [1.0, 2.0, -2.0, 7.0]
        with training_rounding(fq):  # re-entrant
            pass
        assert fq.inexact
    assert fq(x).tolist() == [0.0, 2.0, -2.0, 7.0] and "inexact" not in fq.__dict__


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


# -- dtypes and devices ----------------------------------------------------------------------
def _observed(bayes_scale: float = 1 / 127, **kw) -> FakeQuantize:
    fq = _fq(**kw)
    fq.set_fake_quant_state("calibration")
    fq(torch.tensor([-127 * bayes_scale, 127 * bayes_scale]))
    return fq


@pytest.mark.parametrize(
    "convert",
    [
        lambda m: m.half(),
        lambda m: m.to(torch.bfloat16),
        lambda m: m.double(),
        lambda m: m.to(torch.float64),
        lambda m: m.half().float(),
    ],
    ids=["half", "bfloat16", "double", "to_float64", "half_then_float"],
)
def test_scale_and_statistics_stay_float32_under_dtype_conversions(bayes, convert):
    fq = _observed(0.0123)
    before = {name: t.clone() for name, t in fq.named_buffers()}
    convert(fq)
    for name, t in fq.named_buffers():
        assert t.dtype == before[name].dtype and torch.equal(t, before[name]), name
    assert fq.scale.dtype is torch.float32 and fq.scale.item() == pytest.approx(0.0123)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_inputs_are_quantized_in_float32_with_the_exact_scale(bayes, dtype):
    fq = _observed(0.0123)  # not a float16 / bfloat16 number
    fq.set_fake_quant_state("validation")
    x = torch.linspace(-1.5, 1.5, 1001).to(dtype)
    out = fq(x)
    assert out.dtype is dtype
    # the same as quantizing the float32 values with the float32 scale, then converting
    assert torch.equal(out, fq(x.float()).to(dtype))
    # and not what a scale rounded to the input's dtype would give
    rounded = fq.scale.to(dtype).float()
    assert not torch.equal(out, (torch.floor(x.float() / rounded + 0.5) * rounded).to(dtype))
    if dtype is torch.float16:  # float16 holds every int8 grid value closely enough
        q = torch.floor(x.float() / fq.scale + 0.5).clamp(-128, 127)
        assert torch.equal(torch.floor(out.float() / fq.scale + 0.5), q)


def test_float64_inputs_divide_in_float64(bayes):
    fq = _observed(0.0123)
    fq.set_fake_quant_state("validation")
    x = torch.linspace(-1.5, 1.5, 1001, dtype=torch.float64)
    out = fq(x)
    assert out.dtype is torch.float64
    q = torch.floor(x / fq.scale.double() + 0.5).clamp(-128, 127)
    assert torch.equal(out, q * fq.scale.double())


def test_integer_inputs_are_quantized_with_the_exact_float_scale(bayes):
    frames = torch.arange(256, dtype=torch.uint8)
    for state in ("qat", "validation"):
        a, b = _fq(), _fq()
        a.set_fake_quant_state("calibration")
        b.set_fake_quant_state("calibration")
        assert torch.equal(a(frames), b(frames.float()))  # observes the same range
        assert a.scale.item() == pytest.approx(255 / 127)
        a.set_fake_quant_state(state)
        b.set_fake_quant_state(state)
        out = a(frames)
        assert out.dtype is torch.float32
        assert torch.equal(out, b(frames.float()))


def test_empty_tensors_carry_no_statistics(bayes):
    fq = _fq()
    fq.set_fake_quant_state("calibration")
    empty = torch.empty(0, 3)
    assert fq(empty).shape == (0, 3)
    assert not bool(fq.observed)  # nothing seen yet: VALIDATION would still refuse
    fq(torch.tensor([-1.0, 2.54]))
    assert fq.scale.item() == pytest.approx(2.54 / 127)
    fq.set_fake_quant_state("qat")
    assert fq(empty).shape == (0, 3)
    assert fq.scale.item() == pytest.approx(2.54 / 127)


# -- the scale floor -------------------------------------------------------------------------
def test_a_range_below_the_scale_floor_warns_once_with_the_name_and_range(bayes):
    fq = _fq()
    fq.set_name("the output of 'blocks.3.conv'")
    fq.set_fake_quant_state("calibration")
    x = torch.tensor([-2e-9, 1e-9, 3e-9])
    fq(x)
    with pytest.warns(UserWarning) as record:
        fq.set_fake_quant_state("validation")
    message = str(record[0].message)
    assert "fake quant the output of 'blocks.3.conv'" in message
    assert "[-2e-09, 3e-09]" in message
    assert "below fxq's smallest scale 2**-23" in message
    assert "every value quantizes to 0" in message
    assert "randomly initialised" in message and "qconfig of None" in message
    assert torch.equal(fq(x), torch.zeros(3))  # what the warning announced
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per fake quant
        fq.set_fake_quant_state("qat")
        fq.set_fake_quant_state("validation")
        fq(x)


def test_a_weight_below_the_scale_floor_gets_advice_about_weights(bayes):
    """A trained LayerNorm's gammas near 1e-33 (all-MiniLM-L6-v2): no talk of activations."""
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8)).eval()
    with torch.no_grad():
        model[1].weight[:3] = 1e-33
    qat = fxq.prepare_qat_fx(model, {"": fxq.qconfig.default_calib_8bit_fake_quant_qconfig})
    with pytest.warns(UserWarning) as record:
        fxq.calibration.calibrate(qat, [torch.randn(4, 4)], show_progress=False)
    (message,) = [str(w.message) for w in record if "the weight of '1'" in str(w.message)]
    assert "3 of its 8 channels saw values of magnitude at most 1e-33" in message
    assert "These weights are (nearly) zero there" in message
    assert "vanishing activations" not in message and "randomly initialised" not in message


def test_ranges_above_the_floor_and_all_zero_tensors_do_not_warn(bayes):
    for x in (torch.zeros(4), torch.tensor([-1e-3, 2e-3]), torch.tensor([1e-4])):
        fq = _fq()
        fq.set_fake_quant_state("calibration")
        fq(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fq.set_fake_quant_state("validation")
            fq(x)


def test_per_channel_ranges_below_the_floor_name_the_channels(bayes):
    fq = FakeQuantize(observer=PerChannelMinMaxObserver, ch_axis=0, num_channels=3)
    fq.set_name("the weight of 'fc'")
    w = torch.tensor([[1.0, -0.5], [1e-10, -2e-10], [0.25, 0.0]])
    fq(w)
    with pytest.warns(UserWarning, match=r"the weight of 'fc': 1 of its 3 channels saw values"):
        fq.set_fake_quant_state("validation")


# -- bypass --------------------------------------------------------------------------------
def _prepared_validating():
    from tests.helpers import ResidualNet

    model = fxq.prepare_qat_fx(ResidualNet(), {"": default_qat_8bit_fake_quant_qconfig})
    x = torch.randn(2, 3, 8, 8)
    fxq.set_fake_quantize(model, "calibration")
    model.eval()
    with torch.no_grad():
        model(x)
    fxq.set_fake_quantize(model, "validation")
    return model, x


def test_bypass_is_reentrant(bayes):
    model, x = _prepared_validating()
    with torch.no_grad():
        quantized = model(x)
        with bypass(model):
            reference = model(x)  # the float computation
            with bypass(model):
                assert torch.equal(model(x), reference)
            # the inner exit must not undo the outer block
            assert model.stem.state is FakeQuantState.CALIBRATION
            assert not model.stem.simulate_integer
            assert model.stem.activation_post_process.bypassed
            assert torch.equal(model(x), reference)
            with bypass(model.conv1):  # a part of the model
                assert torch.equal(model(x), reference)
            assert torch.equal(model(x), reference)
        assert not torch.equal(quantized, reference)
        assert model.stem.state is FakeQuantState.VALIDATION
        assert model.stem.simulate_integer and "simulate_integer" not in model.stem.__dict__
        assert not model.stem.activation_post_process.bypassed
        assert torch.equal(model(x), quantized)


def test_bypass_inside_float_fake_quant_restores_it(bayes):
    model, x = _prepared_validating()
    with fxq.debug.float_fake_quant(model):
        with bypass(model):
            pass
        assert not model.stem.simulate_integer
        assert model.stem.state is FakeQuantState.VALIDATION
    assert model.stem.simulate_integer


# -- layering ------------------------------------------------------------------------------
def _imported_modules(path: Path) -> set[str]:
    """Every module a source file imports, at the top or inside functions."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_fake_quantize_does_not_import_the_qat_modules():
    imported = _imported_modules(Path(fxq.fake_quantize.__file__))
    assert not {m for m in imported if m == "fxq.qat" or m.startswith("fxq.qat.")}
    assert not {m for m in imported if m.startswith(("fxq.fx", "fxq.calibration"))}


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("ch_axis", [None, 1])
def test_no_grad_path_equals_the_autograd_path(bayes, exact, dtype, ch_axis):
    # without a gradient to record, fake_quantize_ste skips the mask: the same numbers
    from fxq.fake_quantize import fake_quantize_ste
    from fxq.march.spec import Rounding

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 3, 5, 5, generator=g) * 3).to(dtype)
    x[0, 0, 0, :3] = torch.tensor([0.5 - 2**-25, 0.25, -0.25])  # ties and the float below 1/2
    scale = torch.tensor([0.5]) if ch_axis is None else torch.tensor([0.5, 0.03, 1.0])
    for qdtype in (fxq.qint8, fxq.qint16):
        ste = fake_quantize_ste(
            x.clone().requires_grad_(), scale, qdtype, Rounding.HALF_UP, ch_axis, exact
        )
        with torch.no_grad():
            plain = fake_quantize_ste(
                x.clone().requires_grad_(), scale, qdtype, Rounding.HALF_UP, ch_axis, exact
            )
        direct = fake_quantize_ste(x, scale, qdtype, Rounding.HALF_UP, ch_axis, exact)
        assert ste.dtype == plain.dtype == direct.dtype == dtype
        assert torch.equal(ste.detach(), plain) and torch.equal(plain, direct)
        assert not plain.requires_grad and ste.requires_grad
        # in place (a caller's own tensor): the same numbers, in x's memory where x has the
        # result's dtype; a float16 x is rounded in float32 and left as it was
        own = x.clone()
        rounded = fake_quantize_ste(own, scale, qdtype, Rounding.HALF_UP, ch_axis, exact, True)
        assert torch.equal(rounded, direct)
        assert (rounded.data_ptr() == own.data_ptr()) == (dtype is not torch.float16)
        assert torch.equal(own, rounded if dtype is not torch.float16 else x)


def test_layers_round_their_own_outputs_in_place_unless_something_reads_them(bayes):
    """A conv's output fake quant rounds the conv's own output in place without autograd;
    a hook on the fake quant (the debugging tools record its input) keeps the copy."""
    from fxq.debug import float_fake_quant
    from fxq.fake_quantize import quantize_in_place

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    prepared = fxq.prepare_qat_fx(model, {"": default_qat_8bit_fake_quant_qconfig})
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    prepared(x)
    fxq.set_fake_quantize(prepared, FakeQuantState.VALIDATION)
    conv = next(m for m in prepared.modules() if isinstance(m, fxq.qat.Conv2d))
    fq = conv.activation_post_process
    with float_fake_quant(prepared):
        reference = prepared(x).detach()  # autograd on: rounded into a new tensor
        seen = []
        handle = fq.register_forward_hook(lambda m, args, out: seen.append((args[0], out)))
        with torch.no_grad():
            assert not quantize_in_place(fq, x)  # a hook reads the input
            hooked = prepared(x)
        handle.remove()
        ((before, after),) = seen
        assert before.data_ptr() != after.data_ptr() and not torch.equal(before, after)
        with torch.no_grad():
            assert quantize_in_place(fq, x)
            assert torch.equal(prepared(x), reference) and torch.equal(hooked, reference)
    assert not quantize_in_place(fq, x.requires_grad_())

    class OwnForward(FakeQuantize):  # a user's fake quant with forward(x) only
        def forward(self, x):
            return super().forward(x)

    assert not quantize_in_place(OwnForward(observer=MinMaxObserver), x.detach())


def test_a_qat_fake_quant_step_makes_few_ops(monkeypatch, bayes):
    """On a GPU each small op of a fake quant is a kernel launch and a Python call, and those
    bound the QAT step (an H100 spent 22 ms of kernels and 65 ms on the host per ResNet-18
    step, with 52 ops per activation fake quant): counted here on the CPU with the
    accelerator's deferred NaN check (52 and 37 ops before). Activation: aminmax, NaN flag
    (2), moving average (6), scale (4), fake quant (7), backward: one ``where``; weight: amin
    and amax, NaN flag (2), copy, scale (4), fake quant (6: no mask, as its own range bounds
    it), backward: none."""
    import fxq.observer
    from fxq.quantized import native
    from tests.helpers import RecordedOps

    shape_only = {"detach", "view", "transpose", "reshape", "expand", "scalar_tensor"}

    monkeypatch.setattr(fxq.observer, "IMMEDIATE_CHECK_DEVICES", ())
    # the torch ops of the rounding, as on a GPU without the fused op (on the CPU they are
    # one pass of the native kernel, which records no op)
    monkeypatch.setattr(native, "fake_quantize", lambda *args, **kwargs: None)
    q = default_qat_8bit_fake_quant_qconfig
    cases = ((q.activation(), (4, 8, 6, 6), 20, ["where"]), (q.weight(), (8, 4, 3, 3), 15, []))
    for fq, shape, most, backward_ops in cases:
        fq.set_fake_quant_state("qat")
        x = torch.randn(shape, requires_grad=True)
        fq(x)
        fq(x)  # the NaN flag and the statistics exist from here on
        with RecordedOps(ignore=shape_only) as forward:
            y = fq(x)
        grad = torch.ones_like(y)
        with RecordedOps(ignore=shape_only) as backward:
            torch.autograd.grad(y, x, grad)
        assert len(forward.names) <= most, forward.names
        assert backward.names == backward_ops, backward.names


def _saved_dtypes(fq: FakeQuantize, x: torch.Tensor) -> tuple[list[torch.dtype], torch.Tensor]:
    """The dtypes of the tensors ``fq(x)`` saves for its backward pass, and its output."""
    saved = []

    def pack(t):
        saved.append(t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fq(x)
    return saved, out


def _covering_inputs(shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Tensors across float32's range, with constant, zero, one-spike and one-sided rows."""
    g = torch.Generator().manual_seed(0)
    out = [torch.randn(shape, generator=g) * 10.0**k for k in range(-36, 37, 4)]
    edge = torch.randn(shape, generator=g)
    edge[0] = 0.0
    edge[1] = 0.37
    edge[2] = 0.0
    edge[2].view(-1)[3] = -5.5
    edge[3] = edge[3].abs() + 1.0
    out += [edge, edge * 1e-40, edge * 3e37, -edge]
    return out


@pytest.mark.parametrize("dtype", ["qint8", "qint16"])
@pytest.mark.parametrize("observer", [PerChannelMinMaxObserver, MinMaxObserver])
def test_a_tensor_its_own_statistics_cover_is_never_clipped(bayes, observer, dtype):
    """A weight (latest per-channel min / max) or a running min / max covers what it rounds:
    every value rounds inside the grid, so the straight-through gradient passes everywhere
    and the fake quant makes and keeps no mask (``_clips_gradient`` is False)."""
    from fxq.quantized import functional as qf

    shape = (6, 5, 3, 3)
    kw = {"ch_axis": 0, "num_channels": 6} if observer is PerChannelMinMaxObserver else {}
    fq = FakeQuantize(observer=observer, dtype=dtype, **kw)
    fq.set_fake_quant_state(FakeQuantState.QAT)
    assert not fq._clips_gradient()
    for x in _covering_inputs(shape):
        x.requires_grad_()
        dtypes, out = _saved_dtypes(fq, x)
        assert torch.bool not in dtypes
        grad = torch.randn(shape)
        out.backward(grad)
        assert torch.equal(x.grad, grad)
        d = fq.dtype
        _, inside = qf.fake_quantize(
            x.detach(), fq.scale, d.qmin, d.qmax, fq.rounding, fq.ch_axis, exact=False
        )
        assert bool(inside.all()), float(x.detach().abs().max())


def test_a_fake_quant_that_can_clip_keeps_its_mask(bayes):
    """A moving average lags the batch, and an unsigned grid clamps negative values: both
    clip, so they keep the mask (one bool tensor saved)."""
    moving = FakeQuantize(observer=fxq.observer.MovingAverageMinMaxObserver)
    unsigned = _fq()
    unsigned.activation_post_process(torch.rand(10))
    unsigned.set_offset(128)
    for fq in (moving, unsigned):
        fq.set_fake_quant_state(FakeQuantState.QAT)
        assert fq._clips_gradient()
        dtypes, _ = _saved_dtypes(fq, torch.randn(10, requires_grad=True))
        assert dtypes == [torch.bool]


def test_a_qat_step_without_the_weights_masks_has_the_same_gradients(bayes):
    """The model's gradients equal those of the same step with every mask made and applied."""
    import copy

    from tests.helpers import ResidualNet

    torch.manual_seed(0)
    model = fxq.prepare_qat_fx(ResidualNet(), {"": default_qat_8bit_fake_quant_qconfig}).train()
    set_fake_quantize(model, FakeQuantState.QAT)
    reference = copy.deepcopy(model)
    fakes = [m for m in reference.modules() if isinstance(m, FakeQuantize)]
    unclipped = [
        m for m in model.modules() if isinstance(m, FakeQuantize) and not m._clips_gradient()
    ]
    assert {m.name for m in unclipped} == {
        m.name for m in fakes if isinstance(m.activation_post_process, PerChannelMinMaxObserver)
    }
    assert len(unclipped) >= 4
    for fq in fakes:
        fq._clips_gradient = lambda: True
    for step in range(3):
        x = torch.randn(8, 3, 12, 12, generator=torch.Generator().manual_seed(step)) * (step + 1)
        for m in (model, reference):
            m.zero_grad()
            m(x).square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad), (step, name)


def test_the_scale_for_an_all_zero_value_costs_an_op_per_extra_input(bayes):
    """A fake quant with ``zero_range_inputs`` computes their largest scale at every QAT
    step: one ``maximum`` per input after the first, no op to reshape or move a scale that
    is one element on the same device; an input not yet observed counts as 0."""
    from tests.helpers import RecordedOps

    q = default_qat_8bit_fake_quant_qconfig
    a, b, unseen, out = (q.activation() for _ in range(4))
    for fq, gain in ((a, 1.0), (b, 5.0)):
        fq.set_fake_quant_state("qat")
        fq(torch.randn(4, 8) * gain)
    out.zero_range_inputs = (a, None, b, out)
    with RecordedOps() as ops:
        fallback = out._zero_range_scale()
    assert ops.names == ["maximum"]
    assert fallback.shape == (1,) and torch.equal(fallback, torch.maximum(a.scale, b.scale))
    out.zero_range_inputs = (a,)
    with RecordedOps() as ops:
        assert out._zero_range_scale() is a.scale
    assert ops.names == []
    out.zero_range_inputs = (unseen, a)
    assert torch.equal(out._zero_range_scale(), a.scale)  # the unseen one's scale times 0
