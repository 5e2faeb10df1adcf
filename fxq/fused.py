"""The float module that ``fuse_fx`` puts in place of a fused chain.

``Fused`` runs ``act(bn(op(x)) + residual)`` with each part optional, so one
class covers every row of the fusion table. It is still an ordinary float
module: a fused model computes what the unfused one did.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Fused", "ACTIVATIONS"]

# activation name -> float function
ACTIVATIONS = {
    "relu": F.relu,
    "relu6": F.relu6,
}


class Fused(nn.Module):
    """``act(bn(op(x)) [+ residual])``.

    Args:
        op: a Conv1d/2d/3d, ConvTranspose1d/2d/3d, Linear or BatchNorm module
            (a BatchNorm as ``op`` is the standalone ``bn_relu`` fusion).
        bn: the BatchNorm folded into ``op`` (None if absent).
        activation: ``"relu"``, ``"relu6"`` or None.
        add: whether a residual input is added before the activation.
        pattern: the fusion's name in the march spec, e.g. ``"conv_bn_add_relu"``.
        dropout: an ``nn.Dropout`` between the op and the residual add (``linear -> dropout
            -> + residual`` in Hugging Face encoders): applied in training, an identity at
            inference and in the integer model.
        residual_factor: a per-output-channel factor on the residual (``op(x) + g *
            residual``; see ``fxq.calibration.smooth_activations``), or None.
    """

    _fxq_leaf = True

    def __init__(
        self,
        op: nn.Module,
        bn: nn.Module | None = None,
        activation: str | None = None,
        add: bool = False,
        pattern: str = "",
        dropout: nn.Module | None = None,
        residual_factor: Tensor | None = None,
    ) -> None:
        super().__init__()
        if activation is not None and activation not in ACTIVATIONS:
            raise ValueError(f"unknown fused activation {activation!r}")
        self.op = op
        self.bn = bn
        self.activation = activation
        self.add = add
        self.pattern = pattern
        self.dropout = dropout
        self.register_buffer("residual_factor", residual_factor)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        y = self.op(x)
        if self.bn is not None:
            y = self.bn(y)
        if self.dropout is not None:
            y = self.dropout(y)
        if self.add:
            if residual is None:
                raise ValueError(f"fused {self.pattern} expects a residual input")
            if self.residual_factor is not None:
                axis = -1 if isinstance(self.op, nn.Linear) else 1
                shape = [1] * y.dim()
                shape[axis] = -1
                residual = residual * self.residual_factor.reshape(shape)
            y = y + residual
        if self.activation is not None:
            y = ACTIVATIONS[self.activation](y)
        return y

    def extra_repr(self) -> str:
        return f"pattern={self.pattern}"

    def fused_description(self) -> str:
        """``Fused[conv_bn_relu]`` (a float module: the chain kept in float)."""
        return f"Fused[{self.pattern}]"
