"""A BatchNorm that no conv absorbed: a per-channel affine op.

In the integer model it is ``x * a + b`` with ``a = gamma / std`` quantized
per channel (like a depthwise 1x1 conv weight) and ``b`` an int32 bias; the
QAT module mirrors that, and trains the statistics like a fused conv + BN
(a channel with gamma = 0 outputs beta in every state, as its factor of 0 does).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fxq.fake_quantize import FakeQuantState
from fxq.fused import Fused
from fxq.qat.base import QATModule, activate, quantize_bias
from fxq.qat.weighted import batchnorm_factor
from fxq.qconfig import QConfig

__all__ = ["BatchNorm"]


class BatchNorm(QATModule):
    """QAT BatchNorm1d/2d/3d as a per-channel affine op (optionally + ReLU).

    Args:
        bn: the float BatchNorm (kept as ``self.bn``).
        qconfig: the resolved QConfig.
        activation: ``"relu"`` / ``"relu6"`` for the ``bn_relu`` fusion.
    """

    def __init__(self, bn: nn.Module, qconfig: QConfig, activation: str | None = None) -> None:
        super().__init__(qconfig)
        if bn.running_var is None:
            raise ValueError(
                "a standalone BatchNorm needs running statistics (track_running_stats=True)"
            )
        self.bn = bn
        self.activation = activation
        self.freeze_bn = False
        self.weight_fake_quant = qconfig.weight(ch_axis=0, num_channels=bn.num_features)

    @classmethod
    def from_float(cls, module: nn.Module, qconfig: QConfig) -> BatchNorm:
        if isinstance(module, Fused):
            return cls(module.op, qconfig, activation=module.activation)
        return cls(module, qconfig)

    @property
    def out_channels(self) -> int:
        return self.bn.num_features

    def to_float(self) -> nn.Module:
        """The float BatchNorm (with its fused activation)."""
        if self.activation is None:
            return self.bn
        return Fused(self.bn, activation=self.activation, pattern=f"bn_{self.activation}")

    def factor(self) -> Tensor:
        return batchnorm_factor(self.bn)

    def folded_bias(self) -> Tensor:
        beta = self.bn.bias if self.bn.bias is not None else torch.zeros_like(self.bn.running_mean)
        return beta - self.bn.running_mean * self.factor()

    def _shape(self, ndim: int) -> list[int]:
        shape = [1] * ndim
        shape[1] = -1
        return shape

    def forward(self, x: Tensor) -> Tensor:
        if self.validating():
            return self.run_validation(x)
        if self.standalone:
            (x,) = self.quantize_standalone_inputs([x])
        factor = self.factor()
        a_q = self.weight_fake_quant(factor)
        shape = self._shape(x.dim())
        if self.training and not self.freeze_bn and self.state is not FakeQuantState.VALIDATION:
            # the BatchNorm trains on batch statistics of x scaled by the quantization error of
            # its factor. A channel whose factor cannot be inverted (gamma = 0: timm LeViT's
            # zero-initialised layers) takes x unscaled: the BatchNorm outputs beta there, as the
            # quantized factor of 0 does at deployment, and its statistics stay right.
            invertible = torch.isfinite(factor.detach().reciprocal())
            ratio = a_q / torch.where(invertible, factor, 1.0)
            y = self.bn(x * torch.where(invertible, ratio, 1.0).reshape(shape))
        else:
            b = quantize_bias(
                self.folded_bias(),
                self.input_scale(0),
                self.weight_fake_quant.scale,
                self.state,
                self.march,
            )
            y = x * a_q.reshape(shape) + b.reshape(shape)
        if self.activation is not None:
            y = activate(self.activation, y)
        return self.quantize_output(y)

    def extra_repr(self) -> str:
        act = f", activation={self.activation}" if self.activation else ""
        return f"{self.bn.num_features}{act}, {super().extra_repr()}"
