"""tutorials/debug_accuracy.py --fast: the tools' report, acted on, improves the SQNR."""

import importlib.util
from pathlib import Path

from tests.debug.test_similarity import parse_html

TUTORIAL = Path(__file__).resolve().parents[2] / "tutorials" / "debug_accuracy.py"


def test_debug_accuracy_tutorial(capsys, tmp_path):
    spec = importlib.util.spec_from_file_location("debug_accuracy", TUTORIAL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out_dir = tmp_path / "reports" / "run1"  # --out creates the folder
    results = module.main(["--fast", "--out", str(out_dir)])
    # measured with --fast: 12.51 dB -> 16.48 dB, top-1 agreement 68.8% -> 81.2%
    # (int16 for the six activations that hurt most alone)
    assert results["sqnr before"] > 9.0
    assert results["sqnr after"] > results["sqnr before"] + 2.5
    assert results["agreement after"] >= results["agreement before"]
    assert len(results["int16 layers"]) == 6
    out = capsys.readouterr().out
    assert "logit SQNR against float:  before" in out
    for page in ("similarity/similarity.html", "sensitivity/sensitivity.html"):
        assert parse_html(out_dir / page).svgs == 1
