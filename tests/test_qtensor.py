import pytest
import torch
import torch.nn.functional as F

import fxq
from fxq.qtensor import QTensor


def _q(values, scale=0.5, dtype=fxq.qint8):
    return QTensor(torch.tensor(values, dtype=dtype.storage), torch.tensor([scale]), dtype)


def test_integer_storage_scale_and_dequantize():
    q = _q([[-3, 4], [127, -128]])
    assert q.int_repr().dtype is torch.int8 and q.q_scale() == 0.5
    assert q.dequantize().tolist() == [[-1.5, 2.0], [63.5, -64.0]]
    assert q.dtype is fxq.qint8 and q.shape == (2, 2) and q.ndim == 2
    with pytest.raises(TypeError, match="needs torch.int16 storage"):
        QTensor(torch.zeros(2, dtype=torch.int8), torch.tensor([1.0]), fxq.qint16)


def test_float_carrier_and_storage_hold_the_same_integers():
    q = QTensor(torch.tensor([3.0, -7.0]), torch.tensor([0.25]), fxq.qint8)
    assert q.int_repr().tolist() == [3, -7] and q.int_repr().dtype is torch.int8
    assert q.values().dtype is torch.float32
    r = _q([3, -7], 0.25)
    assert torch.equal(r.values(), q.values())


@pytest.mark.parametrize(
    "op",
    [
        lambda t: t.view(4),
        lambda t: t.reshape(2, 2),
        lambda t: t.flatten(),
        lambda t: t.permute(1, 0),
        lambda t: t.transpose(0, 1),
        lambda t: t[:, 1:],
        lambda t: t.unsqueeze(0).squeeze(0),
        lambda t: torch.flatten(t),
        lambda t: t.contiguous(),
        lambda t: F.relu(t),
        lambda t: t.relu(),
        lambda t: F.max_pool1d(t.unsqueeze(0), 2).squeeze(0),
        lambda t: F.pad(t, (1, 1)),
    ],
)
def test_value_preserving_ops_stay_quantized(op):
    q = _q([[-3, 4], [127, -128]])
    out = op(q)
    assert isinstance(out, QTensor) and out.q_scale() == 0.5
    assert torch.equal(out.dequantize(), op(q.dequantize()))
    assert out.int_repr().dtype is torch.int8


def test_chunk_returns_quantized_pieces():
    a, b = _q([1, 2, 3, 4]).chunk(2)
    assert isinstance(a, QTensor) and a.int_repr().tolist() == [1, 2] and b.q_scale() == 0.5


def test_ops_without_integer_meaning_raise_naming_the_op():
    q = _q([1, 2])
    with pytest.raises(
        TypeError, match=r"torch\.exp has no integer meaning for a QTensor.*dequantize\(\)"
    ):
        torch.exp(q)
    with pytest.raises(TypeError, match="mode='bilinear'"):
        F.interpolate(q.view(1, 1, 2), scale_factor=2, mode="bilinear")
    with pytest.raises(AttributeError, match=r"no integer version of \.sigmoid\(\)"):
        q.sigmoid()
    with pytest.raises(TypeError, match="dropout in training mode"):
        F.dropout(q, 0.5, training=True)
    assert F.dropout(q, 0.5, training=False) is q


def test_per_channel_qtensor():
    q = QTensor(
        torch.tensor([[1, 2], [3, 4]], dtype=torch.int8),
        torch.tensor([0.5, 2.0]),
        fxq.qint8,
        axis=0,
    )
    assert q.dequantize().tolist() == [[0.5, 1.0], [6.0, 8.0]]
    assert q.q_per_channel_scales().tolist() == [0.5, 2.0]
    with pytest.raises(ValueError, match="several scales"):
        q.q_scale()
    with pytest.raises(TypeError, match="per-channel"):
        q.flatten()


def test_to_device_and_refused_dtype_change():
    q = _q([1, 2])
    assert q.to("cpu").int_repr().tolist() == [1, 2]
    with pytest.raises(TypeError, match="would change the integer dtype"):
        q.to(torch.float16)
