import operator
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxq
from fxq import qat
from fxq.observer import MovingAverageMinMaxObserver
from fxq.qconfig import (
    QConfig,
    QConfigResolver,
    default_calib_8bit_fake_quant_qconfig,
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
from tests.helpers import ResidualNet, calibrate, fake_quant_modules, recalibrate_bn


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


# -- the vendor plugin's and torch.ao's qconfig forms -------------------------------------
def test_weight_qkwargs_qscheme_and_ch_axis_say_what_fxq_does(bayes):
    vendor = get_default_qconfig(
        weight_qkwargs={"qscheme": torch.per_channel_symmetric, "ch_axis": 0}
    )
    assert vendor.weight.keywords == get_default_qconfig().weight.keywords
    w = vendor.weight(num_channels=3)
    assert w.ch_axis == 0 and w.scale.shape == (3,) and w.dtype is fxq.qint8
    act = get_default_qconfig(
        activation_qkwargs={"qscheme": torch.per_tensor_symmetric, "quant_min": -128}
    )
    assert act.activation.keywords == get_default_qconfig().activation.keywords
    int16 = get_default_qconfig(
        activation_qkwargs={"dtype": "qint16", "quant_min": -32768, "quant_max": 32767}
    )
    assert int16.activation.dtype is fxq.qint16 and "quant_min" not in int16.activation.keywords


_WEIGHTS = r"fxq weights are symmetric per output channel \(qscheme=torch\.per_channel_symmetric, ch_axis=0\)"
_ACTIVATIONS = r"fxq activations are symmetric per tensor .*: the zero point is always 0"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"weight_qkwargs": {"qscheme": torch.per_tensor_symmetric}},
            r"^weight_qkwargs: qscheme=torch\.per_tensor_symmetric is not available: "
            + _WEIGHTS
            + r"\. Remove 'qscheme' or pass qscheme=torch\.per_channel_symmetric\.$",
        ),
        (
            {"weight_qkwargs": {"qscheme": torch.per_channel_affine, "ch_axis": 0}},
            r"^weight_qkwargs: qscheme=torch\.per_channel_affine is not available: " + _WEIGHTS,
        ),
        (
            {"weight_qkwargs": {"qscheme": torch.per_channel_symmetric, "ch_axis": 1}},
            r"^weight_qkwargs: ch_axis=1 is not available: "
            + _WEIGHTS
            + r"\. Remove 'ch_axis' or pass ch_axis=0\.$",
        ),
        (
            {"activation_qkwargs": {"qscheme": torch.per_tensor_affine}},
            r"^activation_qkwargs: qscheme=torch\.per_tensor_affine is not available: "
            + _ACTIVATIONS
            + r"\. Remove 'qscheme' or pass qscheme=torch\.per_tensor_symmetric\.$",
        ),
        (
            {"activation_qkwargs": {"ch_axis": 1}},
            r"^activation_qkwargs: ch_axis=1 is not available: " + _ACTIVATIONS,
        ),
        (
            {"activation_qkwargs": {"quant_min": 0, "quant_max": 255}},
            r"^activation_qkwargs: quant_min=0 is not the range of qint8 \[-128, 127\]; fxq always "
            r"uses the whole range of the dtype",
        ),
        (
            {"activation_qkwargs": {"reduce_range": True}},
            r"^activation_qkwargs: 'reduce_range' is not an argument of FakeQuantize or of the "
            r"'min_max' observer \(MinMaxObserver\); accepted: dtype, march, scale$",
        ),
        (
            {"activation_observer": "fixed_scale", "activation_qkwargs": {"averaging_constant": 0}},
            r"'averaging_constant' is not an argument of FakeQuantize or of the 'fixed_scale' "
            r"observer \(FixedScaleObserver\); accepted: dtype, march, scale$",
        ),
        (
            {"activation_fake_quant": None, "activation_qkwargs": {"dtype": fxq.qint8}},
            r"^activation_fake_quant=None asks for an int32 \(high-precision\) output, which has "
            r"no fake quant, so activation_qkwargs=.* cannot apply",
        ),
        (
            {"activation_observer": None},
            r"^activation_observer=None is only meaningful with activation_fake_quant=None",
        ),
        (
            {"weight_fake_quant": None},
            r"^weight_fake_quant=None \(float weights\) is not available: fxq weights are int8 on "
            r"every march\. To keep a layer in float, give it a qconfig of None",
        ),
    ],
)
def test_qconfig_forms_fxq_cannot_honour_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        get_default_qconfig(**kwargs)


def test_activation_fake_quant_none_is_an_int32_output(bayes):
    vendor = get_default_qconfig(activation_fake_quant=None, activation_observer=None)
    assert vendor.activation.dtype is fxq.qint32
    # the same qconfig as the high-precision one fxq always had
    old_form = get_default_qconfig(activation_qkwargs={"dtype": fxq.qint32})
    assert vendor.activation.keywords == old_form.activation.keywords
    assert vendor.weight.keywords == old_form.weight.keywords
    model = Model()
    data = [torch.randn(2, 3, 8, 8)]
    outputs = []
    for head in (vendor, old_form):
        prepared = calibrate(
            fxq.prepare_qat_fx(model, {"": q8, "module_name": {"head": head}}), data
        )
        converted = fxq.convert_fx(prepared)
        assert converted.head.high_precision
        with torch.no_grad():
            outputs.append(converted(data[0]))
    assert torch.equal(outputs[0], outputs[1])


def test_vendor_names_of_the_int32_output_qconfig():
    import fxq.qconfig as qconfig_module

    qat_out = qconfig_module.default_qat_8bit_weight_32bit_out_fake_quant_qconfig
    calib_out = qconfig_module.default_calib_8bit_weight_32bit_out_fake_quant_qconfig
    assert qat_out.activation.dtype is fxq.qint32 and calib_out.activation.dtype is fxq.qint32
    assert qconfig_module.default_qat_out_8bit_fake_quant_qconfig is qat_out  # earlier names
    assert qconfig_module.default_calib_out_8bit_fake_quant_qconfig is calib_out
    for name in (
        "default_qat_8bit_weight_32bit_out_fake_quant_qconfig",
        "default_calib_8bit_weight_32bit_out_fake_quant_qconfig",
        "default_qat_out_8bit_fake_quant_qconfig",
        "default_calib_out_8bit_fake_quant_qconfig",
        "default_qat_8bit_fixed_act_fake_quant_qconfig",
        "default_qat_8bit_weight_16bit_fixed_act_fake_quant_qconfig",
    ):
        assert name in qconfig_module.__all__


def test_averaging_constant_selects_the_moving_average_observer():
    frozen = get_default_qconfig(activation_qkwargs={"averaging_constant": 0})
    assert frozen.activation.keywords == {
        "observer": MovingAverageMinMaxObserver,
        "dtype": fxq.qint8,
        "averaging_constant": 0,
    }


def _activation_scales(model):
    return {
        name: fq.scale.clone()
        for name, fq in fake_quant_modules(model).items()
        if fq.ch_axis is None and not fq.is_high_precision
    }


def _qat_steps(qconfig, calibrated, net, steps=3):
    """Load ``calibrated``'s state into a QAT model built with ``qconfig`` and train it."""
    qat = fxq.prepare_qat_fx(net, {"": qconfig})
    qat.load_state_dict(calibrated.state_dict())
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.QAT)
    qat.train()
    start = (_activation_scales(qat), {n: p.detach().clone() for n, p in qat.named_parameters()})
    optimizer = torch.optim.SGD(qat.parameters(), lr=0.05)
    for _ in range(steps):
        loss = qat(2 * torch.randn(4, 3, 8, 8)).square().mean()  # a wider range than calibrated
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return qat, start


@pytest.mark.parametrize("frozen", ["qkwargs", "named"])
def test_averaging_constant_0_keeps_the_calibrated_activation_scales_in_qat(bayes, frozen):
    from fxq.qconfig import default_qat_8bit_fixed_act_fake_quant_qconfig

    data = [torch.randn(4, 3, 8, 8) for _ in range(2)]
    net = recalibrate_bn(ResidualNet(), data)  # train and eval mode see similar ranges
    calibrated = calibrate(
        fxq.prepare_qat_fx(net, {"": default_calib_8bit_fake_quant_qconfig}), data
    )
    calibrated_scales = _activation_scales(calibrated)
    qconfig = (
        get_default_qconfig(activation_qkwargs={"averaging_constant": 0})
        if frozen == "qkwargs"
        else default_qat_8bit_fixed_act_fake_quant_qconfig
    )
    qat, (scales, params) = _qat_steps(qconfig, calibrated, net)
    assert scales.keys() == calibrated_scales.keys() and len(scales) >= 5
    after = _activation_scales(qat)
    assert all(torch.equal(after[n], calibrated_scales[n]) for n in calibrated_scales)
    changed = [n for n, p in qat.named_parameters() if not torch.equal(p, params[n])]
    assert "conv1.weight" in changed and "fc.weight" in changed
    # the weights' scales follow the weights
    assert not torch.equal(qat.fc.weight_fake_quant.scale, calibrated.fc.weight_fake_quant.scale)
    # while the default QAT qconfig moves the activation scales on the same data
    moving, _ = _qat_steps(q8, calibrated, net)
    moved = _activation_scales(moving)
    assert any(not torch.equal(moved[n], calibrated_scales[n]) for n in calibrated_scales)


# -- module_type keys written as strings -------------------------------------------------
@pytest.mark.parametrize("key", ["Conv2d", "nn.Conv2d", "torch.nn.Conv2d"])
def test_module_type_class_name_strings_name_torch_nn_classes(bayes, key):
    model = Model()
    data = [torch.randn(2, 3, 8, 8)]
    by_name = calibrate(fxq.prepare_qat_fx(model, {"": q8, "module_type": {key: None}}), data)
    by_class = calibrate(
        fxq.prepare_qat_fx(model, {"": q8, "module_type": {nn.Conv2d: None}}), data
    )
    convs = [n for n, m in by_name.named_modules() if isinstance(m, nn.Conv2d)]
    assert convs == ["stem", "backbone.0.conv", "backbone.1.conv", "head"]
    assert all(type(by_name.get_submodule(n)) is nn.Conv2d for n in convs)  # every conv float
    kinds = {n: type(m) for n, m in by_name.named_modules() if n}  # "" is a GraphModule class
    assert kinds == {n: type(m) for n, m in by_class.named_modules() if n}
    for prepared in (by_name, by_class):
        fxq.set_fake_quantize(prepared, fxq.FakeQuantState.VALIDATION)
    with torch.no_grad():
        assert torch.equal(by_name(data[0]), by_class(data[0]))


@pytest.mark.parametrize("key", ["add", "add_", operator.add])
def test_module_type_op_name_strings_still_name_functional_ops(bayes, key):
    prepared = fxq.prepare_qat_fx(Model(), {"": q8, "module_type": [(key, None)]})
    kinds = {type(m) for m in prepared.modules()}
    assert qat.Add not in kinds and qat.Conv2d in kinds


@pytest.mark.parametrize(
    "key, hint",
    [
        ("Conv2D", r" Did you mean 'Conv2d', 'Conv3d', 'Conv1d'\?"),
        ("nn.Sigmod", r" Did you mean 'Sigmoid'"),
        (
            "Block",
            r"nothing\. The model has a module class named 'Block' \(tests\.test_qconfig\.Block\): "
            r"pass that class itself\. Use",
        ),
        ("catt", r" Did you mean 'cat'"),
    ],
)
def test_module_type_strings_that_name_nothing_are_refused(bayes, key, hint):
    with pytest.raises(ValueError) as caught:
        _resolver({"": q8, "object_type": {key: None}})
    message = str(caught.value)
    assert message.startswith(
        f"qconfig_dict['object_type']: the key {key!r} matches no torch.nn module class and no "
        "functional op, so it would configure nothing."
    )
    assert re.search(hint, message), message
    assert "Use the class or function itself (e.g. {torch.nn.Conv2d: qconfig}" in message


def test_a_regex_that_matches_no_module_warns(bayes):
    with pytest.warns(UserWarning) as record:
        _resolver({"": q8, "module_name_regex": [("conv", None), (r"neck\..*", None)]})
    assert [str(w.message) for w in record] == [
        "qconfig_dict['module_name_regex']: 'conv' matches no module of the model, so it "
        "selects nothing; it matches part of 'backbone.0.conv', and must match a whole name "
        "(e.g. '.*conv.*')",
        "qconfig_dict['module_name_regex']: 'neck\\\\..*' matches no module of the model, so it "
        "selects nothing",
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _resolver({"": q8, "module_name_regex": [(r"backbone\..*", None)]})
