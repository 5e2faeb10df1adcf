"""The march specification: one frozen dataclass per target architecture.

Everything that differs between accelerator generations is a field here, and
the rest of fxq reads these fields instead of testing march names.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from fxq.dtypes import QDType, qint8

__all__ = ["March", "Rounding", "ScaleConstraint", "MarchSpec", "FUSIONS"]


class March(str, enum.Enum):
    """Target architectures ("marches") of BPU-style accelerators."""

    BERNOULLI2 = "bernoulli2"
    BAYES = "bayes"
    BAYES_E = "bayes-e"

    def __str__(self) -> str:
        return self.value


class Rounding(str, enum.Enum):
    """How a value is rounded to an integer.

    ``HALF_UP``: ties go towards +inf. In integer arithmetic this is the
    accelerator's right shift with rounding: add ``1 << (shift - 1)`` then
    shift arithmetically. For real numbers it is ``floor(x + 1/2)``.

    ``HALF_EVEN``: ties go to the even neighbour (IEEE default, what
    ``torch.round`` does).
    """

    HALF_UP = "half_up"
    HALF_EVEN = "half_even"


class ScaleConstraint(str, enum.Enum):
    """Which scales a march can represent."""

    ANY = "any"  # any positive float32 scale
    POWER_OF_TWO = "power_of_two"  # scales are 2**k, requantization is mostly shifts


# Every fusion fxq knows; a march enables a subset. The patterns themselves live
# in fxq.fx.fuse (one table), keyed by these names.
FUSIONS = frozenset(
    {
        "conv_bn",
        "conv_bn_relu",
        "conv_bn_relu6",
        "conv_relu",
        "conv_relu6",
        "conv_add",
        "conv_add_relu",
        "conv_bn_add",
        "conv_bn_add_relu",
        "linear_bn",
        "linear_bn_relu",
        "linear_relu",
        "linear_add",
        "linear_add_relu",
        "convtranspose_bn",
        "convtranspose_bn_relu",
        "convtranspose_relu",
        "bn_relu",
    }
)


@dataclass(frozen=True)
class MarchSpec:
    """What one march can compute and how.

    Attributes:
        march: the march this spec describes.
        description: one line for humans.
        activation_dtypes: activation dtypes the march runs, first is the default.
        weight_dtype: weights are always int8 on current marches.
        weight_per_channel: weights have one scale per output channel (axis 0).
        scale_constraint: which scales are representable.
        rounding: rounding of every requantization and of fake quantization.
        multiplier_bits: signed width of requantization multipliers, so
            ``|m| <= 2**(multiplier_bits - 1) - 1``.
        shift_range: inclusive range of the right shift that follows a multiplier.
        accumulator_bits: width of the conv / linear / matmul accumulator.
        fusions: names from ``FUSIONS`` that this march can run as one op.
        int16_lut: non-linear ops on int16 inputs use segmented lookup tables.
        high_precision_output: a final conv / linear may emit its int32
            accumulator (``default_qat_8bit_weight_32bit_out_fake_quant_qconfig``).
        norm_input_dtype: a residual sum (an add, or a conv / linear with its fused
            add) that nothing but one LayerNorm or GroupNorm reads runs as one op with
            that normalization: the sum stays on chip in this dtype and is never stored
            (``docs/arithmetic.md``, section 14). None: the sum is an ordinary
            activation of its qconfig's dtype.
    """

    march: March
    description: str
    activation_dtypes: tuple[QDType, ...]
    weight_dtype: QDType = qint8
    weight_per_channel: bool = True
    scale_constraint: ScaleConstraint = ScaleConstraint.ANY
    rounding: Rounding = Rounding.HALF_UP
    multiplier_bits: int = 16
    shift_range: tuple[int, int] = (0, 31)
    accumulator_bits: int = 32
    fusions: frozenset[str] = FUSIONS
    int16_lut: bool = False
    high_precision_output: bool = True
    norm_input_dtype: QDType | None = None

    def __post_init__(self) -> None:
        unknown = set(self.fusions) - FUSIONS
        if unknown:
            raise ValueError(f"march {self.march.value}: unknown fusions {sorted(unknown)}")
        if not self.activation_dtypes:
            raise ValueError(f"march {self.march.value}: no activation dtype")
        if self.norm_input_dtype is not None and not self.supports_activation(
            self.norm_input_dtype
        ):
            raise ValueError(
                f"march {self.march.value}: norm_input_dtype {self.norm_input_dtype.name} is "
                "not one of its activation dtypes"
            )

    @property
    def max_multiplier(self) -> int:
        return (1 << (self.multiplier_bits - 1)) - 1

    def supports_activation(self, dtype: QDType) -> bool:
        return dtype in self.activation_dtypes

    def allowed_dtype_names(self) -> str:
        return ", ".join(d.name for d in self.activation_dtypes)
