"""``linear_add``: a linear layer and the residual add after it run as one integer op, as the
vendor's ``LinearAdd`` on bayes; Hugging Face's ``dense -> dropout -> + residual`` fuses with
its dropout, which stays active in training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxq
from fxq.calibration import ptq
from fxq.export import to_graph, to_onnx
from fxq.fake_quantize import bypass
from fxq.fused import Fused
from fxq.qat.elementwise import Add
from fxq.qconfig import default_qat_8bit_fake_quant_qconfig as q8
from tests.export.helpers import assert_exact_in_runtimes, hf_model
from tests.helpers import assert_validation_equals_converted


class Residual(nn.Module):
    """``LayerNorm(dropout(dense(h)) + x)``, Hugging Face's ``BertSelfOutput``."""

    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        self.pre = nn.Linear(16, 16)
        self.dense = nn.Linear(16, 16)
        self.dropout = nn.Dropout(p)
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(self.dropout(self.dense(self.pre(x))) + x)


def _data():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 5, 16, generator=g) for _ in range(3)]


def test_dense_dropout_add_is_one_integer_op_and_exports_exactly(bayes):
    data = _data()
    prepared = fxq.prepare_qat_fx(Residual().eval(), {"": q8}, example_inputs=(data[0],))
    dense = prepared.get_submodule("dense")
    assert dense.add and isinstance(dense.dropout, nn.Dropout)
    assert not any(isinstance(m, Add) for m in prepared.modules())  # no separate add
    assert not hasattr(prepared, "dropout")  # it lives in the fused layer
    ptq(prepared, data, iters=0, show_progress=False)
    assert_validation_equals_converted(prepared, data)
    integer = fxq.convert_fx(prepared)
    assert integer.get_submodule("dense").add
    graph, onnx_model = to_graph(integer, (data[0],)), to_onnx(integer, (data[0],))
    assert_exact_in_runtimes(integer, graph, onnx_model, (data[1],))


def test_the_fused_dropout_trains(bayes):
    """In training the dropout still drops the dense output (p = 1: only the residual is
    left); in eval it is an identity."""
    x = _data()[0]
    model = Residual(p=1.0).eval()
    prepared = fxq.prepare_qat_fx(model, {"": q8}, example_inputs=(x,))
    with bypass(prepared), torch.no_grad():  # the float function, fake quants passed through
        trained, evaluated = prepared.train()(x), prepared.eval()(x)
        torch.testing.assert_close(trained, model.norm(x))
        torch.testing.assert_close(evaluated, model(x))
        assert (trained - evaluated).abs().max() > 0.1


def test_fused_float_chain_keeps_the_dropout(bayes):
    fused = fxq.fuse_fx(Residual(p=1.0).eval())
    module = fused.get_submodule("dense")
    assert isinstance(module, Fused) and module.pattern == "linear_add"
    x = _data()[0]
    torch.testing.assert_close(fused.train()(x), Residual(p=1.0).norm(x))


def test_bernoulli2_has_no_linear_add():
    fxq.set_march("bernoulli2")
    try:
        fused = fxq.fuse_fx(Residual().eval())
        assert not any(isinstance(m, Fused) and m.add for m in fused.modules())
    finally:
        fxq.set_march("bayes")


@pytest.mark.parametrize("name", ["bert", "distilbert"])
def test_hugging_face_encoders_fuse_both_residual_adds_per_layer(bayes, name):
    model, kwargs = hf_model(name)
    ids = torch.randint(0, 100, (2, 7))
    prepared = fxq.prepare_qat_fx(model.eval(), {"": q8}, example_inputs=(ids,), **kwargs)
    fused = [n for n, m in prepared.named_modules() if getattr(m, "add", False) is True]
    assert len(fused) == 2, fused  # attention output and FFN output projections


@pytest.mark.parametrize("anchor", ["conv", "linear"])
def test_an_added_buffer_is_not_a_fused_residual(bayes, anchor):
    """``op(x) + buffer`` broadcasts the buffer: it stays a separate add, and the model
    converts (fused, the integer op could not broadcast the residual)."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.op = nn.Conv2d(3, 4, 3, padding=1) if anchor == "conv" else nn.Linear(6, 6)
            self.register_buffer("bias_map", torch.randn(6, 6))

        def forward(self, x):
            return self.op(x) + self.bias_map

    g = torch.Generator().manual_seed(0)
    data = [torch.randn(2, 3, 6, 6, generator=g) for _ in range(2)]
    prepared = fxq.prepare_qat_fx(M().eval(), {"": q8}, example_inputs=(data[0],))
    assert not prepared.get_submodule("op").add
    ptq(prepared, data, iters=0, show_progress=False)
    assert_validation_equals_converted(prepared, data)
