"""Trace errors name the failing line wherever it is, and tell the causes apart;
``concrete_args`` in ``fxq.symbolic_trace`` and ``prepare_qat_fx``."""

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
