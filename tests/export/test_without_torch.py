"""A saved integer graph runs where torch is not installed: ``python -m fxq.export.run``
imports numpy and the standard library only (``fxq`` and ``fxq.export`` skip their torch
parts when torch cannot be found)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import torch
from torch import nn

import fxq
import fxq.export
from tests.helpers import ROOT

#: runs in a fresh interpreter in which ``import torch`` fails as if torch were not installed
_NO_TORCH = "import sys\nsys.modules['torch'] = None\n"


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _NO_TORCH + textwrap.dedent(code), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_run_entry_point_without_torch(bayes, tmp_path):
    model = nn.Sequential(fxq.QuantStub(), nn.Conv2d(3, 4, 3), nn.ReLU(), fxq.DeQuantStub())
    qat = fxq.prepare_qat_fx(model.eval(), {"": fxq.qconfig.default_qat_8bit_fake_quant_qconfig})
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    qat(torch.randn(2, 3, 8, 8))
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
    integer = fxq.convert_fx(qat)
    x = torch.randn(3, 3, 8, 8)
    fxq.export.to_graph(integer, x).save(tmp_path / "g.fxq")
    np.save(tmp_path / "x.npy", x.numpy())

    done = _python(
        """
        import runpy
        sys.argv = ["fxq.export.run", *sys.argv[1:]]
        try:
            runpy.run_module("fxq.export.run", run_name="__main__")
        finally:
            loaded = [m for m in sys.modules if m.split(".")[0] == "torch" and sys.modules[m]]
            assert not loaded, loaded
        """,
        str(tmp_path / "g.fxq"),
        str(tmp_path / "x.npy"),
        "-o",
        str(tmp_path / "out"),
    )
    assert done.returncode == 0, done.stderr
    assert "output 0" in done.stdout
    with torch.no_grad():
        expected = integer(x).numpy()
    assert np.array_equal(np.load(tmp_path / "out0.npy"), expected)


def test_fxq_without_torch_says_what_it_can_do():
    done = _python(
        """
        import fxq
        from fxq.export import IntegerGraph, load
        try:
            fxq.prepare_qat_fx
        except ImportError as e:
            print(e)
        """
    )
    assert done.returncode == 0, done.stderr
    assert "needs torch" in done.stdout and "fxq.export.run" in done.stdout
