"""Unsigned ReLU outputs stored shifted (fxq.calibration.offset): which outputs take the
offset, exactness of VALIDATION / integer model / exported graph, state dicts, refusals and
the accuracy it buys."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxq
import fxq.export
from fxq.calibration import calibrate, ptq
from fxq.calibration.offset import offset_activations, offset_candidates, release_overflowing
from fxq.qconfig import default_calib_8bit_fake_quant_qconfig as calib_q8
from fxq.qconfig import default_qat_8bit_fake_quant_qconfig as q8
from fxq.qtensor import QTensor
from tests.calibration.test_ptq import _integer_sqnr


class Net(nn.Module):
    """ReLU outputs read by: a padded conv, a 'same' conv, a linear (through nothing),
    an average pool, a residual add, a transposed conv; and one that is a model output."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.dw = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU6())
        self.same = nn.Sequential(nn.Conv2d(8, 8, 3, padding="same"), nn.ReLU())
        self.pw = nn.Sequential(nn.Conv2d(8, 8, 1), nn.ReLU())  # -> add (not a conv)
        self.res = nn.Conv2d(8, 8, 1)
        self.up_in = nn.Sequential(nn.Conv2d(8, 4, 1), nn.ReLU())  # -> transposed conv
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.head_in = nn.Sequential(nn.Conv2d(8, 8, 1), nn.ReLU())  # -> average pool
        self.fc1 = nn.Sequential(nn.Linear(8, 16), nn.ReLU())  # -> linear
        self.fc2 = nn.Linear(16, 5)
        self.side = nn.Sequential(nn.Linear(8, 3), nn.ReLU())  # a model output

    def forward(self, x):
        x = self.same(self.dw(self.stem(x)))
        x = self.pw(x) + self.res(x)
        up = self.up(self.up_in(x))
        v = F.adaptive_avg_pool2d(self.head_in(x), 1).flatten(1)
        return self.fc2(self.fc1(v)), self.side(v), up


def _calibrated(offset: bool, seed: int = 0) -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(seed)
    model = Net().eval()
    data = [torch.randn(4, 3, 12, 12) for _ in range(3)]
    prepared = fxq.prepare_qat_fx(model, {"": q8})
    if offset:
        offset_activations(prepared)
    calibrate(prepared, data, show_progress=False)
    return prepared, data


def test_candidates_are_the_relu_outputs_only_convs_and_linears_read(bayes):
    prepared, _ = _calibrated(False)
    assert offset_candidates(prepared) == ["stem.0", "dw.0", "same.0", "fc1.0"]
    assert offset_activations(prepared, skip=["dw.0"]) == ["stem.0", "same.0", "fc1.0"]
    fq = prepared.get_submodule("stem.0").activation_post_process
    assert fq.offset == 128 and prepared.get_submodule("dw.0").activation_post_process.offset == 0


def test_the_grid_is_unsigned_and_the_scale_covers_the_range(bayes):
    prepared, data = _calibrated(True)
    fq = prepared.get_submodule("stem.0").activation_post_process
    top = float(fq.observer.max_val)
    assert float(fq.scale) * 255 == pytest.approx(top, rel=1e-6)
    fxq.set_fake_quantize(prepared, "validation")
    y = fq(torch.linspace(-1.0, 2 * top, 1000))
    levels = torch.round(y / fq.scale)
    assert float(levels.min()) == 0 and float(levels.max()) == 255
    # set after calibration: the scale is recomputed from the statistics, the same
    late, _ = _calibrated(False)
    offset_activations(late)
    assert torch.equal(late.get_submodule("stem.0").activation_post_process.scale, fq.scale)


def test_validation_integer_model_and_exported_graph_are_bit_exact(bayes):
    onnx = pytest.importorskip("onnx")  # noqa: F841
    from fxq.export.onnx import graph_to_onnx
    from tests.export.helpers import assert_equal_outputs, lsb_difference, outputs, run_onnx

    prepared, data = _calibrated(True)
    fxq.set_fake_quantize(prepared, "validation")
    integer = fxq.convert_fx(prepared)
    x = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        for a, b in zip(prepared(x), integer(x)):
            assert torch.equal(a, b)
    # the stored form: q - 128 in int8, undone by the reader
    stored = {}
    hook = integer.get_submodule("stem.0").register_forward_hook(
        lambda m, i, o: stored.setdefault("q", o) and None  # keeps the output as it is
    )
    with torch.no_grad():
        integer(x)
    hook.remove()
    q = stored["q"]
    assert isinstance(q, QTensor) and q.offset == 128 and q.int_repr().dtype is torch.int8
    assert int(q.int_repr().min()) == -128  # the ReLU's zeros
    assert torch.equal(q.dequantize(), (q.int_repr().float() + 128) * q.scale)
    graph = fxq.export.to_graph(integer, x)
    expected = outputs(integer, (x,))
    assert_equal_outputs(expected, graph.run(x.numpy()))
    assert_equal_outputs(expected, run_onnx(graph_to_onnx(graph), (x,)))
    convs = {n.name: n for n in graph.nodes if n.op == "conv"}
    # dw and same (padded), pw and res (1 x 1) read a shifted tensor; fc1's reader is a linear
    shifted = [name for name, n in convs.items() if n.attrs.get("pad_value") == -128]
    assert len(shifted) == 4 and all(
        n.attrs.get("pad_value", 0) in (0, -128) for n in convs.values()
    )
    assert sum(1 for t in graph.tensors.values() if t.to_json().get("offset") == 128) == 4
    diffs = lsb_difference(graph, graph_to_onnx(graph, mode="qdq"), integer, (x,))
    assert max(float(d.max()) for d in diffs) <= 3.0


def test_qat_trains_and_a_state_dict_carries_the_offset(bayes):
    prepared, data = _calibrated(True)
    prepared.train()
    fxq.set_fake_quantize(prepared, "qat")
    opt = torch.optim.SGD(prepared.parameters(), lr=1e-3)
    weight = prepared.get_submodule("same.0").weight.detach().clone()
    for x in data:
        out = prepared(x)
        loss = sum(o.pow(2).mean() for o in out)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.isfinite(loss) and not torch.equal(weight, prepared.get_submodule("same.0").weight)
    state = prepared.state_dict()
    assert int(state["stem.0.activation_post_process.offset"]) == 128
    fresh = fxq.prepare_qat_fx(Net().eval(), {"": q8})
    fresh.load_state_dict(state)
    assert fresh.get_submodule("stem.0").activation_post_process.offset == 128
    prepared.eval()
    fresh.eval()
    for m in (prepared, fresh):
        fxq.set_fake_quantize(m, "validation")
    x = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(prepared(x), fresh(x)))
    # a state dict without offsets (a symmetric model) takes them away again
    plain, _ = _calibrated(False)
    fresh.load_state_dict(plain.state_dict())
    assert fresh.get_submodule("stem.0").activation_post_process.offset == 0


def test_other_ops_refuse_a_shifted_tensor(bayes):
    q = QTensor(
        torch.tensor([[-128, 0, 127]], dtype=torch.int8), torch.tensor([0.5]), "qint8", offset=128
    )
    assert torch.equal(q.dequantize(), torch.tensor([[0.0, 64.0, 127.5]]))
    assert q.clone().offset == 128 and "offset=128" in repr(q)
    with pytest.raises(TypeError, match="offset 128.*only convolutions and linear layers"):
        F.relu(q)
    with pytest.raises(TypeError, match="offset 128"):
        q.flatten()
    prepared, _ = _calibrated(True)
    fxq.set_fake_quantize(prepared, "validation")
    integer = fxq.convert_fx(prepared)
    shifted = QTensor(
        torch.zeros(1, 8, 4, 4, dtype=torch.int8), torch.tensor([0.1]), "qint8", 0, 128
    )
    plain = QTensor(torch.zeros(1, 8, 4, 4, dtype=torch.int8), torch.tensor([0.1]), "qint8")
    with pytest.raises(TypeError, match=r"head_in.*offset 128.*only convolutions"):
        integer.get_submodule("head_in.0")(shifted)  # reads the add's output, not shifted
    with pytest.raises(TypeError, match="converted for an input stored with offset 128, got one"):
        integer.get_submodule("same.0")(plain)


def test_an_offset_that_int32_cannot_hold_is_released_or_refused(bayes):
    prepared, data = _calibrated(True)
    layer = prepared.get_submodule("dw.0")
    fq = layer.activation_post_process
    assert fq.offset == 128
    with torch.no_grad():  # a dead channel: its weight scale at the floor
        layer.weight[0].zero_()
        layer.weight_fake_quant.activation_post_process.reset()
        layer.quantized_weight()
        layer.weight_fake_quant.scale[0] = 2.0**-23
        layer.stem_input_scale = None
        prepared.get_submodule("stem.0").activation_post_process.scale.fill_(1e-6)
    fxq.set_fake_quantize(prepared, "validation")
    with pytest.raises(ValueError, match="'dw.0'.*offset 128.*overflows int32"):
        fxq.convert_fx(prepared)
    assert release_overflowing(prepared) == ["dw.0"]
    assert fq.offset == 0
    fxq.convert_fx(prepared)


def test_offsets_gain_on_a_pretrained_network(bayes, pretrained):
    model, calib, held, ref = pretrained
    plain = fxq.prepare_qat_fx(model, {"": calib_q8})
    shifted = fxq.prepare_qat_fx(model, {"": calib_q8})
    assert len(offset_activations(shifted)) == 12
    low = _integer_sqnr(calibrate(plain, calib, show_progress=False), held, ref)
    high = _integer_sqnr(calibrate(shifted, calib, show_progress=False), held, ref)
    assert high > low + 1.5, (low, high)  # measured: 14.05 -> 16.04 dB
    best = ptq(fxq.prepare_qat_fx(model, {"": calib_q8}), calib, method="best", show_progress=False)
    without = ptq(
        fxq.prepare_qat_fx(model, {"": calib_q8}),
        calib,
        method="best",
        offset=False,
        show_progress=False,
    )
    low, high = _integer_sqnr(without, held, ref), _integer_sqnr(best, held, ref)
    assert high > low + 2.0, (low, high)  # measured: 27.95 -> 32.14 dB


def test_a_failing_ptq_puts_the_offsets_back(bayes, pretrained):
    model, calib, _, _ = pretrained
    prepared = fxq.prepare_qat_fx(model, {"": calib_q8})
    before = copy.deepcopy(prepared.state_dict())
    with pytest.raises(RuntimeError, match="stop"):
        ptq(prepared, calib + [None], input_fn=_stop_at_none, show_progress=False)
    offsets = [m.offset for m in prepared.modules() if isinstance(m, fxq.FakeQuantize)]
    assert not any(offsets)
    assert prepared.state_dict().keys() == before.keys()
    assert all(
        np.array_equal(v.numpy(), before[k].numpy()) for k, v in prepared.state_dict().items()
    )


def _stop_at_none(batch):
    if batch is None:
        raise RuntimeError("stop")
    return batch
