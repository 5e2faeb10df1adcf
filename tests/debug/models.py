"""Small models whose accuracy problems are known, for the debug tools' tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fxq
from fxq.qconfig import default_calib_8bit_fake_quant_qconfig
from tests.helpers import calibrate, recalibrate_bn


class ChainNet(nn.Module):
    """Four conv-bn-relu blocks, pooling and a linear head."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.convs = nn.ModuleList(
            nn.Conv2d(3 if i == 0 else channels, channels, 3, padding=1) for i in range(4)
        )
        self.bns = nn.ModuleList(nn.BatchNorm2d(channels) for _ in range(4))
        self.fc = nn.Linear(channels, 10)

    def forward(self, x):
        for conv, bn in zip(self.convs, self.bns):
            x = F.relu(bn(conv(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class SharedConvNet(nn.Module):
    """One conv called twice (two call sites sharing weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.conv = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        x = F.relu(self.stem(x))
        x = F.relu(self.conv(x))
        return self.conv(x)


def batches(count: int = 3, size: int = 4, hw: int = 8, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, 3, hw, hw, generator=g) for _ in range(count)]


def calibrated(model: nn.Module, data: list[torch.Tensor]) -> torch.fx.GraphModule:
    """``model`` prepared with min/max calibration, calibrated on ``data``, in VALIDATION."""
    prepared = fxq.prepare_qat_fx(model, {"": default_calib_8bit_fake_quant_qconfig})
    calibrate(prepared, data)
    fxq.set_fake_quantize(prepared, "validation")
    return prepared


def float_chain(data: list[torch.Tensor]) -> ChainNet:
    model = ChainNet()
    recalibrate_bn(model, data)
    return model


def clip_output(prepared: nn.Module, path: str, factor: float = 0.05) -> None:
    """Make one activation deliberately bad: its range clipped to ``factor`` of what it saw."""
    fq = prepared.get_submodule(path).activation_post_process
    with torch.no_grad():
        fq.scale.mul_(factor)
