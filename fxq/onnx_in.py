"""Float ONNX models in: an ONNX graph becomes an FX ``GraphModule`` of ordinary torch ops.

Deployment teams often receive a float ``.onnx`` file, not a training script.
``load_onnx`` turns it into the form fxq quantizes: convolutions and linear
layers become ``nn.Conv2d`` / ``nn.Linear`` modules holding the file's weights
(named after the weights' initializers where those carry a PyTorch parameter
name, so ``module_name`` qconfigs written for the PyTorch model apply), and
every other op becomes the torch function PyTorch code would call
(``F.relu``, ``operator.add``, ``torch.matmul``, ``F.softmax``, ...), which the
op registry knows. The result then goes through the usual pipeline::

    float_model = fxq.onnx_in.load_onnx("model.onnx")
    calib = fxq.prepare_qat_fx(float_model, {"": default_calib_8bit_fake_quant_qconfig})
    fxq.calibration.ptq(calib, batches)
    integer = fxq.convert_fx(calib)

Every op is one row of ``CONVERTERS`` (ONNX op type -> a function that emits the
torch equivalent). Ops whose inputs are all known when the file is read (shape
arithmetic, constants, ``Shape`` of a tensor whose shape the file fixes) are
evaluated then and become constants. An op type without a row is refused
before any work starts, with every such op and its node names listed.

Conversions that change a float op's form on purpose:

* ``MatMul`` by a constant 2-D matrix, followed by the ``Add`` of a constant
  vector, is one ``nn.Linear``; ``Gemm`` with a constant ``B`` is one too.
* ``Clip(0, 6)`` is ``F.relu6``; ``Clip(0, inf)`` is ``F.relu``.
* A batch-normalization the exporter left unfolded is an ``nn.BatchNorm`` module
  (fxq folds it into the conv before it, as it does for PyTorch models).

Exporters fold a BatchNorm into the convolution before it (``torch.onnx.export``
does in eval mode), so the file's conv weights are the folded float weights; fxq's
own folding gives the same float32 values, and the integer model from the file
equals the one from the PyTorch source bit for bit (``tests/test_onnx_in.py``: ResNet-18
and MobileNetV2 from both of torch's exporters, a small ViT). Two things differ by
construction: ``ptq``'s depthwise equalization scales a BatchNorm's gamma where the
PyTorch model has one and the folded weight where the file has it (the same factors,
rounded in another order: close, not bit for bit), and attention arrives decomposed
(``MatMul``, ``Mul``, ``Softmax``), quantized step by step as the same decomposed
PyTorch code would be, where ``nn.MultiheadAttention`` is one attention op.

Why not a general ONNX-to-torch converter (onnx2torch): its modules are opaque to
fxq's op registry (every ``Add`` became a float op), and version 1.5.15 has no
converter for opset 19's ``Reshape``, which torch's default exporter writes.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

__all__ = ["OnnxImportError", "load_onnx", "unsupported_ops", "CONVERTERS"]


class OnnxImportError(ValueError):
    """The ONNX file cannot be turned into a torch graph (an unsupported op or attribute)."""


#: a value while converting: a graph node (known when the model runs) or a constant tensor
Value = Any


class _Builder:
    """Emits the FX graph: constants fold, everything else is a node."""

    def __init__(self, model: Any) -> None:
        from onnx import numpy_helper

        self.model = model
        self.root = nn.Module()
        self.graph = fx.Graph()
        self.values: dict[str, Value] = {}
        self.uses: dict[str, int] = {}
        self.shapes = _static_shapes(model)
        initializers = {i.name for i in model.graph.initializer}
        #: the graph inputs whose shapes the file leaves open (for messages)
        self.open_inputs = ", ".join(
            repr(i.name)
            for i in model.graph.input
            if i.name not in initializers and i.name not in self.shapes
        )
        self._names: set[str] = set()
        #: id -> (the constant, kept alive so that the id stays its own; its get_attr node)
        self._constants: dict[int, tuple[Tensor, fx.Node]] = {}
        self.opset = next(
            (o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13
        )
        for init in model.graph.initializer:
            self.values[init.name] = torch.from_numpy(numpy_helper.to_array(init).copy())
        for node in model.graph.node:
            for name in node.input:
                self.uses[name] = self.uses.get(name, 0) + 1
        for out in model.graph.output:
            self.uses[out.name] = self.uses.get(out.name, 0) + 1

    # -- values ----------------------------------------------------------------------
    @staticmethod
    def is_node(value: Value) -> bool:
        return isinstance(value, fx.Node)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Value:
        """``fn(*args, **kwargs)``: evaluated now when no argument is a node, else a node."""
        flat = [*args, *kwargs.values()]
        flat += [v for a in flat if isinstance(a, (list, tuple)) for v in a]
        if not any(self.is_node(a) for a in flat):
            return fn(*args, **kwargs)
        node = self.graph.call_function(
            fn,
            tuple(self.operand(a) for a in args),
            {k: self.operand(v) for k, v in kwargs.items()},
        )
        self._run_example(node, fn, args, kwargs)
        return node

    def _run_example(self, node: fx.Node, fn: Callable[..., Any], args: Any, kwargs: Any) -> None:
        """Record ``node``'s value on the example inputs (``node.meta["example"]``) when its
        arguments have one: ``Shape`` ops of values whose shape the file leaves open read it."""
        try:
            example_args = self._examples(args)
            example_kwargs = self._examples(kwargs)
        except KeyError:
            return
        with torch.no_grad():
            node.meta["example"] = fn(*example_args, **example_kwargs)

    def _examples(self, value: Any) -> Any:
        if isinstance(value, fx.Node):
            return value.meta["example"]
        if isinstance(value, (list, tuple)):
            return type(value)(self._examples(v) for v in value)
        if isinstance(value, dict):
            return {k: self._examples(v) for k, v in value.items()}
        return value

    def shape(self, name: str) -> list[int] | None:
        """The shape of value ``name`` when known: fixed by the file, or seen on the example
        inputs, or a constant's."""
        if name in self.shapes:
            return self.shapes[name]
        value = self.values.get(name)
        if isinstance(value, fx.Node):
            value = value.meta.get("example")
        return list(value.shape) if isinstance(value, Tensor) else None

    def operand(self, value: Value) -> Any:
        """A constant as a graph argument: a Python number for a zero-dimensional tensor, a
        buffer of the root module otherwise (one per tensor, however many ops read it)."""
        if isinstance(value, (list, tuple)):
            return type(value)(self.operand(v) for v in value)
        if not isinstance(value, Tensor):
            return value
        if value.numel() == 1 and value.dim() == 0:
            return value.item()
        if id(value) not in self._constants:
            name = self.unique_name("constant")
            self.root.register_buffer(name, value)
            self._constants[id(value)] = (value, self.graph.get_attr(name))
        return self._constants[id(value)][1]

    def module(self, path: str, module: nn.Module, x: Value) -> fx.Node:
        """Add ``module`` at ``path`` (creating the containers on the way) and call it."""
        path = self.unique_name(path)
        parent = self.root
        *parents, leaf = path.split(".")
        for part in parents:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.add_module(leaf, module)
        node = self.graph.call_module(path, (x,))
        self._run_example(node, module, (x,), {})
        return node

    def unique_name(self, name: str) -> str:
        name = ".".join(re.sub(r"\W", "_", p) or "_" for p in name.split(".")) or "op"
        candidate, i = name, 1
        while candidate in self._names:
            candidate = f"{name}_{i}"
            i += 1
        self._names.add(candidate)
        return candidate

    def rank(self, name: str) -> int | None:
        """The rank of value ``name`` when its shape is known."""
        shape = self.shape(name)
        return None if shape is None else len(shape)

    def const(self, node: Any, index: int, what: str) -> Tensor | None:
        """Input ``index`` of ``node``, which must be known when the file is read."""
        if index >= len(node.input) or not node.input[index]:
            return None
        value = self.values[node.input[index]]
        if self.is_node(value):
            raise OnnxImportError(
                f"ONNX node {node.name!r} ({node.op_type}): its {what} (input {index}, "
                f"{node.input[index]!r}) is computed when the model runs; fxq needs it constant"
            )
        return value


def _identifier(text: str) -> str:
    text = re.sub(r"\W", "_", text).strip("_") or "op"
    return f"_{text}" if text[0].isdigit() else text


def _static_shapes(model: Any) -> dict[str, list[int]]:
    """Every value's shape that the file fixes (shape inference), for ``Shape`` ops."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # a model shape inference cannot read still converts, without them
        return {}
    shapes = {}
    for info in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        dims = info.type.tensor_type.shape.dim
        if dims and all(d.HasField("dim_value") for d in dims):
            shapes[info.name] = [d.dim_value for d in dims]
    return shapes


def _attrs(node: Any) -> dict[str, Any]:
    from onnx import helper

    out = {}
    for a in node.attribute:
        value = helper.get_attribute_value(a)
        out[a.name] = value.decode() if isinstance(value, bytes) else value
    return out


# -- converters ------------------------------------------------------------------------------
#: ONNX op type -> converter(builder, node, inputs, attributes) -> value or list of values
CONVERTERS: dict[str, Callable[..., Any]] = {}


def _converts(*op_types: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in op_types:
            CONVERTERS[op] = fn
        return fn

    return register


def _symmetric_padding(node: Any, pads: Sequence[int], spatial: int) -> tuple[int, ...]:
    pads = list(pads) or [0] * (2 * spatial)
    begin, end = pads[:spatial], pads[spatial:]
    if begin != end:
        raise OnnxImportError(
            f"ONNX node {node.name!r} ({node.op_type}): asymmetric pads {pads} are not "
            "supported; re-export with symmetric padding"
        )
    return tuple(begin)


def _check_auto_pad(node: Any, attrs: dict[str, Any]) -> None:
    if attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        raise OnnxImportError(
            f"ONNX node {node.name!r} ({node.op_type}): auto_pad={attrs['auto_pad']!r} is not "
            "supported; re-export with explicit pads"
        )


def _module_path(b: _Builder, node: Any, weight_input: int) -> str:
    """The PyTorch module path the op came from, when the file says it.

    The weight initializer's name without ``.weight`` (``torch.export``'s exporter keeps
    parameter names), else the scope in the node's name (the TorchScript exporter writes
    ``/layer1/layer1.0/conv1/Conv``: ``layer1.0.conv1``), else the node's name.
    """
    name = node.input[weight_input] if weight_input < len(node.input) else ""
    if name.endswith(".weight") and "::" not in name:
        return name[: -len(".weight")]
    scopes = (node.name or "").strip("/").split("/")[:-1]
    parts: list[str] = []
    for scope in scopes:  # each scope is named from an ancestor's name on, or alone
        for k in range(len(parts)):
            if scope.startswith(".".join(parts[k:]) + "."):
                parts = parts[:k] + scope.split(".")
                break
        else:
            parts += scope.split(".")
    return ".".join(parts) or node.name or node.op_type


@_converts("Conv")
def _conv(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    _check_auto_pad(node, attrs)
    weight = b.const(node, 1, "weight")
    bias = b.const(node, 2, "bias")
    spatial = weight.dim() - 2
    if spatial not in (1, 2, 3):
        raise OnnxImportError(f"ONNX node {node.name!r}: Conv{spatial}d is not supported")
    cls = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[spatial - 1]
    group = attrs.get("group", 1)
    conv = cls(
        weight.shape[1] * group,
        weight.shape[0],
        tuple(weight.shape[2:]),
        stride=tuple(attrs.get("strides", [1] * spatial)),
        padding=_symmetric_padding(node, attrs.get("pads", []), spatial),
        dilation=tuple(attrs.get("dilations", [1] * spatial)),
        groups=group,
        bias=bias is not None,
    )
    with torch.no_grad():
        conv.weight.copy_(weight)
        if bias is not None:
            conv.bias.copy_(bias)
    return b.module(_module_path(b, node, 1), conv, inputs[0])


def _linear(b: _Builder, node: Any, x: Value, weight: Tensor, bias: Tensor | None) -> Value:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias.reshape(-1))
    return b.module(_module_path(b, node, 1), linear, x)


@_converts("Gemm")
def _gemm(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    a, weight = inputs[0], inputs[1]
    c = inputs[2] if len(inputs) > 2 else None
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    if attrs.get("transA", 0):
        a = b.call(torch.transpose, a, 0, 1)
    if b.is_node(weight) or alpha != 1.0 or beta != 1.0 or b.is_node(c):
        weight = weight if attrs.get("transB", 0) == 0 else b.call(torch.transpose, weight, 0, 1)
        out = b.call(torch.matmul, a, weight)
        if alpha != 1.0:
            out = b.call(operator.mul, out, alpha)
        if c is not None:
            out = b.call(operator.add, out, c if beta == 1.0 else b.call(operator.mul, c, beta))
        return out
    weight = weight if attrs.get("transB", 0) else weight.t()
    if c is not None and c.numel() not in (1, weight.shape[0]):
        raise OnnxImportError(f"ONNX node {node.name!r} (Gemm): C of shape {list(c.shape)}")
    bias = None if c is None else c.reshape(-1).expand(weight.shape[0]).clone()
    return _linear(b, node, a, weight.contiguous(), bias)


@_converts("MatMul")
def _matmul(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    x, w = inputs
    if b.is_node(x) and not b.is_node(w) and w.dim() == 2:
        return _linear(b, node, x, w.t().contiguous(), None)
    return b.call(torch.matmul, x, w)


def _folds_into_linear(b: _Builder, node: Any, x: Value, c: Value) -> bool:
    """``x`` is a bias-free ``nn.Linear``'s output read only here, and ``c`` a vector of its
    output size: the Add is the layer's bias."""
    if not (b.is_node(x) and x.op == "call_module" and isinstance(c, Tensor)):
        return False
    linear = b.root.get_submodule(x.target)
    return (
        isinstance(linear, nn.Linear)
        and linear.bias is None
        and c.numel() == linear.out_features
        and c.dim() == 1
        and b.uses.get(node.input[0], 0) == 1
        and len(x.users) == 0
    )


@_converts("Add")
def _add(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    x, y = inputs
    for lhs, rhs in ((x, y), (y, x)):
        if _folds_into_linear(b, node, lhs, rhs):
            linear = b.root.get_submodule(lhs.target)
            linear.bias = nn.Parameter(rhs.clone().to(linear.weight.dtype))
            return lhs
    return b.call(operator.add, x, y)


def _binary(fn: Callable[[Any, Any], Any]) -> Callable[..., Value]:
    def convert(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
        return b.call(fn, *inputs)

    return convert


for _op, _fn in {
    "Sub": operator.sub,
    "Mul": operator.mul,
    "Div": operator.truediv,
    "Pow": torch.pow,
    "Equal": torch.eq,
    "Less": torch.lt,
    "Greater": torch.gt,
    "Mod": torch.remainder,
}.items():
    CONVERTERS[_op] = _binary(_fn)


def _unary(fn: Callable[[Any], Any]) -> Callable[..., Value]:
    def convert(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
        return b.call(fn, inputs[0])

    return convert


for _op, _fn in {
    "Relu": F.relu,
    "Sigmoid": torch.sigmoid,
    "Tanh": torch.tanh,
    "Exp": torch.exp,
    "Sqrt": torch.sqrt,
    "Neg": operator.neg,
    "Abs": torch.abs,
    "Erf": torch.erf,
    "Reciprocal": torch.reciprocal,
    "HardSwish": F.hardswish,
    "Softplus": F.softplus,
    "Not": torch.logical_not,
}.items():
    CONVERTERS[_op] = _unary(_fn)


@_converts("Identity", "Dropout")
def _identity(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    return inputs[0]


@_converts("Constant")
def _constant(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    from onnx import numpy_helper

    if "value" in attrs:
        return torch.from_numpy(numpy_helper.to_array(attrs["value"]).copy())
    for key, dtype in (("value_float", torch.float32), ("value_int", torch.int64)):
        if key in attrs:
            return torch.tensor(attrs[key], dtype=dtype)
    for key, dtype in (("value_floats", torch.float32), ("value_ints", torch.int64)):
        if key in attrs:
            return torch.tensor(list(attrs[key]), dtype=dtype)
    raise OnnxImportError(f"ONNX node {node.name!r} (Constant): attributes {sorted(attrs)}")


@_converts("Clip")
def _clip(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    low = b.const(node, 1, "min") if len(inputs) > 1 else attrs.get("min")
    high = b.const(node, 2, "max") if len(inputs) > 2 else attrs.get("max")
    low = None if low is None else float(low)
    high = None if high is None else float(high)
    if low == 0.0 and high == 6.0:
        return b.call(F.relu6, inputs[0])
    if low == 0.0 and (high is None or math.isinf(high)):
        return b.call(F.relu, inputs[0])
    return b.call(torch.clamp, inputs[0], low, high)


@_converts("LeakyRelu")
def _leaky_relu(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    return b.call(F.leaky_relu, inputs[0], attrs.get("alpha", 0.01))


@_converts("HardSigmoid")
def _hard_sigmoid(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    alpha, beta = attrs.get("alpha", 0.2), attrs.get("beta", 0.5)
    if math.isclose(alpha, 1 / 6, rel_tol=1e-6) and beta == 0.5:
        return b.call(F.hardsigmoid, inputs[0])
    return b.call(
        torch.clamp, b.call(operator.add, b.call(operator.mul, inputs[0], alpha), beta), 0.0, 1.0
    )


@_converts("Gelu")
def _gelu(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    return b.call(F.gelu, inputs[0], approximate=attrs.get("approximate", "none"))


@_converts("Softmax")
def _softmax(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    """``Softmax``. From opset 13 on it normalizes along ``axis`` (default -1). Before
    opset 13 the default axis is 1 and the input is coerced to 2-D: the softmax runs over
    all dimensions from ``axis`` on jointly. fxq computes that exactly: flattened from
    ``axis``, a softmax over the last dimension, reshaped back (the input's shape read
    when the model runs where the file leaves it open)."""
    x = inputs[0]
    if b.opset >= 13:
        return b.call(F.softmax, x, dim=attrs.get("axis", -1))
    axis = attrs.get("axis", 1)
    shape = b.shape(node.input[0])
    if shape is not None:
        if not -len(shape) <= axis < len(shape):
            raise OnnxImportError(
                f"ONNX node {node.name!r} (Softmax, opset {b.opset}): axis {axis} is out of "
                f"range for its {len(shape)}-D input {node.input[0]!r} (shape {shape}); "
                "the file is malformed: check it with onnx.checker.check_model"
            )
        axis %= len(shape)
        if all(size == 1 for size in shape[axis + 1 :]):  # one dimension: no flattening
            return b.call(F.softmax, x, dim=axis)
    elif axis == -1:
        return b.call(F.softmax, x, dim=-1)
    if shape is None:
        sizes = b.call(getattr, x, "shape")
    else:  # the batch dimension left free where it is not flattened
        sizes = tuple(shape) if axis == 0 else (-1, *shape[1:])
    flat = b.call(F.softmax, b.call(torch.flatten, x, axis), dim=-1)
    return b.call(torch.reshape, flat, sizes)


@_converts("LayerNormalization")
def _layer_norm(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    weight, bias = b.const(node, 1, "scale"), b.const(node, 2, "bias")
    axis = attrs.get("axis", -1)
    if axis != -1 and axis != -weight.dim() and b.rank(node.input[0]) != axis + weight.dim():
        raise OnnxImportError(
            f"ONNX node {node.name!r} (LayerNormalization): axis {axis} with a scale of shape "
            f"{list(weight.shape)}; only the last dimensions can be normalized"
        )
    norm = nn.LayerNorm(tuple(weight.shape), eps=attrs.get("epsilon", 1e-5), bias=bias is not None)
    with torch.no_grad():
        norm.weight.copy_(weight)
        if bias is not None:
            norm.bias.copy_(bias)
    return b.module(_module_path(b, node, 1), norm, inputs[0])


@_converts("BatchNormalization")
def _batch_norm(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    scale, bias = b.const(node, 1, "scale"), b.const(node, 2, "bias")
    mean, var = b.const(node, 3, "mean"), b.const(node, 4, "variance")
    rank = b.rank(node.input[0]) or 4
    cls = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[rank]
    bn = cls(scale.numel(), eps=attrs.get("epsilon", 1e-5), momentum=1 - attrs.get("momentum", 0.9))
    with torch.no_grad():
        bn.weight.copy_(scale)
        bn.bias.copy_(bias)
        bn.running_mean.copy_(mean)
        bn.running_var.copy_(var)
    return b.module(_module_path(b, node, 1), bn.eval(), inputs[0])


def _pool_args(node: Any, attrs: dict[str, Any]) -> dict[str, Any]:
    _check_auto_pad(node, attrs)
    kernel = tuple(attrs["kernel_shape"])
    return {
        "kernel_size": kernel,
        "stride": tuple(attrs.get("strides", [1] * len(kernel))),
        "padding": _symmetric_padding(node, attrs.get("pads", []), len(kernel)),
        "ceil_mode": bool(attrs.get("ceil_mode", 0)),
    }


@_converts("MaxPool")
def _max_pool(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    if len(node.output) > 1 and node.output[1]:
        raise OnnxImportError(f"ONNX node {node.name!r} (MaxPool): the Indices output")
    args = _pool_args(node, attrs)
    fn = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[len(args["kernel_size"]) - 1]
    return b.call(
        fn,
        inputs[0],
        dilation=tuple(attrs.get("dilations", [1] * len(args["kernel_size"]))),
        **args,
    )


@_converts("AveragePool")
def _avg_pool(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    args = _pool_args(node, attrs)
    fn = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[len(args["kernel_size"]) - 1]
    return b.call(fn, inputs[0], count_include_pad=bool(attrs.get("count_include_pad", 0)), **args)


@_converts("GlobalAveragePool", "GlobalMaxPool")
def _global_pool(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    rank = b.rank(node.input[0]) or 4
    if rank not in (3, 4, 5):
        raise OnnxImportError(f"ONNX node {node.name!r} ({node.op_type}): rank {rank} input")
    kind = "avg" if node.op_type == "GlobalAveragePool" else "max"
    return b.call(getattr(F, f"adaptive_{kind}_pool{rank - 2}d"), inputs[0], 1)


def _axes(b: _Builder, node: Any, attrs: dict[str, Any], index: int) -> list[int] | None:
    if "axes" in attrs:
        return list(attrs["axes"])
    axes = b.const(node, index, "axes")
    return None if axes is None else [int(a) for a in axes.reshape(-1)]


@_converts("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin")
def _reduce(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    axes = _axes(b, node, attrs, 1)
    keep = bool(attrs.get("keepdims", 1))
    if axes is None:
        if attrs.get("noop_with_empty_axes", 0):
            return inputs[0]
        rank = b.rank(node.input[0])
        if rank is None:
            raise OnnxImportError(f"ONNX node {node.name!r} ({node.op_type}): unknown rank")
        axes = list(range(rank))
    if node.op_type in ("ReduceMean", "ReduceSum"):
        fn = torch.mean if node.op_type == "ReduceMean" else torch.sum
        return b.call(fn, inputs[0], dim=tuple(axes), keepdim=keep)
    fn = torch.amax if node.op_type == "ReduceMax" else torch.amin
    return b.call(fn, inputs[0], dim=tuple(axes), keepdim=keep)


@_converts("Flatten")
def _flatten(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    axis = attrs.get("axis", 1)
    if axis == 1:
        return b.call(torch.flatten, inputs[0], 1)
    if axis == 0:
        return b.call(torch.reshape, inputs[0], (1, -1))
    lead = b.call(operator.getitem, b.call(getattr, inputs[0], "shape"), slice(0, axis))
    return b.call(torch.reshape, inputs[0], b.call(operator.add, tuple_of(b, lead), (-1,)))


def tuple_of(b: _Builder, value: Value) -> Value:
    return b.call(tuple, value)


@_converts("Reshape")
def _reshape(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    x = inputs[0]
    shape = [int(s) for s in b.const(node, 1, "shape").reshape(-1)]
    if not attrs.get("allowzero", 0) and 0 in shape:
        known = b.shape(node.input[0])
        sizes = b.call(getattr, x, "shape") if known is None else known
        shape = [b.call(operator.getitem, sizes, i) if s == 0 else s for i, s in enumerate(shape)]
    return b.call(torch.reshape, x, tuple(shape))


@_converts("Transpose")
def _transpose(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    perm = attrs.get("perm")
    if perm is None:
        rank = b.rank(node.input[0])
        if rank is None:
            raise OnnxImportError(f"ONNX node {node.name!r} (Transpose): no perm, unknown rank")
        perm = list(reversed(range(rank)))
    return b.call(torch.permute, inputs[0], tuple(perm))


@_converts("Concat")
def _concat(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    return b.call(torch.cat, list(inputs), dim=attrs["axis"])


@_converts("Unsqueeze")
def _unsqueeze(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    axes = _axes(b, node, attrs, 1)
    rank = b.rank(node.input[0])
    x = inputs[0]
    if rank is None and any(a < 0 for a in axes):
        x_rank = x.dim() if isinstance(x, Tensor) else None
        if x_rank is None:
            raise OnnxImportError(f"ONNX node {node.name!r} (Unsqueeze): unknown rank")
        rank = x_rank
    rank = rank if rank is not None else (x.dim() if isinstance(x, Tensor) else 0)
    out_rank = rank + len(axes)
    for axis in sorted(a % out_rank for a in axes):
        x = b.call(torch.unsqueeze, x, axis)
    return x


@_converts("Squeeze")
def _squeeze(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    axes = _axes(b, node, attrs, 1)
    if axes is None:
        return b.call(torch.squeeze, inputs[0])
    return b.call(torch.squeeze, inputs[0], tuple(axes))


@_converts("Gather")
def _gather(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    axis = attrs.get("axis", 0)
    data, indices = inputs
    if b.is_node(indices):
        if axis != 0:
            raise OnnxImportError(
                f"ONNX node {node.name!r} (Gather): computed indices, axis {axis}"
            )
        return b.call(F.embedding, indices, data)  # a table lookup: embeddings
    if indices.dim() == 0:
        return b.call(torch.select, data, axis, int(indices))
    flat = b.call(torch.index_select, data, axis, indices.reshape(-1).long())
    if indices.dim() == 1:
        return flat
    return b.call(torch.reshape, flat, _gathered_shape(b, node, data, indices, axis))


def _gathered_shape(b: _Builder, node: Any, data: Value, indices: Tensor, axis: int) -> tuple:
    shape = b.shape(node.input[0])
    if shape is None:
        raise OnnxImportError(f"ONNX node {node.name!r} (Gather): unknown shape")
    axis %= len(shape)
    return (*shape[:axis], *indices.shape, *shape[axis + 1 :])


@_converts("Slice")
def _slice(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    if "starts" in attrs:  # opset < 10
        starts, ends, axes, steps = attrs["starts"], attrs["ends"], attrs.get("axes"), None
    else:
        starts = b.const(node, 1, "starts").tolist()
        ends = b.const(node, 2, "ends").tolist()
        axes = b.const(node, 3, "axes")
        axes = None if axes is None else axes.tolist()
        steps = b.const(node, 4, "steps")
        steps = None if steps is None else steps.tolist()
    axes = list(range(len(starts))) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    rank = b.rank(node.input[0])
    x = inputs[0]
    rank = rank if rank is not None else (x.dim() if isinstance(x, Tensor) else max(axes) + 1)
    index: list[Any] = [slice(None)] * rank
    big = 2**62
    for start, end, axis, step in zip(starts, ends, axes, steps):
        index[axis % rank] = slice(
            None if start in (0,) and step > 0 else start,
            None if abs(end) >= big else end,
            None if step == 1 else step,
        )
    return b.call(operator.getitem, x, tuple(index))


@_converts("Split")
def _split(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> list[Value]:
    axis = attrs.get("axis", 0)
    sizes = attrs.get("split")
    if sizes is None and len(node.input) > 1 and node.input[1]:
        sizes = b.const(node, 1, "split").tolist()
    if sizes is None:
        shape = b.shape(node.input[0])
        if shape is None:
            raise OnnxImportError(f"ONNX node {node.name!r} (Split): unknown size of axis {axis}")
        sizes = [shape[axis] // len(node.output)] * len(node.output)
    parts = b.call(torch.split, inputs[0], list(sizes), dim=axis)
    return [b.call(operator.getitem, parts, i) for i in range(len(node.output))]


@_converts("Shape")
def _shape(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    shape = b.shape(node.input[0])
    if shape is None:
        raise OnnxImportError(
            f"ONNX node {node.name!r} (Shape): the shape of {node.input[0]!r} is not fixed by "
            "the file; "
            + (
                f"pass load_onnx(..., input_shapes={{{b.open_inputs}: (...)}}) with the shapes "
                "the model will run at, or re-export with static shapes"
                if b.open_inputs
                else "re-export with static shapes"
            )
        )
    shape = torch.tensor(shape, dtype=torch.int64)
    return shape[attrs.get("start", 0) : attrs.get("end")]


_ONNX_DTYPES = {
    1: torch.float32,
    2: torch.uint8,
    3: torch.int8,
    5: torch.int16,
    6: torch.int32,
    7: torch.int64,
    9: torch.bool,
    10: torch.float16,
    11: torch.float64,
    16: torch.bfloat16,
}


@_converts("Cast")
def _cast(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    dtype = _ONNX_DTYPES.get(attrs["to"])
    if dtype is None:
        raise OnnxImportError(f"ONNX node {node.name!r} (Cast): ONNX dtype {attrs['to']}")
    if b.is_node(inputs[0]) and dtype.is_floating_point:
        return inputs[0]  # a float model's activations stay float (fxq quantizes them)
    return b.call(torch.Tensor.to, inputs[0], dtype)


@_converts("ConstantOfShape")
def _constant_of_shape(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    from onnx import numpy_helper

    shape = b.const(node, 0, "shape").tolist()
    value = (
        torch.from_numpy(numpy_helper.to_array(attrs["value"]).copy())
        if "value" in attrs
        else torch.zeros(1)
    )
    return value.reshape(()).expand(shape).clone()


@_converts("Expand")
def _expand(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    shape = [int(s) for s in b.const(node, 1, "shape")]
    x = inputs[0]
    if isinstance(x, Tensor):
        return x * torch.ones(shape, dtype=x.dtype)  # ONNX broadcasting, as numpy's
    return b.call(torch.Tensor.expand, x, tuple(shape))


@_converts("Where")
def _where(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    return b.call(torch.where, *inputs)


@_converts("Range")
def _range(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    start, limit, delta = (b.const(node, i, "bound") for i in range(3))
    return torch.arange(start.item(), limit.item(), delta.item(), dtype=start.dtype)


@_converts("Resize", "Upsample")
def _resize(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    mode = attrs.get("mode", "nearest")
    index = 1 if node.op_type == "Upsample" else 2
    scales = b.const(node, index, "scales") if len(node.input) > index else None
    sizes = b.const(node, 3, "sizes") if node.op_type == "Resize" and len(node.input) > 3 else None
    transform = attrs.get("coordinate_transformation_mode", "half_pixel")
    if mode == "nearest":
        if attrs.get("nearest_mode", "round_prefer_floor") != "floor" and transform != "asymmetric":
            raise OnnxImportError(
                f"ONNX node {node.name!r} (Resize): nearest with {transform!r} coordinates is "
                "not PyTorch's nearest; re-export from an F.interpolate(mode='nearest') model"
            )
        kwargs: dict[str, Any] = {"mode": "nearest"}
    elif mode == "linear" and transform in ("half_pixel", "pytorch_half_pixel", "align_corners"):
        kwargs = {"mode": "bilinear", "align_corners": transform == "align_corners"}
    else:
        raise OnnxImportError(f"ONNX node {node.name!r} (Resize): mode {mode!r} with {transform!r}")
    if sizes is not None and sizes.numel():
        kwargs["size"] = tuple(int(s) for s in sizes[2:])
    elif scales is not None and scales.numel():
        kwargs["scale_factor"] = tuple(float(s) for s in scales[2:])
    return b.call(F.interpolate, inputs[0], **kwargs)


@_converts("Pad")
def _pad(b: _Builder, node: Any, inputs: list[Value], attrs: dict[str, Any]) -> Value:
    pads = attrs.get("pads") or b.const(node, 1, "pads").tolist()
    value = b.const(node, 2, "constant_value") if len(node.input) > 2 else None
    mode = attrs.get("mode", "constant")
    if len(node.input) > 3 and node.input[3]:
        raise OnnxImportError(f"ONNX node {node.name!r} (Pad): the axes input")
    rank = len(pads) // 2
    torch_pads: list[int] = []
    for axis in reversed(range(rank)):
        torch_pads += [pads[axis], pads[axis + rank]]
    while torch_pads[-2:] == [0, 0] and len(torch_pads) > 2:
        torch_pads = torch_pads[:-2]
    fill = 0.0 if value is None or value.numel() == 0 else float(value)
    if mode == "constant":
        return b.call(F.pad, inputs[0], tuple(torch_pads), value=fill)
    return b.call(F.pad, inputs[0], tuple(torch_pads), mode={"edge": "replicate"}.get(mode, mode))


# -- the public functions --------------------------------------------------------------------
def _as_model(source: str | Path | Any) -> Any:
    try:
        import onnx
    except ImportError as error:  # pragma: no cover - onnx is a dependency of the extra
        raise ImportError("reading ONNX files needs the onnx package: pip install onnx") from error
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"no ONNX file at {str(path)!r}")
        if path.stat().st_size == 0:
            raise OnnxImportError(
                f"{str(path)!r} is empty (0 bytes): the export or the copy did not finish; "
                "export or copy it again"
            )
        try:
            return onnx.load(str(path))
        except Exception as error:
            raise OnnxImportError(f"{str(path)!r} is not a readable ONNX file: {error}") from error
    return source


def _with_input_shapes(model: Any, shapes: Mapping[str, Sequence[int]]) -> Any:
    import onnx

    model = onnx.ModelProto.FromString(model.SerializeToString())  # the caller's stays as it was
    inputs = {i.name: i for i in model.graph.input}
    for name, shape in shapes.items():
        if name not in inputs:
            raise OnnxImportError(
                f"input_shapes names {name!r}, which is not an input of the ONNX model "
                f"(its inputs: {', '.join(inputs)})"
            )
        dims = inputs[name].type.tensor_type.shape.dim
        if len(dims) != len(shape):
            raise OnnxImportError(
                f"input_shapes[{name!r}] has {len(shape)} dimensions; the model's input has {len(dims)}"
            )
        for dim, size in zip(dims, shape):
            if dim.HasField("dim_value") and dim.dim_value != size:
                raise OnnxImportError(
                    f"input_shapes[{name!r}] = {tuple(shape)} disagrees with the model's fixed "
                    f"dimension {dim.dim_value}"
                )
            dim.dim_value = int(size)
    return model


def _node_label(node: Any, index: int) -> str:
    """``node 'Add_3' (Add)``, or the node's position where the file leaves it unnamed."""
    if node.name:
        return f"node {node.name!r} ({node.op_type})"
    return f"node #{index} ({node.op_type}, unnamed)"


def _check_graph(model: Any) -> None:
    """Refuse a graph that is not well formed: no graph or no outputs, a value produced
    twice, a node reading a value nothing before it produces (a dangling name, or nodes
    out of topological order), a graph output declared twice or produced by nothing.

    Raises:
        OnnxImportError: naming the node or output and what is wrong with it.
    """
    check = "check it with onnx.checker.check_model"
    if not model.HasField("graph"):
        raise OnnxImportError(f"the ONNX model has no graph (an empty or truncated file?); {check}")
    graph = model.graph
    if not graph.output:
        raise OnnxImportError(
            f"the ONNX graph {graph.name!r} declares no outputs, so the model would compute "
            "nothing; list the values it returns in graph.output (re-export it)"
        )
    produced = {i.name: "an initializer" for i in graph.initializer}
    produced.update({i.name: "a graph input" for i in graph.input if i.name not in produced})
    later = {
        name: (node, index) for index, node in enumerate(graph.node) for name in node.output if name
    }
    for index, node in enumerate(graph.node):
        for name in node.input:
            if not name or name in produced:
                continue
            if name in later:
                source, source_index = later[name]
                raise OnnxImportError(
                    f"ONNX {_node_label(node, index)} reads {name!r}, which "
                    f"{_node_label(source, source_index)} produces after it: the nodes are "
                    f"not in topological order; sort them (re-export the model) and {check}"
                )
            raise OnnxImportError(
                f"ONNX {_node_label(node, index)} reads {name!r}, which no initializer, graph "
                f"input or earlier node produces: the file is malformed; {check}"
            )
        for name in node.output:
            if not name:
                continue
            if name in produced:
                raise OnnxImportError(
                    f"ONNX {_node_label(node, index)} produces {name!r}, which "
                    f"{produced[name]} already produces: every value needs one producer; "
                    f"rename one of them (re-export the model) and {check}"
                )
            produced[name] = _node_label(node, index)
    declared: set[str] = set()
    for out in graph.output:
        if out.name in declared:
            raise OnnxImportError(
                f"the ONNX graph declares output {out.name!r} twice; every output needs its "
                f"own name: re-export the model and {check}"
            )
        declared.add(out.name)
        if out.name not in produced:
            raise OnnxImportError(
                f"the ONNX graph's output {out.name!r} is produced by no node, initializer or "
                f"graph input: the file is malformed; {check}"
            )


def unsupported_ops(source: str | Path | Any) -> dict[str, list[str]]:
    """The op types of an ONNX model that fxq cannot convert, each with its node names."""
    model = _as_model(source)
    found: dict[str, list[str]] = {}
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type not in CONVERTERS:
            key = (
                node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
            )
            found.setdefault(key, []).append(node.name or "(unnamed)")
    return found


def load_onnx(
    source: str | Path | Any, input_shapes: Mapping[str, Sequence[int]] | None = None
) -> fx.GraphModule:
    """An ONNX model (a path or an ``onnx.ModelProto``) as a float ``GraphModule``.

    Args:
        source: the ``.onnx`` path or a loaded model.
        input_shapes: shapes for inputs whose dimensions the file leaves open
            (``{"input": (1, 3, 224, 224)}``): needed when the graph computes
            with its inputs' shapes (``Shape`` ops, as the TorchScript exporter
            writes for a dynamic batch); the converted graph then runs at
            those shapes. Others keep their dynamic dimensions.

    Returns:
        A ``GraphModule`` of torch ops and modules, in eval mode, whose inputs
        are the ONNX graph's inputs (in order, named after them) and whose
        output is the one output, or a tuple of them.

    Raises:
        FileNotFoundError: no file at the path.
        OnnxImportError: an empty or unreadable file; a malformed graph (no outputs,
            a value produced twice, a node reading a name nothing before it produces,
            an output declared twice or produced by nothing), named; op types fxq
            cannot convert (all listed, with their node names, before any
            conversion), a subgraph (``If``, ``Loop``), or an attribute no torch op
            has (asymmetric padding, a ``Resize`` mode).
    """
    model = _as_model(source)
    _check_graph(model)
    if input_shapes:
        model = _with_input_shapes(model, input_shapes)
    missing = unsupported_ops(model)
    if missing:
        listed = "; ".join(
            f"{op} ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''})"
            for op, names in sorted(missing.items())
        )
        raise OnnxImportError(
            f"the ONNX model has {sum(map(len, missing.values()))} node(s) of op types fxq "
            f"cannot convert: {listed}. Supported: {', '.join(sorted(CONVERTERS))}"
        )
    b = _Builder(model)
    initializers = {i.name for i in model.graph.initializer}
    for inp in model.graph.input:
        if inp.name not in initializers:
            placeholder = b.graph.placeholder(b.unique_name(_identifier(inp.name)))
            shape = b.shapes.get(inp.name)
            dtype = _ONNX_DTYPES.get(inp.type.tensor_type.elem_type)
            if shape is not None and dtype is not None:
                placeholder.meta["example"] = torch.zeros(shape, dtype=dtype)
            b.values[inp.name] = placeholder
    for node in model.graph.node:
        inputs = [b.values[name] if name else None for name in node.input]
        try:
            result = CONVERTERS[node.op_type](b, node, inputs, _attrs(node))
        except OnnxImportError:
            raise
        except Exception as error:
            raise OnnxImportError(
                f"ONNX node {node.name!r} ({node.op_type}) could not be converted: {error}"
            ) from error
        results = result if isinstance(result, list) else [result]
        for name, value in zip(node.output, results):
            b.values[name] = value
    outputs = [b.operand(b.values[o.name]) for o in model.graph.output]
    b.graph.output(outputs[0] if len(outputs) == 1 else tuple(outputs))
    for n in b.graph.nodes:
        n.meta.pop("example", None)  # only the conversion needed them
    b.graph.lint()
    gm = fx.GraphModule(b.root, b.graph, class_name="OnnxModel")
    return gm.eval()
