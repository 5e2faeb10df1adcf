"""Every tutorial runs with small settings and prints sane results."""

import importlib.util
from pathlib import Path

import fxq

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, TUTORIALS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart(capsys):
    results = _load("quickstart").main(["--fast"])
    assert fxq.get_march() is fxq.March.BAYES
    assert results["float"] > 95.0
    assert results["calibrated"] >= results["float"] - 1.5
    assert results["qat"] >= results["float"] - 1.0
    assert results["integer"] == results["qat"]  # VALIDATION is the integer computation
    assert "accuracy on held-out digits" in capsys.readouterr().out


def test_yuv_deployment(capsys):
    results = _load("yuv_deployment").main(["--fast"])
    assert results["float (RGB) accuracy"] > 70.0
    assert results["integer (YUV) accuracy"] >= results["float (RGB) accuracy"] - 5.0
    # the integer model on the camera's YUV predicts what the QAT model predicts on RGB
    assert results["integer (YUV) = QAT (RGB)"] >= 95.0
    assert "inserted centered_yuv2rgb(swing='full') after 'quant'" in capsys.readouterr().out


def test_fx_wrap_detection(capsys):
    results = _load("fx_wrap_detection").main(["--fast"])
    # measured with --fast: float AP50 95.4-96.2 over seeds 0-3, QAT within 0.5 of float
    assert results["float"] > 88.0
    assert results["qat"] >= results["float"] - 3.0
    assert results["integer"] == results["qat"]  # VALIDATION is the integer computation
    assert results["integer = qat"] == 100.0  # same boxes, scores and labels on every image
    out = capsys.readouterr().out
    assert "wrapped methods, one graph node each: ['anchors', 'postprocess']" in out
