"""Integer attention (``docs/arithmetic.md``, section 16): ``F.scaled_dot_product_attention``
and ``nn.MultiheadAttention``, decomposed into integer matmuls, softmax and linear layers.

``scores = sat(shift_round((Q @ K^T) M_s, S_s))`` with ``M_s 2**-S_s ~ s_q s_k scale / s_scores``
(the ``1 / sqrt(d)`` scale folds into the multiplier), the integer softmax of
``fxq.quantized.softmax`` along the last axis over the entries a keep-mask leaves in, and
``out = sat(shift_round((P @ V) M_o, S_o))``. Scores and probabilities are int16 on
marches with int16 activations, int8 elsewhere; the output has the qconfig's dtype.

Masks are never quantized: they decide which entries the softmax takes (``keep_mask``).
A bool mask is used as it is (SDPA: True = attend; ``nn.MultiheadAttention``: True = left
out, torch's conventions); a float mask must be *additive* with only two kinds of entries:
``0`` (attend) and ``<= ADDITIVE_MASK_LIMIT`` (``-1e4``, ``-inf`` and ``torch.finfo(dtype).min``
included: left out). Any other entry raises ``ValueError``. A row with no entry left gives
probability 0 everywhere (its output row is the requantized 0 (+ bias); torch gives NaN for
bool masks and a uniform row for ``finfo.min`` masks). The QAT module uses the same rule.

``forward`` computes with ``fxq.primitives`` only, so that an export records it: the
matmuls (``accumulate.matmul``), the softmax (``normalization.record_softmax``), the
projections (a ``linear`` node), the moves into heads and back (``movement``), the head sum
of the returned weights (``window``) and their requantization (``requant``); the ops that
turn a mask into a keep-mask (``dequantize``, ``compare``, ``logical``, ``reshape``) are
recorded too, so a mask computed from the graph's inputs (a padding mask from
``attention_mask``) and a constant mask (a buffer) both export.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fxq.dtypes import QDType, as_qdtype, qint8, qint32
from fxq.primitives import accumulate, movement, normalization, requant, window
from fxq.primitives.core import Call, NotExportable, ir_dtype, is_recording, record
from fxq.qtensor import QTensor
from fxq.quantized import functional as qf
from fxq.quantized.base import (
    QuantizedModule,
    multiplier_for,
    require_finite,
    warn_if_saturated,
)
from fxq.quantized.ops_base import FunctionalQuantized
from fxq.quantized.softmax import SoftmaxPlan, integer_softmax, softmax_node, softmax_plan

__all__ = [
    "ScaledDotProductAttention",
    "MultiheadAttention",
    "sdpa_arguments",
    "integer_matmul",
    "causal_keep",
    "keep_mask",
    "sdpa_keep",
    "sdpa_scale",
    "sdpa_scale_and_keep",
    "mha_keep",
    "ADDITIVE_MASK_LIMIT",
]

#: a float (additive) mask entry at or below this leaves its score out; 0 keeps it
ADDITIVE_MASK_LIMIT = -1e4


def sdpa_arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of an ``F.scaled_dot_product_attention`` call after ``(q, k, v)``."""
    names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    defaults = (None, 0.0, False, None, False)
    values = dict(zip(names, defaults))
    values.update(zip(names, args))
    values.update({k: v for k, v in kwargs.items() if k in values})
    return values


def mha_arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of an ``nn.MultiheadAttention`` call after ``(query, key, value)``."""
    names = (
        "key_padding_mask",
        "need_weights",
        "attn_mask",
        "average_attn_weights",
        "is_causal",
    )
    values = dict(zip(names, (None, True, None, True, False)))
    values.update(zip(names, args))
    values.update({k: v for k, v in kwargs.items() if k in values})
    return values


def causal_keep(rows: int, cols: int, device: Any) -> Tensor:
    """``keep[i, j] = j <= i``: the mask of ``is_causal=True`` (torch's ``tril``)."""
    return torch.ones(rows, cols, dtype=torch.bool, device=device).tril()


def _checking() -> bool:
    """Whether data-dependent checks may run (not while torch.jit / torch.export trace)."""
    if torch.jit.is_tracing() or torch.jit.is_scripting():
        return False
    compiling = getattr(torch.compiler, "is_compiling", None)
    return not (compiling is not None and compiling())


def _mask_op(op: str, inputs: list[Tensor], y: Tensor, attrs: dict[str, Any]) -> Tensor:
    """``y``, the bool result of a ``compare`` / ``logical`` op on masks, recorded while an
    export records (``fxq.export``'s plain-tensor ops)."""
    if is_recording():
        record(Call(op, inputs, [y], ["bool"], attrs))
    return y


def keep_mask(mask: Tensor, where: str, what: str, attend: bool = True) -> Tensor:
    """The bool keep-mask (True = the score takes part in the softmax) of an attention mask.

    Args:
        mask: a bool mask, or a float additive mask whose entries are ``0`` or
            ``<= ADDITIVE_MASK_LIMIT`` (``-inf`` and ``torch.finfo(dtype).min`` included).
        where: the module's name (for messages).
        what: the argument's name (``"attn_mask"``, ``"key_padding_mask"``).
        attend: the meaning of True in a bool mask: attend (SDPA) or leave out (MHA).

    While an export records, each op is recorded: ``dequantize`` (a quantized mask),
    ``compare le`` and ``logical not`` (a float mask), ``logical not`` (a bool mask of MHA).

    Raises:
        ValueError: a float mask with another value (a bias, e.g. ALiBi or relative
            positions: it has no integer form here; keep the op float with a qconfig of None).
        TypeError: an integer-dtype mask.
        NotExportable: while an export records, a float mask other than float32, or a
            quantized mask with per-channel scales or an offset.
    """
    if isinstance(mask, QTensor):  # a mask computed by quantized ops: its real values
        mask = requant.dequantize(mask)
    if mask.dtype is torch.bool:
        return mask if attend else _mask_op("logical", [mask], ~mask, {"fn": "not"})
    if not mask.is_floating_point():
        raise TypeError(
            f"{where}: {what} of dtype {mask.dtype}: integer attention takes a bool mask or a "
            "float additive mask (0 / -inf); convert it with .bool() or give the op a qconfig "
            "of None"
        )
    if is_recording() and mask.dtype is not torch.float32:
        raise NotExportable(f"its float {what} is {mask.dtype}; export takes float32 or bool masks")
    limit = {"fn": "le", "compute_dtype": "float32", "scalar": float(ADDITIVE_MASK_LIMIT)}
    left_out = _mask_op(
        "compare", [mask], mask <= ADDITIVE_MASK_LIMIT, {**limit, "scalar_first": False}
    )
    if _checking() and not bool((left_out | (mask == 0)).all()):
        bad = mask[~left_out & (mask != 0)]
        raise ValueError(
            f"{where}: the float {what} holds {bad.numel()} value(s) other than 0 and "
            f"<= {ADDITIVE_MASK_LIMIT:g} (e.g. {float(bad.reshape(-1)[0]):g}); integer attention "
            "takes additive masks of 0 (attend) and -inf / finfo.min (left out) only, not "
            "additive biases. Keep this op float with a qconfig of None, or pass a bool mask"
        )
    return _mask_op("logical", [left_out], ~left_out, {"fn": "not"})


def sdpa_keep(
    where: str, mask: Tensor | None, causal: bool, rows: int, cols: int, device: Any
) -> Tensor | None:
    """The keep-mask of ``F.scaled_dot_product_attention``: ``attn_mask`` (True / 0 = attend)
    and ``is_causal`` (``j <= i``) together; None when neither is given."""
    keep = None if mask is None else keep_mask(mask, where, "attn_mask")
    if causal:
        tri = causal_keep(rows, cols, device)
        keep = tri if keep is None else keep & tri
    return keep


def sdpa_scale(options: dict[str, Any], head_dim: int) -> float:
    """The score scale of ``F.scaled_dot_product_attention``: ``scale``, else ``1 / sqrt(E)``."""
    scale = options["scale"]
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def sdpa_scale_and_keep(
    where: str, q: Tensor, k: Tensor, args: tuple, kwargs: dict
) -> tuple[float, Tensor | None]:
    """The score scale and the keep-mask (``sdpa_keep``) of one SDPA call's arguments."""
    options = sdpa_arguments(args, kwargs)
    keep = sdpa_keep(
        where, options["attn_mask"], bool(options["is_causal"]), q.shape[-2], k.shape[-2], q.device
    )
    return sdpa_scale(options, q.shape[-1]), keep


def mha_keep(
    where: str,
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    batch: int,
    heads: int,
) -> Tensor | None:
    """The keep-mask of ``nn.MultiheadAttention`` shaped to broadcast against ``[B, H, L, S]``
    scores (bool masks: True = left out; float masks: additive), or None without masks.

    ``key_padding_mask`` is ``[B, S]`` (or ``[S]``); ``attn_mask`` is ``[L, S]`` or
    ``[B * H, L, S]``. Each op is recorded while an export records (``keep_mask``; the
    reshapes, the ``logical and``).
    """
    keep = None
    if key_padding_mask is not None:
        kpm = keep_mask(key_padding_mask, where, "key_padding_mask", attend=False)
        batched = kpm.dim() == 2
        shape = (-1 if batched else 1, 1, 1, kpm.shape[-1])
        keep = movement.reshape(kpm, shape, "bool", keeps_batch=batched)
    if attn_mask is not None:
        am = keep_mask(attn_mask, where, "attn_mask", attend=False)
        if am.dim() == 3:
            shape = (batch, heads, am.shape[-2], am.shape[-1])
            am = movement.reshape(am, shape, "bool", keeps_batch=heads == 1)
        keep = am if keep is None else _mask_op("logical", [keep, am], keep & am, {"fn": "and"})
    return keep


def integer_matmul(
    module: QuantizedModule,
    a: Tensor,
    b: Tensor,
    a_bits: int,
    b_bits: int,
    multiplier: Tensor,
    shift: Tensor,
    out_dtype: QDType,
    factor: float | None = None,
    scale: Tensor | None = None,
) -> Tensor:
    """``sat(shift_round(sat32(a @ b) M, S))`` with an exact accumulation; float32 integers
    (``fxq.primitives.accumulate.matmul``: ``factor`` the float scale ``M`` holds, ``scale``
    the result's where it stays inside the module).

    Warns (once per module) when the int32 accumulator saturates (int16 q and k)."""
    k = a.shape[-1]
    plan = qf.plan_accumulation(a_bits, k * (1 << (b_bits - 1)), other_bits=b_bits)

    def check(acc: Tensor) -> None:
        warn_if_saturated(
            module,
            acc,
            lambda: (
                f"it sums {k} products of a {a_bits}-bit and a {b_bits}-bit operand (attention's "
                "scores or output). Use int8 for the attention's inputs (their producers' "
                "qconfig), or keep the op in float with a qconfig of None"
            ),
        )

    return accumulate.matmul(
        a, b, plan, multiplier, shift, out_dtype, module.rounding, check, factor, scale
    )


class ScaledDotProductAttention(FunctionalQuantized):
    """Integer ``F.scaled_dot_product_attention`` (no dropout; ``attn_mask`` as a keep-mask,
    see ``keep_mask``; ``is_causal`` and ``scale`` as given).

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
        mask = options["attn_mask"]
        keep = None if mask is None else keep_mask(mask, self.name, "attn_mask")
        scale = sdpa_scale(options, q.shape[-1])
        m_s, k_s, soft, m_o, k_o = self.plan(q, k, v, scale)
        out, _ = attention_core(
            self,
            q,
            k,
            v,
            (m_s, k_s),
            soft,
            (m_o, k_o),
            self.inner_dtype,
            keep,
            causal=bool(options["is_causal"]),
            factor=scale,
        )
        return self.wrap(out)


def attention_core(
    module: QuantizedModule,
    q: QTensor,
    k: QTensor,
    v: QTensor,
    scores_requant: tuple[Tensor, Tensor],
    soft: SoftmaxPlan,
    out_requant: tuple[Tensor, Tensor],
    inner: QDType,
    keep: Tensor | None,
    out_dtype: QDType | None = None,
    causal: bool = False,
    factor: float = 1.0,
    out_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Integer scores, probabilities and output of attention; returns ``(out, probs)`` as float32
    integers (``out`` in ``out_dtype``, default the module's, on ``out_scale`` where it stays
    inside the module; ``probs`` in ``inner``).

    ``keep``: a bool mask broadcastable against the scores (False: left out of the softmax);
    ``causal``: only ``j <= i`` is kept as well; ``factor``: the score scale the multiplier
    holds (the exported score matmul's ``factor``)."""
    key_t = movement.swap_last(k.values(), k.qdtype, k.scale)
    scores = integer_matmul(
        module,
        q.values(),
        key_t,
        q.qdtype.bits,
        k.qdtype.bits,
        *scores_requant,
        inner,
        factor=factor,
        scale=module.scores_scale,
    )
    full = keep
    if causal:
        tri = causal_keep(scores.shape[-2], scores.shape[-1], scores.device)
        full = tri if keep is None else keep & tri
    probs = integer_softmax(scores, -1, soft, inner, module.rounding, keep=full).to(torch.float32)
    d, r = ir_dtype(inner), module.rounding.value
    normalization.record_softmax(
        scores,
        probs,
        d,
        lambda: softmax_node(soft, False, scores.dim() - 1, r, d),
        keep,
        causal,
        float(module.probs_scale),
    )
    out = integer_matmul(
        module,
        probs,
        v.values(),
        inner.bits,
        v.qdtype.bits,
        *out_requant,
        out_dtype or module.out_dtype,
        scale=out_scale,
    )
    return out, probs


def integer_linear(
    module: QuantizedModule,
    x: Tensor,
    x_bits: int,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    multiplier: Tensor,
    shift: Tensor,
    out_dtype: QDType,
    scale: Tensor | None = None,
) -> Tensor:
    """``sat(shift_round(sat32(x W^T + B) M[c], S[c]))`` per output channel; float32 integers.

    While an export records, the call is one ``linear`` node (``fxq.primitives.weighted``):
    the int8 weight (out-major) with its per-channel scale, the int32 bias, multiplier and
    shift; its output on ``scale`` where it stays inside the module."""
    w_abs = int(weight.to(torch.int64).abs().sum(1).max())
    b_abs = int(bias.abs().max()) if bias is not None else 0
    plan = qf.plan_accumulation(x_bits, w_abs, b_abs)
    acc = qf.accumulate(lambda a, w, b: F.linear(a, w, b), x, weight, bias, plan, channel_axis=-1)
    acc = qf.saturate_int32(acc)
    y = qf.requantize_exact(
        acc, multiplier, shift, out_dtype, module.rounding, channel_axis=-1, as_float=True
    )
    if is_recording():
        d = ir_dtype(out_dtype)
        params = {
            "weight": weight.to(torch.int8),
            "weight_scale": weight_scale.float().reshape(-1),
            "multiplier": multiplier.to(torch.int32),
            "shift": shift.to(torch.int32),
        }
        if bias is not None:
            params["bias"] = bias.to(torch.int32)
        attrs = {
            "out_dtype": d,
            "rounding": module.rounding.value,
            "lo": None,
            "hi": None,
            "float_max": None,
            "activation": None,
        }
        scales = [None if scale is None else float(scale)]
        record(Call("linear", [x], [y], [d], attrs, params, scales))
    return y


class MultiheadAttention(FunctionalQuantized):
    """Integer ``nn.MultiheadAttention``: integer q / k / v projections (int8 weights per
    channel, int32 biases), per-head integer attention (``attention_core``; ``key_padding_mask``
    and ``attn_mask`` as keep-masks, see ``mha_keep``), merged heads and the integer output
    projection. Returns ``(output, weights)`` like the float module; the
    weights are the integer probabilities (or their sum over heads) requantized to the
    output's scale (by ``s_p / s_y``, or ``s_p / (H s_y)`` for the mean over heads).
    """

    def __init__(self, qat: nn.Module) -> None:
        super().__init__(qat)
        mha = qat.op
        require_finite(
            qat,
            {
                "in_proj_weight": mha.in_proj_weight,
                "in_proj_bias": mha.in_proj_bias,
                "out_proj.weight": mha.out_proj.weight,
                "out_proj.bias": mha.out_proj.bias,
            },
        )
        self.num_heads, self.embed_dim, self.batch_first = (
            mha.num_heads,
            mha.embed_dim,
            mha.batch_first,
        )
        for prefix, w, b, fq in (
            ("in", mha.in_proj_weight, mha.in_proj_bias, qat.in_proj_weight_fake_quant),
            ("out", mha.out_proj.weight, mha.out_proj.bias, qat.out_proj_weight_fake_quant),
        ):
            s_w = fq.scale.detach().clone().reshape(-1)
            self.register_buffer(
                f"{prefix}_weight", qf.quantize(w.detach(), s_w, qint8, self.rounding, ch_axis=0)
            )
            self.register_buffer(f"{prefix}_weight_scale", s_w)
            self.register_buffer(
                f"{prefix}_float_bias", None if b is None else b.detach().double().clone()
            )
        for name in ("q", "k", "v", "scores", "probs", "context"):
            fq = getattr(qat, f"{name}_quant")
            self.register_buffer(f"{name}_scale", fq.scale.detach().clone().reshape(1))
        self.proj_dtype_name = qat.q_quant.dtype.name
        self.inner_dtype_name = qat.scores_quant.dtype.name

    @property
    def inner_dtype(self) -> QDType:
        return as_qdtype(self.inner_dtype_name)

    @property
    def proj_dtype(self) -> QDType:
        return as_qdtype(self.proj_dtype_name)

    def _bias(self, prefix: str, part: slice, acc_scale: Tensor) -> Tensor | None:
        b = getattr(self, f"{prefix}_float_bias")
        if b is None:
            return None
        return qf.quantize(b[part], acc_scale, qint32, self.rounding, ch_axis=0).to(torch.int64)

    def plan(self, query: QTensor, key: QTensor, value: QTensor) -> dict[str, Any]:
        """Every integer constant for these input scales (cached per scale)."""
        key_ = self.scale_values(query, key, value)
        return self.derived(key_, lambda: self._derive([query.scale, key.scale, value.scale]))

    def _derive(self, scales: list[Tensor]) -> dict[str, Any]:
        e, h = self.embed_dim, self.num_heads
        out: dict[str, Any] = {"proj": []}
        for i, (s_in, name) in enumerate(zip(scales, "qkv")):
            part = slice(i * e, (i + 1) * e)
            acc_scale = s_in.double().reshape(1) * self.in_weight_scale[part].double()
            s_p = getattr(self, f"{name}_scale").double()
            m, s = multiplier_for(
                self,
                acc_scale / s_p,
                {"input": s_in, "weight": self.in_weight_scale[part], name: s_p},
            )
            out["proj"].append((self.in_weight[part], self._bias("in", part, acc_scale), m, s))
        s_q, s_k, s_v = (getattr(self, f"{n}_scale").double() for n in "qkv")
        s_s, s_p, s_c = (
            self.scores_scale.double(),
            self.probs_scale.double(),
            self.context_scale.double(),
        )
        # a tensor divisor: CUDA divides by a Python number as a product with its reciprocal
        root = torch.tensor(math.sqrt(e // h), dtype=torch.float64, device=s_q.device)
        out["scores"] = multiplier_for(
            self, s_q * s_k / root / s_s, {"q": s_q, "k": s_k, "scores": s_s}
        )
        out["softmax"] = softmax_plan(self, self.scores_scale, self.probs_scale, log=False)
        out["context"] = multiplier_for(
            self, s_p * s_v / s_c, {"probabilities": s_p, "v": s_v, "context": s_c}
        )
        acc_scale = s_c * self.out_weight_scale.double()
        s_y = self.output_scale.double()
        m, s = multiplier_for(self, acc_scale / s_y, {"context": s_c, "output": s_y})
        out["out"] = (self.out_weight, self._bias("out", slice(None), acc_scale), m, s)
        roles = {"probabilities": s_p, "output": s_y}
        out["weights"] = multiplier_for(self, s_p / s_y, roles)
        out["weights_mean"] = multiplier_for(self, s_p / (h * s_y), roles)
        return out

    def forward(self, query: QTensor, key: QTensor, value: QTensor, *args: Any, **kwargs: Any):
        options = mha_arguments(args, kwargs)
        if query.dim() != 3:
            raise ValueError(
                f"MultiheadAttention {self.name!r}: integer attention takes batched (3-d) inputs"
            )
        if not self.batch_first and is_recording():
            raise NotExportable("nn.MultiheadAttention is exported with batch_first=True only")
        plan = self.plan(query, key, value)
        e, h = self.embed_dim, self.num_heads
        batch = query.shape[0] if self.batch_first else query.shape[1]
        keep = mha_keep(self.name, options["key_padding_mask"], options["attn_mask"], batch, h)
        heads = []
        for i, (x, name, (w, b, m, s)) in enumerate(zip((query, key, value), "qkv", plan["proj"])):
            scale, dtype = getattr(self, f"{name}_scale"), self.proj_dtype
            vals = x.values() if self.batch_first else x.values().transpose(0, 1)  # [B, L, E]
            s_w = self.in_weight_scale[i * e : (i + 1) * e]
            y = integer_linear(self, vals, x.qdtype.bits, w, s_w, b, m, s, dtype, scale)
            shape = (y.shape[0], y.shape[1], h, e // h)
            y = movement.reshape(y, shape, dtype, scale, keeps_batch=True)
            y = movement.permute(y, (0, 2, 1, 3), dtype, scale)  # [B, H, L, d]
            heads.append(QTensor(y, scale, dtype))
        ctx, probs = attention_core(
            self,
            *heads,
            plan["scores"],
            plan["softmax"],
            plan["context"],
            self.inner_dtype,
            keep,
            self.proj_dtype,
            factor=1.0 / math.sqrt(e // h),
            out_scale=self.context_scale,
        )
        ctx = movement.permute(ctx, (0, 2, 1, 3), self.proj_dtype, self.context_scale)
        shape = (ctx.shape[0], ctx.shape[1], e)  # [B, L, E]
        ctx = movement.reshape(ctx, shape, self.proj_dtype, self.context_scale, keeps_batch=True)
        w, b, m, s = plan["out"]
        y = integer_linear(
            self, ctx, self.proj_dtype.bits, w, self.out_weight_scale, b, m, s, self.out_dtype
        )
        if not self.batch_first:
            y = y.transpose(0, 1)
        weights = None
        if options["need_weights"]:  # requantized to the output's grid (see the QAT module)
            if options["average_attn_weights"]:  # the head sum: exact in float32
                sums = probs.sum(1, keepdim=True)
                window.record_window_sums(probs, sums, [1], None)
                probs, (m, s) = window.drop_axes(sums, [1]), plan["weights_mean"]
            else:
                m, s = plan["weights"]
            weights = self.wrap(requant.requantize(probs, m, s, self.out_dtype, self.rounding))
        return self.wrap(y), weights
