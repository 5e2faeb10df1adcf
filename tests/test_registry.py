"""The op registry, row by row: every target of every quantizable row is prepared,
calibrated, run in VALIDATION and converted, and the integer model must equal
VALIDATION bit for bit; the QAT state_dict round-trips into a fresh prepare,
and the models survive ``.to(float64)`` and back.

A row without an example here fails ``test_every_row_has_an_example``: adding
an op means adding its row, its two classes and its example.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxq
from fxq import registry
from fxq.qconfig import default_qat_8bit_fake_quant_qconfig
from fxq.registry import Kind

QCONFIG = {"": default_qat_8bit_fake_quant_qconfig}


@dataclass
class Example:
    """How to exercise one row.

    ``build(target)`` returns a callable ``(module_or_none, x, y) -> Tensor`` run
    in the model's forward, and the module to register (for module targets).
    """

    shapes: tuple[tuple[int, ...], ...] = ((2, 4, 8, 8),)
    module: Callable[[type], nn.Module] | None = None
    call: Callable[..., Any] | None = None  # (f, x, y); methods come as f(t, *args)
    by_dim: bool = False  # input shape from the 1d / 2d / 3d in the target's name
    ids: int = 0  # > 0: the input is integer token ids below this (no quant stub)

    def input_shapes(self, target: Any) -> tuple[tuple[int, ...], ...]:
        if self.by_dim:
            name = target if isinstance(target, str) else target.__name__
            for d in (1, 2, 3):
                if f"{d}d" in name.lower():
                    return (_BY_DIM[d],)
        return self.shapes


def _unary(*args: Any, **kwargs: Any) -> Callable[..., Any]:
    return lambda f, x, y, **v: f(x, *args, **{**kwargs, **v})


def _binary(f: Callable, x: torch.Tensor, y: torch.Tensor, **v: Any) -> torch.Tensor:
    return f(x.clone(), y)  # clone: in-place forms must not touch the model input


def _divisions(f: Callable, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """tensor / tensor, tensor / number and (``/``) number / tensor; in-place forms: the first."""
    if f is operator.itruediv or getattr(f, "__name__", "") == "div_":
        return f(x.clone(), y)
    out = f(x, y) + f(x, -4.0)
    return out + f(2.0, y) if f is operator.truediv else out


def _attention(f: Callable, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """SDPA without a mask, causal, with a bool keep-mask (a row with nothing kept) and with an
    additive float mask of 0 / ``finfo.min`` (both constants: never quantized)."""
    keep = (torch.arange(60).reshape(2, 1, 5, 6) % 4 != 1) & (torch.arange(5).reshape(5, 1) != 2)
    low = torch.finfo(torch.float32).min
    additive = torch.zeros(5, 6).masked_fill(torch.arange(30).reshape(5, 6) % 3 == 0, low)
    return (
        f(x, y, y)
        + f(x, x, x, is_causal=True, scale=0.5)
        + f(x, y, y, attn_mask=keep)
        + f(x, y, y, additive)
    )


def _pow(f: Callable, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x ** 2`` and ``x ** 3`` (square forms: ``x ** 2``; in-place forms on a copy)."""
    name = getattr(f, "__name__", "")
    if "square" in name:
        return f(x.clone())
    if f is operator.ipow or name == "pow_":
        return f(x.clone(), 3)
    return f(x, 2) + f(x, 3.0)


def _where(f: Callable, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Two quantized operands at different scales, and a number and a quantized operand."""
    condition = torch.arange(64).reshape(8, 8) % 3 == 0
    return f(condition, x, y * 2) + f(condition, 0.5, x)


def _einsum(f: Callable, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Batched matmuls: ``b`` transposed (maxvit's spelling), the output transposed, ``a``
    and ``b`` transposed with the operands as a list."""
    return (
        f("B H I D, B H J D -> B H I J", x, y)
        + f("...jd,...id->...ij", y, x)
        + f("bhdi,bhjd->bhij", [x.transpose(-2, -1), y])
    )


def _grid_sample(f: Callable, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Bilinear with zeros padding (grid values beyond [-1, 1] sample outside), nearest with
    border padding and align_corners, bilinear with border padding."""
    return (
        f(x, y, align_corners=False)
        + f(x, y, mode="nearest", padding_mode="border", align_corners=True)
        + f(x, y, "bilinear", "border", False)
        + f(x, y, "nearest", align_corners=False)
    )


def _first(*args: Any) -> Callable[..., Any]:
    return lambda f, x, y: f(x, *args)[0]


class _SelfAttention(nn.Module):
    """``mha(x, x, x)``: its output and its head-averaged weights (``need_weights``), summed
    with a second call's output (``need_weights=False``) so the test compares one tensor."""

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        self.mha = mha
        padding = torch.zeros(2, 5, dtype=torch.bool)
        padding[0, 3:] = True
        self.register_buffer("padding", padding)
        causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
        self.register_buffer("causal", torch.zeros(5, 5).masked_fill(causal, float("-inf")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, weights = self.mha(x, x, x)
        plain, _ = self.mha(x, x, x, need_weights=False)
        # masks: padding (bool, True = left out) and causal (additive -inf), never quantized
        masked, masked_weights = self.mha(
            x, x, x, key_padding_mask=self.padding, attn_mask=self.causal
        )
        return torch.cat([out, plain, weights, masked, masked_weights], -1)


class _PReLU(nn.Module):
    """A per-channel PReLU with slopes of both signs and 0, and a single-slope one."""

    def __init__(self, prelu: nn.PReLU) -> None:
        super().__init__()
        self.prelu = prelu
        self.prelu.weight.data = torch.tensor([0.25, -0.5, 0.0, 1.75])
        self.single = type(prelu)()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.prelu(x), self.single(x)], 1)


D1, D2, D3 = (2, 4, 8), (2, 4, 8, 8), (2, 4, 4, 6, 6)
_BY_DIM = {1: D1, 2: D2, 3: D3}

EXAMPLES: dict[str, Example] = {}
for d in (1, 2, 3):
    EXAMPLES[f"conv{d}d"] = Example((_BY_DIM[d],), module=lambda c: c(4, 6, 3, padding=1))
    EXAMPLES[f"conv_transpose{d}d"] = Example(
        (_BY_DIM[d],), module=lambda c: c(4, 6, 3, stride=2, padding=1)
    )
    EXAMPLES[f"batch_norm{d}d"] = Example((_BY_DIM[d],), module=lambda c: c(4))
    EXAMPLES[f"avg_pool{d}d"] = Example((_BY_DIM[d],), module=lambda c: c(2), call=_unary(2))
    EXAMPLES[f"adaptive_avg_pool{d}d"] = Example(
        (_BY_DIM[d],), module=lambda c: c(2), call=_unary(2)
    )
    EXAMPLES[f"max_pool{d}d"] = Example(
        (_BY_DIM[d],),
        module=lambda c: c(2),
        call=lambda f, x, y: f(x, 2)[0] if "indices" in f.__name__ else f(x, 2),
    )
    EXAMPLES[f"adaptive_max_pool{d}d"] = Example(
        (_BY_DIM[d],), module=lambda c: c(2), call=_unary(2)
    )
EXAMPLES.update(
    {
        "linear": Example(((2, 3, 8),), module=lambda c: c(8, 5)),
        "quant_stub": Example(module=lambda c: c()),
        "dequant_stub": Example(module=lambda c: c()),
        "add": Example((D2, D2), call=_binary),
        "sub": Example((D2, D2), call=_binary),
        "mul": Example((D2, D2), call=_binary),
        "cat": Example((D2, D2), call=lambda f, x, y: f([x, y], 1)),
        "stack": Example((D2, D2), call=lambda f, x, y: f([x, y * 2], 2)),
        "maximum": Example((D2, D2), call=lambda f, x, y: f(x, y * 2)),
        "minimum": Example((D2, D2), call=lambda f, x, y: f(x, y * 2)),
        "div": Example((D2, D2), call=lambda f, x, y: _divisions(f, x, y * y + 0.5)),
        "matmul": Example(((2, 4, 8), (2, 8, 5)), call=_binary),
        "einsum": Example(((2, 3, 4, 5), (2, 3, 6, 5)), call=_einsum),
        "mean": Example(call=_unary(-1, keepdim=True)),
        "sum": Example(call=_unary(-1)),
        "relu6": Example(module=lambda c: c(), call=_unary()),
        "hardtanh": Example(module=lambda c: c(-0.5, 0.5), call=_unary(-0.5, 0.5)),
        "clamp": Example(call=lambda f, x, y: f(x.clone(), -0.5, 0.5)),
        "interpolate": Example(
            module=lambda c: c(scale_factor=2, mode="bilinear", align_corners=False),
            call=_unary(scale_factor=2, mode="bilinear", align_corners=False),
        ),
        "upsampling_bilinear2d": Example(module=lambda c: c(scale_factor=2)),
        "grid_sample": Example(((2, 4, 8, 8), (2, 5, 6, 2)), call=_grid_sample),
        "upsampling_nearest2d": Example(module=lambda c: c(scale_factor=2)),
        "relu": Example(module=lambda c: c(), call=lambda f, x, y: f(x.clone())),
        "dropout": Example(
            (D1,), module=lambda c: c(0.5), call=lambda f, x, y: f(x, 0.5, False), by_dim=True
        ),
        "pad": Example(module=lambda c: c(1), call=_unary((1, 2)), by_dim=True),
        "pixel_shuffle": Example(module=lambda c: c(2), call=_unary(2)),
        "pixel_unshuffle": Example(module=lambda c: c(2), call=_unary(2)),
        "channel_shuffle": Example(module=lambda c: c(2), call=_unary(2)),
        "identity": Example(module=lambda c: c()),
        "flatten": Example(module=lambda c: c(), call=_unary(1)),
        "unflatten": Example(module=lambda c: c(1, (2, 2)), call=_unary(1, (2, 2))),
        "reshape": Example(
            (D2, (2, 256)),
            call=lambda f, x, y: (
                f(x, y) if f.__name__ in ("view_as", "reshape_as") else f(x, (2, -1))
            ),
        ),
        "permute": Example(call=lambda f, x, y: f(x, (0, 2, 3, 1))),
        "transpose": Example(
            ((8, 4),), call=lambda f, x, y: f(x) if f.__name__ == "t" else f(x, 0, 1)
        ),
        "squeeze": Example(((2, 1, 8),), call=_unary(1)),
        "unsqueeze": Example(call=_unary(1)),
        "chunk": Example(call=_first(2, 1)),
        "split": Example(call=_first(2, 1)),
        "unbind": Example(call=_first(1)),
        "narrow": Example(call=_unary(1, 0, 2)),
        "select": Example(call=_unary(1, 2)),
        "argmax": Example(call=lambda f, x, y: f(x, 1, True)),
        "argmin": Example(call=lambda f, x, y: f(x, -1)),
        "amax": Example(call=lambda f, x, y: f(f(x, -1, True), (1, 3))),
        "amin": Example(call=lambda f, x, y: f(f(x, -1, True), (1, 3))),
        "index_select": Example(call=lambda f, x, y: f(x, 1, torch.tensor([2, 0, 2]))),
        "gather": Example(call=lambda f, x, y: f(x, 3, torch.tensor([7, 0, 3]).repeat(2, 4, 8, 1))),
        "flip": Example(call=lambda f, x, y: f(x, (1,))),
        "roll": Example(call=_unary(1, 2)),
        "expand": Example(
            ((2, 1, 8), (2, 3, 8)),
            call=lambda f, x, y: f(x, y) if f.__name__ == "expand_as" else f(x, 2, 3, 8),
        ),
        "repeat": Example(call=lambda f, x, y: f(x, 1, 2, 1, 1)),
        "contiguous": Example(call=lambda f, x, y: f(x)),
        "getitem": Example(call=lambda f, x, y: f(x, (slice(None), slice(0, 2)))),
        "layer_norm": Example(module=lambda c: c(8), call=_unary((8,))),
        "group_norm": Example(module=lambda c: c(2, 4), call=_unary(2)),
        "softmax": Example(module=lambda c: c(dim=1), call=_unary(1)),
        "normalize": Example(
            call=lambda f, x, y: f(x, dim=-1) + f(x, 2, (1, 2)) + f(x * 0.05, 2.0, 1, 0.5)
        ),
        "multihead_attention": Example(
            ((2, 5, 8),), module=lambda c: _SelfAttention(c(8, 2, batch_first=True))
        ),
        "scaled_dot_product_attention": Example(((2, 2, 5, 8), (2, 2, 6, 8)), call=_attention),
        "pow": Example(call=_pow),
        "where": Example((D2, D2), call=_where),
        "to": Example(call=lambda f, x, y: f(f(x, x.device), torch.float32)),
        "prelu": Example(module=lambda c: _PReLU(c(4))),
        "embedding": Example(((2, 7),), module=lambda c: c(10, 8, padding_idx=0), ids=10),
        "stochastic_depth": Example(
            module=lambda c: c(0.5, "row"), call=lambda f, x, y: f(x, 0.5, "row", False)
        ),
    }
)
for _name in (
    "sigmoid",
    "tanh",
    "hardsigmoid",
    "hardswish",
    "silu",
    "gelu",
    "exp",
    "elu",
    "softplus",
    "mish",
    "abs",
):
    EXAMPLES[_name] = Example(module=lambda c: c(), call=lambda f, x, y: f(x.clone()))

EXAMPLES["leaky_relu"] = Example(
    module=lambda c: c(0.2),
    call=lambda f, x, y: f(x.clone(), 0.2) + f(x, negative_slope=-0.3),
)

QUANTIZABLE = (Kind.WEIGHTED, Kind.COMPUTE, Kind.PASSTHROUGH, Kind.QUANT_STUB, Kind.DEQUANT_STUB)


def _cases() -> list[Any]:
    cases = []
    for row in registry.ROWS:
        if row.kind not in QUANTIZABLE or row.name == "fused":
            continue
        for target in row.targets:
            label = target if isinstance(target, str) else getattr(target, "__name__", target)
            cases.append(pytest.param(row.name, target, id=f"{row.name}-{label}"))
    return cases


class OpModel(nn.Module):
    """``x`` (and ``y``) -> the op -> output; ``y`` is an optional second input."""

    def __init__(self, row_name: str, target: Any) -> None:
        super().__init__()
        self.example = EXAMPLES[row_name]
        self.row_name = row_name
        self.target = target
        self.quant = fxq.QuantStub()  # pass-through-only models need a quantized input
        if isinstance(target, type):
            self.op = self.example.module(target)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x, None)

    def run(self, x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        if not self.example.ids:
            x = self.quant(x)
        target = self.target
        if isinstance(target, type):
            if target in (fxq.DeQuantStub, torch.ao.quantization.DeQuantStub):
                return self.op(torch.relu(x))
            return self.op(x) if y is None else self.op(x, y)
        if isinstance(target, str):
            return self.example.call(_Method(target), x, y)
        return self.example.call(target, x, y)


class BinaryOpModel(OpModel):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.run(x, y)


class _Method:
    """``f(t, *args)`` = ``t.<name>(*args)``, traced as a ``call_method`` node."""

    def __init__(self, name: str) -> None:
        self.__name__ = name

    def __call__(self, t: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(t, self.__name__)(*args, **kwargs)


def _inputs(row_name: str, target: Any, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    shapes = EXAMPLES[row_name].input_shapes(target)
    if EXAMPLES[row_name].ids:
        return tuple(torch.randint(EXAMPLES[row_name].ids, s, generator=g) for s in shapes)
    return tuple(torch.randn(s, generator=g) for s in shapes)


def _prepare(row_name: str, target: Any) -> nn.Module:
    binary = len(EXAMPLES[row_name].input_shapes(target)) == 2
    model = (BinaryOpModel if binary else OpModel)(row_name, target)
    if isinstance(model.__dict__.get("op"), nn.modules.batchnorm._BatchNorm):
        model.op.running_mean.uniform_(-0.5, 0.5)
        model.op.running_var.uniform_(0.5, 2.0)
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxq.fx.prepare.FloatOpWarning)
        # integer inputs are known from example inputs only (token ids get no fake quant)
        example = _inputs(row_name, target, 0) if EXAMPLES[row_name].ids else None
        return fxq.prepare_qat_fx(model, QCONFIG, example_inputs=example)


def _calibrate(qat: nn.Module, row_name: str, target: Any) -> None:
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    qat.eval()
    with torch.no_grad():
        for seed in range(3):
            qat(*_inputs(row_name, target, seed))
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)


def _out(value: Any) -> torch.Tensor:
    return value.dequantize() if isinstance(value, fxq.QTensor) else value


def test_every_row_has_an_example():
    missing = [
        r.name
        for r in registry.ROWS
        if r.kind in QUANTIZABLE and r.name != "fused" and r.name not in EXAMPLES
    ]
    assert missing == []


@pytest.mark.parametrize(("row_name", "target"), _cases())
def test_row_prepare_calibrate_convert_bit_exact(bayes, row_name, target):
    qat = _prepare(row_name, target)
    row = registry.row_named(row_name)
    if row.kind in (Kind.WEIGHTED, Kind.COMPUTE):
        assert any(isinstance(m, row.qat_class) for m in qat.modules()), row.qat
    _calibrate(qat, row_name, target)
    x = _inputs(row_name, target, 7)
    with torch.no_grad():
        expected = qat(*x)
    integer = fxq.convert_fx(qat)
    if row.kind in (Kind.WEIGHTED, Kind.COMPUTE):
        assert any(isinstance(m, row.integer_class) for m in integer.modules()), row.integer
    with torch.no_grad():
        got = _out(integer(*x))
    assert got.shape == expected.shape
    assert torch.equal(got, expected)

    # the QAT state_dict loads into a fresh prepare of the same model
    fresh = _prepare(row_name, target)
    fresh.load_state_dict(qat.state_dict())
    fxq.set_fake_quantize(fresh, fxq.FakeQuantState.VALIDATION)
    fresh.eval()
    with torch.no_grad():
        assert torch.equal(fresh(*x), expected)

    # float64 and back changes nothing, for the QAT and the integer model
    qat.to(torch.float64).to(torch.float32)
    integer.to(torch.float64).to(torch.float32)
    with torch.no_grad():
        assert torch.equal(qat(*x), expected)
        assert torch.equal(_out(integer(*x)), expected)


def test_fused_row_resolves_to_its_anchor(bayes):
    model = nn.Sequential(nn.Conv2d(4, 6, 3), nn.BatchNorm2d(6), nn.ReLU()).eval()
    gm = fxq.fuse_fx(model)
    fused = gm.get_submodule("0")
    assert registry.row_for_module(type(fused)).name == "fused"
    node = next(n for n in gm.graph.nodes if n.op == "call_module")
    row, _ = registry.row_for(node, dict(gm.named_modules()))
    assert row.name == "conv2d" and row.kind is Kind.WEIGHTED


@pytest.mark.parametrize(
    "row", [r for r in registry.ROWS if r.kind is Kind.PASSTHROUGH], ids=lambda r: r.name
)
def test_passthrough_rows_run_on_qtensors(row):
    # every pass-through target must exist on QTensor (the drift that crashed nn.Unflatten)
    for name in row.methods:
        assert callable(getattr(fxq.QTensor, name, None)), name
    if row.qtensor in ("data", "custom"):
        for fn in row.functions:
            assert fxq.qtensor.is_handled(fn), fn


def test_aliases_share_one_qconfig_key():
    assert {registry.canonical_key(t) for t in (operator.add, operator.iadd, torch.add)} == {"add"}
    assert registry.canonical_key("add_") == "add"
    assert registry.canonical_key(F.gelu) == "gelu"
    assert registry.canonical_key(nn.Conv2d) is nn.Conv2d


def test_float_rows_are_listed_with_their_reason(bayes):
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 1)
            self.g = nn.Parameter(torch.ones(8))
            self.w = nn.Parameter(torch.randn(8, 8, 1, 1))

        def forward(self, x):
            y = self.conv(x)
            # a weight computed in the graph: float (a get_attr weight becomes nn.LayerNorm)
            y = F.layer_norm(y.permute(0, 2, 3, 1), (8,), self.g.contiguous()).permute(0, 3, 1, 2)
            y = F.conv2d(y, self.w.contiguous())  # a weight computed in the graph: float
            return torch.cumsum(torch.cumsum(y, 1), 2)

    with pytest.warns(fxq.fx.prepare.FloatOpWarning) as record:
        fxq.prepare_qat_fx(M(), QCONFIG)
    message = str(record[0].message)
    assert "4 op(s)" in message
    line = M.forward.__code__.co_firstlineno
    assert (
        f"layer_norm (torch.nn.functional.layer_norm, {__file__}:{line + 3}): "
        "torch.nn.functional.layer_norm with weight / bias tensors" in message
    )
    assert (
        f"conv2d (torch.nn.functional.conv2d, {__file__}:{line + 4}): torch.nn.functional.conv2d "
        "with a weight tensor" in message
    )
    assert "cumsum" in message and "no registry row" in message
    with pytest.raises(ValueError, match="4 op\\(s\\) have a qconfig but no integer"):
        fxq.prepare_qat_fx(M(), QCONFIG, float_ops="error")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fxq.prepare_qat_fx(M(), QCONFIG, float_ops="ignore")
        # float on purpose: not listed
        fxq.prepare_qat_fx(
            M(),
            {
                "": default_qat_8bit_fake_quant_qconfig,
                "module_type": {
                    F.layer_norm: None,
                    F.conv2d: None,
                    torch.cumsum: None,
                },
            },
        )


def test_unknown_row_name_suggests_close_matches():
    with pytest.raises(KeyError, match="did you mean 'conv2d'"):
        registry.row_named("conv_2d")


def test_docs_ops_md_is_the_registry_table():
    import pathlib

    doc = (pathlib.Path(__file__).parent.parent / "docs" / "ops.md").read_text()
    assert doc.endswith(registry.markdown_table()), (
        "regenerate docs/ops.md's table with fxq.registry.markdown_table()"
    )
