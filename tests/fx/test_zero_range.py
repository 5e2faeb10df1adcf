"""A value that was constant zero during calibration gets a representable scale.

BERT's additive attention mask ``(1.0 - mask) * finfo.min`` is all zeros on
unpadded batches; its scale used to sit at the 2**-23 floor, and the first run
of the converted model failed with a MultiplierRangeError.
"""

import pytest
import torch
from torch import nn

import fxq
from fxq.quantized.functional import MultiplierRangeError
from tests.helpers import calibrate

q8 = fxq.qconfig.default_qat_8bit_fake_quant_qconfig


class MaskedScores(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x, mask):
        scores = self.query(x)
        additive = (1.0 - mask[:, None, :]) * torch.finfo(torch.float32).min
        return self.out(scores + additive)


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_unpadded_mask_converts_and_runs_bit_exact(march):
    fxq.set_march(march)
    model = MaskedScores().eval()
    batches = [(torch.randn(2, 8, 8), torch.ones(2, 8)) for _ in range(2)]
    prepared = fxq.prepare_qat_fx(model, {"": q8}, example_inputs=batches[0])
    fxq.set_fake_quantize(prepared, fxq.FakeQuantState.CALIBRATION)
    with torch.no_grad():
        for x, mask in batches:
            prepared(x, mask)
    zero = prepared.sub.activation_post_process
    assert zero.scale.item() == pytest.approx(
        max(fq.scale.item() for fq in prepared.sub.input_quants if fq is not None)
    )
    x, mask = batches[0]  # inside the calibrated range: the accuracy check means something
    fxq.set_fake_quantize(prepared, fxq.FakeQuantState.VALIDATION)
    with torch.no_grad():
        expected = prepared(x, mask)
        got = fxq.convert_fx(prepared)(x, mask)  # used to raise MultiplierRangeError
        ref = model(x, mask)
    assert torch.equal(expected, got)
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()


def test_a_value_with_a_tiny_range_still_names_the_layer_and_the_fix(bayes):
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)

        def forward(self, x):
            y = self.conv(x)
            return (y + 1e-5) - y  # a range of 1e-5: below what 8 bits can requantize to

    prepared = calibrate(fxq.prepare_qat_fx(Tiny(), {"": q8}), [torch.randn(1, 3, 4, 4)])
    converted = fxq.convert_fx(prepared)
    with pytest.raises(MultiplierRangeError, match=r"Sub 'sub'.*qconfig of None"):
        converted(torch.randn(1, 3, 4, 4))
