"""A BatchNorm that no conv absorbs (standalone), with gamma = 0 channels."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import fxq
from fxq.qconfig import default_qat_8bit_fake_quant_qconfig


class _StandaloneBN(nn.Module):
    """A BatchNorm on the input and one after an add: no conv or linear absorbs either."""

    def __init__(self) -> None:
        super().__init__()
        self.bn_in = nn.BatchNorm2d(3)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        with torch.no_grad():
            self.bn_in.weight[1] = 0.0
            self.bn.weight[:2] = 0.0  # timm LeViT zero-initialises every gamma; half here
            self.bn.weight[2:] = torch.tensor([0.5, -1.5])
            self.bn.bias.copy_(torch.linspace(-1.0, 1.0, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn_in(x)
        return self.bn(self.conv(x) + x[:, :1])


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _StandaloneBN()


def test_zero_gamma_standalone_batchnorm_calibrates_in_training_mode(bayes):
    """CALIBRATION in training mode gives the float training-mode model's output (beta where
    gamma is 0) with the same running statistics; QAT state gives finite gradients."""
    model = _model()
    reference = copy.deepcopy(model).train()
    qat = fxq.prepare_qat_fx(model.eval(), {"": default_qat_8bit_fake_quant_qconfig})
    qat.train()
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    x = torch.randn(4, 3, 8, 8)
    got, want = qat(x), reference(x)
    assert torch.allclose(got, want, atol=1e-5)
    for c in range(2):
        beta = float(reference.bn.bias[c].detach())
        assert torch.equal(got[:, c], torch.full_like(got[:, c], beta))
    bns = {n: m for n, m in qat.named_modules() if isinstance(m, nn.BatchNorm2d)}
    assert len(bns) == 2
    for name, bn in bns.items():
        ref = reference.bn_in if "bn_in" in name else reference.bn
        assert torch.allclose(bn.running_mean, ref.running_mean, atol=1e-6), name
        assert torch.allclose(bn.running_var, ref.running_var, atol=1e-5), name

    fxq.set_fake_quantize(qat, fxq.FakeQuantState.QAT)
    out = qat(x)
    assert torch.isfinite(out).all()
    out.square().sum().backward()
    for name, param in qat.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    gamma = next(bn for name, bn in bns.items() if "bn_in" not in name).weight
    assert (gamma.grad[:2] != 0).all()  # gamma can leave 0


def test_zero_gamma_standalone_batchnorm_validation_equals_integer(bayes):
    """Calibrated in training mode, the VALIDATION model and the integer model agree bit for
    bit, and each gamma = 0 channel is one value near beta in both."""
    qat = fxq.prepare_qat_fx(_model().eval(), {"": default_qat_8bit_fake_quant_qconfig})
    qat.train()
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    torch.manual_seed(1)
    with torch.no_grad():
        for _ in range(3):
            qat(torch.randn(4, 3, 8, 8))
    qat.eval()
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        validation = qat(x)
        integer = fxq.convert_fx(qat)(x)
    assert torch.isfinite(validation).all()
    assert torch.equal(validation, integer)
    for c, beta in ((0, -1.0), (1, -1.0 / 3)):  # one value per gamma = 0 channel: beta, rounded
        value = validation[0, c, 0, 0]
        assert torch.equal(validation[:, c], torch.full_like(validation[:, c], float(value)))
        assert abs(float(value) - beta) < 0.05


def test_small_timm_levit_calibrates_in_training_mode(bayes):
    """timm's LeViT zero-initialises the gamma of the BatchNorm1d closing each residual branch
    (after a linear on tokens, so no fusion absorbs it); a small LeViT calibrates in training
    mode and converts bit for bit."""
    levit = pytest.importorskip("timm.models.levit")
    torch.manual_seed(0)
    model = levit.Levit(
        img_size=32, num_classes=10, embed_dim=(32, 48), key_dim=8, depth=(1, 1), num_heads=(2, 3)
    )
    zero = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d) and not m.weight.any()]
    assert len(zero) == 5
    x = torch.randn(2, 3, 32, 32)
    qat = fxq.prepare_qat_fx(
        model.eval(), {"": default_qat_8bit_fake_quant_qconfig}, example_inputs=(x,)
    )
    qat.train()
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a random model's vanishing activations
        with torch.no_grad():
            qat(x)
            qat(torch.randn(2, 3, 32, 32))
        qat.eval()
        fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
        with torch.no_grad():
            validation = qat(x)
            integer = fxq.convert_fx(qat)(x)
    assert torch.isfinite(validation).all()
    assert torch.equal(validation, integer)
