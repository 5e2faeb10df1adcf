"""Integer attention (``docs/arithmetic.md``, section 16): ``F.scaled_dot_product_attention``
and ``nn.MultiheadAttention``, decomposed into integer matmuls, softmax and linear layers.

``scores = sat(shift_round((Q @ K^T) M_s, S_s))`` with ``M_s 2**-S_s ~ s_q s_k scale / s_scores``
(the ``1 / sqrt(d)`` scale folds into the multiplier), the integer softmax of
``fxq.quantized.softmax`` along the last axis (``is_causal`` leaves out ``j > i``), and
``out = sat(shift_round((P @ V) M_o, S_o))``. Scores and probabilities are int16 on
marches with int16 activations, int8 elsewhere; the output has the qconfig's dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from fxq.dtypes import QDType, as_qdtype
from fxq.qtensor import QTensor
from fxq.quantized import functional as qf
from fxq.quantized.base import QuantizedModule, multiplier_for
from fxq.quantized.ops_base import FunctionalQuantized
from fxq.quantized.softmax import SoftmaxPlan, integer_softmax, softmax_plan

__all__ = [
    "ScaledDotProductAttention",
    "sdpa_arguments",
    "integer_matmul",
    "causal_keep",
]


def sdpa_arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of an ``F.scaled_dot_product_attention`` call after ``(q, k, v)``."""
    names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    defaults = (None, 0.0, False, None, False)
    values = dict(zip(names, defaults))
    values.update(zip(names, args))
    values.update({k: v for k, v in kwargs.items() if k in values})
    return values


def causal_keep(rows: int, cols: int, device: Any) -> Tensor:
    """``keep[i, j] = j <= i``: the mask of ``is_causal=True`` (torch's ``tril``)."""
    return torch.ones(rows, cols, dtype=torch.bool, device=device).tril()


def integer_matmul(
    module: QuantizedModule,
    a: Tensor,
    b: Tensor,
    a_bits: int,
    b_bits: int,
    multiplier: Tensor,
    shift: Tensor,
    out_dtype: QDType,
) -> Tensor:
    """``sat(shift_round(sat32(a @ b) M, S))`` with an exact accumulation; float32 integers."""
    k = a.shape[-1]
    plan = qf.plan_accumulation(a_bits, k * (1 << (b_bits - 1)), other_bits=b_bits)
    acc = qf.accumulate(lambda x, w, _: torch.matmul(x, w), a, b, None, plan)
    acc = qf.saturate_int32(acc)
    return qf.requantize_exact(acc, multiplier, shift, out_dtype, module.rounding, as_float=True)


class ScaledDotProductAttention(FunctionalQuantized):
    """Integer ``F.scaled_dot_product_attention`` (no ``attn_mask``, no dropout; ``is_causal``
    and ``scale`` as given).

    Buffers:
        scores_scale, probs_scale: the scales of the integer scores and probabilities.
    """

    def __init__(self, qat: nn.Module) -> None:
        super().__init__(qat)
        self.register_buffer("scores_scale", qat.scores_quant.scale.detach().clone().reshape(1))
        self.register_buffer("probs_scale", qat.probs_quant.scale.detach().clone().reshape(1))
        self.inner_dtype_name = qat.scores_quant.dtype.name

    @property
    def inner_dtype(self) -> QDType:
        return as_qdtype(self.inner_dtype_name)

    def plan(self, q: QTensor, k: QTensor, v: QTensor, scale: float):
        """Multipliers of both matmuls and the softmax plan for these input scales."""
        key = (*self.scale_values(q, k, v), scale)
        return self.derived(key, lambda: self._derive(q.scale, k.scale, v.scale, scale))

    def _derive(self, s_q: Tensor, s_k: Tensor, s_v: Tensor, scale: float):
        s_s, s_p = self.scores_scale.double(), self.probs_scale.double()
        real = s_q.double() * s_k.double() * scale / s_s
        m_s, k_s = multiplier_for(
            self, real, {"query": s_q, "key": s_k, "scores": s_s, f"x scale {scale:.6g}": 1.0}
        )
        soft = softmax_plan(self, self.scores_scale, self.probs_scale, log=False)
        s_y = self.output_scale.double()
        m_o, k_o = multiplier_for(
            self, s_p * s_v.double() / s_y, {"probabilities": s_p, "value": s_v, "output": s_y}
        )
        return m_s, k_s, soft, m_o, k_o

    def forward(self, q: QTensor, k: QTensor, v: QTensor, *args: Any, **kwargs: Any) -> QTensor:
        options = sdpa_arguments(args, kwargs)
        scale = options["scale"]
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        m_s, k_s, soft, m_o, k_o = self.plan(q, k, v, scale)
        out = attention_core(
            self, q, k, v, (m_s, k_s), soft, (m_o, k_o), self.inner_dtype, options["is_causal"]
        )
        return self.wrap(out[0])


def attention_core(
    module: QuantizedModule,
    q: QTensor,
    k: QTensor,
    v: QTensor,
    scores_requant: tuple[Tensor, Tensor],
    soft: SoftmaxPlan,
    out_requant: tuple[Tensor, Tensor],
    inner: QDType,
    causal: bool,
    out_dtype: QDType | None = None,
) -> tuple[Tensor, Tensor]:
    """Integer scores, probabilities and output of attention; returns ``(out, probs)`` as float32
    integers (``out`` in ``out_dtype``, default the module's, ``probs`` in ``inner``)."""
    scores = integer_matmul(
        module,
        q.values(),
        k.values().transpose(-2, -1),
        q.qdtype.bits,
        k.qdtype.bits,
        *scores_requant,
        inner,
    )
    keep = causal_keep(scores.shape[-2], scores.shape[-1], scores.device) if causal else None
    probs = integer_softmax(scores, -1, soft, inner, module.rounding, keep=keep).to(torch.float32)
    out = integer_matmul(
        module,
        probs,
        v.values(),
        inner.bits,
        v.qdtype.bits,
        *out_requant,
        out_dtype or module.out_dtype,
    )
    return out, probs
