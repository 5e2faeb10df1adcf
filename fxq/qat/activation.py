"""Non-linear activations with their own output scale.

``Clamp`` covers a standalone ReLU6 / Hardtanh (a ReLU fused into a conv, or
a standalone ReLU, needs no module). The others are lookup tables in the
integer model: 256 entries for int8 inputs, segmented tables for int16.
"""

from __future__ import annotations

from fxq.qat.base import FunctionalQAT

__all__ = ["Clamp", "LookupTableOp", "PReLU"]


class Clamp(FunctionalQAT):
    """ReLU6 / Hardtanh / clamp with constant bounds, requantized to its own scale."""


class LookupTableOp(FunctionalQAT):
    """A pointwise non-linear function (sigmoid, tanh, hardsigmoid, hardswish, silu,
    gelu, exp, ...) evaluated in float during QAT and by table lookup once converted."""


class PReLU(FunctionalQAT):
    """``nn.PReLU`` / ``nn.LeakyReLU`` / ``F.leaky_relu``: the float op (a PReLU's slope trained
    in float) during QAT; in the integer model the slope is the negative side's (per-channel)
    multiplier (exact)."""
