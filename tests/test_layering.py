"""Imports go one way, bottom to top (DESIGN.md, "Layout"), with no cycles.

Every ``import`` in fxq's sources counts, including those inside functions:
a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import pathlib

import fxq

ROOT = pathlib.Path(fxq.__file__).parent

#: bottom to top; a module belongs to the layer of its longest matching prefix
LAYERS: tuple[tuple[str, ...], ...] = (
    ("fxq.dtypes", "fxq.march", "fxq.utils.warning_summary"),  # the last imports no fxq
    (  # pure integer math, no nn.Module
        "fxq.quantized.functional",
        "fxq.quantized.native",
        "fxq.quantized._requant_triton",  # native's kernels on CUDA
    ),
    (
        "fxq.qtensor",
        "fxq.observer",
        "fxq.calibration.observers",
        "fxq.quantized.fake_quant_ops",  # the fused QAT step: the observers' updates
        "fxq.quantized._fake_quant_triton",
        "fxq.fake_quantize",
        "fxq.stubs",
        "fxq.fused",
    ),
    ("fxq.registry",),
    ("fxq.qconfig", "fxq.quantized"),  # integer modules
    ("fxq.qat",),  # QAT modules
    ("fxq.fx",),  # the passes
    ("fxq.calibration", "fxq.debug", "fxq.deploy", "fxq.summary", "fxq.functional", "fxq.utils"),
    ("fxq",),
    ("fxq.cli", "fxq.__main__"),  # the command line: uses everything above
)


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = ("fxq",) + path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str:
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _imports(name: str) -> set[str]:
    tree = ast.parse(MODULES[name].read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fxq"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in MODULES else _resolve(node.module))
        elif isinstance(node, ast.Import):
            out.update(_resolve(a.name) for a in node.names if a.name.startswith("fxq"))
    out.discard(name)
    return out


GRAPH = {name: _imports(name) for name in MODULES}


def layer(name: str) -> int:
    best, best_len = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, f"{name} is in no layer; add it to LAYERS"
    return best


def test_every_import_goes_down_or_sideways():
    upward = [
        f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
        for a, targets in GRAPH.items()
        for b in targets
        if layer(b) > layer(a)
    ]
    assert upward == []


def test_integer_modules_never_import_qat_modules():
    offenders = {
        a: sorted(b for b in targets if b.startswith("fxq.qat"))
        for a, targets in GRAPH.items()
        if a.startswith("fxq.quantized")
    }
    assert {a: b for a, b in offenders.items() if b} == {}


def test_no_import_cycles():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert cycles == []
