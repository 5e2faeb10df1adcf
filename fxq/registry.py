"""The op registry: every fact fxq knows about an op, one row per op.

A row (``OpRow``) says which float targets the op matches (module classes,
functions, ``Tensor`` method names), its qconfig key (``OpRow.name``: the
aliases ``torch.add``, ``operator.add``, ``x.add(y)`` and ``x += y`` are one
key), what kind of op it is (``Kind``), its QAT class and its integer class,
the role it plays in fusions, how a ``QTensor`` runs it when it is a
pass-through, and (``OpRow.export``) its export rule. Every pass reads this table:

* ``prepare_qat_fx`` asks ``row_for(node)`` what to do with each node;
* ``convert_fx`` lowers a QAT module to ``integer_class_for(type(qat))``;
* ``QTensor`` gets its pass-through methods and functions installed from the
  PASSTHROUGH rows (so an op that is a pass-through in prepare always runs
  on a QTensor after convert);
* ``fuse_fx`` takes the members of each fusion step (``fusion_role``);
* qconfig resolution canonicalises functional targets with ``canonical_key``;
* ``fxq.summary`` and the float-op warning give ``OpRow.reason`` for ops that
  stay float.

Supporting a new op is adding a row here and its two classes. The QAT and
integer classes are named by dotted path and imported on first use, so this
module sits below both layers (``fxq.quantized`` never imports ``fxq.qat``).

>>> import torch, operator
>>> row_for_function(operator.iadd).name, row_for_method("add_").name
('add', 'add')
>>> row_for_module(torch.nn.Conv2d).integer_class.__name__
'Conv2d'
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import importlib.util
import math
import operator
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Node

from fxq import stubs
from fxq.fused import Fused
from fxq.qtensor import QTensor, implements, is_handled, passthrough_function, passthrough_method

__all__ = [
    "Kind",
    "OpRow",
    "ROWS",  # noqa: F822 (made by __getattr__: reading it imports the optional packages)
    "rows",
    "NONTENSOR_METHODS",
    "row_for",
    "row_for_module",
    "registry_class",
    "row_for_function",
    "row_for_method",
    "row_named",
    "canonical_key",
    "integer_class_for",
    "fusion_members",
    "target_name",
    "EinsumMatmul",
    "einsum_as_matmul",
    "einsum_operands",
]


class Kind(str, enum.Enum):
    """What an op does to quantization.

    * ``WEIGHTED``: a module with weights, swapped for its QAT twin.
    * ``COMPUTE``: makes a new value (``+``, ``cat``, pooling, LUT ops...); its
      QAT module owns the output fake quant.
    * ``PASSTHROUGH``: keeps its input's integer grid and scale (ReLU, max
      pooling, reshapes, slicing, dropout...); no fake quant, no module.
    * ``QUANT_STUB`` / ``DEQUANT_STUB``: the user's boundaries.
    * ``FLOAT``: no quantized implementation; runs in float, with quantize /
      dequantize inserted at its borders (``OpRow.reason`` says why).
    * ``NONTENSOR``: sizes, shapes and other Python values.
    """

    WEIGHTED = "weighted"
    COMPUTE = "compute"
    PASSTHROUGH = "passthrough"
    QUANT_STUB = "quant_stub"
    DEQUANT_STUB = "dequant_stub"
    FLOAT = "float"
    NONTENSOR = "nontensor"


#: how a QTensor runs a PASSTHROUGH op:
#: ``"data"``: the op applied to the integer data, the scale kept (per-tensor only);
#: ``"custom"``: QTensor implements it itself (ReLU clamps, padding, dropout, max pooling...);
#: None: nothing to run (e.g. ``nn.Identity``) or the row's module calls other rows' targets.
QTENSOR_MODES = ("data", "custom", None)


@dataclass(frozen=True)
class OpRow:
    """Every fact about one op.

    Attributes:
        name: the op's qconfig key (``"add"``, ``"conv2d"``, ``"sigmoid"``);
            also names the QAT module prepare inserts for a functional op.
        kind: see ``Kind``.
        modules: float module classes; a subclass that keeps the class's
            ``forward`` matches too (see ``registry_class``).
        functions: functions matched as ``call_function`` targets.
        methods: ``Tensor`` method names matched as ``call_method`` targets.
        qat: dotted path of the ``fxq.qat`` class (WEIGHTED / COMPUTE / stubs).
        integer: dotted path of the ``fxq.quantized`` class.
        fusion_role: the step this op plays in ``fxq.fx.fuse.PATTERNS``
            (``"conv"``, ``"convtranspose"``, ``"linear"``, ``"bn"``, ``"add"``,
            ``"relu"``, ``"relu6"``) or None.
        qtensor: how a QTensor runs a PASSTHROUGH op (``QTENSOR_MODES``).
        refine: optional ``(row, node, module) -> OpRow`` that looks at a call's
            arguments (an interpolation mode, clamp bounds) and returns the row
            that applies to this call (e.g. a FLOAT variant with a reason).
        reason: why a FLOAT row stays float (shown in warnings and summaries).
        doc: a one-line description.

    ``export`` (a property) is the op's export rule, which ``fxq.export`` keeps
    (by integer class, and by row name for pass-through ops that compute on values).
    """

    name: str
    kind: Kind
    modules: tuple[type, ...] = ()
    functions: tuple[Callable, ...] = ()
    methods: tuple[str, ...] = ()
    qat: str | None = None
    integer: str | None = None
    fusion_role: str | None = None
    qtensor: str | None = None
    refine: Callable[[OpRow, Node | None, nn.Module | None], OpRow] | None = None
    reason: str = ""
    doc: str = ""

    def __post_init__(self) -> None:
        if self.qtensor not in QTENSOR_MODES:
            raise ValueError(f"row {self.name!r}: qtensor must be one of {QTENSOR_MODES}")
        needs_classes = self.kind in (Kind.WEIGHTED, Kind.COMPUTE) and self.refine is None
        if needs_classes and (self.qat is None or self.integer is None):
            raise ValueError(f"row {self.name!r}: a {self.kind.value} op needs qat and integer")

    @property
    def qat_class(self) -> type:
        """The fxq.qat class (imported on first use)."""
        return _import(self.qat)

    @property
    def integer_class(self) -> type:
        """The fxq.quantized class (imported on first use)."""
        return _import(self.integer)

    @property
    def export(self) -> Callable[..., None] | None:
        """How ``fxq.export.to_graph`` exports this op, or None where it has no rule.

        Looked up in ``fxq.export`` on first use (``fxq.export.build.rule_for_row``),
        which this module does not import: the rule of the integer class for a
        quantized op, the value or movement rule for a pass-through op.
        """
        return _import(_EXPORT_RULE_FOR_ROW)(self)

    @property
    def targets(self) -> tuple[Any, ...]:
        """Every float target this row matches."""
        return self.modules + self.functions + self.methods

    def resolve(self, node: Node | None, module: nn.Module | None) -> OpRow:
        """The row that applies to this particular call."""
        return self.refine(self, node, module) if self.refine is not None else self

    def as_float(self, reason: str) -> OpRow:
        """This op, kept in float for ``reason`` (a refinement result)."""
        return dataclasses.replace(
            self, kind=Kind.FLOAT, qat=None, integer=None, refine=None, reason=reason
        )

    def as_passthrough(self) -> OpRow:
        """This op, keeping its input's integer grid (a refinement result)."""
        return dataclasses.replace(
            self, kind=Kind.PASSTHROUGH, qat=None, integer=None, refine=None, qtensor="custom"
        )


#: where fxq.export keeps the export rules (a layer above this module)
_EXPORT_RULE_FOR_ROW = "fxq.export.build.rule_for_row"


@functools.cache
def _import(path: str | None) -> Any:
    if path is None:
        raise KeyError("this op has no class of that kind")
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


# -- refinements ---------------------------------------------------------------------
def _arg(node: Node | None, index: int, name: str, default: Any = None) -> Any:
    if node is None:
        return default
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


_INTERP_MODES = ("bilinear", "linear")
_NEAREST_MODES = ("nearest", "nearest-exact")


def _refine_interpolate(row: OpRow, node: Node | None, module: nn.Module | None) -> OpRow:
    mode = getattr(module, "mode", "nearest") if module is not None else _arg(node, 3, "mode")
    mode = "nearest" if mode is None else mode
    if mode in _NEAREST_MODES:
        return row.as_passthrough()
    if mode in _INTERP_MODES:
        return dataclasses.replace(row, refine=None)
    return row.as_float(f"interpolation mode {mode!r} has no integer implementation")


def _refine_pad(row: OpRow, node: Node | None, module: nn.Module | None) -> OpRow:
    mode = _arg(node, 2, "mode", "constant")
    value = _arg(node, 3, "value", None)
    if mode == "constant" and value not in (None, 0, 0.0):
        return row.as_float(f"padding with the value {value} is not on the integer grid")
    return dataclasses.replace(row, refine=None)


def _refine_clamp(row: OpRow, node: Node | None, module: nn.Module | None) -> OpRow:
    bounds = [_arg(node, 1, "min"), _arg(node, 2, "max")]
    if any(isinstance(b, Node) for b in bounds):
        return row.as_float("clamp with tensor bounds has no fixed integer meaning")
    return dataclasses.replace(row, refine=None)


def _refine_fused(row: OpRow, node: Node | None, module: nn.Module | None) -> OpRow:
    return row_for_module(type(module.op)).resolve(node, module.op)


def _refine_norm_weights(row: OpRow, node: Node | None, module: nn.Module | None) -> OpRow:
    if module is None and any(
        isinstance(_arg(node, i, name), Node) for i, name in ((2, "weight"), (3, "bias"))
    ):
        module_form = "nn.LayerNorm" if row.name == "layer_norm" else "nn.GroupNorm"
        return row.as_float(
            f"{target_name(node.target)} with weight / bias tensors: fxq quantizes the affine "
            f"parameters of modules; use the module form ({module_form})"
        )
    return dataclasses.replace(row, refine=None)


def _refine_sdpa(row: OpRow, node: Node | None, module: nn.Module | None) -> OpRow:
    # an attn_mask (bool, or additive 0 / -inf) is a keep-mask that prepare never quantizes
    # (the QAT class's ``unquantized_args``); other float values raise when the op runs
    dropout = _arg(node, 4, "dropout_p", 0.0)
    gqa = _arg(node, 7, "enable_gqa", False)
    if isinstance(dropout, Node) or dropout:
        return row.as_float("scaled_dot_product_attention with dropout_p > 0 (random in any mode)")
    if isinstance(gqa, Node) or gqa:
        return row.as_float("scaled_dot_product_attention with enable_gqa=True")
    return dataclasses.replace(row, refine=None)


#: grid_sample variants with an integer implementation (fxq.quantized.grid_sample.MODES /
#: PADDING_MODES; the registry does not import the integer layer)
_GRID_MODES = ("bilinear", "nearest")
_GRID_PADDING_MODES = ("zeros", "border")


def _refine_grid_sample(row: OpRow, node: Node | None, module: nn.Module | None) -> OpRow:
    mode = _arg(node, 2, "mode", "bilinear")
    padding = _arg(node, 3, "padding_mode", "zeros")
    if mode not in _GRID_MODES:
        return row.as_float(
            f"grid_sample mode {mode!r} has no integer implementation (bilinear and nearest do)"
        )
    if padding not in _GRID_PADDING_MODES:
        return row.as_float(
            f"grid_sample padding_mode {padding!r} has no integer implementation (zeros and "
            "border do; reflection folds coordinates and is not implemented yet)"
        )
    return dataclasses.replace(row, refine=None)


def _refine_mha(row: OpRow, node: Node | None, module: nn.Module | None) -> OpRow:
    if module is not None:
        unsupported = [
            what
            for what, bad in (
                ("different kdim / vdim", not module._qkv_same_embed_dim),
                ("bias_k / bias_v", module.bias_k is not None),
                ("add_zero_attn", module.add_zero_attn),
            )
            if bad
        ]
        if unsupported:
            return row.as_float(f"nn.MultiheadAttention with {', '.join(unsupported)}")
    return dataclasses.replace(row, refine=None)


#: a fill value at or below this builds an additive attention mask (fxq.quantized.attention's
#: ADDITIVE_MASK_LIMIT; the registry does not import the integer layer)
_MASK_FILL_LIMIT = -1e4
#: exponents with an integer pow (fxq.quantized.power.INTEGER_EXPONENTS)
_POW_EXPONENTS = (2, 3)


def is_mask_fill(value: Any) -> bool:
    """Whether ``value`` (a ``torch.where`` operand) is the fill of an additive attention mask:
    a Python number at or below ``-1e4``."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and value <= _MASK_FILL_LIMIT
    )


def _nontensor(row: OpRow) -> OpRow:
    return dataclasses.replace(row, kind=Kind.NONTENSOR, qat=None, integer=None, refine=None)


def _refine_pow(row: OpRow, node: Node | None, module: nn.Module | None) -> OpRow:
    if node is None:
        return dataclasses.replace(row, refine=None)
    args = [*node.args, *node.kwargs.values()]
    if all(_python_value(a) for a in args):
        return _nontensor(row)  # sizes: x.size(-1) ** -0.5
    base = node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("self"))
    if not isinstance(base, Node):
        return row.as_float(f"{target_name(node.target)}: a number raised to a tensor power")
    if getattr(node.target, "__name__", node.target) in ("square", "square_"):
        return dataclasses.replace(row, refine=None)
    exponent = _arg(node, 1, "exponent")
    if isinstance(exponent, Node):
        return row.as_float(f"{target_name(node.target)} with a tensor exponent")
    is_number = isinstance(exponent, (int, float)) and not isinstance(exponent, bool)
    if not is_number or exponent not in _POW_EXPONENTS:
        return row.as_float(
            f"{target_name(node.target)} with the exponent {exponent!r}: integer pow takes "
            f"{' and '.join(map(str, _POW_EXPONENTS))}"
        )
    return dataclasses.replace(row, refine=None)


def _refine_where(row: OpRow, node: Node | None, module: nn.Module | None) -> OpRow:
    if node is None:
        return dataclasses.replace(row, refine=None)
    if len(node.args) + len(node.kwargs) < 3:
        return row.as_float("torch.where(condition) returns indices (integer tensors)")
    values = [_arg(node, 1, "input"), _arg(node, 2, "other")]
    for v in values:
        if is_mask_fill(v):
            return row.as_float(
                f"torch.where with the fill value {v:g} builds an additive attention mask "
                "(0 / -inf), not an activation: scaled_dot_product_attention and "
                "nn.MultiheadAttention take such masks unquantized; eager attention's "
                "`scores + mask` has no integer form (use attn_implementation='sdpa')"
            )
    return dataclasses.replace(row, refine=None)


def _device_like(value: Any) -> bool:
    if isinstance(value, Node):
        return (
            value.op == "call_function"
            and value.target is getattr
            and value.args[1:2] == ("device",)
        )
    return value is None or isinstance(value, (str, torch.device, bool)) or value is torch.float32


def _refine_to(row: OpRow, node: Node | None, module: nn.Module | None) -> OpRow:
    args = [*node.args[1:], *node.kwargs.values()] if node is not None else []
    if all(_device_like(a) for a in args):
        return dataclasses.replace(row, refine=None)
    shown = ", ".join(map(str, args))
    return row.as_float(
        f"Tensor.to({shown}): a dtype other than float32 (or a tensor argument) leaves the "
        "integer grid"
    )


def _refine_div(row: OpRow, node: Node | None, module: nn.Module | None) -> OpRow:
    mode = _arg(node, 2, "rounding_mode")
    if mode is not None:
        return row.as_float(f"division with rounding_mode={mode!r} (an integer quotient)")
    return dataclasses.replace(row, refine=None)


@dataclass(frozen=True)
class EinsumMatmul:
    """A two-operand ``torch.einsum`` equation that is a (batched) matrix product.

    ``einsum(eq, a, b) == out_t(matmul(a_t(a), b_t(b)))`` where ``x_t`` swaps the last two
    axes when the flag is set.

    Attributes:
        transpose_a: ``a`` is ``[..., k, i]`` (swap to ``[..., i, k]``).
        transpose_b: ``b`` is ``[..., j, k]`` (swap to ``[..., k, j]``).
        transpose_out: the output is ``[..., j, i]``.
    """

    transpose_a: bool
    transpose_b: bool
    transpose_out: bool


def einsum_as_matmul(equation: str) -> EinsumMatmul:
    """How a two-operand einsum equation lowers to ``matmul`` (with transposes).

    The equation must name the same batch axes, in the same order, at the front of
    both operands and of the output (``...`` counts as one batch axis), then two axes
    per operand: one shared axis ``k`` that is summed over, one free axis of each
    operand; the output ends with the two free axes. Spaces are ignored; letters are
    case-sensitive (as in torch). Without ``->`` the output is torch's implicit one.

    >>> einsum_as_matmul("B G H I D, B G H J D -> B G H I J")
    EinsumMatmul(transpose_a=False, transpose_b=True, transpose_out=False)

    Raises:
        ValueError: the equation is not a (transposed) batched matrix product; the message
            says why.
    """
    eq = equation.replace(" ", "")
    lhs, arrow, out = eq.partition("->")
    operands = lhs.split(",")
    if len(operands) != 2:
        raise ValueError(f"{len(operands)} operand(s), not 2")
    a, b = (_einsum_axes(o) for o in operands)
    if not arrow:  # torch: the axes named once, in alphabetical order (``...`` first)
        once = [x for x in a + b if (a + b).count(x) == 1]
        out_axes = (["..."] if "..." in a + b else []) + sorted(x for x in once if x != "...")
    else:
        out_axes = _einsum_axes(out)
    for name, axes in (
        ("the first operand", a),
        ("the second operand", b),
        ("the output", out_axes),
    ):
        if len(axes) != len(set(axes)):
            raise ValueError(f"{name} repeats an axis (a diagonal)")
        if len(axes) < 2:
            raise ValueError(f"{name} has fewer than two axes")
    batch = a[:-2]
    if b[:-2] != batch or out_axes[:-2] != batch:
        raise ValueError("the operands and the output do not share the same leading batch axes")
    shared = set(a[-2:]) & set(b[-2:])
    if len(shared) != 1 or "..." in shared:
        raise ValueError("the last two axes of the operands do not share exactly one summed axis")
    (k,) = shared
    i = next(x for x in a[-2:] if x != k)
    j = next(x for x in b[-2:] if x != k)
    if out_axes[-2:] not in ([i, j], [j, i]) or k in out_axes:
        raise ValueError(f"the output does not end with the free axes {i!r} and {j!r}")
    return EinsumMatmul(a[-1] != k, b[-2] != k, out_axes[-2:] == [j, i])


def _einsum_axes(term: str) -> list[str]:
    if "..." in term and not term.startswith("..."):
        raise ValueError("'...' is only accepted first (as the batch axes)")
    axes = ["..."] if term.startswith("...") else []
    rest = term[3:] if axes else term
    if not all(c.isalpha() for c in rest):
        raise ValueError(f"{term!r} has characters other than letters")
    return axes + list(rest)


def einsum_operands(args: tuple, kwargs: dict) -> tuple[Any, list[Any]]:
    """``(equation, operands)`` of a ``torch.einsum`` call (operands given one by one or as a
    list)."""
    equation = args[0] if args else kwargs.get("equation")
    operands = list(args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    return equation, operands


def _refine_einsum(row: OpRow, node: Node | None, module: nn.Module | None) -> OpRow:
    if node is None:
        return dataclasses.replace(row, refine=None)
    equation, operands = einsum_operands(node.args, node.kwargs)
    if not isinstance(equation, str):
        return row.as_float("torch.einsum with an equation computed in the graph")
    if len(operands) != 2:
        return row.as_float(
            f"torch.einsum({equation!r}) with {len(operands)} operand(s): the integer einsum "
            "takes two"
        )
    try:
        einsum_as_matmul(equation)
    except ValueError as e:
        return row.as_float(
            f"torch.einsum({equation!r}) is not a batched matrix product ({e}); only "
            "'...ik,...kj->...ij' (either operand or the output transposed) is integer"
        )
    return dataclasses.replace(row, refine=None)


def _refine_normalize(row: OpRow, node: Node | None, module: nn.Module | None) -> OpRow:
    if node is None:
        return dataclasses.replace(row, refine=None)
    p, dim, eps = _arg(node, 1, "p", 2.0), _arg(node, 2, "dim", 1), _arg(node, 3, "eps", 1e-12)
    if any(isinstance(v, Node) for v in (p, dim, eps)) or _arg(node, 4, "out") is not None:
        return row.as_float("F.normalize with p, dim or eps computed in the graph, or with out=")
    if p != 2:
        return row.as_float(f"F.normalize with p={p!r}: the integer form is the L2 norm (p=2)")
    return dataclasses.replace(row, refine=None)


#: operators that compute on sizes in traced code (``x.shape[0] // 2``, ``h == w``)
_SHAPE_OPERATORS = (
    operator.eq,
    operator.ne,
    operator.lt,
    operator.le,
    operator.gt,
    operator.ge,
    operator.floordiv,
    operator.mod,
)
#: tensor attributes that are Python values
_VALUE_ATTRIBUTES = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "layout"})


def _python_value(arg: Any, depth: int = 0) -> bool:
    """Whether a node argument provably holds a Python value (a size, a shape, a number)."""
    if not isinstance(arg, Node):
        return not isinstance(arg, torch.Tensor)
    if depth > 32:
        return False
    if arg.op == "call_method":
        return arg.target in NONTENSOR_METHODS
    if arg.op != "call_function":
        return False
    if arg.target is getattr:
        return len(arg.args) > 1 and arg.args[1] in _VALUE_ATTRIBUTES
    if arg.target is len or arg.target in (math.floor, math.ceil, math.sqrt, int, float):
        return True
    if getattr(arg.target, "__module__", None) in ("_operator", "operator"):
        inputs = [*arg.args, *arg.kwargs.values()]
        return all(_python_value(a, depth + 1) for a in inputs)
    return False


def _refine_shape_arithmetic(row: OpRow, node: Node | None, module: nn.Module | None) -> OpRow:
    args = [*node.args, *node.kwargs.values()] if node is not None else []
    if node is not None and all(_python_value(a) for a in args):
        return dataclasses.replace(row, refine=None)
    return row.as_float(f"no integer {target_name(node.target) if node else row.name} on tensors")


def _refine_functional_weight(row: OpRow, node: Node | None, module: nn.Module | None) -> OpRow:
    what = target_name(node.target) if node is not None else row.name
    return row.as_float(
        f"{what} with a weight tensor: fxq quantizes the weights of modules; use the nn "
        "module form (e.g. nn.Conv2d) so its weight gets a fake quant"
    )


# -- the table -------------------------------------------------------------------------
_Q = "fxq.qat."
_I = "fxq.quantized."


def _weighted(name: str, module: type, cls: str, role: str, qat_file: str = "weighted") -> OpRow:
    return OpRow(
        name,
        Kind.WEIGHTED,
        modules=(module,),
        qat=f"{_Q}{qat_file}.{cls}",
        integer=f"{_I}{qat_file}.{cls}",
        fusion_role=role,
        doc=f"{module.__name__} with int8 per-channel weights and an int32 bias",
    )


def _compute(
    name: str,
    cls: str,
    file: str,
    modules: Iterable[type] = (),
    functions: Iterable[Callable] = (),
    methods: Iterable[str] = (),
    integer: str | None = None,
    **extra: Any,
) -> OpRow:
    return OpRow(
        name,
        Kind.COMPUTE,
        modules=tuple(modules),
        functions=tuple(functions),
        methods=tuple(methods),
        qat=f"{_Q}{file}.{cls}",
        integer=f"{_I}{file}.{integer or cls}",
        **extra,
    )


def _lut(name: str, modules=(), functions=(), methods=()) -> OpRow:
    return _compute(
        name,
        "LookupTableOp",
        "activation",
        modules,
        functions,
        methods,
        integer="LookupTable",
        doc=f"{name} by lookup table",
    )


def _pass(
    name: str, modules=(), functions=(), methods=(), qtensor: str | None = "data", **extra
) -> OpRow:
    return OpRow(
        name,
        Kind.PASSTHROUGH,
        modules=tuple(modules),
        functions=tuple(functions),
        methods=tuple(methods),
        qtensor=qtensor,
        **extra,
    )


def _float(name: str, reason: str, modules=(), functions=(), methods=(), **extra) -> OpRow:
    return OpRow(
        name,
        Kind.FLOAT,
        modules=tuple(modules),
        functions=tuple(functions),
        methods=tuple(methods),
        reason=reason,
        **extra,
    )


def _dims(fmt: str, *namespaces: Any) -> list[Any]:
    return [getattr(ns, fmt.format(d)) for d in (1, 2, 3) for ns in namespaces]


def _table() -> list[OpRow]:
    rows: list[OpRow] = []
    for d in (1, 2, 3):
        rows.append(_weighted(f"conv{d}d", getattr(nn, f"Conv{d}d"), f"Conv{d}d", "conv"))
        rows.append(
            _weighted(
                f"conv_transpose{d}d",
                getattr(nn, f"ConvTranspose{d}d"),
                f"ConvTranspose{d}d",
                "convtranspose",
            )
        )
        rows.append(
            dataclasses.replace(
                _weighted(
                    f"batch_norm{d}d", getattr(nn, f"BatchNorm{d}d"), "BatchNorm", "bn", "batchnorm"
                ),
                doc="folded into the conv / linear before it; alone, a per-channel integer affine",
            )
        )
    rows.append(_weighted("linear", nn.Linear, "Linear", "linear"))
    rows.append(
        OpRow(
            "fused",
            Kind.WEIGHTED,
            modules=(Fused,),
            refine=_refine_fused,
            doc="a fused chain (conv / linear + bn + add + relu); resolves to its anchor's row",
        )
    )
    rows += [
        OpRow(
            "quant_stub",
            Kind.QUANT_STUB,
            modules=(stubs.QuantStub, torch.ao.quantization.QuantStub),
            qat=f"{_Q}stubs.QuantStub",
            integer=f"{_I}stubs.Quantize",
            doc="float -> quantized boundary",
        ),
        OpRow(
            "dequant_stub",
            Kind.DEQUANT_STUB,
            modules=(stubs.DeQuantStub, torch.ao.quantization.DeQuantStub),
            integer=f"{_I}stubs.DeQuantize",
            doc="quantized -> float boundary",
        ),
        # -- elementwise ---------------------------------------------------------------
        _compute(
            "add",
            "Add",
            "elementwise",
            functions=(operator.add, operator.iadd, torch.add),
            methods=("add", "add_"),
            fusion_role="add",
        ),
        _compute(
            "sub",
            "Sub",
            "elementwise",
            functions=(operator.sub, operator.isub, torch.sub),
            methods=("sub", "sub_"),
        ),
        _compute(
            "mul",
            "Mul",
            "elementwise",
            functions=(operator.mul, operator.imul, torch.mul),
            methods=("mul", "mul_"),
        ),
        _compute(
            "pow",
            "Pow",
            "power",
            functions=(torch.pow, operator.pow, operator.ipow, torch.square),
            methods=("pow", "pow_", "square", "square_"),
            refine=_refine_pow,
        ),
        _compute("where", "Where", "where", functions=(torch.where,), refine=_refine_where),
        _compute("cat", "Cat", "elementwise", functions=(torch.cat, torch.concat)),
        _compute("stack", "Stack", "elementwise", functions=(torch.stack,)),
        _compute(
            "maximum", "Maximum", "elementwise", functions=(torch.maximum,), methods=("maximum",)
        ),
        _compute(
            "minimum", "Minimum", "elementwise", functions=(torch.minimum,), methods=("minimum",)
        ),
        _compute(
            "div",
            "Div",
            "division",
            functions=(operator.truediv, operator.itruediv, torch.div, torch.true_divide),
            methods=("div", "div_", "true_divide"),
            refine=_refine_div,
        ),
        _compute(
            "matmul",
            "MatMul",
            "matmul",
            functions=(operator.matmul, torch.matmul, torch.bmm),
            methods=("matmul", "bmm"),
        ),
        _compute(
            "einsum",
            "Einsum",
            "matmul",
            functions=(torch.einsum,),
            refine=_refine_einsum,
            doc="two-operand equations that are a batched matmul ('...ik,...kj->...ij', either "
            "operand or the output transposed): transposes and the integer matmul; other "
            "equations stay float",
        ),
        # -- pooling and reductions ------------------------------------------------------
        *[
            _compute(
                f"avg_pool{d}d",
                "AvgPool",
                "pooling",
                modules=(getattr(nn, f"AvgPool{d}d"),),
                functions=(getattr(F, f"avg_pool{d}d"),),
            )
            for d in (1, 2, 3)
        ],
        *[
            _compute(
                f"adaptive_avg_pool{d}d",
                "AdaptiveAvgPool",
                "pooling",
                modules=(getattr(nn, f"AdaptiveAvgPool{d}d"),),
                functions=(getattr(F, f"adaptive_avg_pool{d}d"),),
            )
            for d in (1, 2, 3)
        ],
        _compute("mean", "Mean", "pooling", functions=(torch.mean,), methods=("mean",)),
        _compute("sum", "Sum", "pooling", functions=(torch.sum,), methods=("sum",)),
        # -- clamps ------------------------------------------------------------------------
        _compute(
            "relu6",
            "Clamp",
            "activation",
            modules=(nn.ReLU6,),
            functions=(F.relu6,),
            fusion_role="relu6",
        ),
        _compute(
            "hardtanh", "Clamp", "activation", modules=(nn.Hardtanh,), functions=(F.hardtanh,)
        ),
        _compute(
            "clamp",
            "Clamp",
            "activation",
            functions=(torch.clamp, torch.clip),
            methods=("clamp", "clamp_", "clip"),
            refine=_refine_clamp,
        ),
        # -- lookup tables -------------------------------------------------------------------
        _lut("sigmoid", (nn.Sigmoid,), (torch.sigmoid, F.sigmoid), ("sigmoid", "sigmoid_")),
        _lut("tanh", (nn.Tanh,), (torch.tanh, F.tanh), ("tanh", "tanh_")),
        _lut("hardsigmoid", (nn.Hardsigmoid,), (F.hardsigmoid,)),
        _lut("hardswish", (nn.Hardswish,), (F.hardswish,)),
        _lut("silu", (nn.SiLU,), (F.silu,)),
        _lut("gelu", (nn.GELU,), (F.gelu,)),
        _lut("exp", (), (torch.exp,), ("exp",)),
        _compute(
            "leaky_relu",
            "PReLU",
            "activation",
            modules=(nn.LeakyReLU,),
            functions=(F.leaky_relu,),
            doc="as prelu: the slope is the negative side's multiplier (exact, no table)",
        ),
        _lut("elu", (nn.ELU,), (F.elu,)),
        _lut("softplus", (nn.Softplus,), (F.softplus,)),
        _lut("mish", (nn.Mish,), (F.mish,)),
        _lut("abs", (), (torch.abs,), ("abs", "abs_")),
        _compute("prelu", "PReLU", "activation", modules=(nn.PReLU,)),
        # -- lookups ---------------------------------------------------------------------
        _compute("embedding", "Embedding", "embedding", modules=(nn.Embedding,)),
        # -- normalization ---------------------------------------------------------------
        _compute(
            "layer_norm",
            "LayerNorm",
            "normalization",
            modules=(nn.LayerNorm,),
            functions=(F.layer_norm,),
            refine=_refine_norm_weights,
        ),
        _compute(
            "group_norm",
            "GroupNorm",
            "normalization",
            modules=(nn.GroupNorm,),
            functions=(F.group_norm,),
            refine=_refine_norm_weights,
        ),
        _compute(
            "normalize",
            "L2Normalize",
            "normalization",
            functions=(F.normalize,),
            refine=_refine_normalize,
            doc="p=2: int64 sum of squares, rsqrt table, int16 (bayes) / int8 normalized values, "
            "requantized; other p stay float",
        ),
        _compute(
            "softmax",
            "Softmax",
            "softmax",
            modules=(nn.Softmax, nn.LogSoftmax),
            functions=(F.softmax, torch.softmax, F.log_softmax, torch.log_softmax),
            methods=("softmax", "log_softmax"),
        ),
        _compute(
            "scaled_dot_product_attention",
            "ScaledDotProductAttention",
            "attention",
            functions=(F.scaled_dot_product_attention,),
            refine=_refine_sdpa,
        ),
        _compute(
            "multihead_attention",
            "MultiheadAttention",
            "attention",
            modules=(nn.MultiheadAttention,),
            refine=_refine_mha,
        ),
        # -- resampling --------------------------------------------------------------------
        _compute(
            "interpolate",
            "Interpolate",
            "interpolate",
            modules=(nn.Upsample,),
            functions=(F.interpolate,),
            refine=_refine_interpolate,
        ),
        _compute(
            "upsampling_bilinear2d",
            "Interpolate",
            "interpolate",
            modules=(nn.UpsamplingBilinear2d,),
        ),
        _pass("upsampling_nearest2d", modules=(nn.UpsamplingNearest2d,), qtensor=None),
        _compute(
            "grid_sample",
            "GridSample",
            "grid_sample",
            functions=(F.grid_sample,),
            refine=_refine_grid_sample,
        ),
        # -- pass-throughs -------------------------------------------------------------------
        _pass(
            "relu",
            (nn.ReLU,),
            (F.relu, torch.relu),
            ("relu", "relu_"),
            qtensor="custom",
            fusion_role="relu",
        ),
        *[
            _pass(
                f"max_pool{d}d",
                (getattr(nn, f"MaxPool{d}d"),),
                (getattr(F, f"max_pool{d}d"), getattr(F, f"max_pool{d}d_with_indices")),
                qtensor="custom",
            )
            for d in (1, 2, 3)
        ],
        *[
            _pass(
                f"adaptive_max_pool{d}d",
                (getattr(nn, f"AdaptiveMaxPool{d}d"),),
                (getattr(F, f"adaptive_max_pool{d}d"),),
                qtensor="custom",
            )
            for d in (1, 2, 3)
        ],
        _pass(
            "dropout",
            (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout),
            (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout),
            qtensor="custom",
        ),
        _pass(
            "pad",
            (
                nn.ZeroPad1d,
                nn.ZeroPad2d,
                nn.ZeroPad3d,
                nn.ReflectionPad1d,
                nn.ReflectionPad2d,
                nn.ReplicationPad1d,
                nn.ReplicationPad2d,
            ),
            (F.pad,),
            qtensor="custom",
            refine=_refine_pad,
        ),
        _pass("pixel_shuffle", (nn.PixelShuffle,), (F.pixel_shuffle,), qtensor="custom"),
        _pass("pixel_unshuffle", (nn.PixelUnshuffle,), (F.pixel_unshuffle,), qtensor="custom"),
        _pass("channel_shuffle", (nn.ChannelShuffle,), (torch.channel_shuffle,), qtensor="custom"),
        _pass("identity", (nn.Identity,), qtensor=None),
        _pass("flatten", (nn.Flatten,), (torch.flatten,), ("flatten",)),
        _pass("unflatten", (nn.Unflatten,), (torch.unflatten,), ("unflatten",)),
        _pass("reshape", (), (torch.reshape,), ("reshape", "view", "view_as", "reshape_as")),
        _pass("permute", (), (torch.permute,), ("permute",)),
        _pass(
            "transpose",
            (),
            (torch.transpose, torch.t, torch.swapaxes, torch.swapdims),
            ("transpose", "t", "swapaxes", "swapdims"),
        ),
        _pass("squeeze", (), (torch.squeeze,), ("squeeze",)),
        _pass("unsqueeze", (), (torch.unsqueeze,), ("unsqueeze",)),
        _pass("chunk", (), (torch.chunk,), ("chunk",)),
        _pass("split", (), (torch.split,), ("split",)),
        _pass("unbind", (), (torch.unbind,), ("unbind",)),
        _pass("narrow", (), (torch.narrow,), ("narrow",)),
        _pass("select", (), (torch.select,), ("select",)),
        _pass("index_select", (), (torch.index_select,), ("index_select",)),
        _pass("gather", (), (torch.gather,), ("gather",)),
        _pass("amax", (), (torch.amax,), ("amax",)),
        _pass("amin", (), (torch.amin,), ("amin",)),
        _pass("argmax", (), (torch.argmax,), ("argmax",), qtensor="custom"),
        _pass("argmin", (), (torch.argmin,), ("argmin",), qtensor="custom"),
        _pass("flip", (), (torch.flip,), ("flip",)),
        _pass("roll", (), (torch.roll,), ("roll",)),
        _pass("expand", (), (), ("expand", "expand_as")),
        _pass("repeat", (), (), ("repeat",)),
        _pass("contiguous", (), (), ("contiguous", "clone", "detach"), qtensor="custom"),
        _pass("to", (), (), ("to",), qtensor="custom", refine=_refine_to),
        _pass("getitem", (), (operator.getitem,), ("__getitem__",)),
        # -- known float ops (no integer implementation yet) ---------------------------------
        _float(
            "conv_functional",
            "",
            functions=(F.conv1d, F.conv2d, F.conv3d, F.linear),
            refine=_refine_functional_weight,
        ),
        _float("prelu_functional", "", functions=(F.prelu,), refine=_refine_functional_weight),
        # -- Python values -------------------------------------------------------------------
        OpRow("getattr", Kind.NONTENSOR, functions=(getattr, len), doc="shapes and attributes"),
        OpRow(
            "python_value",
            Kind.NONTENSOR,
            functions=(torch._assert, torch.finfo, torch.iinfo, math.floor, math.ceil, math.sqrt),
            doc="assertions and number types on Python values",
        ),
        OpRow(
            "shape_arithmetic",
            Kind.NONTENSOR,
            functions=_SHAPE_OPERATORS,
            refine=_refine_shape_arithmetic,
            doc="comparisons, floor division and remainders of sizes (Python values); on tensors "
            "they stay float",
        ),
        OpRow("tensor_metadata", Kind.NONTENSOR, methods=tuple(sorted(NONTENSOR_METHODS))),
    ]
    return _documented(rows)


def _documented(rows: list[OpRow]) -> list[OpRow]:
    return [dataclasses.replace(r, doc=_DOCS.get(r.name, r.doc)) for r in rows]


def _torchvision_rows() -> list[OpRow]:
    from torchvision.ops import StochasticDepth, stochastic_depth

    # identity in eval; a random mask in training
    return [_pass("stochastic_depth", (StochasticDepth,), (stochastic_depth,), qtensor=None)]


#: rows whose targets live in optional packages, by package: added once the package has been
#: imported (a model can hold its modules or call its functions only then), so that
#: ``import fxq`` imports none of them
_OPTIONAL_ROWS: dict[str, Callable[[], list[OpRow]]] = {"torchvision": _torchvision_rows}


_DOCS = {
    "add": "inputs rescaled to the output scale by fixed-point multipliers, one shift",
    "sub": "as add, with the second multiplier negated",
    "mul": "int32 product at s_a * s_b, requantized",
    "pow": "x ** 2: int32 X*X, requantized; x ** 3: (X*X >> K) * X, requantized (K = 0 for "
    "int8, 16 for int16); other exponents stay float",
    "where": "condition a bool tensor (never quantized); input / other requantized to the "
    "output scale (numbers: round(c / s_y)), then selected; a -inf / finfo.min fill value "
    "(an additive attention mask) stays float",
    "to": "a move to another device (or to float32): the grid is kept",
    "cat": "every input requantized to the output scale",
    "stack": "every input requantized to the output scale, then stacked",
    "maximum": "both inputs requantized to the output scale, then the larger",
    "minimum": "both inputs requantized to the output scale, then the smaller",
    "matmul": "exact integer accumulation, requantized",
    "mean": "int32 sum, requantized by scale / count",
    "sum": "int32 sum, requantized",
    "relu6": "a clamp in the integer domain",
    "hardtanh": "a clamp in the integer domain",
    "clamp": "a clamp in the integer domain (constant bounds)",
    "interpolate": "bilinear with integer weights; nearest keeps the grid",
    "upsampling_bilinear2d": "bilinear with integer weights",
    "grid_sample": "4-d input, quantized grid: fixed-point coordinates (8 fraction bits), "
    "bilinear with integer weights or nearest, zeros / border padding, requantized; bicubic "
    "and reflection stay float",
    "relu": "max(q, 0): the grid is kept",
    "layer_norm": "int64 mean and variance, rsqrt table, int16 (bayes) / int8 normalized values, "
    "int8 per-channel affine, requantized",
    "group_norm": "as layer_norm, over each group; per-channel affine",
    "scaled_dot_product_attention": "integer q @ k^T (scale in the multiplier), integer softmax "
    "over the entries attn_mask (bool, or additive 0 / <= -1e4; never quantized) and is_causal "
    "leave in, integer probabilities @ v; int16 scores and probabilities (bayes)",
    "multihead_attention": "int8 per-channel q / k / v and output projections with int32 biases, "
    "integer attention per head as scaled_dot_product_attention (key_padding_mask and attn_mask "
    "as keep-masks); returns the integer probabilities as weights",
    "abs": "|x| by lookup table (exact where the output scale is the input's; the int16 "
    "segments have a knot at 0)",
    "prelu": "both sides requantized to the output scale; the per-channel slope is the "
    "negative side's multiplier (exact); F.prelu with a weight tensor stays float",
    "embedding": "int8 table with one scale per row, requantized once to the output scale; "
    "a lookup is an exact gather of integer token ids",
    "div": "tensor / tensor and number / tensor: one exact integer division; tensor / number: "
    "a multiplier",
    "softmax": "subtract max, exp2 table, int32 sum, exact integer division (log-softmax: "
    "log table), 16-bit intermediates",
}
for _d in (1, 2, 3):
    _DOCS[f"avg_pool{_d}d"] = "int32 sum, requantized by scale / (kernel size)"
    _DOCS[f"adaptive_avg_pool{_d}d"] = "int32 sum per window, requantized"


#: tensor methods that return Python values (sizes, flags), not tensors
NONTENSOR_METHODS = frozenset(
    {
        "size",
        "dim",
        "numel",
        "nelement",
        "element_size",
        "is_contiguous",
        "get_device",
        "tolist",
        "item",
        "__len__",
    }
)

_ROWS: tuple[OpRow, ...] = tuple(_table())

_BY_NAME: dict[str, OpRow] = {}
_BY_MODULE: dict[type, OpRow] = {}
_BY_FUNCTION: dict[Any, OpRow] = {}
_BY_METHOD: dict[str, OpRow] = {}


def _index(new: Iterable[OpRow]) -> None:
    for row in new:
        if row.name in _BY_NAME:
            raise ValueError(f"two registry rows are named {row.name!r}")
        _BY_NAME[row.name] = row
        for table, targets in (
            (_BY_MODULE, row.modules),
            (_BY_FUNCTION, row.functions),
            (_BY_METHOD, row.methods),
        ):
            for t in targets:
                if t in table:
                    raise ValueError(f"{t!r} is in rows {table[t].name!r} and {row.name!r}")
                table[t] = row


_index(_ROWS)


def _add_optional_rows(import_packages: bool = False) -> None:
    """Add the rows of the optional packages imported by now (or, with ``import_packages``,
    of every installed one). Cheap when there is nothing to add: every lookup calls it."""
    global _ROWS
    for package in list(_OPTIONAL_ROWS):
        if package not in sys.modules and not (
            import_packages and importlib.util.find_spec(package) is not None
        ):
            continue
        make = _OPTIONAL_ROWS.pop(package)
        try:
            added = _documented(make())
        except ImportError:  # pragma: no cover  (a broken install: its ops stay unknown)
            continue
        _index(added)
        _ROWS = _ROWS + tuple(added)
        _install_qtensor_passthroughs(added)
        registry_class.cache_clear()
        _integer_by_qat.cache_clear()


def rows() -> tuple[OpRow, ...]:
    """The registry's rows: fxq's own and those of the optional packages imported by now."""
    if _OPTIONAL_ROWS:
        _add_optional_rows()
    return _ROWS


def __getattr__(name: str) -> Any:
    if name == "ROWS":  # every row, those of installed optional packages included
        _add_optional_rows(import_packages=True)
        return _ROWS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- lookups ---------------------------------------------------------------------------
def target_name(target: Any) -> str:
    """A readable name for a node target (``torch.nn.functional.layer_norm``, ``x.view``)."""
    if isinstance(target, str):
        return f"Tensor.{target}"
    if isinstance(target, type):
        return f"{target.__module__}.{target.__qualname__}"
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", None) or repr(target)
    if module in ("_operator", "operator"):
        return f"operator.{name}"
    for prefix, namespace in (("torch.nn.functional", F), ("torch", torch)):
        if getattr(namespace, name, None) is target:
            return f"{prefix}.{name}"
    if module.startswith("torch._C") or module == "":
        module = "torch"
    return f"{module}.{name}"


def _unknown(target: Any) -> OpRow:
    return OpRow(
        target_name(target),
        Kind.FLOAT,
        reason="no registry row: fxq has no integer implementation of this op",
    )


def row_named(name: str) -> OpRow:
    """The row whose qconfig key is ``name``.

    Raises:
        KeyError: for an unknown name (the message lists close matches).
    """
    rows()
    try:
        return _BY_NAME[name]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(name, list(_BY_NAME), n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise KeyError(f"no registry row named {name!r}{hint}") from None


#: methods that decide what a registry module computes: a subclass overriding one of them
#: computes something else, so it is not its base (it is traced through instead)
_COMPUTING_METHODS = ("forward", "_conv_forward")


@functools.cache
def registry_class(cls: type) -> type | None:
    """The registry module class that ``cls`` behaves as, or None.

    ``cls`` itself when a row names it; otherwise the nearest base class that a
    row names, provided no class between them overrides ``forward`` (or
    ``_conv_forward``): ``class MyConv(nn.Conv2d): pass`` and torchvision's
    ``Conv3DSimple`` are ``nn.Conv2d`` / ``nn.Conv3d`` for tracing, fusion,
    QAT and convert. A subclass with its own ``forward`` computes something
    else and gets None (the tracer traces through it).

    >>> class MyConv(torch.nn.Conv2d):
    ...     pass
    >>> registry_class(MyConv) is torch.nn.Conv2d, registry_class(torch.nn.Module)
    (True, None)
    """
    rows()  # a class of an optional package: its rows first
    if cls in _BY_MODULE:
        return cls
    for i, base in enumerate(cls.__mro__[1:], start=1):
        if base in _BY_MODULE:
            between = cls.__mro__[:i]
            if any(name in klass.__dict__ for klass in between for name in _COMPUTING_METHODS):
                return None
            return base
    return None


def row_for_module(cls: type) -> OpRow:
    """The row of a float module class (or of the registry class it subclasses without
    changing ``forward``, see ``registry_class``); a FLOAT row when unknown."""
    base = registry_class(cls)
    return _BY_MODULE[base] if base is not None else _unknown(cls)


def row_for_function(fn: Any) -> OpRow:
    """The row of a ``call_function`` target; a FLOAT row when unknown."""
    rows()
    try:
        row = _BY_FUNCTION.get(fn)
    except TypeError:  # unhashable target
        row = None
    return row or _unknown(fn)


def row_for_method(name: str) -> OpRow:
    """The row of a ``call_method`` target (a ``Tensor`` method name); FLOAT when unknown."""
    return _BY_METHOD.get(name) or _unknown(name)


def row_for(node: Node, modules: dict[str, nn.Module]) -> tuple[OpRow, nn.Module | None]:
    """The row that applies to ``node`` (refined by its arguments) and its module."""
    module = None
    if node.op == "call_module":
        module = modules[node.target]
        row = row_for_module(type(module))
    elif node.op == "call_function":
        row = row_for_function(node.target)
    elif node.op == "call_method":
        row = row_for_method(node.target)
    else:
        row = _unknown(node.op)
    return row.resolve(node, module), module


def canonical_key(target: Any) -> Any:
    """The qconfig key of a functional target: its row's name (the target itself if unknown).

    Module classes are their own key (``nn.Conv2d``); ``torch.add``,
    ``operator.iadd`` and the method name ``"add_"`` all give ``"add"``.
    """
    if isinstance(target, type):
        return target
    rows()
    if isinstance(target, str):
        row = _BY_NAME.get(target) or _BY_METHOD.get(target)
        return row.name if row is not None else target
    try:
        row = _BY_FUNCTION.get(target)
    except TypeError:
        return target
    return row.name if row is not None else target


@functools.cache
def _integer_by_qat() -> dict[type, type]:
    table: dict[type, type] = {}
    for row in rows():
        if row.qat is not None and row.integer is not None:
            table[row.qat_class] = row.integer_class
    return table


def integer_class_for(qat_cls: type) -> type:
    """The fxq.quantized class a QAT class converts to.

    A class that ``torch.distributed`` made for a wrapped module converts as the module's
    own class: ``fully_shard`` (FSDP2) turns an ``fxq.qat.Conv2d`` into an instance of
    ``FSDPConv2d(FSDPModule, Conv2d)``, whose VALIDATION forward builds the integer twin here.

    Raises:
        KeyError: for a class that no row names as its QAT class.
    """
    try:
        return _integer_by_qat()[_without_distributed_wrapper(qat_cls)]
    except KeyError:
        raise KeyError(f"no registry row converts {qat_cls.__name__}") from None


def _without_distributed_wrapper(cls: type) -> type:
    """The first class of ``cls``'s MRO that ``torch.distributed`` did not define: ``cls``
    itself, or the module's class under ``fully_shard``'s / ``replicate``'s dynamic subclass
    (``type(f"FSDP{name}", (FSDPModule, cls), ...)``, made in ``torch.distributed``)."""
    for base in cls.__mro__:
        if not base.__module__.startswith("torch.distributed."):
            return base
    return cls


def fusion_members(role: str) -> tuple[tuple[type, ...], tuple[Any, ...], tuple[str, ...]]:
    """The module classes, functions and method names that play ``role`` in fusions."""
    members = [r for r in rows() if r.fusion_role == role]
    return (
        tuple(m for r in members for m in r.modules),
        tuple(f for r in members for f in r.functions),
        tuple(m for r in members for m in r.methods),
    )


def functional_target(node: Node) -> Callable:
    """The callable a COMPUTE ``call_function`` / ``call_method`` node computes."""
    if node.op == "call_function":
        return node.target
    name = node.target
    if name.endswith("_") and not name.startswith("__"):
        name = name.rstrip("_")
    fn = getattr(torch, name, None)
    return fn if fn is not None else getattr(torch.Tensor, node.target)


# -- QTensor pass-throughs ----------------------------------------------------------------
def _install_qtensor_passthroughs(new: Iterable[OpRow]) -> None:
    """Give QTensor every pass-through row's methods and functions ("data" rows)."""
    for row in new:
        if row.kind is not Kind.PASSTHROUGH or row.qtensor != "data":
            continue
        for name in row.methods:
            if name not in QTensor.__dict__:
                setattr(QTensor, name, passthrough_method(name))
        for fn in row.functions:
            if not is_handled(fn):
                implements(fn)(passthrough_function(fn))


_install_qtensor_passthroughs(_ROWS)


# -- documentation ----------------------------------------------------------------------
def _target_label(target: Any) -> str:
    if isinstance(target, str):
        return f"`.{target}()`"
    if isinstance(target, type):
        module = target.__module__
        prefix = "nn." if module.startswith("torch.nn") else f"{module}."
        return f"`{prefix}{target.__name__}`"
    return f"`{target_name(target).replace('torch.nn.functional.', 'F.')}`"


def markdown_table() -> str:
    """The registry as a Markdown table (``docs/ops.md`` is this text; a test keeps it so)."""
    lines = [
        "| op (qconfig key) | kind | matches | QAT / integer class | fusion role | notes |",
        "|---|---|---|---|---|---|",
    ]
    _add_optional_rows(import_packages=True)  # the same table whatever was imported
    for row in _ROWS:
        classes = (
            f"`{row.qat.removeprefix('fxq.')}` / `{row.integer.removeprefix('fxq.')}`"
            if row.qat and row.integer
            else ""
        )
        notes = row.reason or row.doc
        if row.refine is not None and row.kind is not Kind.FLOAT:
            notes = (notes + "; " if notes else "") + "depends on the call's arguments"
        lines.append(
            f"| `{row.name}` | {row.kind.value} | {', '.join(map(_target_label, row.targets))} "
            f"| {classes} | {row.fusion_role or ''} | {notes} |"
        )
    return "\n".join(lines) + "\n"
