"""Warnings are summaries: one per public call, counting and naming the modules."""

import warnings

import pytest
import torch
from torch import nn

import fxq
from fxq.calibration import calibrate
from fxq.qconfig import get_default_qconfig
from fxq.utils.warning_summary import summarises_warnings, warn_per_module

FLOOR = (
    "the scale is clamped at fxq's smallest scale 2**-23, so their values quantize to 0 or to a "
    "few levels"
)


class _Vanishing(nn.Module):
    """Twelve layers whose activations are about 1e-9, as in a random deep network."""

    def __init__(self, depth: int = 12) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(2, 2, 1, bias=False) for _ in range(depth))

    def forward(self, x):
        x = x * 1e-9
        for conv in self.convs:
            x = conv(x)
        return x


def _prepared():
    torch.manual_seed(0)
    example = (torch.randn(1, 2, 4, 4),)
    return fxq.prepare_qat_fx(_Vanishing(), {"": get_default_qconfig()}, example_inputs=example)


def _floored(model) -> list[str]:
    return [
        m.name
        for m in model.modules()
        if isinstance(m, fxq.FakeQuantize) and float(m.scale.max()) <= 2**-23
    ]


def _expected(call: str, names: list[str], first: str) -> str:
    shown = ", ".join(names[:10]) + f" ... and {len(names) - 10} more"
    return f"{call}: {len(names)} fake quants: {FLOOR}: {shown}. The first: {first}"


def test_calibrate_warns_once_naming_the_count_and_the_layers(bayes):
    model = _prepared()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        calibrate(model, [torch.randn(2, 2, 4, 4)], show_progress=False)
    names = _floored(model)
    assert names[:3] == ["the output of 'convs.0'", "the output of 'convs.1'", names[2]]
    assert len(names) == 13  # the twelve convs and the multiplication
    assert len(record) == 1, [str(w.message) for w in record]
    (warning,) = record
    message = str(warning.message)
    first = message.split("The first: ", 1)[1]
    assert first.startswith("fxq: fake quant the output of 'convs.0': it saw values in [")
    assert message == _expected("fxq.calibration.calibrate", names, first)
    assert warning.filename == __file__  # points at the user's call
    # once per fake quant: switching state later adds nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fxq.set_fake_quantize(model, "validation")
        model(torch.randn(2, 2, 4, 4))


def test_set_fake_quantize_summarises_too(bayes):
    model = _prepared()
    fxq.set_fake_quantize(model, "calibration")
    with torch.no_grad():
        model(torch.randn(2, 2, 4, 4))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fxq.set_fake_quantize(model, "validation")
    assert [str(w.message).split(": ", 1)[0] for w in record] == ["fxq.set_fake_quantize"]
    assert str(record[0].message).startswith(f"fxq.set_fake_quantize: 13 fake quants: {FLOOR}: ")


@summarises_warnings("outer")
def _outer(names):
    _inner(names)
    warn_per_module("other", "other alone", headline="another kind")


@summarises_warnings("inner")
def _inner(names):
    for name in names:
        warn_per_module(name, f"{name} is odd", headline="odd", what="layer")


def test_nested_calls_warn_once_at_the_outermost_and_group_by_kind():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _outer(["a", "b", "c"])
    assert [str(w.message) for w in record] == [
        "outer: 3 layers: odd: a, b, c. The first: a is odd",
        "other alone",  # a kind found once keeps its own message
    ]


def test_findings_outside_a_call_warn_at_once():
    with pytest.warns(RuntimeWarning, match=r"^x alone$"):
        warn_per_module("x", "x alone", headline="h", category=RuntimeWarning)
