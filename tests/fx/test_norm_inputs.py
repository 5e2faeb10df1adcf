"""A residual sum that only a normalization reads runs fused with it on bayes: the sum is int16
on chip whatever the qconfig (``MarchSpec.norm_input_dtype``, ``docs/arithmetic.md`` section 14).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxq
import fxq.export
from fxq.calibration import calibrate, mixed_precision, ptq
from fxq.calibration.mixed_precision import _activation_sizes
from fxq.export.onnx import graph_to_onnx
from fxq.qconfig import default_qat_8bit_fake_quant_qconfig as q8
from tests.calibration.test_range_search import D, PostNormEncoder
from tests.export.helpers import assert_exact_in_runtimes
from tests.helpers import assert_validation_equals_converted, sqnr


class PostNorm(PostNormEncoder):
    """A BERT-style block: ``ln1(h + fc2(gelu(fc1(h))))`` after ``h = ln0(embed(x) + pos)``,
    the residual stream holding one massive channel on the first token (as BERT's)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.pos = nn.Parameter(torch.randn(12, D, generator=g) * 0.1)

    def forward(self, x):
        h = self.ln0(self.embed(x) + self.pos)
        return self.ln1(h + self.fc2(F.gelu(self.fc1(h))))


class PreNorm(nn.Module):
    """``x + fc(ln(x))``, twice: each sum is read by the next add (and a LayerNorm), so the
    residual stream is stored."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.fc1 = nn.LayerNorm(D), nn.Linear(D, D)
        self.ln2, self.fc2 = nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, x):
        x = x + self.fc1(self.ln1(x))
        return x + self.fc2(self.ln2(x))


def _batches(n: int = 4, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(8, 12, D + 1, generator=g)
        x[..., D] = 0.0
        x[:, 0, D] = 1.0  # the first token of every sample carries the outlier
        out.append(x)
    return out


def _prepare(model: nn.Module, example: torch.Tensor) -> torch.fx.GraphModule:
    return fxq.prepare_qat_fx(model.eval(), {"": q8}, example_inputs=(example,))


def _dtypes(prepared) -> dict[str, tuple[str, str]]:
    return {
        name: (m.activation_post_process.dtype.name, m.activation_post_process.on_chip_with)
        for name, m in prepared.named_modules()
        if isinstance(m, fxq.qat.QATModule) and m.has_output_quant
    }


def test_the_sums_before_a_layernorm_are_int16_on_chip(bayes):
    prepared = _prepare(PostNorm(), _batches(1)[0])
    dtypes = _dtypes(prepared)
    # the embedding's add and fc2's fused residual add (linear_add): read by a LayerNorm only
    assert dtypes["add"] == ("qint16", "ln0")
    assert dtypes["fc2"] == ("qint16", "ln1")
    # what is stored stays as the qconfig says: int8
    assert {n: d for n, d in dtypes.items() if n not in ("add", "fc2")} == {
        n: ("qint8", "") for n in dtypes if n not in ("add", "fc2")
    }
    assert int(prepared.state_dict()["fc2.activation_post_process.bits"]) == 16
    rows = {r["node"]: r["output"] for r in fxq.summary(prepared, show=False)}
    assert rows["fc2"] == "qint16 (not calibrated) (on chip, fused with ln1)"


def test_a_stored_residual_stream_keeps_its_qconfig(bayes):
    prepared = _prepare(PreNorm(), torch.randn(2, 5, D))
    assert all(dtype == ("qint8", "") for dtype in _dtypes(prepared).values())


@pytest.mark.parametrize("march", ["bayes-e", "bernoulli2"])
def test_marches_without_the_fusion_keep_int8(march):
    fxq.set_march(march)
    prepared = _prepare(PostNorm(), _batches(1)[0])
    assert all(dtype == ("qint8", "") for dtype in _dtypes(prepared).values())


def _integer_sqnr(prepared, model, calib, held, narrow: bool = False) -> float:
    if narrow:  # the sums as ordinary int8 activations: what bayes computed before
        for m in prepared.modules():
            if isinstance(m, fxq.FakeQuantize) and m.on_chip_with:
                m.set_dtype(fxq.qint8)
    ptq(prepared, calib, iters=0, bias_correction=False, show_progress=False)
    integer = fxq.convert_fx(prepared)
    with torch.no_grad():
        return sqnr(torch.cat([model(x) for x in held]), torch.cat([integer(x) for x in held]))


def test_the_on_chip_sum_carries_the_outlier_that_int8_loses(bayes):
    model = PostNorm().eval()
    calib, held = _batches(4, seed=1), _batches(4, seed=2)
    fused = _integer_sqnr(_prepare(model, calib[0]), model, calib, held)
    narrow = _integer_sqnr(_prepare(model, calib[0]), model, calib, held, narrow=True)
    assert fused > narrow + 3, (narrow, fused)  # measured: 10.1 -> 16.7 dB


def test_exact_in_validation_numpy_and_onnxruntime(bayes):
    model = PostNorm().eval()
    calib = _batches(4)
    prepared = calibrate(_prepare(model, calib[0]), calib, show_progress=False)
    assert_validation_equals_converted(prepared, calib)
    integer = fxq.convert_fx(prepared)
    graph = fxq.export.to_graph(integer, (calib[0],))
    # the int16 sum between the fused linear + add and the LayerNorm reading it
    norms = {n.name: n.inputs for n in graph.nodes if n.op == "normalize"}
    assert norms == {"ln0": ["add"], "ln1": ["fc2"]}
    assert [graph.tensors[t].dtype for t in ("add", "fc2", "ln0", "gelu")] == ["int16"] * 2 + [
        "int8"
    ] * 2
    assert_exact_in_runtimes(integer, graph, graph_to_onnx(graph), (calib[1],))


def test_byte_budgets_do_not_count_the_on_chip_sums(bayes):
    model = PostNorm().eval()
    calib = _batches(2)
    base = calibrate(_prepare(model, calib[0]), calib, show_progress=False)
    sizes = _activation_sizes(base, calib[:1])
    assert "fc2" not in sizes and "add" not in sizes and "fc1" in sizes
    chosen = mixed_precision(model, base, calib[:1], int16_budget=0.5, budget_unit="bytes")
    named = set(chosen.get("module_name", {}))
    assert named and not named & {"fc2", "add"}


def test_a_march_keeps_its_sums_in_one_of_its_own_dtypes():
    from fxq.march.spec import March, MarchSpec

    with pytest.raises(ValueError, match="norm_input_dtype qint16 is not one of its activation"):
        MarchSpec(
            march=March.BAYES_E,
            description="int8 only",
            activation_dtypes=(fxq.qint8,),
            norm_input_dtype=fxq.qint16,
        )
