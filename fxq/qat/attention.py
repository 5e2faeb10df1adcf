"""Attention with an integer twin (``docs/arithmetic.md``, section 16).

``F.scaled_dot_product_attention`` becomes ``ScaledDotProductAttention``: the scores
``q @ k^T * scale`` and the softmax probabilities get their own fake quants
(int16 on marches with int16 activations, else int8), the output the op's.
``nn.MultiheadAttention`` becomes ``MultiheadAttention``: int8 per-channel
projection weights with int32 biases, fake-quantized q / k / v, scores,
probabilities and merged heads, then the output projection.

Masks (SDPA's ``attn_mask``; MHA's ``key_padding_mask`` and ``attn_mask``) are never
quantized: prepare leaves the arguments named in ``unquantized_args`` alone, and both the
float QAT computation and the integer one turn them into the same keep-mask
(``fxq.quantized.attention.keep_mask``: bool masks, or additive float masks of 0 and
``<= -1e4``). The scores fake quant sees the unmasked scores; a row with nothing left gives
probability 0.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fxq.dtypes import QDType, qint16
from fxq.fake_quantize import FakeQuantize, FakeQuantState
from fxq.qat.base import FunctionalQAT, quantize_bias
from fxq.qconfig import QConfig
from fxq.quantized import functional as qf
from fxq.quantized.attention import mha_arguments, mha_keep, sdpa_scale_and_keep

__all__ = ["ScaledDotProductAttention", "MultiheadAttention", "inner_dtype", "mha_arguments"]


def inner_dtype(qat: FunctionalQAT) -> QDType:
    """Scores and probabilities: int16 where the march has int16, else the activation dtype."""
    if qat.spec.supports_activation(qint16):
        return qint16
    return qat.qconfig.activation_dtype


def _inner_quant(qconfig: QConfig, dtype: QDType) -> FakeQuantize:
    return qconfig.activation(dtype=dtype)


def attention_probs(scores: Tensor, keep: Tensor | None) -> Tensor:
    """Float softmax of the scores along the last axis over the entries ``keep`` leaves in
    (all without a mask); a row with no entry left is 0, as in the integer softmax."""
    if keep is None:
        return torch.softmax(scores, -1)
    probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1)
    return torch.where(keep.any(-1, keepdim=True), probs, torch.zeros_like(probs))


def _quantize_leading(module: FunctionalQAT, args: tuple, count: int) -> tuple:
    """The first ``count`` (float) arguments as QTensors at their input fake quants' scales;
    the rest (masks, options) as they are."""
    from fxq.qat.base import _exact_float_inputs
    from fxq.quantized.base import quantize_tensors

    quants = [q for q in module.input_quants if q is not None]
    head = _exact_float_inputs(tuple(args[:count]), False)
    head = quantize_tensors(
        head, [q.scale for q in quants], [q.dtype for q in quants], module.spec.rounding
    )
    return (*head, *args[count:])


class ScaledDotProductAttention(FunctionalQAT):
    """``F.scaled_dot_product_attention(q, k, v, attn_mask=..., is_causal=..., scale=...)``
    without dropout (the registry keeps those calls in float); ``attn_mask`` is a bool mask
    (True = attend) or an additive float mask of 0 / ``<= -1e4``, never quantized."""

    #: ``(position, keyword)`` of the arguments prepare does not quantize
    unquantized_args = ((3, "attn_mask"),)

    def __init__(self, qconfig: QConfig, fn: Any = None, module: nn.Module | None = None) -> None:
        super().__init__(qconfig, fn, module)
        dtype = inner_dtype(self)
        self.scores_quant = _inner_quant(qconfig, dtype)
        self.probs_quant = _inner_quant(qconfig, dtype)

    def validation_forward(self, *args: Any, **kwargs: Any) -> Tensor:
        if self.standalone:
            return super().validation_forward(*args, **kwargs)
        from fxq.qat.base import _autocast_off

        args = _quantize_leading(self, args, 3)
        with torch.no_grad(), _autocast_off(self._device()):
            return self.integer_twin()(*args, **kwargs).dequantize()

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if self.validating():
            return self.run_validation(q, k, v, *args, **kwargs)
        scale, keep = sdpa_scale_and_keep(self.name, q, k, args, kwargs)
        scores = self.scores_quant(torch.matmul(q, k.transpose(-2, -1)) * scale)
        probs = self.probs_quant(attention_probs(scores, keep))
        return self.quantize_output(torch.matmul(probs, v))


class MultiheadAttention(FunctionalQAT):
    """``nn.MultiheadAttention`` (one embedding size for q, k, v; no bias_k / bias_v / zero
    attention) decomposed into quantized projections, matmuls and softmax;
    ``key_padding_mask`` and ``attn_mask`` (bool: True = left out; float: additive 0 /
    ``<= -1e4``) are keep-masks, never quantized.

    Fake quants: ``in_proj_weight_fake_quant`` / ``out_proj_weight_fake_quant`` (int8 per
    output channel), ``q_quant``, ``k_quant``, ``v_quant`` (projections), ``scores_quant``,
    ``probs_quant`` (int16 where the march has int16), ``context_quant`` (merged heads),
    ``activation_post_process`` (the output projection). Biases are fake-quantized to int32
    at ``s_in * s_w``. Returned attention weights (``need_weights``) are requantized to the
    output's scale and dtype: prepare gives each graph value one fake quant, and the
    output tuple is one value.
    """

    #: ``(position, keyword)`` of the arguments prepare does not quantize
    unquantized_args = ((3, "key_padding_mask"), (5, "attn_mask"))

    def __init__(self, qconfig: QConfig, fn: Any = None, module: nn.Module | None = None) -> None:
        super().__init__(qconfig, fn, module)
        e = module.embed_dim
        self.in_proj_weight_fake_quant = qconfig.weight(ch_axis=0, num_channels=3 * e)
        self.out_proj_weight_fake_quant = qconfig.weight(ch_axis=0, num_channels=e)
        for name in ("q_quant", "k_quant", "v_quant", "context_quant"):
            setattr(self, name, qconfig.activation())
        dtype = inner_dtype(self)
        self.scores_quant = _inner_quant(qconfig, dtype)
        self.probs_quant = _inner_quant(qconfig, dtype)

    def _bias(self, bias: Tensor | None, input_scale: Tensor | None, weight_scale: Tensor):
        if bias is None:
            return None
        return quantize_bias(bias, input_scale, weight_scale, self.state, self.march)

    def validation_forward(self, *args: Any, **kwargs: Any):
        from fxq.qat.base import _autocast_off
        from fxq.qtensor import QTensor

        twin = self.integer_twin()
        args = _quantize_leading(self, args, 3)
        with torch.no_grad(), _autocast_off(self._device()):
            out, weights = twin(*args, **kwargs)
        return out.dequantize(), (weights.dequantize() if isinstance(weights, QTensor) else None)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any):
        if self.validating():
            return self.run_validation(query, key, value, *args, **kwargs)
        mha = self.op
        options = mha_arguments(args, kwargs)
        if mha.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        # [L, B, E] -> [B, H, L, d]
        e, h = mha.embed_dim, mha.num_heads
        w = self.in_proj_weight_fake_quant(mha.in_proj_weight)
        s_w = self.in_proj_weight_fake_quant.scale
        b = mha.in_proj_bias
        heads = []
        for i, (x, fq) in enumerate(
            zip((query, key, value), (self.q_quant, self.k_quant, self.v_quant))
        ):
            part = slice(i * e, (i + 1) * e)
            bias = self._bias(None if b is None else b[part], self.input_scale(i), s_w[part])
            y = fq(F.linear(x, w[part], bias))
            heads.append(y.reshape(y.shape[0], y.shape[1], h, e // h).permute(1, 2, 0, 3))
        q, k, v = heads
        scale = 1.0 / math.sqrt(e // h)
        scores = self.scores_quant(torch.matmul(q, k.transpose(-2, -1)) * scale)
        keep = mha_keep(self.name, options["key_padding_mask"], options["attn_mask"], q.shape[0], h)
        probs = self.probs_quant(attention_probs(scores, keep))
        dropped = F.dropout(probs, mha.dropout, self.training) if mha.dropout else probs
        ctx = torch.matmul(dropped, v).permute(2, 0, 1, 3).reshape(q.shape[2], q.shape[0], e)
        ctx = self.context_quant(ctx)
        wo = self.out_proj_weight_fake_quant(mha.out_proj.weight)
        bo = self._bias(
            mha.out_proj.bias, self.context_quant.scale, self.out_proj_weight_fake_quant.scale
        )
        out = self.quantize_output(F.linear(ctx, wo, bo))
        if mha.batch_first:
            out = out.transpose(0, 1)
        weights = None
        if options["need_weights"]:  # on the output's grid: one fake quant per graph value
            weights = probs.mean(1) if options["average_attn_weights"] else probs
            if self.state is not FakeQuantState.CALIBRATION:
                fq = self.activation_post_process
                weights = qf.fake_quantize(
                    weights, fq.scale, fq.dtype.qmin, fq.dtype.qmax, self.spec.rounding
                )[0]
        return out, weights
