"""Ranges clipped on the error after the next normalization (``fxq.calibration.range_search``)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxq
from fxq.calibration import ptq
from fxq.calibration.range_search import has_normalization, search_ranges, searchable_quants
from fxq.qconfig import default_qat_8bit_fake_quant_qconfig as q8
from tests.helpers import assert_validation_equals_converted, sqnr

D = 32


class PostNormEncoder(nn.Module):
    """A BERT-style (post-norm) encoder whose residual stream holds a massive activation: one
    channel of the first token is about 100x every other value (the input's last feature
    flags that token), as in BERT's first-token outliers."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Linear(D + 1, D)
        self.ln0 = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)
        self.ln1 = nn.LayerNorm(D)
        with torch.no_grad():
            for m in (self.embed, self.fc1, self.fc2):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) / m.in_features**0.5)
                m.bias.zero_()
            self.embed.weight[:, D] = 0.0
            self.embed.weight[5, D] = 150.0  # the flagged token's channel 5

    def forward(self, x):
        h = self.ln0(self.embed(x))
        return self.ln1(h + self.fc2(F.gelu(self.fc1(h))))


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        x = torch.randn(8, 12, D + 1, generator=g)
        x[..., D] = 0.0
        x[:, 0, D] = 1.0  # the first token of every sample carries the outlier
        batches.append(x)
    return batches


def _prepared(model, data):
    fxq.set_march("bayes")
    return fxq.prepare_qat_fx(model.eval(), {"": q8}, example_inputs=(data[0],))


def _sqnr_after_ptq(model, data, **kwargs) -> float:
    prepared = _prepared(model, data)
    ptq(prepared, data, iters=0, bias_correction=False, show_progress=False, **kwargs)
    fxq.set_fake_quantize(prepared, fxq.FakeQuantState.VALIDATION)
    with torch.no_grad():
        return sqnr(torch.cat([model(x) for x in data]), torch.cat([prepared(x) for x in data]))


def test_visits_what_reaches_a_normalization(data):
    prepared = _prepared(PostNormEncoder(), data)
    assert has_normalization(prepared)
    ptq(prepared, data, iters=0, search_ranges=False, show_progress=False)
    names = [node.target for node, _ in searchable_quants(prepared)]
    # every int8 activation before a LayerNorm but the norms' own outputs; not fc2 (it holds
    # the residual add, linear_add: its output is the sum, which bayes keeps on chip in int16
    # with the LayerNorm that alone reads it)
    assert names == ["x_quant", "embed", "fc1", "gelu"]
    assert prepared.fc2.activation_post_process.dtype is fxq.qint16


def test_only_the_search_fixes_the_massive_activation(data):
    model = PostNormEncoder()
    without = _sqnr_after_ptq(model, data, search_ranges=False)
    searched = _sqnr_after_ptq(model, data, search_ranges=True)
    assert without < 10 and searched > without + 5, (without, searched)  # 9.0 -> 16.0 dB


def test_clips_the_massive_activation(data):
    prepared = _prepared(PostNormEncoder(), data)
    ptq(prepared, data, iters=0, search_ranges=False, show_progress=False)
    scale = float(prepared.embed.activation_post_process.scale)
    report = search_ranges(prepared, data)
    assert "embed" in [r.module for r in report]
    chosen = next(r for r in report if r.module == "embed")
    assert chosen.error_after < chosen.error_before / 4
    assert float(prepared.embed.activation_post_process.scale) < scale / 4


def test_validation_equals_converted_bit_for_bit(data):
    prepared = _prepared(PostNormEncoder(), data)
    ptq(prepared, data, show_progress=False)
    assert_validation_equals_converted(prepared, data)


def test_not_applied_without_normalization():
    fxq.set_march("bayes")
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).eval()
    x = [torch.randn(2, 3, 8, 8)]
    prepared = fxq.prepare_qat_fx(model, {"": q8}, example_inputs=(x[0],))
    assert not has_normalization(prepared)


def test_candidates_checked(data):
    with pytest.raises(ValueError, match="candidates"):
        search_ranges(_prepared(PostNormEncoder(), data), data, candidates=(1.0, 1.5))
