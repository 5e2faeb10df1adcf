"""Graph surgery for deployment: the seed workflow verbatim, and the helpers."""

import contextlib
import copy
import io
import re
import warnings

import pytest
import torch

import fxq
from fxq.deploy import insert_after, yuv_input
from fxq.functional import centered_yuv2rgb, rgb2centered_yuv
from fxq.qtensor import QTensor
from tests.helpers import calibrate


def test_seed_workflow_verbatim():
    # ---- the seed snippet, with fxq names ---------------------------------------------------
    import torch
    from torch import nn

    from fxq import DeQuantStub, March, QuantStub, convert_fx, prepare_qat_fx, set_march
    from fxq.functional import centered_yuv2rgb
    from fxq.qconfig import default_qat_8bit_fake_quant_qconfig

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant = QuantStub()
            self.conv = nn.Conv2d(3, 3, 3)
            self.bn = nn.BatchNorm2d(3)
            self.relu = nn.ReLU()
            self.dequant = DeQuantStub()

        def forward(self, x):
            x = self.quant(x)
            x = self.conv(x)
            x = self.bn(x)
            x = self.relu(x)
            x = self.dequant(x)
            return x

    data = torch.rand(1, 3, 28, 28)
    net = Net()
    set_march(March.BAYES)
    net.qconfig = default_qat_8bit_fake_quant_qconfig
    qat_net = prepare_qat_fx(net)
    qat_net(data)
    quantized_net = convert_fx(qat_net)
    traced = quantized_net

    print("Before centered_yuv2rgb")
    traced.graph.print_tabular()

    patterns = ["quant"]
    for n in traced.graph.nodes:
        if any(n.target == pattern for pattern in patterns):
            with traced.graph.inserting_after(n):
                new_node = traced.graph.call_function(centered_yuv2rgb, (n,), {"swing": "full"})
                n.replace_all_uses_with(new_node)
                new_node.args = (n,)

    traced.quant.scale.fill_(1.0)
    traced.recompile()
    print("\nAfter centered_yuv2rgb")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        traced.graph.print_tabular()
    # ---- end of the seed snippet ---------------------------------------------------------------
    table = out.getvalue()
    rows = [line.split() for line in table.splitlines()[2:] if line.strip()]
    assert [r[1] for r in rows] == ["x", "quant", "centered_yuv2rgb", "conv", "dequant", "output"]
    assert "<function centered_yuv2rgb" in table
    assert traced.quant.scale.item() == 1.0

    # ---- run the edited model on camera frames ----------------------------------------------
    # centered_yuv2rgb hands the conv int8 RGB at its default q_scale, 1/128, while the conv was
    # converted for the calibrated stub scale (about 1/127): the conv derives its multipliers,
    # shifts and int32 bias for 1/128 and warns once.
    calibrated = qat_net.quant.activation_post_process.scale.item()
    assert calibrated != 1 / 128
    frames = rgb2centered_yuv(torch.randint(0, 256, (2, 3, 28, 28)), "full")  # camera integers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            got = traced(frames)
            again = traced(frames)
    rescaled = [str(w.message) for w in caught if "was converted for input" in str(w.message)]
    assert rescaled == [
        f"fxq: Conv2d 'conv' was converted for input 0 scale {calibrated:.8g} but receives scale "
        "0.0078125; it computes what a model converted for input scale 0.0078125 computes "
        "(multipliers, shifts and int32 bias derived again, cached per scale). If that is not "
        "intended, the op before it must output the scale it was converted for"
    ]
    assert torch.equal(got, again)

    # the same QAT model converted with its stub fixed at 1/128, fed the same RGB integers (as
    # floats on the 1/128 grid, which its stub quantizes back exactly), computes the same numbers
    at_1_128 = copy.deepcopy(qat_net)
    at_1_128.quant.activation_post_process.scale.fill_(1 / 128)
    reference = convert_fx(at_1_128)
    assert reference.conv.input_scale.item() == 1 / 128
    camera = QTensor(frames.to(torch.int8), torch.tensor([1.0]), fxq.qint8)
    rgb = centered_yuv2rgb(camera, swing="full")
    assert rgb.q_scale() == 1 / 128
    with torch.no_grad():
        expected = reference(rgb.dequantize())
    assert torch.equal(got, expected)
    assert expected.abs().sum() > 0 and (expected > 0).float().mean() > 0.2  # not all clipped


class _YuvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.quant = fxq.QuantStub(scale=1 / 128)  # inputs normalised as (rgb - 128) / 128
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.dequant = fxq.DeQuantStub()

    def forward(self, x):
        return self.dequant(torch.relu(self.conv(self.quant(x))))


def _converted_yuv_net():
    fxq.set_march("bayes")
    net = _YuvNet()
    qat = calibrate(
        fxq.prepare_qat_fx(net, {"": fxq.qconfig.default_calib_8bit_fake_quant_qconfig}),
        [(torch.rand(4, 3, 8, 8) * 255 - 128) / 128],
    )
    return net, qat, fxq.convert_fx(qat)


def test_insert_after_matches_the_manual_recipe():
    _, _, converted = _converted_yuv_net()
    manual = _converted_yuv_net()[2]
    new = insert_after(converted, "quant", centered_yuv2rgb, swing="full")
    assert new.target is centered_yuv2rgb and new.args[0].name == "quant"
    assert [u.name for u in new.users] == ["conv"]
    for n in manual.graph.nodes:
        if n.target == "quant":
            with manual.graph.inserting_after(n):
                m = manual.graph.call_function(centered_yuv2rgb, (n,), {"swing": "full"})
            n.replace_all_uses_with(m)
            m.args = (n,)
    manual.recompile()
    assert converted.code == manual.code


def test_insert_after_a_missing_node_says_which_exist():
    _, _, converted = _converted_yuv_net()
    with pytest.raises(
        KeyError,
        match=r"^no node named 'qaunt' in the graph; did you mean 'quant', 'dequant'\? Nodes: x, quant, conv",
    ):
        insert_after(converted, "qaunt", centered_yuv2rgb)
    with pytest.raises(TypeError, match="not the quantize stub of a converted model"):
        yuv_input(converted, "conv")


def test_yuv_input_gives_the_predictions_of_rgb_input():
    _, qat, converted = _converted_yuv_net()
    rgb = torch.randint(0, 256, (4, 3, 8, 8)).float()
    fxq.set_fake_quantize(qat, "validation")
    with torch.no_grad():
        from_rgb = qat((rgb - 128) / 128)
        node = yuv_input(converted, "quant", swing="full")
        yuv = rgb2centered_yuv(rgb, "full")
        from_yuv = converted(yuv)
    assert node.kwargs["q_scale"] == pytest.approx(1 / 128) and converted.quant.scale.item() == 1.0
    # YUV rounding in the camera costs a little; the outputs stay close
    assert (from_rgb - from_yuv).abs().max() < 0.05 * from_rgb.abs().max()
    inner = []
    converted.conv.register_forward_pre_hook(lambda m, i: inner.append(i[0]))
    converted(yuv)
    assert isinstance(inner[0], QTensor) and inner[0].q_scale() == pytest.approx(1 / 128)


class _AutoStubNet(torch.nn.Module):
    """_YuvNet without stubs: prepare_qat_fx quantizes the input itself (``x_quant``)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x))


class _ExplicitStubNet(_AutoStubNet):
    def __init__(self):
        super().__init__()
        self.quant = fxq.QuantStub()
        self.dequant = fxq.DeQuantStub()

    def forward(self, x):
        return self.dequant(torch.relu(self.conv(self.quant(x))))


class _TwoInputNet(_AutoStubNet):
    def forward(self, x, y):
        return torch.relu(self.conv(x) + y)


def _convert(net, *batch):
    fxq.set_march("bayes")
    qat = fxq.prepare_qat_fx(
        net, {"": fxq.qconfig.default_calib_8bit_fake_quant_qconfig}, example_inputs=batch
    )
    fxq.set_fake_quantize(qat, "calibration")
    with torch.no_grad():
        qat(*batch)
    fxq.set_fake_quantize(qat, "validation")
    return fxq.convert_fx(qat)


def test_yuv_input_finds_the_automatic_input_stub():
    """A model without QuantStub: "quant" (or no name) is its only input stub, and the camera
    model it gives equals the explicit-stub model's, bit for bit."""
    torch.manual_seed(0)
    auto_net = _AutoStubNet()
    explicit_net = _ExplicitStubNet()
    explicit_net.conv.load_state_dict(auto_net.conv.state_dict())
    calibration = (torch.rand(4, 3, 8, 8) * 255 - 128) / 128
    explicit = _convert(explicit_net, calibration)
    auto, auto_default = _convert(auto_net, calibration), _convert(auto_net, calibration)
    assert [n.name for n in fxq.deploy.input_stubs(auto)] == ["x_quant"]
    assert fxq.deploy.find_node(auto, "quant").name == "x_quant"
    nodes = [
        yuv_input(explicit, "quant", swing="full"),
        yuv_input(auto, "quant", swing="full"),
        yuv_input(auto_default, swing="full"),
    ]
    assert [n.args[0].name for n in nodes] == ["quant", "x_quant", "x_quant"]
    assert len({n.kwargs["q_scale"] for n in nodes}) == 1
    assert auto.x_quant.scale.item() == 1.0 and auto_default.x_quant.scale.item() == 1.0
    yuv = rgb2centered_yuv(torch.randint(0, 256, (2, 3, 8, 8)).float(), "full")
    with torch.no_grad():
        want = explicit(yuv)
        assert want.abs().sum() > 0
        assert torch.equal(auto(yuv), want)
        assert torch.equal(auto_default(yuv), want)


def test_yuv_input_without_the_stub_suggests_the_input_stubs():
    x = torch.rand(2, 3, 8, 8)
    auto = _convert(_AutoStubNet(), x)
    nodes = "Nodes: x, x_quant, conv, conv_dequant, output"
    with pytest.raises(
        KeyError,
        match="^"
        + re.escape(
            f"no node named 'qaunt' in the graph; did you mean 'x_quant' (the input quantize "
            f"stub)? {nodes}"
        )
        + "$",
    ):
        yuv_input(auto, "qaunt")
    two = _convert(_TwoInputNet(), x, torch.rand(2, 4, 8, 8))
    with pytest.raises(
        KeyError,
        match="^"
        + re.escape(
            "no node named 'quant' in the graph; did you mean 'x_quant', 'y_quant' (the input "
            "quantize stubs)? The model has 2 inputs: name the stub of the one to change. Nodes: "
        ),
    ):
        yuv_input(two)
    node = yuv_input(two, "x_quant", swing="full")
    assert node.args[0].name == "x_quant" and [u.name for u in node.users] == ["conv"]
    # insert_after finds "quant" the same way
    assert insert_after(auto, "quant", torch.neg).args[0].name == "x_quant"
