"""How far apart two tensors are: the measures every debug table uses.

Every function takes a reference and a test value (tensors, ``QTensor``s, or
nested tuples / lists / dicts of them, flattened in order), compares them in
float64 and returns a Python float.

>>> import torch
>>> ref = torch.tensor([1.0, -2.0, 3.0, 4.0])
>>> round(sqnr(ref, ref + 0.1), 2), round(cosine(ref, ref), 6)
(31.76, 1.0)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten

from fxq.qtensor import QTensor

__all__ = [
    "flat",
    "cosine",
    "sqnr",
    "mse",
    "l1",
    "max_abs",
    "Similarity",
    "similarity_for",
    "SIMILARITIES",
]


def flat(value: Any) -> Tensor | None:
    """Every tensor leaf of ``value`` (``QTensor``s dequantized) as one float64 vector.

    Returns None when ``value`` holds no floating-point or quantized tensor.
    """
    leaves, _ = tree_flatten(value)
    parts = []
    for leaf in leaves:
        if isinstance(leaf, QTensor):
            leaf = leaf.dequantize()
        if isinstance(leaf, Tensor) and (leaf.is_floating_point() or leaf.dtype is torch.uint8):
            parts.append(leaf.detach().reshape(-1).to(torch.float64))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else torch.cat([p.to(parts[0].device) for p in parts])


def _pair(ref: Any, test: Any) -> tuple[Tensor, Tensor]:
    a, b = flat(ref), flat(test)
    if a is None or b is None:
        raise ValueError("no floating-point tensor to compare")
    if a.shape != b.shape:
        raise ValueError(f"cannot compare values of {a.numel()} and {b.numel()} elements")
    return a, b.to(a.device)


def cosine(ref: Any, test: Any) -> float:
    """Cosine similarity (1.0: same direction; two all-zero values count as 1.0)."""
    a, b = _pair(ref, test)
    na, nb = a.norm(), b.norm()
    if na == 0 and nb == 0:
        return 1.0
    if na == 0 or nb == 0:
        return 0.0
    return float((a @ b) / (na * nb))


def sqnr(ref: Any, test: Any) -> float:
    """Signal-to-quantization-noise ratio in dB: ``10 log10(mean(ref²) / mean((ref-test)²))``.

    ``inf`` when the values are equal.
    """
    a, b = _pair(ref, test)
    noise = (a - b).pow(2).mean()
    if noise == 0:
        return math.inf
    signal = a.pow(2).mean()
    if signal == 0:
        return -math.inf
    return float(10 * torch.log10(signal / noise))


def mse(ref: Any, test: Any) -> float:
    """Mean squared error."""
    a, b = _pair(ref, test)
    return float((a - b).pow(2).mean()) if a.numel() else 0.0


def l1(ref: Any, test: Any) -> float:
    """Mean absolute error."""
    a, b = _pair(ref, test)
    return float((a - b).abs().mean()) if a.numel() else 0.0


def max_abs(ref: Any, test: Any) -> float:
    """Largest absolute difference."""
    a, b = _pair(ref, test)
    return float((a - b).abs().max()) if a.numel() else 0.0


@dataclass(frozen=True)
class Similarity:
    """A named measure and which way is better.

    Attributes:
        name: the column heading.
        fn: ``(reference, test) -> float``.
        higher_is_better: True for similarities (cosine, SQNR), False for errors (MSE, L1).
    """

    name: str
    fn: Callable[[Any, Any], float]
    higher_is_better: bool

    def worst_first_key(self, value: float) -> float:
        """Sort key that puts the worst value first."""
        if value != value:  # NaN: worst of all
            return -math.inf
        return value if self.higher_is_better else -value


SIMILARITIES: dict[str, Similarity] = {
    "cosine": Similarity("cosine", cosine, True),
    "sqnr": Similarity("sqnr", sqnr, True),
    "mse": Similarity("mse", mse, False),
    "l1": Similarity("l1", l1, False),
    "max_abs": Similarity("max_abs", max_abs, False),
}


def similarity_for(choice: str | Callable[[Any, Any], float] | Similarity) -> Similarity:
    """The ``Similarity`` a user's choice names.

    Args:
        choice: ``"cosine"``, ``"sqnr"``, ``"mse"``, ``"l1"``, ``"max_abs"`` (any case; the
            vendor spells them ``"Cosine"``, ``"MSE"``...), a ``Similarity``, or a callable
            ``(reference, test) -> float`` where higher means more similar.

    Raises:
        ValueError: for an unknown name.
    """
    if isinstance(choice, Similarity):
        return choice
    if callable(choice):
        return Similarity(getattr(choice, "__name__", "custom"), choice, True)
    key = str(choice).lower()
    if key not in SIMILARITIES:
        raise ValueError(
            f"unknown similarity {choice!r}; use one of {', '.join(SIMILARITIES)} "
            "or a callable (reference, test) -> float where higher means more similar"
        )
    return SIMILARITIES[key]
