"""``mixed_precision`` on a small pre-norm encoder: the residual adds (functional ops, whose
fake quants live in modules ``prepare_qat_fx`` created) are chosen through their owner."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxq
from fxq.calibration import calibrate, mixed_precision
from fxq.calibration.mixed_precision import _activation_sizes
from fxq.debug.sensitivity import quantized_values
from fxq.qconfig import default_qat_8bit_fake_quant_qconfig as q8
from tests.helpers import sqnr

D, TOKENS, VOCAB = 32, 16, 50


class Residual(nn.Module):
    """``x + gelu(dense(norm(y)))``: a pre-norm block, its residual add in its own forward (a
    GELU between them: a linear layer right before the add would fuse with it, ``linear_add``,
    and the add would be no functional op of its own). The sum is read by the next layer and
    the next add, not by a normalization alone (bayes would keep such a sum on chip in int16
    with the normalization, ``MarchSpec.norm_input_dtype``, leaving nothing to choose)."""

    def __init__(self, d_in: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_in)
        self.dense = nn.Linear(d_in, D)

    def forward(self, y, x):
        return x + F.gelu(self.dense(self.norm(y)))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = Residual(D)
        self.up = nn.Linear(D, 2 * D)
        self.out = Residual(2 * D)

    def forward(self, x):
        x = self.mix(x, x)
        return self.out(self.up(x), x)


class Encoder(nn.Module):
    """A random pre-norm encoder: token ids to [batch, tokens, hidden]."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.Sequential(Layer(), Layer())

    def forward(self, ids):
        return self.layers(self.embed(ids))


def _data(seed: int) -> torch.Tensor:
    """Token ids, [batch, tokens]."""
    return torch.randint(VOCAB, (8, TOKENS), generator=torch.Generator().manual_seed(seed))


def _prepare(model, qconfig_dict):
    return fxq.prepare_qat_fx(model, qconfig_dict, example_inputs=(_data(0),))


def _model_and_base():
    torch.manual_seed(0)
    model = Encoder().eval()
    with torch.no_grad():  # a planted outlier channel: the residual stream before each
        model.embed.weight[:, 3] += 40.0  # LayerNorm spans 40 times its other channels' range
    calib = [_data(0), _data(1)]
    base = calibrate(_prepare(model, {"": q8}), calib, show_progress=False)
    return model, calib, base


def _int16_names(prepared) -> set[str]:
    return {
        v.name
        for v in quantized_values(prepared)
        if v.kind == "activation" and v.fake_quant.dtype is fxq.qint16
    }


def _integer_sqnr(model, qconfig_dict, calib, held) -> float:
    prepared = calibrate(_prepare(model, qconfig_dict), calib, show_progress=False)
    with torch.no_grad():
        return sqnr(model(held), fxq.convert_fx(prepared)(held))


def test_mixed_precision_reaches_the_residual_adds(bayes):
    model, calib, base = _model_and_base()
    adds = [v.name for v in quantized_values(base) if v.type == "Add"]
    assert adds == ["layers.0.mix.add", "layers.0.out.add", "layers.1.mix.add", "layers.1.out.add"]
    sizes = _activation_sizes(base, calib[:1])
    total = sum(sizes.values())
    chosen = mixed_precision(model, base, calib[:1], int16_budget=0.2, budget_unit="bytes")
    # an add is named by a regex matching exactly its owner's path (not its submodules')
    patterns = dict(chosen.get("module_name_regex", []))
    assert patterns and all(qc.activation_dtype is fxq.qint16 for qc in patterns.values())
    prepared = _prepare(model, chosen)
    wide = _int16_names(prepared)
    raised_adds = wide & set(adds)
    assert len(raised_adds) == len(patterns) >= 1
    # the owners' linear layers and LayerNorms keep int8 unless chosen on their own
    owners = {a.rpartition(".")[0] for a in raised_adds}
    inside = {f"{o}.{m}" for o in owners for m in ("dense", "norm")}
    assert wide & inside == inside & set(chosen["module_name"])
    assert set(chosen["module_name"]) <= wide
    assert sum(sizes[n] for n in wide) <= 0.2 * total
    held = _data(2)
    int8 = _integer_sqnr(model, {"": q8}, calib, held)
    mixed = _integer_sqnr(model, chosen, calib, held)
    assert mixed > int8 + 1.5, (int8, mixed)  # measured: 28.33 -> 30.94 dB


def test_an_owner_with_its_own_entry_is_not_reached(bayes):
    """An owner whose ops another entry of the qconfig_dict configures is left alone: a regex
    comes after ``module_name`` in the resolution and would not apply."""
    model, calib, _ = _model_and_base()
    qconfig_dict = {"": q8, "module_name": {"layers.0": q8}}
    base = calibrate(_prepare(model, qconfig_dict), calib, show_progress=False)
    chosen = mixed_precision(
        model, base, calib[:1], int16_budget=0.5, qconfig_dict=qconfig_dict, budget_unit="bytes"
    )
    patterns = dict(chosen.get("module_name_regex", []))
    assert not any(p.startswith(r"layers\.0") for p in patterns)
    wide = _int16_names(_prepare(model, chosen))
    assert {n for n in wide if ".add" in n} == {f"layers.1.{p}.add" for p in ("mix", "out")} & wide


def test_quantize_one_ranking_takes_each_activations_own_noise(bayes):
    """``ranking="quantize_one"``: each activation's noise alone at int8, everything else
    float; raising it removes that share of the summed noise."""
    from fxq.calibration.mixed_precision import _as_raised

    rows = _as_raised([{"name": "a", "sqnr": 20.0}, {"name": "b", "sqnr": 10.0}])
    assert [r["name"] for r in rows] == ["b", "a"]  # b's noise (0.1) is the larger share
    assert all(abs(r["baseline"] - (-10 * math.log10(0.11))) < 1e-9 for r in rows)
    assert [round(r["sqnr"], 9) for r in rows] == [20.0, 10.0]  # what is left: a's, b's
    model, calib, base = _model_and_base()
    chosen = mixed_precision(
        model, base, calib[:1], int16_budget=0.2, budget_unit="bytes", ranking="quantize_one"
    )
    held = _data(2)
    int8 = _integer_sqnr(model, {"": q8}, calib, held)
    assert _integer_sqnr(model, chosen, calib, held) > int8 + 1.5  # 28.33 -> 31.00 dB
    with pytest.raises(ValueError, match=r"ranking must be one of \('raise_one', 'quantize_one'\)"):
        mixed_precision(model, base, calib[:1], ranking="best")


def test_activations_already_int16_count_against_the_budget(bayes):
    """The budget bounds the int16 share of the model the result prepares: an activation
    the ranked model has int16 already (here the last add, as a qconfig makes it; a model
    output ``ptq`` widens alike) is paid for first."""
    from fxq.qconfig import default_qat_8bit_weight_16bit_act_fake_quant_qconfig as a16

    model, calib, _ = _model_and_base()
    qconfig_dict = {"": q8, "module_name_regex": [(r"layers\.1\.out", a16)]}
    base = calibrate(_prepare(model, qconfig_dict), calib, show_progress=False)
    sizes = _activation_sizes(base, calib[:1])
    already = _int16_names(base)
    assert sum(sizes[n] for n in already) > 0.08 * sum(sizes.values())  # most of the budget
    chosen = mixed_precision(
        model, base, calib[:1], int16_budget=0.15, qconfig_dict=qconfig_dict, budget_unit="bytes"
    )
    wide = _int16_names(_prepare(model, chosen))
    assert already <= wide
    assert sum(sizes[n] for n in wide) <= 0.15 * sum(sizes.values())
    # the budget left after the int16 already there was spent on something
    assert len(wide) > len(already)
