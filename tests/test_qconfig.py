import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxq
from fxq import qat
from fxq.qconfig import (
    QConfig,
    QConfigResolver,
    get_default_qconfig,
)
from fxq.qconfig import (
    default_qat_8bit_fake_quant_qconfig as q8,
)
from fxq.qconfig import (
    default_qat_8bit_weight_16bit_act_fake_quant_qconfig as q16,
)
from fxq.qconfig import (
    default_qat_out_8bit_fake_quant_qconfig as qout,
)
from tests.helpers import fake_quant_modules


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.act = nn.Sigmoid()

    def forward(self, x):
        return self.act(self.conv(x)) + x


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 1)
        self.backbone = nn.Sequential(Block(), Block())
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.head(self.backbone(self.stem(x)))


def _resolver(d, model=None):
    return QConfigResolver(d, model or Model(), fxq.get_march_spec())


def test_priority_attribute_name_regex_type_global(bayes):
    model = Model()
    model.backbone[1].qconfig = q16  # attribute beats everything below
    r = _resolver(
        {
            "": q8,
            "module_type": [(nn.Sigmoid, None)],
            "module_name_regex": [(r"backbone\.0\..*", qout)],
            "module_name": {"backbone.0.act": q8},
        },
        model,
    )
    assert r.resolve("backbone.1.conv", nn.Conv2d).qconfig is q16
    assert r.resolve("backbone.1.conv", nn.Conv2d).source == "attribute"
    assert r.resolve("backbone.0.act", nn.Sigmoid).qconfig is q8  # name beats regex and type
    assert r.resolve("backbone.0.conv", nn.Conv2d).qconfig is qout  # regex beats global
    assert r.resolve("head", nn.Conv2d).qconfig is q8  # global
    assert r.resolve("stem", nn.Sigmoid).qconfig is None  # type beats global
    assert r.resolve("stem", nn.Conv2d).source == "global"


def test_module_name_prefix_covers_submodules_longest_wins(bayes):
    r = _resolver({"module_name": {"backbone": q16, "backbone.1": None}})
    assert r.resolve("backbone.0.conv", nn.Conv2d).qconfig is q16
    assert r.resolve("backbone.1.conv", nn.Conv2d).qconfig is None
    assert r.resolve("head", nn.Conv2d).source == "default"


def test_functional_aliases_and_object_type(bayes):
    r = _resolver({"": q8, "object_type": [(torch.add, None)]})
    for target in (operator.add, operator.iadd, torch.add, "add", "add_"):
        assert r.resolve("backbone.0", target).qconfig is None
    assert r.resolve("backbone.0", torch.cat).qconfig is q8


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"module_types": {}}, r"unknown key 'module_types' \(did you mean 'module_type'\?\)"),
        (
            {"": "int8"},
            r"the value for the global qconfig \(''\) must be a fxq QConfig or None, got str",
        ),
        (
            {"module_name": {"backbone.9": q8}},
            r"no module named 'backbone.9' in the model; close names: .*backbone.0",
        ),
        ({"module_name": [("head", q8, 1)]}, r"must be a dict or a list of \(key, qconfig\) pairs"),
        ({"module_type": q8}, r"must be a dict or a list of \(key, qconfig\) pairs, got QConfig"),
        ({"module_name_regex": [("(", q8)]}, r"bad regex '\('"),
        ({"module_name": {3: q8}}, r"keys must be strings"),
        ([("", q8)], r"qconfig_dict must be a dict"),
    ],
)
def test_bad_qconfig_dicts_are_value_errors(bayes, bad, message):
    with pytest.raises(ValueError, match=message):
        _resolver(bad)


def test_dtype_the_march_cannot_run():
    fxq.set_march("bernoulli2")
    with pytest.raises(
        ValueError, match=r"module_name 'head'.* qint16, which march bernoulli2 cannot run"
    ):
        _resolver({"module_name": {"head": q16}})
    model = Model()
    model.qconfig = q16
    with pytest.raises(ValueError, match=r"attribute <root>.qconfig.*bernoulli2"):
        fxq.prepare_qat_fx(model)


def test_prepare_honours_none_regions(bayes):
    model = Model()
    prepared = fxq.prepare_qat_fx(model, {"": q8, "module_name": {"backbone.1": None}})
    assert type(prepared.get_submodule("backbone.0.conv")) is qat.Conv2d
    assert type(prepared.get_submodule("backbone.1.conv")) is nn.Conv2d  # stays float
    assert type(prepared.get_submodule("backbone.1.act")) is nn.Sigmoid
    # the float region's output re-enters quantized code through an inserted quantize stub
    head_inputs = prepared.head.input_quants
    assert len(head_inputs) == 1 and head_inputs[0].name.startswith("the output of '")
    stubs = [
        n
        for n in prepared.graph.nodes
        if n.op == "call_module" and isinstance(prepared.get_submodule(n.target), qat.QuantStub)
    ]
    assert [n.args[0].name for n in stubs] == ["x", "add_1"]


def test_functional_op_types_in_prepare(bayes):
    prepared = fxq.prepare_qat_fx(Model(), {"": q8, "module_type": [(operator.add, None)]})
    kinds = {type(m) for m in prepared.modules()}
    assert qat.Add not in kinds and qat.LookupTableOp in kinds


def test_get_default_qconfig_names(bayes):
    qc = get_default_qconfig(
        activation_observer="moving_average", activation_qkwargs={"dtype": fxq.qint16}
    )
    fq = qc.activation()
    assert fq.dtype is fxq.qint16 and type(fq.observer).__name__ == "MovingAverageMinMaxObserver"
    w = qc.weight(num_channels=3)
    assert w.ch_axis == 0 and w.scale.shape == (3,)
    with pytest.raises(ValueError, match="unknown observer 'median'"):
        get_default_qconfig(activation_observer="median")
    with pytest.raises(ValueError, match="weights are int8"):
        get_default_qconfig(weight_qkwargs={"dtype": fxq.qint16})
    with pytest.raises(ValueError, match="fake-quant factory"):
        QConfig(activation=None, weight=qc.weight)


def test_functional_ops_take_their_owners_qconfig(bayes):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Block()

        def forward(self, x):
            return F.relu(self.inner(x)) * 2.0

    prepared = fxq.prepare_qat_fx(M(), {"": q8, "module_name": {"inner": q16}})
    assert prepared.inner.add.activation_post_process.dtype is fxq.qint16  # '+' inside Block
    assert prepared.mul.activation_post_process.dtype is fxq.qint8  # '*' in the root
    assert set(fake_quant_modules(prepared)) >= {
        "inner.add.activation_post_process",
        "mul.activation_post_process",
    }
