"""Gradient masks kept as ``uint8`` in compiled graphs (``fxq.utils.grad_mask``): the same
gradients as torch's ReLU / ReLU6 and as the eager straight-through estimator."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fxq.qat.base import activate
from fxq.utils.grad_mask import keep_mask, pass_gradient

SPECIAL = [-1e30, -6.0, -1.0, -0.0, 0.0, 1e-45, 0.5, 5.999999, 6.0, 6.5, 1e30]
SPECIAL += [float("inf"), float("-inf"), float("nan")]


@pytest.mark.parametrize("name", ["relu", "relu6"])
@pytest.mark.parametrize("compiled", [False, True])
def test_fused_activations_keep_torch_values_and_gradients(name, compiled):
    reference = {"relu": F.relu, "relu6": F.relu6}[name]
    x = torch.tensor(SPECIAL + torch.randn(50).mul(4).tolist())
    grad = torch.randn(x.shape)
    a = x.clone().requires_grad_()
    expected = reference(a)
    expected.backward(grad)

    def ours(v):
        return activate(name, v)

    if compiled:
        torch._dynamo.reset()
        ours = torch.compile(ours, backend="aot_eager", fullgraph=True)
    b = x.clone().requires_grad_()
    got = ours(b)
    got.backward(grad)
    assert torch.allclose(got, expected, rtol=0, atol=0, equal_nan=True)
    # 0 where blocked. At a NaN torch's ReLU passes the gradient; its ReLU6 passes it or
    # not depending on its kernel's vectorization (a tensor of 14 values: passes; of 64:
    # not), so ReLU6 is compared away from NaN (compiled, fxq's passes it, as ReLU does)
    where = ~x.isnan() if name == "relu6" else torch.ones_like(x, dtype=torch.bool)
    assert torch.equal(b.grad[where], a.grad[where])
    if compiled or name == "relu":
        assert torch.equal(b.grad[x.isnan()], grad[x.isnan()])


def test_the_compiled_mask_is_uint8_and_passes_the_same_gradient():
    passes = torch.tensor([True, False, True, False])
    grad = torch.tensor([1.5, -2.0, -0.0, 3.0])
    assert keep_mask(passes) is passes  # eager: the bool itself
    kept = torch.compile(keep_mask, backend="aot_eager", fullgraph=True)(passes)
    assert kept.dtype is torch.uint8 and kept.tolist() == [1, 0, 1, 0]
    assert torch.equal(pass_gradient(grad, kept), pass_gradient(grad, passes))
    assert pass_gradient(grad, kept).tolist() == [1.5, 0.0, 0.0, 0.0]
