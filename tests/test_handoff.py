"""The hand-offs between stages carry everything through ``state_dict``.

A model calibrated by each documented recipe (``calibrate``, ``ptq`` with learned rounding,
``ptq(method="calibrate")`` with its bias correction, a ``mixed_precision`` choice) is saved
as a state dict and loaded in a new Python process into a model freshly prepared with the
QAT qconfig, as the README's flow does. In VALIDATION it must equal the calibrated model bit
for bit, and so must the integer models converted from both. The recipes change more than
tensors (outputs widened to int32, biases added to bias-free layers, int16 activations);
before those travelled with the state dict, the loaded model differed by up to half an
output step, or the load failed on unexpected keys.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import fxq
from fxq.calibration import calibrate, ptq
from fxq.calibration.mixed_precision import mixed_precision
from fxq.qconfig import default_calib_8bit_fake_quant_qconfig as calib_q8
from fxq.qconfig import default_qat_8bit_fake_quant_qconfig as q8
from tests.helpers import HandoffNet, run_in_fresh_process

IMAGE = (4, 3, 16, 16)


def _recipes(net: nn.Module, data: list[torch.Tensor], march: str) -> dict[str, nn.Module]:
    recipes = {
        "calibrate": calibrate(fxq.prepare_qat_fx(net, {"": calib_q8}), data),
        "ptq": ptq(fxq.prepare_qat_fx(net, {"": calib_q8}), data, iters=2),
        "ptq calibrate": ptq(fxq.prepare_qat_fx(net, {"": calib_q8}), data, method="calibrate"),
    }
    if march == "bayes":  # the march with int16 activations
        chosen = mixed_precision(net, recipes["ptq"], data, int16_budget=0.5)
        recipes["mixed precision"] = ptq(fxq.prepare_qat_fx(net, chosen), data, iters=2)
    return recipes


def _what_the_recipe_changed(model: nn.Module) -> set[str]:
    changed = set()
    for m in model.modules():
        if isinstance(m, fxq.FakeQuantize) and m.dtype is not fxq.qint8 and m.ch_axis is None:
            changed.add(m.dtype.name)
        if isinstance(m, fxq.FakeQuantize) and m.offset:
            changed.add("offset")
        if (
            isinstance(m, nn.Module)
            and getattr(m, "bias", False) is not None
            and hasattr(m, "weight_fake_quant")
            and getattr(m, "bn", None) is None
        ):
            changed.add("bias")
    return changed


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_each_recipe_hands_off_to_a_fresh_qat_model_in_a_new_process(march, tmp_path: Path):
    fxq.set_march(march)
    net = HandoffNet().eval()
    data = [torch.randn(IMAGE) for _ in range(3)]
    x = torch.randn(IMAGE)
    expected, changes = {}, {}
    for name, calib in _recipes(net, data, march).items():
        changes[name] = sorted(_what_the_recipe_changed(calib))
        fxq.set_fake_quantize(calib, fxq.FakeQuantState.VALIDATION)
        with torch.no_grad():
            expected[name] = (calib.eval()(x), fxq.convert_fx(calib)(x))
        torch.save(calib.state_dict(), tmp_path / f"{name}.pt")
    # the recipes change what the README's flow used to lose
    assert "qint32" in changes["ptq"] and "bias" in changes["ptq calibrate"]
    assert changes["calibrate"] == []
    if march == "bayes":
        assert "qint16" in changes["mixed precision"]
    torch.save({"net": net.state_dict(), "x": x, "expected": expected}, tmp_path / "expected.pt")
    code = f"""
        import json
        import torch
        import fxq
        from fxq.qconfig import default_qat_8bit_fake_quant_qconfig as q8
        from tests.helpers import HandoffNet

        fxq.set_march({march!r})
        saved = torch.load({str(tmp_path / "expected.pt")!r}, weights_only=True)
        net = HandoffNet()
        net.load_state_dict(saved["net"])
        results = {{}}
        for name, (validation, integer) in saved["expected"].items():
            qat = fxq.prepare_qat_fx(net, {{"": q8}})
            state = torch.load({str(tmp_path)!r} + "/" + name + ".pt", weights_only=True)
            qat.load_state_dict(state)  # strict: every key matches
            fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
            with torch.no_grad():
                results[name] = [
                    torch.equal(qat.eval()(saved["x"]), validation),
                    torch.equal(fxq.convert_fx(qat)(saved["x"]), integer),
                ]
        print(json.dumps(results))
        """
    results = json.loads(run_in_fresh_process(code))
    assert results == {name: [True, True] for name in expected}


def test_a_qat_checkpoint_resumes_with_its_frozen_batchnorms(bayes, tmp_path: Path):
    """``freeze_bn_stats`` changes what a training step computes: it travels with the state."""
    net = HandoffNet().eval()
    data = [torch.randn(IMAGE) for _ in range(2)]
    qat = fxq.prepare_qat_fx(net, {"": q8})
    qat.load_state_dict(ptq(fxq.prepare_qat_fx(net, {"": calib_q8}), data, iters=0).state_dict())
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.QAT)
    fxq.qat.freeze_bn_stats(qat.train())
    torch.save(qat.state_dict(), tmp_path / "qat.pt")
    x = torch.randn(IMAGE)
    with torch.no_grad():
        step = qat(x)  # training mode, BatchNorms frozen: running statistics folded
    torch.save({"net": net.state_dict(), "x": x, "step": step}, tmp_path / "expected.pt")
    code = f"""
        import torch
        import fxq
        from fxq.qconfig import default_qat_8bit_fake_quant_qconfig as q8
        from tests.helpers import HandoffNet

        fxq.set_march("bayes")
        saved = torch.load({str(tmp_path / "expected.pt")!r}, weights_only=True)
        net = HandoffNet()
        net.load_state_dict(saved["net"])
        qat = fxq.prepare_qat_fx(net, {{"": q8}}).train()
        qat.load_state_dict(torch.load({str(tmp_path / "qat.pt")!r}, weights_only=True))
        with torch.no_grad():
            print(torch.equal(qat(saved["x"]), saved["step"]))
        """
    assert run_in_fresh_process(code) == "True"


def test_a_dtype_the_march_cannot_run_fails_the_load_naming_the_fake_quant(bayes):
    net = HandoffNet().eval()
    data = [torch.randn(IMAGE)]
    int16 = fxq.qconfig.default_calib_8bit_weight_16bit_act_fake_quant_qconfig
    state = calibrate(fxq.prepare_qat_fx(net, {"": int16}), data).state_dict()
    fxq.set_march("bernoulli2")
    fresh = fxq.prepare_qat_fx(net, {"": q8})
    with pytest.raises(
        RuntimeError,
        match=r"stem\.activation_post_process\.bits: the saved dtype qint16 is not available on "
        r"march bernoulli2 \(it runs: qint8\); load with the march it was saved with",
    ):
        fresh.load_state_dict(state)


def _as_it_is(model: nn.Module, x: torch.Tensor) -> tuple:
    """What a failed load must not change: every state-dict entry, each fake quant's dtype,
    offset and scale, each parameter's identity, and the model's output."""
    with torch.no_grad():
        out = model(x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grids = [
        (n, m.dtype, m.offset, m.scale)
        for n, m in model.named_modules()
        if isinstance(m, fxq.FakeQuantize)
    ]
    return state, grids, [id(p) for p in model.parameters()], out


def _assert_as_it_was(model: nn.Module, x: torch.Tensor, before: tuple) -> None:
    state, grids, params, out = _as_it_is(model, x)
    assert state.keys() == before[0].keys()
    assert all(torch.equal(state[k], before[0][k]) for k in state)
    assert [g[:3] for g in grids] == [g[:3] for g in before[1]]
    assert all(a[3] is b[3] for a, b in zip(grids, before[1]))  # the same scale tensors
    assert params == before[2] and torch.equal(out, before[3])


def test_a_failed_load_leaves_the_model_as_it_was(bayes):
    """torch copies a state dict's tensors as it goes and raises at the end, and fxq's fake
    quants adopt a saved dtype while they load: a load that fails puts everything back."""
    torch.manual_seed(0)
    net = HandoffNet().eval()
    data = [torch.randn(IMAGE)]
    x = torch.randn(IMAGE)
    int16 = fxq.qconfig.default_calib_8bit_weight_16bit_act_fake_quant_qconfig
    # the stem's output in int16 (adopted by the load) and the fc in float (unexpected keys)
    saved = calibrate(
        fxq.prepare_qat_fx(net, {"": calib_q8, "module_name": [("stem", int16), ("fc", None)]}),
        data,
    ).state_dict()
    saved = {k: v for k, v in saved.items() if not k.startswith("fc.")}
    saved.update({f"fc.extra{i}": torch.zeros(1) for i in range(2)})
    saved["stem.weight"] = saved["stem.weight"] + 1  # copied before the failure
    model = calibrate(fxq.prepare_qat_fx(net, {"": calib_q8}), data)
    fxq.set_fake_quantize(model, fxq.FakeQuantState.VALIDATION)
    before = _as_it_is(model, x)
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: \"fc.extra0"):
        model.load_state_dict(saved)
    _assert_as_it_was(model, x, before)
    # with assign=True torch puts the state dict's tensors in place of the model's
    with pytest.raises(RuntimeError, match="Unexpected key"):
        model.load_state_dict(saved, assign=True)
    _assert_as_it_was(model, x, before)
    # a shape that differs: an error torch records as it goes
    wrong = dict(model.state_dict(), **{"fc.weight": torch.zeros(5, 9)})
    wrong["stem.weight"] = wrong["stem.weight"] + 1
    with pytest.raises(RuntimeError, match="size mismatch for fc.weight"):
        model.load_state_dict(wrong)
    _assert_as_it_was(model, x, before)
    # not strict: the unexpected keys are ignored and the rest loads, as torch's
    model.load_state_dict(saved, strict=False)
    assert model.stem.activation_post_process.dtype is fxq.qint16
    assert torch.equal(model.stem.weight, saved["stem.weight"])


def test_a_load_a_later_post_hook_forgives_stays_and_a_non_tensor_fails_cleanly(bayes):
    torch.manual_seed(0)
    net = HandoffNet().eval()
    model = calibrate(fxq.prepare_qat_fx(net, {"": calib_q8}), [torch.randn(IMAGE)])
    x = torch.randn(IMAGE)
    fxq.set_fake_quantize(model, fxq.FakeQuantState.VALIDATION)
    before = _as_it_is(model, x)
    # a value that is not a tensor: torch records the error, the model is put back, and
    # nothing of the load is left on the model
    saved = dict(model.state_dict())
    saved["stem.weight"] = saved["stem.weight"] + 1
    saved["fc.weight_fake_quant.scale"] = 0.5
    with pytest.raises(RuntimeError, match="fc.weight_fake_quant.scale"):
        model.load_state_dict(saved)
    _assert_as_it_was(model, x, before)
    assert "_fxq_load_kept" not in model.__dict__

    # a post hook registered after fxq's that forgives the fake quants' missing keys: the
    # load succeeds and stays (fxq's restore decides after every other hook)
    def forgive(module, incompatible):
        incompatible.missing_keys.clear()

    model.register_load_state_dict_post_hook(forgive)
    weights = {k: model.state_dict()[k] + 1 for k in ("stem.weight", "fc.weight")}
    model.load_state_dict(weights)  # strict: every other key is missing, then forgiven
    assert torch.equal(model.stem.weight, weights["stem.weight"])


def test_a_failed_load_of_an_integer_or_copied_model_leaves_it_as_it_was(bayes):
    torch.manual_seed(0)
    net = HandoffNet().eval()
    qat = calibrate(fxq.prepare_qat_fx(net, {"": calib_q8}), [torch.randn(IMAGE)])
    fxq.set_march("bernoulli2")  # power-of-two scales
    other = calibrate(fxq.prepare_qat_fx(net, {"": calib_q8}), [torch.randn(IMAGE)])
    other = copy.deepcopy(other)  # the hooks are copied
    x = torch.randn(IMAGE)
    fxq.set_fake_quantize(other, fxq.FakeQuantState.VALIDATION)
    before = _as_it_is(other, x)
    # a bayes state dict's scales are not powers of two: refused, naming them
    with pytest.raises(
        RuntimeError,
        match=r"stem\.weight_fake_quant\.scale: 8 of 8 saved scales \(e\.g\. [0-9.e-]+\) are not "
        r"powers of two, which march bernoulli2 requires; load with the march it was saved with",
    ):
        other.load_state_dict(qat.state_dict())
    _assert_as_it_was(other, x, before)
    integer = fxq.convert_fx(other)
    with torch.no_grad():
        out = integer(x)
    state = {k: v.clone() for k, v in integer.state_dict().items()}
    wrong = dict(state, **{"fc.weight": torch.zeros(2, 2, dtype=state["fc.weight"].dtype)})
    wrong["stem.weight"] = wrong["stem.weight"] + 1
    with pytest.raises(RuntimeError, match="size mismatch for fc.weight"):
        integer.load_state_dict(wrong)
    assert all(torch.equal(v, state[k]) for k, v in integer.state_dict().items())
    with torch.no_grad():
        assert torch.equal(integer(x), out)


def test_a_state_dict_without_dtypes_keeps_the_qconfigs(bayes):
    """State dicts saved before the dtype was saved (no ``bits`` keys) still load."""
    net = HandoffNet().eval()
    calib = calibrate(fxq.prepare_qat_fx(net, {"": calib_q8}), [torch.randn(IMAGE)])
    state = {k: v for k, v in calib.state_dict().items() if not k.endswith(".bits")}
    fresh = fxq.prepare_qat_fx(net, {"": q8})
    fresh.load_state_dict(state)
    assert {m.dtype for m in fresh.modules() if isinstance(m, fxq.FakeQuantize)} == {fxq.qint8}
