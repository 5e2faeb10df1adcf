"""Trace errors name the failing line wherever it is, and tell the causes apart;
``concrete_args`` in ``fxq.symbolic_trace`` and ``prepare_qat_fx``."""

import math
import re
import warnings

import pytest
import torch
from torch import nn

import fxq
from fxq.fx.prepare import FloatOpWarning
from fxq.fx.tracer import FxqTraceError, _is_internal
from tests.helpers import calibrate

q8 = fxq.qconfig.default_qat_8bit_fake_quant_qconfig


def test_only_torch_itself_is_internal():
    import torchvision

    torch_dir = torch.__file__.rsplit("/", 1)[0]
    assert _is_internal(f"{torch_dir}/fx/proxy.py")
    assert not _is_internal(torchvision.models.detection.generalized_rcnn.__file__)


def test_torchvision_detection_error_names_the_line_and_advice():
    tv = pytest.importorskip("torchvision")
    model = tv.models.detection.ssdlite320_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=3
    ).eval()
    with pytest.raises(FxqTraceError) as info:
        fxq.symbolic_trace(model)
    message = str(info.value)
    assert re.search(
        r"torchvision[/\\]models[/\\]detection[/\\]ssd\.py:\d+, in SSD\.forward", message
    )
    assert "for img in images:" in message
    assert "'images' are used as Python containers" in message
    assert "installed package 'torchvision'" in message and "fx_wrap" in message


class Masked(nn.Module):
    """Hugging Face style: optional arguments checked in Python."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, mask=None, inputs_embeds=None):
        if x is not None and inputs_embeds is not None:
            raise ValueError("You cannot specify both x and inputs_embeds")
        y = self.proj(x)
        if mask is not None:
            y = y * mask
        return y


class TensorBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, mask=None):
        y = self.proj(x)
        if y.sum() > 0:
            y = -y
        return y


def test_an_argument_that_should_be_concrete_is_told_apart():
    with pytest.raises(FxqTraceError) as info:
        fxq.symbolic_trace(Masked())
    message = str(info.value)
    assert "should be concrete, not control flow" in message
    assert "'inputs_embeds' (default None)" in message and "concrete_args=" in message
    with pytest.raises(FxqTraceError) as info:
        fxq.symbolic_trace(TensorBranch())
    message = str(info.value)
    assert "depends on tensor values" in message and "should be concrete" not in message
    assert "if y.sum() > 0:" in message


def test_concrete_args_trace_and_default_to_the_traced_value():
    model = Masked()
    gm = fxq.symbolic_trace(model, concrete_args={"mask": None, "inputs_embeds": None})
    x = torch.randn(2, 4)
    assert torch.equal(gm(x), model(x))
    assert torch.equal(gm(x, None, None), model(x))
    with pytest.raises(ValueError, match=r"does not take"):
        fxq.symbolic_trace(model, concrete_args={"attention": None})


@pytest.mark.parametrize("form", ["concrete_args", "keyword_example_inputs"])
def test_prepare_with_concrete_arguments_converts(bayes, form):
    model = Masked()
    x = torch.randn(8, 4)
    if form == "concrete_args":
        kwargs = {"concrete_args": {"mask": None, "inputs_embeds": None}}
    else:
        kwargs = {"example_inputs": {"x": x}}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FloatOpWarning)  # the argument checks are not float ops
        prepared = fxq.prepare_qat_fx(model, {"": q8}, **kwargs)
    assert type(prepared.proj) is fxq.qat.Linear
    calibrate(prepared, [x])
    fxq.set_fake_quantize(prepared, fxq.FakeQuantState.VALIDATION)
    with torch.no_grad():
        expected = prepared(x)
        got = fxq.convert_fx(prepared)(x)
    assert torch.equal(expected, got)


def test_keyword_example_inputs_need_every_argument_without_default(bayes):
    with pytest.raises(ValueError, match=r"no value for 'x'"):
        fxq.prepare_qat_fx(Masked(), {"": q8}, example_inputs={"mask": torch.ones(4)})


class PadToMultiple(nn.Module):
    """timm MobileViT's unfold: a Python condition on sizes only."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)

    def forward(self, x):
        y = self.conv(x)
        H, W = y.shape[-2:]
        new_h, new_w = math.ceil(H / 4) * 4, math.ceil(W / 4) * 4
        if new_h != H or new_w != W:
            y = nn.functional.interpolate(y, size=(new_h, new_w), mode="bilinear")
        return y


class SizeAndDataBranch(nn.Module):
    def forward(self, x):
        if x.sum() > x.size(0):  # reads sizes and data
            x = -x
        return x


_SIZE_ADVICE = (
    "This condition reads tensor sizes (shape, size(), dim()), which the tracer answers from "
    "example inputs: pass example_inputs=... (inputs like those you will call the model with) "
    "to fxq.prepare_qat_fx / fxq.symbolic_trace so sizes are known and the branch is decided "
    "while the sizes stay graph values; or wrap the function or method containing this line "
    "with @fxq.fx_wrap()"
)


def test_a_condition_on_sizes_advises_example_inputs_first(bayes):
    with pytest.raises(FxqTraceError) as info:
        fxq.symbolic_trace(PadToMultiple())
    message = str(info.value)
    assert "reads tensor sizes, and no example inputs were given" in message
    assert re.search(r"test_trace_errors\.py:\d+, in PadToMultiple\.forward", message)
    assert "if new_h != H or new_w != W:" in message
    assert _SIZE_ADVICE in message
    # the advice works: with example inputs the model traces and quantizes
    x = torch.randn(2, 2, 6, 8)
    qat = fxq.prepare_qat_fx(PadToMultiple(), {"": q8}, example_inputs=(x,))
    calibrate(qat, [x])
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
    integer = fxq.convert_fx(qat)
    assert torch.equal(qat(x), integer(x))
    assert qat(x).shape == (2, 2, 8, 8)


class RankBranch(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x):
        rank = {"dim": lambda: x.dim(), "len": lambda: len(x.shape), "ndim": lambda: x.ndim}
        if rank[self.how]() == 4:
            x = x + 1
        return x


@pytest.mark.parametrize("how", ["dim", "len", "ndim"])
def test_a_condition_on_ranks_advises_example_inputs(how):
    with pytest.raises(FxqTraceError, match=re.escape(_SIZE_ADVICE)):
        fxq.symbolic_trace(RankBranch(how))


def test_a_condition_on_data_still_advises_fx_wrap():
    with pytest.raises(FxqTraceError) as info:
        fxq.symbolic_trace(SizeAndDataBranch())
    message = str(info.value)
    assert "if x.sum() > x.size(0):" in message
    assert "This code depends on tensor values" in message
    assert "Wrap the function or method containing this line with @fxq.fx_wrap()" in message
    assert "example_inputs" not in message
    # and example inputs do not decide it: a graph is never specialised on data
    with pytest.raises(FxqTraceError, match="depends on tensor values"):
        fxq.symbolic_trace(SizeAndDataBranch(), example_inputs=(torch.randn(2, 3),))


class TwoInputs(nn.Module):
    def forward(self, x, scale=None, shift=None):
        if shift is not None:
            x = x + shift
        return x * scale if scale is not None else x


def test_a_call_without_a_traced_input_names_it():
    x = torch.randn(2, 3)
    for example in ((x, x), {"x": x, "scale": x}):
        gm = fxq.symbolic_trace(TwoInputs(), example_inputs=example)
        assert torch.equal(gm(x, x), x * x)
        with pytest.raises(
            TypeError,
            match=r"^TwoInputs was traced with the inputs 'x', 'scale' and is called without "
            r"'scale': call it with every input it was traced with, or trace it",
        ):
            gm(x)
    # traced without example inputs, the arguments with defaults stay optional graph inputs
    # (an @fx_wrap() function may take None), as in torch.fx
    gm = fxq.symbolic_trace(TwoInputs(), concrete_args={"shift": None})
    assert torch.equal(gm(x, x), x * x)


class _ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x))


def test_one_example_tensor_is_one_input_and_extra_examples_are_refused(bayes):
    qconfig = fxq.qconfig.default_qat_8bit_fake_quant_qconfig
    x = torch.randn(2, 3, 8, 8)
    # a tensor is the one input (it was split into its samples: "expected 4D input")
    bare = fxq.prepare_qat_fx(_ConvBN().eval(), {"": qconfig}, example_inputs=x)
    wrapped = fxq.prepare_qat_fx(_ConvBN().eval(), {"": qconfig}, example_inputs=(x,))
    assert bare.code == wrapped.code
    with pytest.raises(TypeError) as info:
        fxq.prepare_qat_fx(_ConvBN().eval(), {"": qconfig}, example_inputs=(x, x))
    assert str(info.value) == (
        "example_inputs holds 2 inputs, but _ConvBN.forward takes 1 (x); pass one example per "
        "input, in forward's order (a tuple: (x,) for one input)"
    )
