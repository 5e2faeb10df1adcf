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
    (
        "fxq.dtypes",
        "fxq.march",
        "fxq.utils.warning_summary",
        "fxq.utils.grad_mask",
        "fxq.quantized._triton_launch",
    ),  # the last three import no fxq
    ("fxq.primitives.core", "fxq.primitives.schema", "fxq.primitives.arith"),  # no torch
    (  # pure integer math, no nn.Module
        "fxq.quantized.functional",
        "fxq.quantized.native",
        "fxq.quantized._requant_triton",  # native's kernels on CUDA
        "fxq.quantized._im2col_triton",  # conv_as_gemm's columns on CUDA
    ),
    ("fxq.primitives",),  # one module per primitive family: torch, numpy, ONNX side by side
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


# -- fxq.export reads no other module's private names -----------------------------------------
#
# Export records what an integer module computes through the module's public methods
# (``requantization``, ``plan``, ``pool_dims``...), never through its private helpers
# (DESIGN.md, "Integer primitives: one definition each"). The rule, for every file of
# fxq/export: an access ``x._name`` (a single leading underscore; dunders are public
# protocol), a ``getattr`` / ``hasattr`` / ``setattr`` of a literal ``"_name"`` on ``x``, or
# an import of ``_name`` from an fxq module, is allowed only when ``x`` (or the module) is
# fxq.export's own:
#
# * ``self`` or ``cls``;
# * a name bound at the top level of the same file (a def, a class, an assignment);
# * a name imported from fxq.export (``from fxq.export.common import _Exporter``,
#   ``from . import runtime``);
# * a parameter annotated with, or a local assigned from a call of, such a name
#   (``ex: _Exporter``, ``ex = _Exporter(gm)``), in the function or one enclosing it.
#
# Everything else counts: a name imported from another fxq package (``pooling._AVG``), a
# parameter of any other or no annotation (``m._derive``), a chain (``a.b._c``), a call's
# result. Private *module paths* of third-party packages (``from torch.utils._pytree import
# tree_flatten``) name public functions and are torch's business, not fxq's layering.
EXPORT = ROOT / "export"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_module(module: str | None, level: int) -> bool:
    """Whether ``from <module> import ...`` (``level`` leading dots) imports fxq.export's own."""
    if level:
        return level == 1  # fxq/export has no subpackages: one dot is fxq.export itself
    return module is not None and (module == "fxq.export" or module.startswith("fxq.export."))


def _annotation_name(node: ast.expr | None) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


class _PrivateAccesses(ast.NodeVisitor):
    """Collects ``x._name`` accesses whose ``x`` is not fxq.export's own (the rule above)."""

    def __init__(self, tree: ast.Module, where: str) -> None:
        self.where = where
        self.found: list[str] = []
        self.own: set[str] = {"self", "cls"}
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.own.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    self.own.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        for node in ast.walk(tree):  # imports anywhere (lazy ones in functions too)
            if isinstance(node, ast.ImportFrom) and _own_module(node.module, node.level):
                self.own.update(a.asname or a.name for a in node.names)
        self.scopes: list[set[str]] = []

    def _typed_locals(self, fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> set[str]:
        out = set()
        params = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
        for arg in params:
            if _annotation_name(getattr(arg, "annotation", None)) in self.own:
                out.add(arg.arg)
        if isinstance(fn, ast.Lambda):
            return out
        for node in ast.walk(fn):
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Call)
                and _annotation_name(node.value.func) in self.own
            ):
                out.update(t.id for t in node.targets if isinstance(t, ast.Name))
        return out

    def _function(self, node) -> None:
        self.scopes.append(self._typed_locals(node))
        self.generic_visit(node)
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _allowed(self, receiver: ast.expr) -> bool:
        if not isinstance(receiver, ast.Name):
            return False
        return receiver.id in self.own or any(receiver.id in scope for scope in self.scopes)

    def _report(self, node: ast.AST, text: str) -> None:
        self.found.append(f"{self.where}:{node.lineno}: {text}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if _is_private(node.attr) and not self._allowed(node.value):
            self._report(node, f"{ast.unparse(node.value)}.{node.attr}")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = _annotation_name(node.func)
        if name in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2:
            attr = node.args[1]
            if (
                isinstance(attr, ast.Constant)
                and isinstance(attr.value, str)
                and _is_private(attr.value)
                and not self._allowed(node.args[0])
            ):
                self._report(node, f"{name}({ast.unparse(node.args[0])}, {attr.value!r})")
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        foreign_fxq = not node.level and (node.module or "").split(".")[0] == "fxq"
        if foreign_fxq and not _own_module(node.module, node.level):
            for alias in node.names:
                if _is_private(alias.name):
                    self._report(node, f"from {node.module} import {alias.name}")


def private_accesses(path: pathlib.Path) -> list[str]:
    """``file:line: what`` for each of ``path``'s reads of another module's private names."""
    tree = ast.parse(path.read_text())
    visitor = _PrivateAccesses(tree, str(path.relative_to(ROOT.parent)))
    visitor.visit(tree)
    return visitor.found


def test_export_reads_no_private_names_of_other_modules():
    found = [hit for path in sorted(EXPORT.glob("*.py")) for hit in private_accesses(path)]
    assert found == []


def test_the_private_access_rule_catches_what_it_should():
    source = """
from fxq.export.common import _Exporter
from fxq.quantized import pooling
from fxq.quantized.pooling import _AVG_PARAMS, AvgPool
_TABLE = {}

def rule(ex: _Exporter, m: AvgPool, args):
    ex._output(args)                 # allowed: a parameter annotated with fxq.export's class
    _TABLE._x, self._y               # allowed: this file's name, self
    local = _Exporter(None)
    local._z                         # allowed: built from fxq.export's class
    m._derive(args)                  # 1: an integer module's private method
    pooling._pool_dims(m)            # 2: a private function of fxq.quantized
    getattr(m, "_channel_axis")      # 3: the same through getattr
    m.op._x, ex.values._y            # 4, 5: chains
    m.__class__, getattr(m, "name")  # allowed: dunder, public
"""
    path = EXPORT / "_probe.py"
    tree = ast.parse(source)
    visitor = _PrivateAccesses(tree, path.name)
    visitor.visit(tree)
    assert [hit.split(": ", 1)[1] for hit in visitor.found] == [
        "from fxq.quantized.pooling import _AVG_PARAMS",
        "m._derive",
        "pooling._pool_dims",
        "getattr(m, '_channel_axis')",
        "m.op._x",
        "ex.values._y",
    ]
