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
    assert tests.endswith("python -m pytest -q")


def test_constraints_pin_torch_and_torchvision():
    pins = dict(
        line.split("==") for line in (ROOT / "constraints.txt").read_text().split() if "==" in line
    )
    assert pins["torch"] == "2.14.1" and pins["torchvision"] == "0.29.1"


def test_readme_python_names_exist():
    import fxq

    readme = (ROOT / "README.md").read_text()
    for name in set(re.findall(r"fxq\.([a-zA-Z_]+)\(", readme)):
        assert hasattr(fxq, name), name
