import pytest
import torch
from torch import nn

import fxq
from fxq.march import MARCH_SPECS, Rounding, ScaleConstraint, spec_for


def test_set_march_accepts_member_and_string():
    fxq.set_march(fxq.March.BAYES)
    assert fxq.get_march() is fxq.March.BAYES
    fxq.set_march("bernoulli2")
    assert fxq.get_march() is fxq.March.BERNOULLI2
    fxq.set_march("bayes-e")
    assert fxq.get_march() is fxq.March.BAYES_E
    assert fxq.March.BAYES_E.value == "bayes-e"


def test_unknown_march_lists_choices():
    with pytest.raises(ValueError, match="'bernoulli2', 'bayes', 'bayes-e'"):
        fxq.set_march("nash")


def test_specs_state_dtypes_and_arithmetic():
    b2, bayes, be = (spec_for(m) for m in ("bernoulli2", "bayes", "bayes-e"))
    assert [d.name for d in b2.activation_dtypes] == ["qint8"]
    assert [d.name for d in bayes.activation_dtypes] == ["qint8", "qint16"]
    assert [d.name for d in be.activation_dtypes] == ["qint8"]
    assert b2.scale_constraint is ScaleConstraint.POWER_OF_TWO
    assert bayes.scale_constraint is ScaleConstraint.ANY
    assert all(s.rounding is Rounding.HALF_UP for s in MARCH_SPECS.values())
    assert bayes.max_multiplier == 32767 and bayes.shift_range == (0, 31)
    assert b2.max_multiplier == 127
    assert "convtranspose_bn" in bayes.fusions and "convtranspose_bn" not in b2.fusions
    assert all(s.weight_per_channel for s in MARCH_SPECS.values())


def test_prepare_without_march_is_a_clear_error():
    model = nn.Sequential(nn.Conv2d(3, 3, 1))
    with pytest.raises(RuntimeError, match=r"no march is set.*'bernoulli2', 'bayes', 'bayes-e'"):
        fxq.prepare_qat_fx(model, {"": fxq.qconfig.default_qat_8bit_fake_quant_qconfig})


def test_get_march_spec_uses_current_march():
    fxq.set_march("bayes")
    assert fxq.get_march_spec().march is fxq.March.BAYES
    assert torch.int16 is fxq.qint16.storage
