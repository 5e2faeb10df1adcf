"""LayerNorm and GroupNorm with an integer twin (``docs/arithmetic.md``, section 14), and
``F.normalize`` (section 27).

During QAT the float op runs with its affine weight fake-quantized per channel
(int8) and its bias at the int32 grid ``2**-Q s_w`` of the integer model; the
output gets its own fake quant. In VALIDATION the integer twin runs.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fxq.dtypes import QDType
from fxq.qat.base import FunctionalQAT, quantize_bias
from fxq.qconfig import QConfig
from fxq.quantized import functional as qf
from fxq.quantized.normalization import (
    group_norm_arguments,
    layer_norm_arguments,
    norm_z_dtype,
    unit_range_scale,
)

__all__ = ["LayerNorm", "GroupNorm", "L2Normalize"]


class _Normalization(FunctionalQAT):
    def __init__(self, qconfig: QConfig, fn: Any = None, module: nn.Module | None = None) -> None:
        super().__init__(qconfig, fn, module)
        weight = getattr(module, "weight", None)
        self.weight_fake_quant = (
            qconfig.weight(ch_axis=0, num_channels=weight.numel()) if weight is not None else None
        )

    @property
    def z_dtype(self) -> QDType:
        """int16 normalized values where the march has int16, else int8."""
        return norm_z_dtype(self.spec)

    def affine_parameters(self) -> tuple[Tensor | None, Tensor | None]:
        """The float affine weight and bias, flattened (None where absent)."""
        w = getattr(self.op, "weight", None)
        b = getattr(self.op, "bias", None)
        return (
            None if w is None else w.detach().reshape(-1),
            None if b is None else b.detach().reshape(-1),
        )

    def fake_affine(self, n: int) -> tuple[Tensor | None, Tensor | None]:
        """Fake-quantized weight (int8 per channel) and bias (int32 at ``2**-Q s_w``), flat."""
        w = getattr(self.op, "weight", None)
        b = getattr(self.op, "bias", None)
        w_q, s_w = None, torch.ones(1)
        if w is not None:
            w_q = self.weight_fake_quant(w.reshape(-1))
            s_w = self.weight_fake_quant.scale
        b_q = None
        if b is not None:
            q = qf.norm_fraction_bits(n, self.z_dtype.bits)
            unit = torch.tensor([2.0**-q], device=b.device)
            b_q = quantize_bias(b.reshape(-1), unit, s_w.to(b.device), self.state, self.march)
        return w_q, b_q

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if self.validating():
            return self.run_validation(x, *args, **kwargs)
        if self.standalone:
            (x,) = self.quantize_standalone_inputs([x])
        return self.quantize_output(self.normalize(x, args, kwargs))


class LayerNorm(_Normalization):
    """``nn.LayerNorm`` / ``F.layer_norm`` (without weight tensors) with an integer twin."""

    def normalize(self, x: Tensor, args: tuple, kwargs: dict) -> Tensor:
        shape, eps = layer_norm_arguments(self.op, args, kwargs)
        w, b = self.fake_affine(math.prod(shape))
        return F.layer_norm(
            x,
            shape,
            None if w is None else w.reshape(shape),
            None if b is None else b.reshape(shape),
            eps,
        )


class GroupNorm(_Normalization):
    """``nn.GroupNorm`` / ``F.group_norm`` (without weight tensors) with an integer twin."""

    def normalize(self, x: Tensor, args: tuple, kwargs: dict) -> Tensor:
        groups, eps = group_norm_arguments(self.op, args, kwargs)
        w, b = self.fake_affine((x.numel() // x.shape[0]) // groups)
        return F.group_norm(x, groups, w, b, eps)


class L2Normalize(FunctionalQAT):
    """``F.normalize(x, p=2, dim, eps)`` with an integer twin: the float op on the fake-quantized
    input, its output fake-quantized at a fixed scale (``unit_range_scale``: the values lie in
    ``[-1, 1]``, and an observer would clip the rows with one dominant element that a batch
    average of ranges misses). A high-precision (int32) output keeps the qconfig's fake quant.
    """

    def __init__(self, qconfig: QConfig, fn: Any = None, module: nn.Module | None = None) -> None:
        super().__init__(qconfig, fn, module)
        fq = self.activation_post_process
        if not fq.is_high_precision and not fq.is_fixed_scale:
            scale = unit_range_scale(fq.dtype, self.spec)
            self.qconfig = QConfig(
                activation=qconfig.activation.with_args(scale=scale), weight=qconfig.weight
            )
            self.activation_post_process = self.qconfig.activation()
