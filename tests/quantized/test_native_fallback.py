"""Without a working C compiler fxq warns once, saying why and what to do, and the
integer model's results are those of the native kernels, bit for bit."""

import stat
import warnings

import pytest
import torch
from torch import nn

import fxq
from fxq.calibration import calibrate
from fxq.qconfig import get_default_qconfig
from fxq.quantized import native


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """A process that has not tried to build the kernels yet, with an empty cache."""
    monkeypatch.setattr(native, "_TRIED", False)
    monkeypatch.setattr(native, "_LIB", None)
    monkeypatch.setenv("FXQ_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FXQ_NATIVE", raising=False)
    return monkeypatch


def _fallback_warnings() -> list[str]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert native.available() is False
        assert native.available() is False  # tried once: no second warning
    return [str(w.message) for w in record]


def _integer_model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1)).eval()
    x = torch.randn(4, 3, 12, 12)
    prepared = fxq.prepare_qat_fx(model, {"": get_default_qconfig()}, example_inputs=(x[:1],))
    calibrate(prepared, [x], show_progress=False)
    fxq.set_fake_quantize(prepared, "validation")
    return fxq.convert_fx(prepared), x


def test_a_missing_compiler_warns_once_with_the_reason_and_results_stay_exact(bayes, fresh_build):
    integer, x = _integer_model()
    with torch.no_grad():
        assert native.available() is True  # this machine has a compiler
        expected = integer(x)
    fresh_build.setattr(native, "_TRIED", False)
    fresh_build.setattr(native, "_LIB", None)
    fresh_build.setenv("CC", "/nonexistent/cc")
    assert _fallback_warnings() == [
        native.fallback_message("the C compiler CC='/nonexistent/cc' was not found")
    ]
    with torch.no_grad():
        assert torch.equal(integer(x), expected)  # the torch path computes the same integers


def test_the_warning_says_how_to_fix_it():
    message = native.fallback_message("REASON")
    assert message == (
        "fxq: the native CPU kernels are not available, so integer models and QAT fake "
        "quants on the CPU run the torch path (same results, slower): REASON. To build them, install a C compiler with "
        "OpenMP (e.g. `apt install gcc`) or point CC at one; to use the torch path without "
        "this warning, set FXQ_NATIVE=0"
    )


def test_a_failing_compiler_is_quoted_by_its_first_error_line(fresh_build, tmp_path):
    cc = tmp_path / "badcc"
    cc.write_text(
        "#!/bin/sh\necho 'cc: note: something' >&2\n"
        "echo 'kernels.c:1:10: fatal error: omp.h: No such file or directory' >&2\n"
        "echo 'compilation terminated.' >&2\nexit 1\n"
    )
    cc.chmod(cc.stat().st_mode | stat.S_IXUSR)
    fresh_build.setenv("CC", str(cc))
    reason = f"{cc} failed: kernels.c:1:10: fatal error: omp.h: No such file or directory"
    assert _fallback_warnings() == [native.fallback_message(reason)]


def test_no_compiler_on_the_path(fresh_build, tmp_path):
    fresh_build.delenv("CC", raising=False)
    fresh_build.setenv("PATH", str(tmp_path))  # an empty directory: no cc, no gcc
    reason = "no C compiler was found (CC is not set; neither cc nor gcc is on PATH)"
    assert _fallback_warnings() == [native.fallback_message(reason)]


def test_fxq_native_0_chooses_the_torch_path_silently(fresh_build):
    fresh_build.setenv("FXQ_NATIVE", "0")
    fresh_build.setenv("CC", "/nonexistent/cc")
    assert _fallback_warnings() == []
