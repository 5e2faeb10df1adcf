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
    assert "accuracy on held-out digits" in capsys.readouterr().out
