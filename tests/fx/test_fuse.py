import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxq
from fxq.fused import Fused
from fxq.fx.fuse import PATTERNS


def _bn(cls, n):
    bn = cls(n)
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    bn.weight.data.uniform_(0.5, 1.5)
    bn.bias.data.uniform_(-0.5, 0.5)
    return bn


class Chain(nn.Module):
    """anchor -> [bn] -> [+ residual] -> [act], built from a pattern's steps."""

    def __init__(self, anchor: str, steps, functional: bool):
        super().__init__()
        self.steps = steps
        self.functional = functional
        if anchor == "conv":
            self.op, bn_cls, self.shape = (
                nn.Conv2d(4, 4, 3, padding=1),
                nn.BatchNorm2d,
                (2, 4, 5, 5),
            )
        elif anchor == "convtranspose":
            self.op, bn_cls, self.shape = (
                nn.ConvTranspose2d(4, 4, 3, padding=1),
                nn.BatchNorm2d,
                (2, 4, 5, 5),
            )
        elif anchor == "linear":
            self.op, bn_cls, self.shape = nn.Linear(4, 4), nn.BatchNorm1d, (3, 4)
        else:  # a standalone bn
            self.op, bn_cls, self.shape = _bn(nn.BatchNorm2d, 4), None, (2, 4, 5, 5)
        self.bn = _bn(bn_cls, 4) if "bn" in steps else None
        self.relu = nn.ReLU()
        self.relu6 = nn.ReLU6()
        self.other = nn.Identity()

    def forward(self, x):
        y = self.op(x)
        if self.bn is not None:
            y = self.bn(y)
        if "add" in self.steps:
            r = self.other(x)
            y = torch.add(y, r) if self.functional else y + r
        if "relu" in self.steps:
            y = F.relu(y) if self.functional else self.relu(y)
        if "relu6" in self.steps:
            y = F.relu6(y) if self.functional else self.relu6(y)
        return y


@pytest.mark.parametrize("functional", [False, True], ids=["modules", "functionals"])
@pytest.mark.parametrize("pattern", PATTERNS, ids=[p.name for p in PATTERNS])
def test_every_pattern_fuses_and_computes_the_same(bayes, pattern, functional):
    model = Chain(pattern.anchor, pattern.steps, functional).eval()
    x = torch.randn(model.shape)
    fused = fxq.fuse_fx(model).eval()
    mods = [m for m in fused.modules() if isinstance(m, Fused)]
    assert [m.pattern for m in mods] == [pattern.name]
    assert torch.allclose(fused(x), model(x), atol=1e-6)
    # nothing of the chain is left beside the fused module
    ops = [n for n in fused.graph.nodes if n.op in ("call_module", "call_function", "call_method")]
    assert [
        fused.get_submodule(n.target).pattern
        for n in ops
        if n.op == "call_module" and isinstance(fused.get_submodule(n.target), Fused)
    ] == [pattern.name]
    bn_nodes = [
        n
        for n in ops
        if n.op == "call_module"
        and isinstance(fused.get_submodule(n.target), nn.modules.batchnorm._BatchNorm)
    ]
    assert bn_nodes == []
    assert not any(n.target in (F.relu, F.relu6, torch.add, operator.add) for n in ops)


def test_march_decides_which_fusions_exist():
    model = Chain("convtranspose", ("bn",), False).eval()
    fxq.set_march("bernoulli2")
    assert not any(isinstance(m, Fused) for m in fxq.fuse_fx(model).modules())
    fxq.set_march("bayes")
    assert any(isinstance(m, Fused) for m in fxq.fuse_fx(model).modules())


def test_no_fusion_when_an_intermediate_value_has_other_users(bayes):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)
            self.bn = nn.BatchNorm2d(3)

        def forward(self, x):
            y = self.conv(x)
            return self.bn(y) + y  # y read twice

    fused = fxq.fuse_fx(M())
    assert not any(isinstance(m, Fused) for m in fused.modules())


def test_fuse_fx_does_not_modify_its_input(bayes):
    model = Chain("conv", ("bn", "relu"), False).eval()
    fxq.fuse_fx(model)
    assert type(model.op) is nn.Conv2d and isinstance(model.bn, nn.BatchNorm2d)


def test_resnet_blocks_fuse_with_residual_add(bayes):
    import torchvision

    fused = fxq.fuse_fx(torchvision.models.resnet18().eval())
    patterns = sorted(m.pattern for m in fused.modules() if isinstance(m, Fused))
    assert patterns.count("conv_bn_add_relu") == 8  # the second conv of each basic block
    assert patterns.count("conv_bn_relu") == 9  # stem + first conv of each block
    assert patterns.count("conv_bn") == 3  # downsample paths
    bn_nodes = [
        n
        for n in fused.graph.nodes
        if n.op == "call_module" and isinstance(fused.get_submodule(n.target), nn.BatchNorm2d)
    ]
    assert bn_nodes == []
    with pytest.raises(AttributeError):
        fused.get_submodule("layer1.0.bn1")  # absorbed into layer1.0.conv1
