"""What the package declares is true: its pins, its version bounds, its licence, and an
``import fxq`` that loads no optional package."""

import importlib.metadata
import re
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
OPTIONAL = ("torchvision", "timm", "transformers", "onnx", "onnxruntime", "onnxscript", "scipy")
OPTIONAL += ("matplotlib", "sklearn", "skimage", "nncf", "torchao")


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower()


def _pins() -> dict[str, str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    pins = [line.split("==") for line in lines if line.strip() and not line.startswith("#")]
    return {name.strip().lower(): version.strip() for name, version in pins}


def test_import_fxq_loads_no_optional_package():
    code = f"import sys, fxq; print(sorted(m for m in {OPTIONAL!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"


def test_torchvision_rows_arrive_with_torchvision():
    code = (
        "import sys, fxq\n"
        "from fxq import registry\n"
        "before = [r.name for r in registry.rows() if r.name == 'stochastic_depth']\n"
        "import torchvision\n"
        "row = registry.row_for_module(torchvision.ops.StochasticDepth)\n"
        "fn = registry.row_for_function(torchvision.ops.stochastic_depth)\n"
        "print(before, row.name, row.kind.value, fn.name)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.split() == ["[]", "stochastic_depth", "passthrough", "stochastic_depth"]


def test_registry_rows_list_the_optional_packages_rows():
    pytest.importorskip("torchvision")
    code = "from fxq import registry; print('stochastic_depth' in [r.name for r in registry.ROWS])"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "True"


def test_constraints_pin_every_package_pyproject_names_at_the_installed_version():
    named = {_name(r) for r in PYPROJECT["dependencies"]}
    for extra, requirements in PYPROJECT["optional-dependencies"].items():
        if extra != "bench":  # the peers benchmarks/ptq_accuracy.py measures: not pinned
            named |= {_name(r) for r in requirements}
    pins = _pins()
    assert named - set(pins) == set()
    assert pins["torch"] == "2.14.1" and pins["torchvision"] == "0.29.1"
    for name, version in pins.items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # e.g. triton off Linux x86-64
        assert installed.split("+")[0] == version, name  # 2.14.1+cpu is torch 2.14.1


def test_torch_lower_bound_covers_the_apis_fxq_calls():
    (torch_requirement,) = [r for r in PYPROJECT["dependencies"] if _name(r) == "torch"]
    assert torch_requirement == "torch>=2.7"  # torch.compiler.is_exporting is new in 2.7
    assert callable(torch.compiler.is_exporting) and callable(torch.library.custom_op)


def test_the_licence_file_is_the_licence_pyproject_names():
    assert PYPROJECT["license"] == "Apache-2.0"
    assert PYPROJECT["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
