import copy

import pytest
import torch
from torch import nn

import fxq
import fxq.calibration
from fxq import qat
from fxq.qconfig import default_calib_8bit_fake_quant_qconfig as calib_q8
from fxq.qconfig import default_qat_8bit_fake_quant_qconfig as q8
from tests.helpers import ResidualNet, SeedNet, calibrate, fake_quant_modules, sqnr


def test_seed_example():
    from fxq import prepare_qat_fx
    from fxq.qconfig import default_qat_8bit_fake_quant_qconfig

    fxq.set_march("bayes")
    net = SeedNet()
    net.qconfig = default_qat_8bit_fake_quant_qconfig
    prepared = prepare_qat_fx(net)
    assert type(prepared.quant) is qat.QuantStub
    assert (
        type(prepared.conv) is qat.Conv2d and prepared.conv.fused_description() == "Conv2d+bn+relu"
    )
    assert prepared.conv.qconfig_source == "attribute: <root>.qconfig"
    out = prepared(torch.randn(2, 3, 8, 8))
    assert out.shape == (2, 8, 8, 8) and (out >= 0).all()


def test_prepare_never_modifies_its_input(bayes):
    net = ResidualNet()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    structure = [type(m) for m in net.modules()]
    prepared = fxq.prepare_qat_fx(net, {"": q8})
    prepared(torch.randn(2, 3, 8, 8))
    prepared.train()(torch.randn(2, 3, 8, 8)).sum().backward()
    assert [type(m) for m in net.modules()] == structure
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_exactly_one_fake_quant_per_quantized_value(bayes):
    prepared = fxq.prepare_qat_fx(ResidualNet(), {"": q8})
    activation_fqs = {
        n for n in fake_quant_modules(prepared) if n.endswith("activation_post_process")
    }
    # input stub, stem, conv1, conv2(+add+relu), pool, fc; flatten and relu keep their input's grid
    assert activation_fqs == {
        "x_quant.activation_post_process",
        "stem.activation_post_process",
        "conv1.activation_post_process",
        "conv2.activation_post_process",
        "pool.activation_post_process",
        "fc.activation_post_process",
    }
    # each QAT module links the fake quant of every tensor input
    assert prepared.conv2.input_quants == (
        prepared.conv1.activation_post_process,
        prepared.stem.activation_post_process,
    )
    assert prepared.fc.input_quants == (prepared.pool.activation_post_process,)


def test_inputs_are_quantized_automatically_without_stub(bayes):
    prepared = fxq.prepare_qat_fx(ResidualNet(), {"": q8})
    first = [n for n in prepared.graph.nodes if n.op == "call_module"][0]
    assert first.target == "x_quant" and first.args[0].op == "placeholder"


def test_quant_stub_scale_is_honoured(bayes):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant = fxq.QuantStub(scale=1 / 128)
            self.conv = nn.Conv2d(3, 3, 1)

        def forward(self, x):
            return self.conv(self.quant(x))

    prepared = fxq.prepare_qat_fx(M(), {"": q8})
    calibrate(prepared, [torch.randn(2, 3, 4, 4) * 100])
    assert prepared.quant.activation_post_process.scale.item() == 1 / 128


def test_module_called_twice_gets_an_observer_per_call(bayes):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)
            self.act = nn.Sigmoid()

        def forward(self, x):
            return self.act(self.conv(x)) + self.act(self.conv(x * 10.0))

    prepared = fxq.prepare_qat_fx(M(), {"": q8})
    calibrate(prepared, [torch.randn(4, 3, 4, 4)])
    convs = [prepared.conv, prepared.conv_call1]
    assert convs[0].weight is convs[1].weight
    small, large = (c.activation_post_process.scale.item() for c in convs)
    assert large == pytest.approx(10 * small, rel=0.3)
    acts = [m for m in prepared.modules() if isinstance(m, qat.LookupTableOp)]
    assert len(acts) == 2 and acts[0].activation_post_process is not acts[1].activation_post_process


def test_conv_bn_keeps_training_statistics_and_freezes(bayes):
    prepared = fxq.prepare_qat_fx(ResidualNet(), {"": q8}).train()
    bn = prepared.conv1.bn
    x = torch.randn(8, 3, 8, 8) * 3 + 1
    before = bn.running_mean.clone()
    prepared(x)
    assert not torch.equal(bn.running_mean, before)
    fxq.qat.freeze_bn_stats(prepared)
    frozen = bn.running_mean.clone()
    prepared(x)
    assert torch.equal(bn.running_mean, frozen)
    prepared.apply(fxq.qat.update_bn_stats)
    prepared(x)
    assert not torch.equal(bn.running_mean, frozen)


def test_calibration_mode_computes_the_float_model(bayes):
    """No rounding in CALIBRATION: the folded conv+bn math equals the float model."""
    net = ResidualNet()
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    x = torch.randn(4, 3, 8, 8)
    prepared = fxq.prepare_qat_fx(net, {"": q8})
    fxq.set_fake_quantize(prepared, "calibration")
    assert torch.allclose(prepared.eval()(x), net.eval()(x), atol=1e-5)
    # training mode: batch statistics, exactly like the float model in training mode
    net_copy = copy.deepcopy(net).train()
    assert torch.allclose(prepared.train()(x), net_copy(x), atol=1e-5)


def test_calibrated_state_dict_starts_the_qat_run(bayes):
    net = ResidualNet()
    calib = fxq.prepare_qat_fx(net, {"": calib_q8})
    calibrate(calib, [torch.randn(4, 3, 8, 8) for _ in range(3)])
    trained = fxq.prepare_qat_fx(net, {"": q8})
    missing = trained.load_state_dict(calib.state_dict())
    assert missing.missing_keys == [] and missing.unexpected_keys == []
    for name, fq in fake_quant_modules(calib).items():
        assert torch.equal(fake_quant_modules(trained)[name].scale, fq.scale)
    # the moving average continues from the calibrated range: one all-zero batch moves it by 1%
    obs = trained.x_quant.activation_post_process.observer
    lo, hi = obs.min_val.item(), obs.max_val.item()
    fxq.set_fake_quantize(trained, "qat")
    trained.eval()(torch.zeros(1, 3, 8, 8))
    assert obs.min_val.item() == pytest.approx(0.99 * lo)
    assert obs.max_val.item() == pytest.approx(0.99 * hi)


def test_validation_tracks_the_float_model(bayes):
    net = ResidualNet().eval()
    data = [torch.randn(8, 3, 8, 8) for _ in range(4)]
    prepared = calibrate(fxq.prepare_qat_fx(net, {"": calib_q8}), data)
    fxq.set_fake_quantize(prepared, "validation")
    x = torch.randn(8, 3, 8, 8)
    with torch.no_grad():
        assert sqnr(net(x), prepared(x)) > 25.0


def test_nothing_to_quantize_is_an_error(bayes):
    with pytest.raises(ValueError, match="nothing to quantize"):
        fxq.prepare_qat_fx(ResidualNet())


@pytest.mark.parametrize("with_example", [False, True])
def test_python_number_arguments(bayes, with_example):
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)

        def forward(self, x, k):  # k: a Python number, not annotated
            return self.conv(x) * k

    x = torch.randn(2, 3, 4, 4)
    example = (x, 3) if with_example else None
    prepared = fxq.prepare_qat_fx(Scaled(), {"": calib_q8}, example_inputs=example)
    # with example inputs fxq knows k is a number; without, k passes through its quantize stub
    assert ("k_quant" in dict(prepared.named_children())) is not with_example
    fxq.calibration.calibrate(prepared, [(x, 3)], show_progress=False)  # tuple batches: (x, k)
    fxq.set_fake_quantize(prepared, "validation")
    with torch.no_grad():
        expected = prepared(x, 3)
        assert torch.equal(fxq.convert_fx(prepared)(x, 3), expected)


class _SharedConv(nn.Module):
    """One conv called at two places."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        return self.conv(x) + self.conv(x * 10.0)


def test_call_site_clones_own_their_hooks(bayes):
    prepared = fxq.prepare_qat_fx(_SharedConv(), {"": q8})
    calls = []
    prepared.conv.register_forward_hook(lambda m, i, o: calls.append("conv"))
    prepared.conv_call1.register_forward_hook(lambda m, i, o: calls.append("conv_call1"))
    prepared(torch.randn(1, 3, 4, 4))
    assert calls == ["conv", "conv_call1"]


def test_compare_is_exact_on_a_shared_module(bayes):
    prepared = fxq.prepare_qat_fx(_SharedConv(), {"": q8})
    calibrate(prepared, [torch.randn(4, 3, 4, 4)])
    integer = fxq.convert_fx(prepared)
    rows = fxq.debug.compare_qat_quantized(prepared, integer, torch.randn(2, 3, 4, 4), show=False)
    by_layer = {r["layer"]: r for r in rows}
    assert {"conv", "conv_call1"} <= set(by_layer)
    assert all(r["exact"] == 1.0 and r["max_lsb"] == 0 for r in rows)


def test_prepared_modules_follow_the_model_device(bayes):
    model = ResidualNet().to("meta")
    prepared = fxq.prepare_qat_fx(model, {"": q8})
    devices = {t.device.type for t in list(prepared.parameters()) + list(prepared.buffers())}
    assert devices == {"meta"}


def test_a_model_with_no_quantizable_op_says_which_ops_it_found(bayes):
    class OnlyCumsum(nn.Module):
        def forward(self, x):
            return torch.cumsum(x, -1)

    with pytest.raises(ValueError, match="selects no op that fxq can quantize") as info:
        fxq.prepare_qat_fx(OnlyCumsum(), {"": q8})
    assert "cumsum (torch.cumsum" in str(info.value) and "no registry row" in str(info.value)


def test_float_ops_argument_is_checked(bayes):
    with pytest.raises(ValueError, match="float_ops must be one of"):
        fxq.prepare_qat_fx(ResidualNet(), {"": q8}, float_ops="raise")


def test_float_fake_quant_is_reentrant(bayes):
    prepared = fxq.prepare_qat_fx(ResidualNet(), {"": q8})
    with fxq.debug.float_fake_quant(prepared):
        with fxq.debug.float_fake_quant(prepared):
            assert not prepared.stem.simulate_integer
        assert not prepared.stem.simulate_integer
    assert prepared.stem.simulate_integer


class _TimmLayerNorm2d(nn.LayerNorm):
    """timm's / torchvision ConvNeXt's ``LayerNorm2d``: its own forward calls F.layer_norm."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = torch.nn.functional.layer_norm(
            x, self.normalized_shape, self.weight, self.bias, self.eps
        )
        return x.permute(0, 3, 1, 2)


class _TimmGroupNorm(nn.GroupNorm):
    def forward(self, x):
        return torch.nn.functional.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)


@pytest.mark.parametrize("norm", ["layer_norm", "group_norm"])
def test_functional_norms_with_module_weights_become_integer_modules(bayes, norm):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.norm = _TimmLayerNorm2d(8) if norm == "layer_norm" else _TimmGroupNorm(2, 8)
            nn.init.uniform_(self.norm.weight, 0.5, 1.5)
            nn.init.uniform_(self.norm.bias, -0.5, 0.5)

        def forward(self, x):
            return self.norm(self.conv(x))

    model = Net().eval()
    x = torch.randn(2, 3, 6, 6)
    prepared = fxq.prepare_qat_fx(model, {"": q8}, example_inputs=(x,), float_ops="error")
    qat_norm = prepared.get_submodule(f"norm.{norm}")
    assert isinstance(qat_norm, qat.QATModule)
    assert torch.equal(qat_norm.op.weight, model.norm.weight)  # the model's own affine parameters
    assert torch.equal(qat_norm.op.bias, model.norm.bias)
    calibrate(prepared, [x, torch.randn(2, 3, 6, 6)])
    with torch.no_grad():
        assert torch.allclose(prepared(x), model(x), atol=1e-5)  # CALIBRATION: the float model
        fxq.set_fake_quantize(prepared, "validation")
        expected = prepared(x)
        assert torch.equal(fxq.convert_fx(prepared)(x), expected)
    assert sqnr(model(x), expected) > 25


def test_float_ops_on_shapes_and_weights_only_are_constants_not_listed(bayes):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.table = nn.Parameter(torch.randn(8))

        def forward(self, x):
            positions = torch.arange(x.shape[1], device=x.device).float()
            encoding = torch.special.i0(positions[:, None] / 8 * self.table)  # no integer i0
            return torch.special.i0(self.proj(x)) + encoding

    x = torch.randn(2, 5, 8)
    with pytest.warns(fxq.fx.prepare.FloatOpWarning) as caught:
        prepared = fxq.prepare_qat_fx(Net().eval(), {"": q8}, example_inputs=(x,))
    listed = [ln for ln in str(caught[0].message).splitlines() if ln.startswith("  - ")]
    assert len(listed) == 1 and listed[0].startswith("  - special_i0_1 ("), listed
    status = {n.name: n.meta.get("fxq_status") for n in prepared.graph.nodes}
    assert status["special_i0"] == "constant" and status["special_i0_1"] == "float fallback"


def test_a_buffer_written_with_input_data_is_not_a_constant(bayes):
    class KeepsLast(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.register_buffer("last", torch.zeros(2, 4))

        def forward(self, x):
            self.last.copy_(x)
            return self.proj(x) + torch.special.i0(self.last)

    x = torch.randn(2, 4)
    with pytest.warns(fxq.fx.prepare.FloatOpWarning, match=r"special_i0 \(torch\.special_i0"):
        fxq.prepare_qat_fx(KeepsLast().eval(), {"": q8}, example_inputs=(x,))

    # a graph from another tracer may read the buffer through a second get_attr node
    from fxq.fx.graph_utils import data_dependent_nodes

    graph = torch.fx.Graph()
    inp = graph.placeholder("x")
    graph.call_method("copy_", (graph.get_attr("last"), inp))
    read = graph.call_function(torch.special.i0, (graph.get_attr("last"),))
    constant = graph.call_function(torch.special.i0, (graph.get_attr("proj.weight"),))
    graph.output((read, constant))
    dependent = data_dependent_nodes(torch.fx.GraphModule(KeepsLast(), graph))
    assert read in dependent and constant not in dependent
