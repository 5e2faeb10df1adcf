"""What every fxq.quantized module shares."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxq.dtypes import QDType, as_qdtype
from fxq.march import March, spec_for
from fxq.qtensor import QTensor

__all__ = ["QuantizedModule", "Standalone", "check_input", "quantize_tensors", "warn_if_saturated"]


class QuantizedModule(nn.Module):
    """Base class: an integer op on QTensors, built from its QAT twin.

    Integer parameters are buffers, so ``state_dict`` round-trips and
    ``.to(device)`` moves them.

    Attributes:
        march: the march whose rounding and multiplier widths apply.
        name: where the module sits (for error messages), set by convert.
    """

    _fxq_leaf = True

    def __init__(self, march: March) -> None:
        super().__init__()
        self.march = march
        self.name = ""

    @property
    def spec(self):
        return spec_for(self.march)

    @property
    def rounding(self):
        return self.spec.rounding

    @classmethod
    def from_qat(cls, qat: nn.Module) -> QuantizedModule:  # pragma: no cover - abstract
        raise NotImplementedError


def check_input(module: QuantizedModule, x: Any, scale: Tensor, index: int = 0) -> QTensor:
    """Check that input ``index`` is a QTensor at the scale the module was converted for."""
    if not isinstance(x, QTensor):
        raise TypeError(
            f"{type(module).__name__} {module.name!r} expects a QTensor as input {index}, got "
            f"{type(x).__name__}; quantize it first (fxq.quantized.Quantize)"
        )
    if x.scale.numel() != 1 or not torch.equal(x.scale, scale.to(x.scale.device)):
        got = x.scale.tolist()
        raise ValueError(
            f"{type(module).__name__} {module.name!r}: input {index} has scale {got}, but the module "
            f"was converted for scale {scale.item():.8g}. If you edited the graph, the op before "
            "this one must output the scale this layer expects"
        )
    return x


def quantize_tensors(values: Any, scales: list[Tensor], dtypes: list[QDType], rounding) -> Any:
    """Quantize the float tensors in a nested structure, in flattened order."""
    leaves, spec = tree_flatten(values)
    out, i = [], 0
    for leaf in leaves:
        if isinstance(leaf, Tensor) and leaf.is_floating_point():
            out.append(QTensor.quantize(leaf, scales[i], dtypes[i], rounding))
            i += 1
        else:
            out.append(leaf)
    return tree_unflatten(out, spec)


class Standalone(QuantizedModule):
    """A quantized op that opaque code calls with float tensors.

    Quantizes its tensor inputs with the scales its QAT twin learned, runs
    the integer op, and returns float (the dequantized result).
    """

    def __init__(self, inner: QuantizedModule, scales: list[Tensor], dtypes: list[QDType]) -> None:
        super().__init__(inner.march)
        self.inner = inner
        for i, s in enumerate(scales):
            self.register_buffer(f"input_scale_{i}", s.detach().clone().reshape(1))
        self.input_dtypes = [d.name for d in dtypes]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        scales = [getattr(self, f"input_scale_{i}") for i in range(len(self.input_dtypes))]
        dtypes = [as_qdtype(d) for d in self.input_dtypes]
        args, kwargs = quantize_tensors((args, kwargs), scales, dtypes, self.rounding)
        out = self.inner(*args, **kwargs)
        return out.dequantize() if isinstance(out, QTensor) else out


_INT32_LIMIT = float((1 << 31) - 1)


def warn_if_saturated(module: QuantizedModule, acc: Tensor) -> None:
    """Warn (once per module) when an int32 accumulator actually saturated.

    Only called where the worst case can exceed int32; the march's accumulator
    saturates, so results stay defined, but the layer is far less accurate.
    """
    if module.__dict__.get("_warned_saturation"):
        return
    hits = int((acc.abs() >= _INT32_LIMIT).sum())
    if hits:
        module.__dict__["_warned_saturation"] = True
        warnings.warn(
            f"fxq: the int32 accumulator of {type(module).__name__} {module.name!r} saturated on {hits} "
            f"of {acc.numel()} elements; products of two int16 values (or int16 inputs with large "
            "weights) overflow 32 bits. Use int8 for one operand or scale the values down.",
            RuntimeWarning,
            stacklevel=3,
        )
