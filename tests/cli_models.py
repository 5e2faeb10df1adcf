"""Model and data factories that the command-line tests name (``tests.cli_models:small_cnn``);
kept free of test-only imports so that ``python -m fxq`` imports them quickly."""

from __future__ import annotations

import torch
from torch import nn


class SmallCNN(nn.Module):
    """A small classifier: conv-bn-relu, a residual block, pooling, linear."""

    def __init__(self, num_classes: int = 10, width: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()
        )
        self.block = nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width))
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.relu(x + self.block(x))
        return self.fc(self.pool(x).flatten(1))


def small_cnn(num_classes: int = 10, width: int = 8) -> nn.Module:
    """``SmallCNN`` with seeded weights, in eval mode."""
    torch.manual_seed(0)
    return SmallCNN(num_classes, width).eval()


def random_batches(count: int = 3, size: int = 16) -> list[torch.Tensor]:
    """``count`` batches of 4 images (3 x ``size`` x ``size``), seeded."""
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(4, 3, size, size, generator=generator) for _ in range(count)]


def not_a_model() -> int:
    return 3


def unexportable(width: int = 4) -> nn.Module:
    """A conv followed by ``erfinv``, a float op no exporter translates."""
    torch.manual_seed(0)

    class Unexportable(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, width, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.special.erfinv(0.5 * torch.tanh(self.conv(x)))

    return Unexportable().eval()


def handoff_net() -> nn.Module:
    """``tests.helpers.HandoffNet`` with seeded weights, in eval mode (int16 pays on it)."""
    from tests.helpers import HandoffNet

    torch.manual_seed(0)
    return HandoffNet().eval()
