"""``torch.jit.trace(integer_model, x)`` with its defaults, the vendor's deploy convention.

``check_trace`` (on by default) traces the model again and compares the two graphs. The
integer modules derive their constants (multipliers, shifts, tables) on the first call
and cache them: those derivations now run outside the trace, so both traces record the
cached constants and agree.
"""

from __future__ import annotations

import pytest
import torch

import fxq
from fxq.calibration import calibrate
from fxq.qconfig import default_calib_8bit_fake_quant_qconfig as calib_q8
from fxq.utils.sample_data import photo_crops, pretrained_mobilenet_v2
from tests.helpers import ResidualNet


def _integer(model: torch.nn.Module, shape: tuple[int, ...]) -> torch.nn.Module:
    prepared = fxq.prepare_qat_fx(model.eval(), {"": calib_q8})
    calibrate(prepared, [photo_crops(shape[0], size=shape[-1], seed=s) for s in range(2)])
    fxq.set_fake_quantize(prepared, fxq.FakeQuantState.VALIDATION)
    return fxq.convert_fx(prepared)


@pytest.mark.parametrize(
    "make",
    [ResidualNet, pretrained_mobilenet_v2],
    ids=["residual", "mobilenet_v2"],
)
def test_jit_trace_with_default_checks_is_exact(bayes, make):
    integer = _integer(make(), (2, 3, 32, 32))  # never called before the trace
    traced = torch.jit.trace(integer, photo_crops(2, size=32, seed=5))
    x = photo_crops(2, size=32, seed=6)
    with torch.no_grad():
        expected = integer(x)
    assert expected.abs().max() > 0
    assert torch.equal(traced(x), expected)
