"""SmoothQuant-style migration of LayerNorm output outliers (``fxq.calibration.smooth``)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxq
from fxq.calibration import ptq
from fxq.calibration.smooth import smooth_activations, smoothing_pairs
from fxq.fake_quantize import bypass
from fxq.qconfig import default_qat_8bit_fake_quant_qconfig as q8
from tests.helpers import assert_validation_equals_converted, sqnr

D, HEADS = 32, 4


class PreNormBlock(nn.Module):
    """A pre-norm transformer block (ViT / GPT style): the LayerNorm outputs feed only linear
    layers; the residual stream bypasses them."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.ln2 = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).reshape(b, t, 3, HEADS, D // HEADS).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, D))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Encoder(nn.Module):
    """Two pre-norm blocks and a final LayerNorm; a few LayerNorm ``gamma`` channels are 40x
    the others (the planted outliers), and the weights reading them are 40x smaller, so the
    float function weighs every channel alike."""

    def __init__(self, outliers: bool = True) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.blocks = nn.Sequential(PreNormBlock(), PreNormBlock())
        self.norm = nn.LayerNorm(D)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    m.weight.copy_(torch.randn(m.weight.shape, generator=g) / m.in_features**0.5)
                    m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
            if outliers:
                for block in self.blocks:
                    for ln, readers in ((block.ln1, [block.qkv]), (block.ln2, [block.fc1])):
                        ln.weight[[3, 17]] = 40.0
                        for m in readers:
                            m.weight[:, [3, 17]] /= 40.0

    def forward(self, x):
        return self.norm(self.blocks(x))


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 6, D, generator=g) for _ in range(4)]


def _prepared(model, data):
    fxq.set_march("bayes")
    return fxq.prepare_qat_fx(model.eval(), {"": q8}, example_inputs=(data[0],))


def _sqnr_after_ptq(model, data, **kwargs) -> float:
    prepared = _prepared(model, data)
    ptq(prepared, data, iters=0, show_progress=False, **kwargs)
    fxq.set_fake_quantize(prepared, fxq.FakeQuantState.VALIDATION)
    with torch.no_grad():
        return sqnr(torch.cat([model(x) for x in data]), torch.cat([prepared(x) for x in data]))


def test_finds_the_prenorm_layernorms(data):
    prepared = _prepared(Encoder(), data)
    pairs = dict(smoothing_pairs(prepared))
    assert len(pairs) == 4  # ln1 -> qkv and ln2 -> fc1 in both blocks; not the final norm
    assert all(len(readers) == 1 for readers in pairs.values())


def test_float_function_unchanged(data):
    prepared = _prepared(Encoder(), data)
    with bypass(prepared), torch.no_grad():
        before = [prepared(x) for x in data]
    report = smooth_activations(prepared, data)
    assert len(report) == 4 and max(r.max_factor / r.min_factor for r in report) > 5
    with bypass(prepared), torch.no_grad():
        after = [prepared(x) for x in data]
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_only_the_migration_fixes_planted_outliers(data):
    model = Encoder()
    without = _sqnr_after_ptq(model, data, smooth=False)
    with_smooth = _sqnr_after_ptq(model, data)
    clean = _sqnr_after_ptq(Encoder(outliers=False), data, smooth=False)
    # the outlier channels cost about 10 dB; the migration gives back most of it
    assert without < clean - 6
    assert with_smooth > without + 6
    assert with_smooth > clean - 1  # 13.1 dB without, 22.0 with, 21.7 without outliers


def test_validation_equals_converted_bit_for_bit(data):
    prepared = _prepared(Encoder(), data)
    ptq(prepared, data, show_progress=False)
    assert_validation_equals_converted(prepared, data)


def test_alpha_checked(data):
    with pytest.raises(ValueError, match="alpha"):
        smooth_activations(_prepared(Encoder(), data), data, alpha=1.5)
