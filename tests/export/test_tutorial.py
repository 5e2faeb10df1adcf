"""tutorials/export.py runs with --fast, and every export agrees with the integer model."""

import importlib.util
from pathlib import Path

TUTORIAL = Path(__file__).resolve().parents[2] / "tutorials" / "export.py"


def test_export_tutorial(capsys, tmp_path):
    spec = importlib.util.spec_from_file_location("export_tutorial", TUTORIAL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out_dir = tmp_path / "new" / "nested"  # --out creates the folder
    results = module.main(["--fast", "--out", str(out_dir)])
    assert results["integer accuracy"] > 90.0
    assert results["integer graph (numpy) exact"] is True
    assert results["integer ONNX (onnxruntime) exact"] is True
    assert results["QDQ ONNX (onnxruntime) max LSB"] <= 8.0
    assert results["QDQ ONNX (onnxruntime) same class"] >= 97.0
    out = capsys.readouterr().out
    assert "IntegerGraph (march bayes" in out and "bit-exact" in out
    assert {p.name for p in out_dir.iterdir()} == {"digits.fxq", "digits.onnx", "digits_qdq.onnx"}
