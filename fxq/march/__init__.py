"""Marches: the target architectures fxq compiles for.

>>> import fxq
>>> fxq.set_march("bayes")
>>> fxq.get_march()
<March.BAYES: 'bayes'>
>>> fxq.get_march_spec().activation_dtypes
(fxq.qint8, fxq.qint16)

The three specs below are fxq's own definitions, guided by public vendor
documentation; ``docs/arithmetic.md`` states them in full.
"""

from __future__ import annotations

from fxq.dtypes import qint8, qint16
from fxq.march.spec import FUSIONS, March, MarchSpec, Rounding, ScaleConstraint

__all__ = [
    "March",
    "MarchSpec",
    "Rounding",
    "ScaleConstraint",
    "FUSIONS",
    "MARCH_SPECS",
    "set_march",
    "get_march",
    "get_march_spec",
    "spec_for",
]

_BERNOULLI2_FUSIONS = FUSIONS - {
    "convtranspose_bn",
    "convtranspose_bn_relu",
    "convtranspose_relu",
    "linear_bn",
    "linear_bn_relu",
    "linear_add",
    "linear_add_relu",
    "bn_relu",
}

MARCH_SPECS: dict[March, MarchSpec] = {
    March.BERNOULLI2: MarchSpec(
        march=March.BERNOULLI2,
        description="oldest generation: int8 only, power-of-two scales, 8-bit multipliers",
        activation_dtypes=(qint8,),
        scale_constraint=ScaleConstraint.POWER_OF_TWO,
        multiplier_bits=8,
        shift_range=(0, 24),
        fusions=frozenset(_BERNOULLI2_FUSIONS),
        int16_lut=False,
        high_precision_output=True,
    ),
    March.BAYES: MarchSpec(
        march=March.BAYES,
        description="int8 and int16 activations, any float scale, 16-bit multipliers",
        activation_dtypes=(qint8, qint16),
        int16_lut=True,
        norm_input_dtype=qint16,
    ),
    March.BAYES_E: MarchSpec(
        march=March.BAYES_E,
        description="cost-reduced bayes for edge devices: int8 activations only",
        activation_dtypes=(qint8,),
        int16_lut=False,
    ),
}

_global_march: March | None = None


def _as_march(march: March | str) -> March:
    if isinstance(march, March):
        return march
    if isinstance(march, str):
        for m in March:
            if m.value == march.lower() or m.name == march.upper():
                return m
    raise ValueError(
        f"unknown march {march!r}; choose one of "
        + ", ".join(repr(m.value) for m in March)
        + " (or the fxq.March members)"
    )


def set_march(march: March | str) -> None:
    """Select the target architecture for every following prepare / convert.

    Args:
        march: a ``fxq.March`` member or its string (``"bernoulli2"``,
            ``"bayes"``, ``"bayes-e"``).

    Raises:
        ValueError: for an unknown march.
    """
    global _global_march
    _global_march = _as_march(march)


def get_march() -> March | None:
    """The march set by ``set_march``, or None when none was set."""
    return _global_march


def get_march_spec(march: March | str | None = None) -> MarchSpec:
    """The spec of ``march``, or of the current march when None.

    Raises:
        RuntimeError: when no march is given and none was set, listing the marches.
    """
    if march is None:
        march = _global_march
        if march is None:
            raise RuntimeError(
                "no march is set: call fxq.set_march(...) first with one of "
                + ", ".join(repr(m.value) for m in March)
                + ' (e.g. fxq.set_march("bayes"))'
            )
    return MARCH_SPECS[_as_march(march)]


def spec_for(march: March | str) -> MarchSpec:
    """The spec of a given march (no global state involved)."""
    return MARCH_SPECS[_as_march(march)]
