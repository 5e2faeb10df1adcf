"""What every QAT module shares: ordinary nn.Module behaviour, bias quantization, the twin."""

from __future__ import annotations

import copy
import importlib
import inspect
import pkgutil

import pytest
import torch
from torch import nn

import fxq
import fxq.qat
from fxq.fake_quantize import FakeQuantState, fake_quantize_ste
from fxq.qat.base import quantize_bias
from fxq.qconfig import default_qat_8bit_fake_quant_qconfig

# nn.Module methods a subclass may override on purpose (with nn.Module's signature)
# nn.Module's documented extension points, overridden with their own signatures
_OVERRIDABLE = {
    "forward",
    "extra_repr",
    "_save_to_state_dict",
    "_load_from_state_dict",
    "_apply",
    "train",
}


def _fxq_module_classes() -> list[type[nn.Module]]:
    for info in pkgutil.walk_packages(fxq.__path__, "fxq."):
        if info.name.startswith("fxq.export"):
            continue  # optional dependencies; no modules there
        importlib.import_module(info.name)
    found, stack = [], [nn.Module]
    while stack:
        for cls in stack.pop().__subclasses__():
            stack.append(cls)
            if cls.__module__.startswith("fxq.") and cls not in found:
                found.append(cls)
    return found


def test_no_fxq_module_shadows_nn_module_internals():
    """`.to()`, `.cuda()`, `.half()` call `nn.Module._apply(fn)`: a method of that name with
    another meaning breaks them (as `WeightedQAT._apply(x, weight, bias)` once did)."""
    internal = {name for name in vars(nn.Module) if not name.startswith("__")}
    classes = _fxq_module_classes()
    assert any(c.__name__ == "WeightedQAT" for c in classes)
    problems = []
    for cls in classes:
        for name, value in vars(cls).items():
            if name not in internal:
                continue
            if name not in _OVERRIDABLE:
                problems.append(f"{cls.__module__}.{cls.__qualname__}.{name}")
            elif name == "_apply" and list(inspect.signature(value).parameters) != [
                "self",
                "fn",
                "recurse",
            ]:
                problems.append(
                    f"{cls.__module__}.{cls.__qualname__}._apply{inspect.signature(value)}"
                )
    assert problems == []


@pytest.mark.parametrize(
    "float_op",
    [
        nn.Conv1d(2, 4, 3),
        nn.Conv2d(2, 4, 3),
        nn.Conv3d(2, 4, 1),
        nn.ConvTranspose1d(2, 4, 3),
        nn.ConvTranspose2d(2, 4, 3, groups=2),
        nn.ConvTranspose3d(2, 4, 1),
        nn.Linear(2, 4),
    ],
    ids=lambda m: type(m).__name__,
)
def test_every_weighted_qat_module_moves_and_changes_dtype(bayes, float_op):
    qat_cls = getattr(fxq.qat, type(float_op).__name__)
    module = qat_cls.from_float(copy.deepcopy(float_op), default_qat_8bit_fake_quant_qconfig)
    shape = {nn.Linear: (3, 2), nn.Conv1d: (1, 2, 5), nn.ConvTranspose1d: (1, 2, 5)}.get(
        type(float_op), (1, 2, 5, 5) if "2d" in type(float_op).__name__ else (1, 2, 2, 2, 2)
    )
    x = torch.randn(shape)
    reference = module(x)
    for dtype in (torch.float64, torch.float16, torch.float32):
        module.to(dtype)
        assert module.weight.dtype is dtype
        assert module.weight_fake_quant.scale.dtype is torch.float32
        assert module.activation_post_process.scale.dtype is torch.float32
    assert module.cpu() is module
    # float32 -> float64 -> float16 rounds the weights; the float64 result stays close
    module = qat_cls.from_float(copy.deepcopy(float_op), default_qat_8bit_fake_quant_qconfig)
    out = module.double()(x.double())
    assert out.dtype is torch.float64 and torch.allclose(out.float(), reference, atol=0.05)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_bias_of_a_16_bit_model_is_quantized_at_the_float32_scale(bayes, dtype):
    input_scale = torch.tensor([0.0123])
    weight_scale = torch.tensor([0.00731, 0.0517])
    bias = torch.tensor([0.3, -1.7]).to(dtype)
    out = quantize_bias(bias, input_scale, weight_scale, FakeQuantState.QAT, "bayes")
    assert out.dtype is dtype
    scale = input_scale * weight_scale  # float32: never rounded to 16 bits
    expected = fake_quantize_ste(bias.float(), scale, fxq.qint32, fxq.get_march_spec().rounding, 0)
    assert torch.equal(out, expected.to(dtype))
    truncated = (input_scale * weight_scale).to(dtype).float()
    assert not torch.equal(out.float(), torch.floor(bias.float() / truncated + 0.5) * truncated)
