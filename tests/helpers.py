"""Models and measurements shared by the tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import fxq

ROOT = Path(__file__).resolve().parents[1]


def run_in_fresh_process(code: str, **environment: str) -> str:
    """Run Python ``code`` in a new interpreter (from the repository root, with these
    environment variables added); return its stdout."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        env={**os.environ, **environment},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()


def sqnr(reference: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB."""
    noise = (reference.double() - test.double()).pow(2).mean()
    return float(10 * torch.log10(reference.double().pow(2).mean() / noise.clamp_min(1e-30)))


@torch.no_grad()
class RecordedOps:
    """Within the block, the names of the aten ops that run (``.names``), e.g. to count a
    step's host syncs (``_local_scalar_dense``) or a fake quant's kernels."""

    def __init__(self, ignore: set[str] = frozenset()) -> None:
        self.ignore = ignore
        self.names: list[str] = []

    def __enter__(self) -> RecordedOps:
        from torch.utils._python_dispatch import TorchDispatchMode

        recorded = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if name not in recorded.ignore:
                    recorded.names.append(name)
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)


def assert_validation_equals_converted(prepared: nn.Module, batches) -> None:
    """The converted integer model of ``prepared`` and ``prepared`` in VALIDATION give the
    same outputs bit for bit on every batch (``prepared`` is left in VALIDATION)."""
    import copy

    converted = fxq.convert_fx(copy.deepcopy(prepared))
    fxq.set_fake_quantize(prepared, fxq.FakeQuantState.VALIDATION)
    with torch.no_grad():
        for x in batches:
            assert torch.equal(prepared(x), converted(x))


def recalibrate_bn(model: nn.Module, batches) -> nn.Module:
    """Set BatchNorm running statistics from data (cumulative average), so a
    randomly initialised model has normalised activations in eval mode."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [bn.momentum for bn in bns]
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None
    model.train()
    for x in batches:
        model(x)
    for bn, momentum in zip(bns, momenta):  # None would sync with the host at every step
        bn.momentum = momentum
    return model.eval()


def calibrate(qat: nn.Module, batches) -> nn.Module:
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    qat.eval()
    with torch.no_grad():
        for x in batches:
            qat(x)
    return qat


def fake_quant_modules(model: nn.Module) -> dict[str, fxq.FakeQuantize]:
    return {n: m for n, m in model.named_modules() if isinstance(m, fxq.FakeQuantize)}


class SeedNet(nn.Module):
    """The seed example: QuantStub, conv, bn, relu and a qconfig attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = fxq.QuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.dequant = fxq.DeQuantStub()
        self.qconfig = fxq.qconfig.default_qat_8bit_fake_quant_qconfig

    def forward(self, x):
        return self.dequant(self.relu(self.bn(self.conv(self.quant(x)))))


class ResidualNet(nn.Module):
    """conv-bn-relu, a residual block with `+=`, pooling and a linear head."""

    def __init__(self, channels: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn0 = nn.BatchNorm2d(channels)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x):
        x = F.relu(self.bn0(self.stem(x)))
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        out = F.relu(out)
        return self.fc(torch.flatten(self.pool(out), 1))


# -- a RetinaNet-style detector -------------------------------------------------------------
class _Head(nn.Module):
    """Shared across pyramid levels: each conv is called once per level."""

    def __init__(self, channels: int, outputs: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.out = nn.Conv2d(channels, outputs, 3, padding=1)

    def forward(self, x):
        return self.out(F.relu(self.conv(x)))


class TinyRetinaNet(nn.Module):
    """Backbone, two pyramid levels, shared class / box heads, and an
    ``@fx_wrap()`` post-process whose ``self.training`` branch returns raw
    outputs while eval decodes boxes with data-dependent Python."""

    def __init__(self, num_classes: int = 3, anchors_per_cell: int = 2) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.anchors_per_cell = anchors_per_cell
        self.score_thresh = 0.05
        self.quant = fxq.QuantStub()
        self.c1 = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU()
        )
        self.c2 = nn.Sequential(
            nn.Conv2d(16, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU()
        )
        self.lat1 = nn.Conv2d(16, 16, 1)
        self.lat2 = nn.Conv2d(16, 16, 1)
        self.cls_head = _Head(16, anchors_per_cell * num_classes)
        self.box_head = _Head(16, anchors_per_cell * 4)
        self.box_scale = nn.Linear(4, 4)  # used only inside the wrapped post-process

    def forward(self, x):
        x = self.quant(x)
        f1 = self.c1(x)
        f2 = self.c2(f1)
        p2 = self.lat2(f2)
        p1 = self.lat1(f1) + F.interpolate(p2, scale_factor=2.0, mode="nearest")
        feats = [p1, p2]
        cls = [self.cls_head(f) for f in feats]
        box = [self.box_head(f) for f in feats]
        return self.postprocess(cls, box)

    @fxq.fx_wrap()
    def postprocess(self, cls, box):
        if self.training:
            return {"cls": cls, "box": box}
        detections = []
        for c, b in zip(cls, box):
            n, _, h, w = c.shape
            scores = c.sigmoid().reshape(n, self.anchors_per_cell, self.num_classes, h, w)
            deltas = self.box_scale(
                b.reshape(n, self.anchors_per_cell, 4, h, w).permute(0, 1, 3, 4, 2)
            )
            keep = scores.amax(2) > self.score_thresh
            detections.append((scores.amax(2)[keep], deltas[keep]))
        scores = torch.cat([d[0] for d in detections])
        boxes = torch.cat([d[1] for d in detections])
        return {"scores": scores, "boxes": boxes, "count": int(scores.numel())}


class HandoffNet(nn.Module):
    """Bias-free convs (bias correction adds biases), a depthwise conv (equalization), ReLUs
    that only convs read (offsets), a BatchNorm no conv absorbs, a linear output (int32)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn0 = nn.BatchNorm2d(8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.pw = nn.Conv2d(8, 8, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5, bias=False)
        for bn in (self.bn0, self.bn1, self.bn2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.data.uniform_(0.5, 1.5)
            bn.bias.data.uniform_(-0.2, 0.2)

    def forward(self, x):
        y = F.relu(self.bn0(self.stem(x)))
        z = self.pw(F.relu(self.dw(y)))
        z = F.relu(self.bn2(z + y))
        return self.fc(z.mean((2, 3)))
