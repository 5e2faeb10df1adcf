"""``IntegerGraph.run`` checks its inputs as onnxruntime does (rank, shape, dtype), saturates
``±Inf`` as the integer model does and refuses NaN (``docs/integer_graph.md``, 3)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import fxq
import fxq.export
from fxq.export.graph import GraphInputError
from tests.export.helpers import assert_equal_outputs, outputs


def _convert(model: nn.Module, *example: torch.Tensor) -> nn.Module:
    qat = fxq.prepare_qat_fx(model.eval(), {"": fxq.qconfig.default_qat_8bit_fake_quant_qconfig})
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    with torch.no_grad():
        qat(*example)
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxq.convert_fx(qat)


class _Transposed(nn.Module):
    """Moves values across samples: exported with a fixed batch."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.linear, self.dq = fxq.QuantStub(), nn.Linear(4, 4), fxq.DeQuantStub()

    def forward(self, x):
        return self.dq(self.linear(self.q(x)).transpose(0, 1))


class _Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.conv, self.dq = (
            fxq.QuantStub(),
            nn.Conv2d(3, 4, 3, padding=1),
            fxq.DeQuantStub(),
        )

    def forward(self, x):
        return self.dq(self.conv(self.q(x)))


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qx, self.qy, self.dq = fxq.QuantStub(), fxq.QuantStub(), fxq.DeQuantStub()

    def forward(self, x, y):
        return self.dq(torch.add(self.qx(x), self.qy(y)))


@pytest.fixture(scope="module")
def conv():
    fxq.set_march("bayes")
    integer = _convert(_Conv(), torch.randn(2, 3, 8, 8))
    return integer, fxq.export.to_graph(integer, torch.randn(2, 3, 8, 8))


def test_a_fixed_batch_graph_refuses_another_batch_size(bayes):
    integer = _convert(_Transposed(), torch.randn(2, 4))
    graph = fxq.export.to_graph(integer, torch.randn(2, 4))
    assert not graph.dynamic_batch
    x = torch.randn(2, 4)
    assert_equal_outputs(outputs(integer, (x,)), graph.run(x.numpy()))
    with pytest.raises(
        GraphInputError,
        match=r"^input 'x': got shape \[3, 4\], expected 2x4 \(dimension 0 is 3, expected 2\); "
        r"the graph was exported with a fixed batch size \(dynamic_batch false\): export it "
        r"again with the batch size you run$",
    ):
        graph.run(np.zeros((3, 4), np.float32))


def test_a_dynamic_batch_graph_takes_any_batch_but_fixed_other_sizes(conv):
    integer, graph = conv
    x = torch.randn(5, 3, 8, 8)
    assert_equal_outputs(outputs(integer, (x,)), graph.run(x.numpy()))
    with pytest.raises(
        GraphInputError,
        match=r"^input 'x': got shape \[2, 3, 9, 8\], expected Nx3x8x8 \(dimension 2 is 9, "
        r"expected 8\); this size is fixed at export \(declare it in dynamic_dims to make it dynamic\)$",
    ):
        graph.run(np.zeros((2, 3, 9, 8), np.float32))


def test_wrong_rank_names_the_input_and_both_ranks(conv):
    _, graph = conv
    with pytest.raises(
        GraphInputError,
        match=r"^input 'x': got rank 3 \(shape \[3, 8, 8\]\), expected rank 4 \(shape Nx3x8x8\)$",
    ):
        graph.run(np.zeros((3, 8, 8), np.float32))


@pytest.mark.parametrize("dtype", [np.bool_, np.complex64])
def test_wrong_dtype_names_the_input_expected_and_got(conv, dtype):
    _, graph = conv
    got = np.dtype(dtype)
    with pytest.raises(
        GraphInputError,
        match=rf"^input 'x': got dtype {got}, expected float32 \(a real dtype\); convert it, "
        r"e\.g\. x\.astype\(np\.float32\)$",
    ):
        graph.run(np.zeros((2, 3, 8, 8), dtype))


def test_integer_camera_frames_still_quantize_as_the_integer_model(conv):
    integer, graph = conv
    frame = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    assert_equal_outputs(outputs(integer, (frame,)), graph.run(frame.numpy()))


def test_a_symbolic_size_is_the_same_in_every_input(bayes):
    integer = _convert(_TwoInputs(), torch.randn(2, 4), torch.randn(2, 4))
    graph = fxq.export.to_graph(integer, (torch.randn(2, 4), torch.randn(2, 4)))
    assert [graph.tensors[i].shape for i in graph.inputs] == [["N", 4], ["N", 4]]
    with pytest.raises(
        GraphInputError,
        match=r"^input 'y': dimension 0 \('N'\) is 3, but 'N' is 2 in input 'x'; give every "
        r"input the same size there$",
    ):
        graph.run(np.zeros((2, 4), np.float32), np.zeros((3, 4), np.float32))


def test_inf_saturates_exactly_as_the_integer_model_without_warnings(conv):
    integer, graph = conv
    x = torch.randn(2, 3, 8, 8)
    x[1, 1, 4, 4], x[1, 2, 5, 5] = float("inf"), -float("inf")
    expected = outputs(integer, (x,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = graph.run(x.numpy())
    assert_equal_outputs(expected, got)
    assert np.isfinite(got[0]).all()


def test_nan_is_refused_naming_the_input_count_and_index(conv):
    integer, graph = conv
    x = torch.randn(2, 3, 8, 8)
    x[0, 0, 0, 0] = x[1, 2, 3, 4] = float("nan")
    quantize = next(n.target for n in integer.graph.nodes if n.op == "call_module")
    with torch.no_grad(), pytest.raises(ValueError) as info:
        integer(x)  # the integer model refuses NaN as the graph does (it let it through)
    assert str(info.value) == (
        f"Quantize {quantize!r}: its input holds 2 NaN value(s) (the first at index "
        "(0, 0, 0, 0)), which it cannot quantize: an integer has no NaN (the exported graph "
        "refuses them too); replace them before running (e.g. torch.nan_to_num(x, nan=0.0)), "
        "or find the float op that made them. +-Inf saturates"
    )
    with pytest.raises(
        GraphInputError,
        match=r"^input 'x' holds 2 NaN value\(s\) \(the first at index \(0, 0, 0, 0\)\), which "
        r"node '\w+' \(quantize\) cannot quantize: an integer has no NaN; replace them before "
        r"running \(e\.g\. np\.nan_to_num\(x, nan=0\.0\)\)\. \+-Inf saturates$",
    ):
        graph.run(x.numpy())
