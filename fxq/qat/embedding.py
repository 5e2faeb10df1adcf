"""``nn.Embedding`` with an integer twin (``docs/arithmetic.md``, section 18).

During QAT the table is fake-quantized per row (int8, one scale per token) and
looked up with the float op; the output gets its own fake quant. In VALIDATION
the integer twin runs: it looks the token ids up in the table requantized to the
output scale, which is what the converted model computes.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from fxq.qat.base import FunctionalQAT
from fxq.qconfig import QConfig

__all__ = ["Embedding"]


class Embedding(FunctionalQAT):
    """``nn.Embedding`` on integer token ids: int8 per-row table, output at the activation scale.

    Raises:
        ValueError: for ``max_norm`` (it rewrites the table during the lookup) or a sparse
            gradient's ``scale_grad_by_freq`` combination the integer model cannot mirror.
    """

    def __init__(self, qconfig: QConfig, fn: Any = None, module: nn.Module | None = None) -> None:
        super().__init__(qconfig, fn, module)
        if module is None:
            raise ValueError("fxq.qat.Embedding replaces an nn.Embedding module")
        if module.max_norm is not None:
            raise ValueError(
                "nn.Embedding with max_norm rewrites its table while looking up; fxq has no "
                "integer form of it: give it a qconfig of None or drop max_norm"
            )
        self.weight_fake_quant = qconfig.weight(ch_axis=0, num_channels=module.num_embeddings)

    def fake_table(self) -> Tensor:
        """The table fake-quantized per row (int8)."""
        return self.weight_fake_quant(self.op.weight)

    def forward(self, ids: Tensor) -> Tensor:
        if self.validating():
            return self.run_validation(ids)
        op = self.op
        y = F.embedding(
            ids, self.fake_table(), op.padding_idx, None, 2.0, op.scale_grad_by_freq, op.sparse
        )
        return self.quantize_output(y)
