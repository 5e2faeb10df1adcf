"""``tutorials/torchvision_detection.py --fast``: torchvision detectors with integer heads."""

import importlib.util
import warnings

import pytest

from fxq.fx.prepare import FloatOpWarning
from tests.helpers import ROOT

pytest.importorskip("torchvision")
pytest.importorskip("skimage")


def _load_tutorial():
    path = ROOT / "tutorials" / "torchvision_detection.py"
    spec = importlib.util.spec_from_file_location("torchvision_detection", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_torchvision_detection_tutorial(capsys):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        warnings.simplefilter("error", FloatOpWarning)  # no op with a qconfig stays float
        warnings.filterwarnings("error", message=r".*stays float")  # every opaque layer ran
        results = _load_tutorial().main(["--fast"])
    # random weights: activations vanish in many layers, said in one summary per call
    # (it was one warning per layer: 182 of them)
    summaries = [str(w.message).split(" fake quants: ")[0] for w in record]
    assert [s.split(": ")[0] for s in summaries] == ["fxq.set_fake_quantize"] * 2, summaries
    assert all(int(s.split(": ")[1]) > 10 for s in summaries), summaries
    for name, parts in (
        ("fasterrcnn", ("backbone", "fpn", "rpn head", "box head", "box predictor")),
        ("ssdlite", ("backbone", "head")),
    ):
        r = results[name]
        assert set(r["layers"]) == set(parts)
        for part, share in r["layers"].items():
            integer, total = map(int, share.split("/"))
            assert total > 0 and integer == total, (name, part, share)
        assert r["boxes"] > 0
        assert r["identical"] is True  # integer detections == VALIDATION's, bit for bit
    out = capsys.readouterr().out
    assert "identical to QAT (VALIDATION): True" in out
