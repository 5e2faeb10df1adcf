"""Shared fixtures of the calibration tests."""

import pytest
import torch
from torch import nn


@pytest.fixture(scope="module")
def pretrained():
    """The first blocks of ImageNet MobileNetV2 (real weights) and real photo crops."""
    from fxq.utils.sample_data import photo_crops, pretrained_mobilenet_v2

    full = pretrained_mobilenet_v2()
    model = nn.Sequential(
        full.features[:7], nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 16)
    ).eval()
    with torch.no_grad():  # a head reading the features (its logits are what is compared)
        model[3].weight.copy_(torch.randn(16, 32, generator=torch.Generator().manual_seed(0)))
        model[3].bias.zero_()
    calib = list(photo_crops(16, size=96, seed=0).split(8))
    held = photo_crops(16, size=96, seed=1)
    with torch.no_grad():
        ref = model(held)
    return model, calib, held, ref
