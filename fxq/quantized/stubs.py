"""Quantize, dequantize and requantize."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from fxq.dtypes import QDType, as_qdtype
from fxq.march import March
from fxq.primitives import requant
from fxq.qtensor import QTensor
from fxq.quantized import functional as qf
from fxq.quantized.base import QuantizedModule, check_input, multiplier_for, same_scale

__all__ = ["Quantize", "DeQuantize", "Requantize", "UnusedQuantize"]


class Quantize(QuantizedModule):
    """float -> QTensor with ``clamp(round(x / scale))``.

    ``scale`` is a buffer: deployment code may change it (e.g. to 1.0 for
    integer camera input followed by ``centered_yuv2rgb``); the modules after
    it then compute for the new scale (``fxq.quantized.base``).

    Inputs of any real dtype quantize exactly: float16 / bfloat16 and integer
    frames of up to 16 bits (``uint8``) as the same values in float32 would,
    with the float32 scale (``fxq.quantized.functional.quantize``). The scale
    stays float32 under ``.half()`` / ``.double()`` of the model.
    """

    def __init__(self, scale: Tensor, dtype: QDType, march: March) -> None:
        super().__init__(march)
        self.register_buffer("scale", scale.detach().clone().reshape(1).to(torch.float32))
        self.dtype_name = as_qdtype(dtype).name

    @property
    def dtype(self) -> QDType:
        return as_qdtype(self.dtype_name)

    @classmethod
    def from_qat(cls, qat: nn.Module) -> Quantize:
        fq = qat.activation_post_process
        return cls(fq.scale, fq.dtype, fq.march)

    def forward(self, x: Tensor | QTensor) -> QTensor:
        if not isinstance(x, (Tensor, QTensor)):  # a Python number: passes through
            return x
        if isinstance(x, QTensor):
            return Requantize(self.scale, self.dtype, self.march)(x)
        if _holds_nan(x):
            nan = torch.isnan(x)
            first = tuple(int(i) for i in nan.nonzero()[0])
            raise ValueError(
                f"Quantize {getattr(self, 'name', '')!r}: its input holds {int(nan.sum())} NaN "
                f"value(s) (the first at index {first}), which it cannot quantize: an integer "
                "has no NaN (the exported graph refuses them too); replace them before running "
                "(e.g. torch.nan_to_num(x, nan=0.0)), or find the float op that made them. "
                "+-Inf saturates"
            )
        q = requant.quantize_values(x, self.scale, self.dtype, self.rounding)
        return QTensor(q, self.scale, self.dtype)

    def extra_repr(self) -> str:
        return f"scale={self.scale.item():.6g}, dtype={self.dtype_name}"


def _holds_nan(x: Tensor) -> bool:
    """Whether a plain float CPU tensor holds NaN. Not on an accelerator, where the read
    would be a host sync per quantize (a CUDA graph could not even be captured), nor while
    compiling or tracing, where a graph cannot read it, nor for fake or meta tensors."""
    if not x.is_floating_point() or type(x) is not Tensor or x.device.type != "cpu":
        return False
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    return bool(torch.isnan(x).any())


class DeQuantize(nn.Module):
    """QTensor -> float; floats and other values pass through unchanged.

    Lists, tuples, named tuples and dicts (an op that returns several tensors, e.g.
    ``max_pool2d(..., return_indices=True)`` or ``chunk``) are dequantized
    element by element.

    Args:
        follow_model_dtype: convert places these before float layers: the
            result takes the model's floating dtype (a non-persistent buffer
            follows ``.half()`` / ``.double()``), so a float region runs in
            the dtype the user chose. Otherwise (the model's outputs) the
            result is the exact ``float32`` value of the integers.
    """

    _fxq_leaf = True

    def __init__(self, follow_model_dtype: bool = False) -> None:
        super().__init__()
        if follow_model_dtype:
            self.register_buffer("dtype_of_model", torch.empty(0), persistent=False)

    def forward(self, x):
        dtype = getattr(self, "dtype_of_model", None)
        return _dequantize(x, None if dtype is None else dtype.dtype)


def _dequantize(x, dtype):
    def leaf(v):
        if not isinstance(v, QTensor):
            return v
        return requant.dequantize(v, dtype)

    if isinstance(x, (QTensor, Tensor)):  # the common case, without the tree walk
        return leaf(x)
    return tree_map(leaf, x)  # lists / tuples / dicts / named tuples of them


class Requantize(QuantizedModule):
    """QTensor -> QTensor at another scale and/or dtype: ``clamp(shift_round(q * m, n))``."""

    def __init__(self, scale: Tensor, dtype: QDType, march: March) -> None:
        super().__init__(march)
        self.register_buffer("scale", scale.detach().clone().reshape(1).to(torch.float32))
        self.dtype_name = as_qdtype(dtype).name

    def forward(self, x: QTensor) -> QTensor:
        check_input(self, x)
        dtype = as_qdtype(self.dtype_name)
        if x.qdtype is dtype and same_scale(x, self.scale):
            return x
        m, n = self.derived(
            (qf.host_float(x.scale),),
            lambda: multiplier_for(
                self, qf.scale_ratio(x.scale, self.scale), {"input": x.scale, "output": self.scale}
            ),
        )
        return QTensor(
            requant.requantize(x.values(), m, n, dtype, self.rounding), self.scale, dtype
        )


class UnusedQuantize(nn.Module):
    """A quantize stub that saw no tensor during calibration (only Python numbers).

    Python values pass through; a tensor is an error, since there is no scale.
    """

    _fxq_leaf = True

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def forward(self, x):
        if isinstance(x, (Tensor, QTensor)):
            raise RuntimeError(
                f"quantize stub {self.name!r} saw no tensor during calibration, so it has no scale; "
                "calibrate with data that reaches it"
            )
        return x
