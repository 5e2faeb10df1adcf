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
