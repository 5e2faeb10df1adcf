"""Softmax and log-softmax over any dim (``docs/arithmetic.md``, section 15).

The float op runs during QAT with its output fake-quantized; in VALIDATION the
integer twin (``fxq.quantized.softmax.Softmax``) runs.
"""

from __future__ import annotations

from fxq.qat.base import FunctionalQAT

__all__ = ["Softmax"]


class Softmax(FunctionalQAT):
    """``nn.Softmax`` / ``nn.LogSoftmax`` / ``F.softmax`` / ``x.softmax(dim)`` / log-softmax."""
