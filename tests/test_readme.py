"""The README's set-up is what CI runs, and its example names exist."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_commands():
    script = (ROOT / ".ci" / "run").read_text()
    assert (
        'block_after "<!-- ci:setup -->"' in script and 'block_after "<!-- ci:test -->"' in script
    )
    readme = (ROOT / "README.md").read_text()
    out = subprocess.run(
        [
            "bash",
            "-c",
            f"source <(sed -n '/^block_after()/,/^}}/p' {ROOT / '.ci' / 'run'}); cd {ROOT}; block_after '<!-- ci:setup -->'; block_after '<!-- ci:test -->'",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert len(out) == 2
    setup, tests = out
    assert setup in readme and tests in readme
    assert "python3 -m venv .venv" in setup and "pip install -c constraints.txt" in setup
    assert tests.endswith("python -m pytest -q -n auto --maxprocesses=4")


def test_constraints_pin_torch_and_torchvision():
    pins = dict(
        line.split("==") for line in (ROOT / "constraints.txt").read_text().split() if "==" in line
    )
    assert pins["torch"] == "2.14.1" and pins["torchvision"] == "0.29.1"


def test_a_users_day_calibrates_with_ptq():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## A user's day", 1)[1].split("```")[1]
    assert "from fxq.calibration import ptq\n" in block
    assert "\nptq(calib, loader, num_batches=20)" in block
    assert "calibrate(" not in block


def test_the_cpu_only_install_pins_what_constraints_pin():
    readme = (ROOT / "README.md").read_text()
    (line,) = [x for x in readme.splitlines() if "download.pytorch.org/whl/cpu" in x]
    pins = dict(x.split("==") for x in (ROOT / "constraints.txt").read_text().split() if "==" in x)
    assert line.endswith(
        "pip install --index-url https://download.pytorch.org/whl/cpu "
        f"torch=={pins['torch']} torchvision=={pins['torchvision']}"
    )
    # a paragraph of its own, not one of the commands CI runs
    assert readme.index(line) > readme.index("<!-- ci:test -->")


def test_readme_python_names_exist():
    import fxq

    readme = (ROOT / "README.md").read_text()
    for name in set(re.findall(r"fxq\.([a-zA-Z_]+)\(", readme)):
        assert hasattr(fxq, name), name
