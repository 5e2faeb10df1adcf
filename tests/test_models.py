"""Every torchvision model the foundation issue lists, on real photos: prepare,
calibrate, VALIDATION forward, convert (bit-exact with VALIDATION), one QAT step."""

import pytest
import torch
import torchvision
from torch import nn

import fxq
from fxq.qat import QATModule
from fxq.qconfig import default_qat_8bit_fake_quant_qconfig as q8
from fxq.utils.sample_data import photo_crops
from tests.helpers import calibrate, recalibrate_bn, sqnr

MODELS = {
    # name: minimum integer-vs-float SQNR (dB) after min/max calibration (random init,
    # BatchNorm statistics from the photos; measured values minus about 3 dB: a
    # regression guard, not an accuracy claim: random weights accumulate 8-bit noise
    # layer after layer; tests/test_accuracy.py measures a pretrained model)
    "resnet18": 20.5,
    "resnet50": 10.0,
    "mobilenet_v2": 7.5,
    "mobilenet_v3_large": 6.0,
    "shufflenet_v2_x1_0": 7.5,
    "efficientnet_b0": 0.5,
    "regnet_x_400mf": 8.5,
    "squeezenet1_1": 31.0,
    "densenet121": 16.0,
    "googlenet": 9.5,
    "mnasnet1_0": 4.0,
    "resnext50_32x4d": 9.5,
}


def _logits(out):
    return out if torch.is_tensor(out) else out[0]


@pytest.mark.parametrize("name", list(MODELS))
def test_torchvision_model(bayes, name):
    torch.manual_seed(0)
    kwargs = {"aux_logits": False, "init_weights": False} if name == "googlenet" else {}
    model = getattr(torchvision.models, name)(num_classes=10, **kwargs)
    photos = photo_crops(16, size=112, seed=0)
    data = list(photos[:12].split(4))
    recalibrate_bn(model, data)  # random init: give BatchNorm real statistics

    prepared = fxq.prepare_qat_fx(model, {"": q8})
    graph_bns = [
        n
        for n in prepared.graph.nodes
        if n.op == "call_module"
        and isinstance(prepared.get_submodule(n.target), nn.modules.batchnorm._BatchNorm)
    ]
    assert graph_bns == [], "every BatchNorm after a conv is folded into it"

    # calibration computes the float model exactly (no rounding)
    calibrate(prepared, data)
    x = photos[12:]  # held out from calibration
    with torch.no_grad():
        ref = _logits(model.eval()(x))
        cal = _logits(prepared(x))
        assert torch.allclose(cal, ref, rtol=1e-3, atol=1e-3 * ref.abs().max().item())
        fxq.set_fake_quantize(prepared, "validation")
        out = _logits(prepared(x))
        converted = fxq.convert_fx(prepared)
        integer = _logits(converted(x))
    assert torch.isfinite(out).all()
    # the integer model computes exactly what the QAT model computes in VALIDATION
    assert torch.equal(integer, out)
    assert sqnr(ref, integer) > MODELS[name]

    # one QAT step: gradients reach every weight, BatchNorm statistics move
    fxq.set_fake_quantize(prepared, "qat")
    prepared.train()
    bns = [
        m.bn
        for m in prepared.modules()
        if isinstance(m, QATModule) and getattr(m, "bn", None) is not None
    ]
    before = [bn.running_mean.clone() for bn in bns]
    opt = torch.optim.SGD(prepared.parameters(), lr=0.01)
    loss = nn.functional.cross_entropy(_logits(prepared(x)), torch.randint(0, 10, (4,)))
    loss.backward()
    weights = [
        m.weight for m in prepared.modules() if isinstance(m, QATModule) and hasattr(m, "weight")
    ]
    assert weights and all(w.grad is not None and torch.isfinite(w.grad).all() for w in weights)
    opt.step()
    assert all(not torch.equal(bn.running_mean, b) for bn, b in zip(bns, before))
    assert (len(bns) > 0) == (name != "squeezenet1_1")
