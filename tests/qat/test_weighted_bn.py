"""Fused conv + BatchNorm in training mode (batch statistics) with gamma = 0 channels."""

from __future__ import annotations

import copy

import torch
from torch import nn

import fxq
from fxq.qconfig import default_qat_8bit_fake_quant_qconfig


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6))
    with torch.no_grad():
        model[1].weight[:3] = 0.0  # timm's zero_init_last zeroes every gamma; half here
        model[1].weight[3:] = torch.tensor([0.5, -1.0, 2.0])
        model[1].bias.copy_(torch.linspace(-1.0, 1.0, 6))
    return model


def test_zero_gamma_in_training_mode_is_finite_and_the_float_batchnorm(bayes):
    """CALIBRATION rounds nothing: the training-mode output is the float model's (beta where
    gamma is 0), the running statistics follow the conv's true output, and in QAT state gamma
    still gets a gradient (it can leave 0)."""
    model = _model()
    reference = copy.deepcopy(model).train()
    qat = fxq.prepare_qat_fx(model.eval(), {"": default_qat_8bit_fake_quant_qconfig})
    qat.train()
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    x = torch.randn(4, 3, 8, 8)
    got, want = qat(x), reference(x)
    assert torch.isfinite(got).all()
    assert torch.allclose(got, want, atol=1e-5)
    for c in range(3):
        assert torch.equal(
            got[:, c], torch.full_like(got[:, c], float(reference[1].bias[c].detach()))
        )
    bn = next(m for m in qat.modules() if isinstance(m, nn.BatchNorm2d))
    assert torch.allclose(bn.running_mean, reference[1].running_mean, atol=1e-6)
    assert torch.allclose(bn.running_var, reference[1].running_var, atol=1e-5)

    fxq.set_fake_quantize(qat, fxq.FakeQuantState.QAT)
    out = qat(x)
    assert torch.isfinite(out).all()
    out.square().sum().backward()
    assert torch.isfinite(bn.weight.grad).all() and (bn.weight.grad[:3] != 0).all()
    conv_weight = next(
        p for n, p in qat.named_parameters() if n.endswith("weight") and p.dim() == 4
    )
    assert torch.isfinite(conv_weight.grad).all()


def test_the_folded_bias_without_a_conv_bias_is_the_general_formulas(bayes):
    """A conv without bias folds its BatchNorm's bias as ``beta - mean * factor`` (two ops
    fewer): the general ``beta + (0 - mean) * factor``'s values, bit for bit, with zero,
    tiny and huge means and gammas; and the same gradients."""
    model = nn.Sequential(nn.Conv2d(3, 64, 3, bias=False), nn.BatchNorm2d(64))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        bn = model[1]
        bn.running_mean.copy_(torch.randn(64, generator=g) * torch.logspace(-30, 30, 64))
        bn.running_mean[:4] = torch.tensor([0.0, -0.0, 1e-45, -3e38])
        bn.running_var.copy_(torch.rand(64, generator=g) + 1e-3)
        bn.weight.copy_(torch.randn(64, generator=g) * torch.logspace(-20, 20, 64))
        bn.bias.copy_(torch.randn(64, generator=g))
    qat = fxq.prepare_qat_fx(model.eval(), {"": default_qat_8bit_fake_quant_qconfig})
    (layer,) = [m for m in qat.modules() if isinstance(m, fxq.qat.weighted.WeightedQAT)]
    got = layer.folded_bias()
    bn = layer.bn
    factor = fxq.qat.weighted.batchnorm_factor(bn)
    general = bn.bias + (torch.zeros_like(bn.running_mean) - bn.running_mean) * factor
    assert torch.equal(got, general)
    grads = [torch.autograd.grad(b.square().sum(), [bn.weight, bn.bias]) for b in (got, general)]
    assert all(torch.equal(a, b) for a, b in zip(*grads))
