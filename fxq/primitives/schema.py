"""What an ``.fxq`` file may hold for one op (``docs/integer_graph.md``, 1): attribute kinds,
array dtypes and ranks, and the checks of their relations.

Each primitive declares its op's ``OpSpec`` beside its kernels (``fxq.primitives``);
``fxq.export.validate`` checks every node of a loaded file against it. This module imports
numpy and the standard library only (no torch).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "IntegerGraphFormatError",
    "MARCH_LIMITS",
    "MAX_LEFT_SHIFT",
    "OpSpec",
    "Param",
    "Ctx",
    "KINDS",
    "SHIFT",
    "OPT_SHIFT",
    "RESULT_ATTRS",
    "MAX_GEOMETRY",
    "per_channel",
    "geometry",
]

#: march -> (multiplier bits, largest right shift): ``fxq.march.MARCH_SPECS`` (a test keeps them
#: equal); a negative shift (a left shift, residual inputs) goes down to ``-MAX_LEFT_SHIFT``
MARCH_LIMITS: dict[str, tuple[int, int]] = {
    "bernoulli2": (8, 24),
    "bayes": (16, 31),
    "bayes-e": (16, 31),
}
MAX_LEFT_SHIFT = 31

QUANT = ("int8", "int16", "int32")
PLAIN = ("bool", "int32", "int64", "float32")  # not quantized values (runtime.PLAIN_DTYPES)
ROUNDINGS = ("half_up", "half_even")
ARRAY_DTYPES = ("bool", "int8", "int16", "int32", "int64", "float32", "float64")
MAX_RANK = 8


#: the attributes of an op whose output is a quantized tensor it rounds onto
RESULT_ATTRS = {"dtype": "qdtype", "rounding": "rounding"}


class IntegerGraphFormatError(ValueError):
    """A ``.fxq`` file is damaged, crafted, or written by another fxq version: the message names
    the file, the member or node, what is wrong and what to do."""


# -- the JSON schema of an op -----------------------------------------------------------------
def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_float(v: Any) -> bool:
    return (isinstance(v, float) or is_int(v)) and math.isfinite(v)


def is_ints(v: Any) -> bool:
    return isinstance(v, list) and all(is_int(e) for e in v)


def optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


def one_of(*choices: Any) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, str) and v in choices


KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (is_int, "an integer"),
    "int?": (optional(is_int), "an integer or null"),
    "float": (is_float, "a finite number"),
    "float?": (optional(is_float), "a finite number or null"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "bool?": (optional(lambda v: isinstance(v, bool)), "true, false or null"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "ints": (is_ints, "a list of integers"),
    "ints?": (optional(is_ints), "a list of integers or null"),
    "qdtype": (one_of(*QUANT), f"one of {list(QUANT)}"),
    "anydtype": (one_of(*QUANT, *PLAIN), f"one of {[*QUANT, *PLAIN]}"),
    "str?": (optional(lambda v: isinstance(v, str)), "a string or null"),
    "outdtype": (one_of(*QUANT, "float32"), f"one of {[*QUANT, 'float32']}"),
    "rounding": (one_of(*ROUNDINGS), f"one of {list(ROUNDINGS)}"),
    "floats?": (
        optional(lambda v: isinstance(v, list) and all(is_float(e) and e > 0 for e in v)),
        "a list of positive numbers or null",
    ),
    "any": (lambda v: True, "any value"),
}


@dataclass(frozen=True)
class Param:
    dtypes: tuple[str, ...]
    ranks: tuple[int, ...] | None = None  # None: any rank up to MAX_RANK
    required: bool = True


INT_DTYPES = ("int8", "int16", "int32", "int64")
SHIFT = Param(INT_DTYPES)
OPT_SHIFT = Param(INT_DTYPES, required=False)


@dataclass(frozen=True)
class OpSpec:
    """What a file may hold for one op: input counts, attribute kinds, array dtypes and ranks,
    and a ``check(ctx)`` of the relations between them."""

    inputs: tuple[int, ...]
    attrs: dict[str, str]
    params: dict[str, Param]
    check: Callable[[Any], None] | None = None
    outputs: int = 1
    extra_params: str = ""  # a prefix of parameters counted by an attribute (matrix_0, ...)


class Ctx:
    """One node being checked: its attributes, arrays, input shapes, and the error to raise."""

    def __init__(
        self,
        where: str,
        node: dict,
        params: dict,
        inputs: list[dict],
        march: str,
        outputs: list[dict] | None = None,
    ):
        self.where, self.node, self.attrs, self.params = where, node, node["attrs"], params
        self.in_shapes = [t["shape"] for t in inputs]  # declared shapes (ints and symbols)
        self.in_dtypes = [t["dtype"] for t in inputs]
        self.outputs = outputs or []  # the declared output tensors
        bits, hi = MARCH_LIMITS.get(march, MARCH_LIMITS["bayes"])
        self.max_multiplier, self.max_shift = (1 << (bits - 1)) - 1, hi
        self.march = march or "bayes"

    def fail(self, reason: str) -> IntegerGraphFormatError:
        n = self.node
        return IntegerGraphFormatError(
            f"{self.where}: node {n['name']!r} (op {n['op']!r}): {reason}; the file is damaged or "
            "was written by another fxq: export it again"
        )

    def rank(self, i: int = 0) -> int:
        return len(self.in_shapes[i])

    def axis(self, name: str, value: Any, rank: int | None = None) -> None:
        rank = self.rank() if rank is None else rank
        if not is_int(value) or not -rank <= value < max(rank, 1):
            raise self.fail(f"{name} {value!r} is not an axis of a rank-{rank} input")

    def shift(self, name: str, values: Any) -> None:
        v = np.asarray(values)
        if v.size and (v.min() < -MAX_LEFT_SHIFT or v.max() > self.max_shift):
            raise self.fail(
                f"{name} holds {int(v.min())}..{int(v.max())}, outside march {self.march}'s "
                f"shifts {-MAX_LEFT_SHIFT}..{self.max_shift}"
            )

    def multiplier(self, name: str, values: Any) -> None:
        v = np.asarray(values)
        if v.size and np.abs(v.astype(np.int64)).max() > self.max_multiplier:
            raise self.fail(
                f"{name} holds {int(np.abs(v.astype(np.int64)).max())} in magnitude, wider than "
                f"march {self.march}'s multipliers (at most {self.max_multiplier})"
            )

    def size(self, name: str, expected: int) -> None:
        p = self.params.get(name)
        if p is not None and p.size != expected:
            raise self.fail(f"param {name!r} has {p.size} entries, expected {expected}")


def per_channel(c: Ctx, n: int, names: tuple[str, ...]) -> None:
    """Each of the params ``names`` (where present) holds one entry or one per channel."""
    for k in names:
        p = c.params.get(k)
        if p is not None and p.size not in (1, n):
            raise c.fail(f"param {k!r} has {p.size} entries for {n} channels")


#: the largest window, stride, padding or pooled size a file may declare
MAX_GEOMETRY = 1 << 16


def geometry(c: Ctx, names: tuple[str, ...]) -> None:
    """No window, stride, padding or size among the attrs ``names`` above ``MAX_GEOMETRY``."""
    for k in names:
        v = c.attrs.get(k)
        flat = [e for p in v for e in (p if isinstance(p, list) else [p])] if v else []
        if any(abs(e) > MAX_GEOMETRY for e in flat):
            raise c.fail(f"{k} {v} holds sizes above {MAX_GEOMETRY}")
