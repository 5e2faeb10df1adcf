"""Integer ``nn.Embedding`` (``docs/arithmetic.md``, section 18).

The int8 table ``W`` has one scale ``s_w[v]`` per row (token). The output table is
``T[v] = sat(shift_round(W[v] * M[v], S[v]))`` with ``M[v] 2**-S[v] ~ s_w[v] / s_y``,
computed once per output scale; a lookup is ``Y[..., :] = T[ids[...], :]``, an exact
gather. Rows whose integers are all 0 (``padding_idx``) stay 0 with ``M = 0``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fxq.dtypes import qint8
from fxq.primitives import table as tables
from fxq.qtensor import QTensor
from fxq.quantized import functional as qf
from fxq.quantized.base import multiplier_for, require_finite
from fxq.quantized.ops_base import FunctionalQuantized

__all__ = ["Embedding"]


class Embedding(FunctionalQuantized):
    """Integer ``nn.Embedding``: token ids (an integer tensor) -> the table row at ``s_y``.

    Buffers:
        weight: the int8 table, ``(num_embeddings, embedding_dim)``.
        weight_scale: float32, one scale per row.
    """

    def __init__(self, qat: nn.Module) -> None:
        super().__init__(qat)
        w = qat.op.weight.detach()
        s_w = qat.weight_fake_quant.scale.detach().reshape(-1)
        require_finite(qat, {"weight": w, "weight scale": s_w})
        self.register_buffer("weight", qf.quantize(w, s_w, qint8, self.rounding, ch_axis=0))
        self.register_buffer("weight_scale", s_w.float().clone())

    def table(self) -> Tensor:
        """The table at the output scale as exact float32 integers (cached)."""
        return self.derived(("table",), self._table)

    def _table(self) -> Tensor:
        w = self.weight.to(torch.float32)
        zero = (self.weight == 0).all(dim=1)
        ratio = self.weight_scale.double() / self.output_scale.double()
        ratio = torch.where(zero, torch.ones_like(ratio), ratio)
        m, s = multiplier_for(
            self, ratio, {"weight": self.weight_scale, "output": self.output_scale}
        )
        m = torch.where(zero.to(m.device), torch.zeros_like(m), m)
        return qf.requantize_exact(
            w, m, s, self.out_dtype, self.rounding, channel_axis=0, as_float=True
        )

    def forward(self, ids: Tensor) -> QTensor:
        if not isinstance(ids, Tensor) or ids.is_floating_point() or ids.dtype is torch.bool:
            raise TypeError(
                f"Embedding {self.name!r}: token ids must be an integer tensor, got "
                f"{type(ids).__name__ if not isinstance(ids, Tensor) else ids.dtype}"
            )
        return self.wrap(tables.embedding(ids, self.table(), self.out_dtype))

    def extra_repr(self) -> str:
        n, d = self.weight.shape
        return f"{n}, {d}, " + super().extra_repr()
