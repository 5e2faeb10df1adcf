"""``@fxq.fx_wrap`` written without parentheses means the same as ``@fxq.fx_wrap()``."""

import pytest
import torch
from torch import nn

import fxq
from fxq.fx.tracer import call_wrapped_method, is_fx_wrapped


@fxq.fx_wrap
def clip_if_positive(x):
    if x.sum() > 0:  # data-dependent: only a wrapped function can do this in a traced model
        return x.clamp(max=1.0)
    return x


@fxq.fx_wrap
class Gate(nn.Module):
    def forward(self, x):
        return x if x.max() > 0 else -x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.gate = Gate()

    def forward(self, x):
        return self.post(self.gate(clip_if_positive(self.conv(x))))

    @fxq.fx_wrap
    def post(self, x):
        return x * 2 if self.training else x.abs()


def test_bare_fx_wrap_marks_functions_methods_and_classes():
    assert is_fx_wrapped(clip_if_positive) and is_fx_wrapped(Gate) and is_fx_wrapped(Net.post)
    assert clip_if_positive.__name__ == "clip_if_positive"
    assert clip_if_positive(-torch.ones(2)).tolist() == [-1.0, -1.0]  # runs as the original


def test_bare_fx_wrap_traces_like_the_called_form():
    net = Net()
    gm = fxq.symbolic_trace(net)
    calls = [(n.op, n.target) for n in gm.graph.nodes if n.op.startswith("call")]
    assert calls == [
        ("call_module", "conv"),
        ("call_function", clip_if_positive),
        ("call_module", "gate"),  # a leaf: one node
        ("call_function", call_wrapped_method),  # self.post runs at call time
    ]
    x = torch.randn(2, 3, 4, 4)
    for mode in (net.train, net.eval):
        mode()
        gm.train(net.training)
        assert torch.equal(gm(x), net(x))


def test_bare_fx_wrap_refuses_what_fx_wrap_refuses():
    with pytest.raises(
        TypeError, match=r"applies to functions, methods and nn.Module classes, got 3"
    ):
        fxq.fx_wrap(3)
    with pytest.raises(TypeError, match=r"on a class needs an nn.Module subclass"):
        fxq.fx_wrap(int)
