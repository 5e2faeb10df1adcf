"""Attention with an integer twin (``docs/arithmetic.md``, section 16).

``F.scaled_dot_product_attention`` becomes ``ScaledDotProductAttention``: the scores
``q @ k^T * scale`` and the softmax probabilities get their own fake quants
(int16 on marches with int16 activations, else int8), the output the op's.
``nn.MultiheadAttention`` becomes ``MultiheadAttention``: int8 per-channel
projection weights with int32 biases, fake-quantized q / k / v, scores,
probabilities and merged heads, then the output projection.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from fxq.dtypes import QDType, qint16
from fxq.fake_quantize import FakeQuantize
from fxq.qat.base import FunctionalQAT
from fxq.qconfig import QConfig
from fxq.quantized.attention import causal_keep, sdpa_arguments

__all__ = ["ScaledDotProductAttention", "inner_dtype"]


def inner_dtype(qat: FunctionalQAT) -> QDType:
    """Scores and probabilities: int16 where the march has int16, else the activation dtype."""
    if qat.spec.supports_activation(qint16):
        return qint16
    return qat.qconfig.activation_dtype


def _inner_quant(qconfig: QConfig, dtype: QDType) -> FakeQuantize:
    return qconfig.activation(dtype=dtype)


def attention_probs(scores: Tensor, causal: bool) -> Tensor:
    """Float softmax of the scores along the last axis (``j > i`` left out when ``causal``)."""
    if causal:
        keep = causal_keep(scores.shape[-2], scores.shape[-1], scores.device)
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, -1)


class ScaledDotProductAttention(FunctionalQAT):
    """``F.scaled_dot_product_attention(q, k, v, is_causal=..., scale=...)`` without a mask
    or dropout (the registry keeps those calls in float)."""

    def __init__(self, qconfig: QConfig, fn: Any = None, module: nn.Module | None = None) -> None:
        super().__init__(qconfig, fn, module)
        dtype = inner_dtype(self)
        self.scores_quant = _inner_quant(qconfig, dtype)
        self.probs_quant = _inner_quant(qconfig, dtype)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if self.validating():
            return self.validation_forward(q, k, v, *args, **kwargs)
        options = sdpa_arguments(args, kwargs)
        scale = options["scale"]
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        scores = self.scores_quant(torch.matmul(q, k.transpose(-2, -1)) * scale)
        probs = self.probs_quant(attention_probs(scores, bool(options["is_causal"])))
        return self.quantize_output(torch.matmul(probs, v))
