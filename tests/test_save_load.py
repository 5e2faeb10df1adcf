"""Saving and loading every kind of model, as docs/guide.md ("Saving and loading") says.

Models are saved here and loaded in a new Python process, as a later program
would load them; outputs must be equal (``torch.equal``) before and after.
"""

from __future__ import annotations

import inspect
import json
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

import fxq
from fxq.calibration import calibrate
from fxq.qconfig import default_calib_8bit_fake_quant_qconfig as calib_q8
from fxq.qconfig import default_qat_8bit_fake_quant_qconfig as q8
from tests.helpers import ResidualNet, TinyRetinaNet, run_in_fresh_process

# TinyRetinaNet's @fx_wrap post-process stays float on purpose
pytestmark = pytest.mark.filterwarnings("ignore::fxq.FloatOpWarning")

KINDS = ("float", "calibrated", "qat", "integer")
IMAGE = (2, 3, 32, 32)


def same(a, b) -> bool:
    """Exact equality of nested outputs: dicts, lists, tuples, tensors and numbers."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def _every_kind(net: nn.Module) -> dict[str, nn.Module]:
    """The float model, a calibrated model, a QAT model after a few steps, and the integer model."""
    data = [torch.randn(IMAGE) for _ in range(2)]
    calibrated = calibrate(fxq.prepare_qat_fx(net, {"": calib_q8}), data)
    qat = fxq.prepare_qat_fx(net, {"": q8})
    qat.load_state_dict(calibrated.state_dict())
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.QAT)
    qat.train()
    optimizer = torch.optim.SGD(qat.parameters(), lr=0.01)
    for x in data:
        out = qat(x)
        loss = sum(t.square().mean() for t in out["cls"] + out["box"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for prepared in (calibrated, qat):
        fxq.set_fake_quantize(prepared, fxq.FakeQuantState.VALIDATION)
        prepared.eval()
    integer = fxq.convert_fx(qat)
    return {"float": net.eval(), "calibrated": calibrated, "qat": qat, "integer": integer}


def _outputs(models: dict[str, nn.Module], x: torch.Tensor) -> dict[str, object]:
    with torch.no_grad():
        return {kind: model(x) for kind, model in models.items()}


def test_state_dicts_load_with_weights_only_into_rebuilt_models(bayes, tmp_path: Path):
    models = _every_kind(TinyRetinaNet())
    x = torch.randn(IMAGE)
    expected = _outputs(models, x)
    assert not same(expected["calibrated"], expected["float"])  # the comparisons can fail
    assert not same(expected["qat"], expected["calibrated"])  # QAT trained the weights
    for kind, model in models.items():
        torch.save(model.state_dict(), tmp_path / f"{kind}.pt")
    torch.save({"x": x, **expected}, tmp_path / "expected.pt")
    code = f"""
        import json
        import torch
        import fxq
        from fxq.calibration import calibrate
        from fxq.qconfig import default_calib_8bit_fake_quant_qconfig as calib_q8
        from fxq.qconfig import default_qat_8bit_fake_quant_qconfig as q8
        from tests.helpers import TinyRetinaNet

        {inspect.getsource(same).replace(chr(10), chr(10) + " " * 8)}
        def load(name):
            return torch.load({str(tmp_path)!r} + "/" + name + ".pt", weights_only=True)

        fxq.set_march("bayes")
        expected = load("expected")
        x = expected["x"]
        results = {{}}

        model = TinyRetinaNet()
        with torch.no_grad():
            results["float, before loading"] = same(model.eval()(x), expected["float"])
        model.load_state_dict(load("float"))

        calib = fxq.prepare_qat_fx(TinyRetinaNet(), {{"": calib_q8}})
        calib.load_state_dict(load("calibrated"))

        qat = fxq.prepare_qat_fx(TinyRetinaNet(), {{"": q8}})
        qat.load_state_dict(load("qat"))
        results["qat, state after loading is QAT"] = all(
            fq.state is fxq.FakeQuantState.QAT
            for fq in qat.modules() if isinstance(fq, fxq.FakeQuantize)
        )
        for prepared in (calib, qat):
            fxq.set_fake_quantize(prepared, fxq.FakeQuantState.VALIDATION)
        integer = fxq.convert_fx(qat)

        other = fxq.prepare_qat_fx(TinyRetinaNet(), {{"": q8}})
        calibrate(other, [torch.randn(2, 3, 32, 32)])
        integer_from_its_own_state = fxq.convert_fx(other)
        with torch.no_grad():
            results["integer, before loading"] = same(
                integer_from_its_own_state(x), expected["integer"]
            )
        integer_from_its_own_state.load_state_dict(load("integer"))

        with torch.no_grad():
            for name, m, kind in [
                ("float", model, "float"),
                ("calibrated", calib, "calibrated"),
                ("qat", qat, "qat"),
                ("integer converted from the QAT state_dict", integer, "integer"),
                ("integer loaded from its own state_dict", integer_from_its_own_state, "integer"),
            ]:
                results[name] = same(m.eval()(x), expected[kind])
        print(json.dumps(results))
        """
    assert json.loads(run_in_fresh_process(code)) == {
        "float, before loading": False,
        "qat, state after loading is QAT": True,
        "integer, before loading": False,
        "float": True,
        "calibrated": True,
        "qat": True,
        "integer converted from the QAT state_dict": True,
        "integer loaded from its own state_dict": True,
    }


def test_whole_model_pickles_need_weights_only_false_and_the_models_code(bayes, tmp_path: Path):
    models = _every_kind(TinyRetinaNet())
    plain = _every_kind_plain()
    x = torch.randn(IMAGE)
    expected = _outputs(models, x)
    for kind, model in {**models, **plain}.items():
        torch.save(model, tmp_path / f"{kind}.pkl")
        for refused in ({"weights_only": True}, {}):  # explicitly, and torch's default
            with pytest.raises(pickle.UnpicklingError):
                torch.load(tmp_path / f"{kind}.pkl", **refused)
    torch.save({"x": x, **expected}, tmp_path / "expected.pt")
    code = f"""
        import json
        import sys
        import torch

        {inspect.getsource(same).replace(chr(10), chr(10) + " " * 8)}
        def load(name):
            return torch.load({str(tmp_path)!r} + "/" + name + ".pkl", weights_only=False)

        sys.modules["tests.helpers"] = None  # the models' own code cannot be imported
        without_code = {{}}
        for name in {[*KINDS, *plain]!r}:
            try:
                load(name)
                without_code[name] = "loaded"
            except ModuleNotFoundError:
                without_code[name] = "ModuleNotFoundError"
        del sys.modules["tests.helpers"]

        import fxq

        expected = torch.load({str(tmp_path / "expected.pt")!r}, weights_only=True)
        loaded = {{kind: load(kind) for kind in {list(KINDS)!r}}}
        with torch.no_grad():
            equal = {{kind: same(m(expected["x"]), expected[kind]) for kind, m in loaded.items()}}
        kept = all(
            fq.state is fxq.FakeQuantState.VALIDATION and not fq.training
            for fq in loaded["qat"].modules() if isinstance(fq, fxq.FakeQuantize)
        )
        print(json.dumps({{"without code": without_code, "equal": equal, "state kept": kept}}))
        """
    assert json.loads(run_in_fresh_process(code)) == {
        "without code": {
            "float": "ModuleNotFoundError",  # the float model's class
            "calibrated": "ModuleNotFoundError",  # TinyRetinaNet has @fx_wrap methods
            "qat": "ModuleNotFoundError",
            "integer": "ModuleNotFoundError",
            "plain qat": "loaded",  # torch.nn modules and functional ops only: fxq suffices
            "plain integer": "loaded",
        },
        "equal": dict.fromkeys(KINDS, True),
        "state kept": True,
    }


def _every_kind_plain() -> dict[str, nn.Module]:
    """A prepared and an integer model of a model made of torch.nn modules and functions only."""
    qat = calibrate(fxq.prepare_qat_fx(ResidualNet(), {"": q8}), [torch.randn(IMAGE)])
    return {"plain qat": qat, "plain integer": fxq.convert_fx(qat)}
