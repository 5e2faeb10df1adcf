"""Issue #11: torchvision and timm model families, fully integer with ``example_inputs``.

Each model (random init, small inputs) is prepared with ``example_inputs`` for
the bayes march, calibrated on two batches, converted, and checked twice:

* the integer model computes exactly what the QAT model computes in
  VALIDATION (``torch.equal``), and CALIBRATION computes the float model;
* no compute op is left in float: prepare's FloatOpWarning lists nothing and
  ``fxq.summary`` of the integer model has no unsupported row. A model added
  with an op that has no integer implementation yet gives ``Case.missing``:
  this half is then an ``xfail(strict=True)`` naming the op, so it flips when
  the op lands (as maxvit_t's einsum / swapaxes and edgenext's F.normalize did).

Sizes are the smallest each architecture takes (timm ``img_size=32``;
EfficientFormer's attention biases need a 7x7 map, so 224; MaxViT with a 2x2
partition so that 64x64 works). To keep the module fast (no slow marker:
66 s of CPU time single-threaded), the deep ones are built with
fewer blocks per stage through their constructors (ViT/DeiT depth 2, swin_t
[2, 2, 2, 2], maxvit_t, efficientnet_v2_s, LeViT and EfficientFormer one or
two per stage); every block type of each family is still there.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import fxq
from fxq.fx.prepare import FloatOpWarning
from tests.helpers import calibrate

timm = pytest.importorskip("timm")
torchvision = pytest.importorskip("torchvision")

q8 = fxq.qconfig.default_qat_8bit_fake_quant_qconfig


def _tv_vit() -> nn.Module:
    from torchvision.models.vision_transformer import VisionTransformer

    # vit_b_16's blocks (nn.MultiheadAttention, class token, learned positions), small
    return VisionTransformer(
        image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64
    )


def _tv_swin_t() -> nn.Module:
    from torchvision.models.swin_transformer import SwinTransformer

    # swin_t with two blocks (plain and shifted window) per stage instead of [2, 2, 6, 2]
    return SwinTransformer(
        patch_size=[4, 4],
        embed_dim=96,
        depths=[2, 2, 2, 2],
        num_heads=[3, 6, 12, 24],
        window_size=[7, 7],
        stochastic_depth_prob=0.2,
    )


def _tv_maxvit_t() -> nn.Module:
    from torchvision.models.maxvit import MaxVit

    # maxvit_t's stem, channels and head size, one block per stage instead of [2, 2, 5, 2];
    # partition 7 would need 224x224 inputs, 2 works with 64x64
    return MaxVit(
        input_size=(64, 64),
        stem_channels=64,
        partition_size=2,
        block_channels=[64, 128, 256, 512],
        block_layers=[1, 1, 1, 1],
        head_dim=32,
        stochastic_depth_prob=0.2,
    )


def _tv_efficientnet_v2_s() -> nn.Module:
    from torchvision.models.efficientnet import EfficientNet, _efficientnet_conf

    # efficientnet_v2_s's six stages (Fused-MBConv and MBConv with squeeze-excitation), one
    # block each
    settings, last_channel = _efficientnet_conf("efficientnet_v2_s")
    for stage in settings:
        stage.num_layers = 1
    return EfficientNet(settings, dropout=0.2, last_channel=last_channel)


def _tv(name: str) -> Callable[[], nn.Module]:
    return lambda: getattr(torchvision.models, name)()


def _timm(name: str, **kwargs) -> Callable[[], nn.Module]:
    return lambda: timm.create_model(name, pretrained=False, **kwargs)


@dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]
    shape: tuple[int, ...]
    missing: str = ""  # the ops without an integer implementation yet


CASES = {
    "vit (torchvision VisionTransformer)": Case(_tv_vit, (2, 3, 32, 32)),
    "swin_t": Case(_tv_swin_t, (2, 3, 32, 32)),
    "maxvit_t": Case(_tv_maxvit_t, (2, 3, 64, 64)),
    "convnext_tiny": Case(_tv("convnext_tiny"), (2, 3, 32, 32)),
    "efficientnet_v2_s": Case(_tv_efficientnet_v2_s, (2, 3, 32, 32)),
    "regnet_y_400mf": Case(_tv("regnet_y_400mf"), (2, 3, 32, 32)),
    "mobilenet_v3_small": Case(_tv("mobilenet_v3_small"), (2, 3, 32, 32)),
    "vit_tiny_patch16_224": Case(
        _timm("vit_tiny_patch16_224", img_size=32, depth=2), (2, 3, 32, 32)
    ),
    "deit_tiny_patch16_224": Case(
        _timm("deit_tiny_patch16_224", img_size=32, depth=2), (2, 3, 32, 32)
    ),
    "mobilevit_xxs": Case(_timm("mobilevit_xxs"), (2, 3, 64, 64)),
    "levit_128s": Case(_timm("levit_128s", img_size=64, depth=(1, 1, 1)), (2, 3, 64, 64)),
    "efficientformer_l1": Case(_timm("efficientformer_l1", depths=(1, 1, 1, 2)), (1, 3, 224, 224)),
    "convnext_atto": Case(_timm("convnext_atto"), (2, 3, 32, 32)),
    "edgenext_xx_small": Case(_timm("edgenext_xx_small"), (2, 3, 64, 64)),
}


@dataclass
class Result:
    float_ops: list[str]  # prepare's FloatOpWarning lines
    unsupported: list[str]  # fxq.summary rows of the integer model that run in float
    reference: torch.Tensor  # the float model
    calibrated: torch.Tensor  # the QAT model in CALIBRATION
    validation: torch.Tensor  # the QAT model in VALIDATION
    integer: torch.Tensor  # the converted model


def _logits(out) -> torch.Tensor:
    return out if torch.is_tensor(out) else out[0]


@functools.cache
def _run(name: str) -> Result:
    """Prepare, calibrate, convert and run one model (once per test session)."""
    case = CASES[name]
    torch.manual_seed(0)
    model = case.build().eval()
    x, *batches = (torch.randn(case.shape) for _ in range(3))
    fxq.set_march("bayes")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FloatOpWarning)
        qat = fxq.prepare_qat_fx(model, {"": q8}, example_inputs=(batches[0],))
    float_ops = [
        line.strip()[2:]
        for w in caught
        if issubclass(w.category, FloatOpWarning)
        for line in str(w.message).splitlines()
        if line.startswith("  - ")
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random init: scales clamped at vanishing layer scales
        calibrate(qat, batches)
        with torch.no_grad():
            reference, calibrated = _logits(model(x)), _logits(qat(x))
            fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
            validation = _logits(qat(x))
            converted = fxq.convert_fx(qat)
            integer = _logits(converted(x))
    unsupported = [
        f"{row['node']} ({row['type']})"
        for row in fxq.summary(converted, show=False)
        if row["unsupported"]
    ]
    return Result(float_ops, unsupported, reference, calibrated, validation, integer)


def _no_float_case(name: str):
    missing = CASES[name].missing
    if not missing:
        return name
    return pytest.param(
        name, marks=pytest.mark.xfail(strict=True, reason=f"{missing} not integer yet")
    )


@pytest.mark.parametrize("name", list(CASES))
def test_integer_model_equals_validation_bit_for_bit(name):
    result = _run(name)
    assert result.integer.shape == (CASES[name].shape[0], 1000)
    assert torch.isfinite(result.integer).all()
    assert torch.equal(result.integer, result.validation)
    # CALIBRATION runs the float model (fusion and folding change nothing but rounding)
    scale = result.reference.abs().max().item()
    assert torch.allclose(result.calibrated, result.reference, rtol=1e-3, atol=1e-4 * scale)


@pytest.mark.parametrize("name", [_no_float_case(n) for n in CASES])
def test_no_compute_op_is_left_in_float(name):
    result = _run(name)
    assert result.float_ops == []
    assert result.unsupported == []
