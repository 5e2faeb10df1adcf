"""What every fxq.qat module shares.

A QAT module computes its op in float on fake-quantized inputs and
fake-quantizes its output with ``activation_post_process`` (so every
quantized value has exactly one output fake quant). It also knows the fake
quants that produced its inputs (``input_quants``, linked by
``prepare_qat_fx``): their scales give the int32 bias scale and, in
VALIDATION state, the integer simulation.

A module reached only from opaque code (inside an ``@fx_wrap()`` method)
has no graph producer to link; prepare puts it in *standalone* mode, where it
quantizes its own tensor inputs with ``input_quant`` fake quants.

Devices and dtypes: QAT modules are ordinary modules (``.to(device)``,
``.half()``, ``.double()``, DDP, ``torch.autocast``); their fake quants keep
float32 scales. In VALIDATION the integer twin follows the module's device
(it is rebuilt after a move), runs with autocast off, and its inputs are
quantized in float32 (float64 for float64 inputs), so a VALIDATION output is
the converted model's whatever the model's float dtype.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxq.dtypes import qint32
from fxq.fake_quantize import (
    FakeQuantize,
    FakeQuantState,
    _as_state,
    _attribute_set,
    fake_quantize_ste,
    quantize_in_place,
)
from fxq.fused import ACTIVATIONS
from fxq.march import spec_for
from fxq.qconfig import QConfig
from fxq.utils.grad_mask import keep_mask, pass_gradient

__all__ = ["QATModule", "FunctionalQAT", "quantize_bias", "freeze_bn_stats", "update_bn_stats"]


class QATModule(nn.Module):
    """Base class of fxq.qat modules.

    Args:
        qconfig: the resolved QConfig of this op.

    Attributes:
        activation_post_process: the output fake quant.
        qconfig: the QConfig used to build the module.
        qconfig_source: where the qconfig came from (set by prepare).
        state: the current ``FakeQuantState``.
    """

    _fxq_leaf = True
    #: True for ops whose output is a new value with its own fake quant.
    has_output_quant = True

    def __init__(self, qconfig: QConfig) -> None:
        super().__init__()
        self.qconfig = qconfig
        self.qconfig_source = ""
        if self.has_output_quant:
            self.activation_post_process = qconfig.activation()
            self.march = self.activation_post_process.march
        else:
            self.march = qconfig.weight().march
        self.state = FakeQuantState.QAT
        self._input_quants: tuple[FakeQuantize | None, ...] = ()
        self.standalone = False
        self.name = ""  # the module's path, set by prepare (for messages)

    # -- state -----------------------------------------------------------------
    # ``freeze_bn`` changes what a training step computes, so it travels with the state dict
    # of a module that folds a BatchNorm (a state dict without it keeps the module's flag)
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if getattr(self, "bn", None) is not None:
            destination[prefix + "freeze_bn"] = torch.tensor(bool(self.freeze_bn))

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors
    ):
        if getattr(self, "bn", None) is not None and prefix + "freeze_bn" in state_dict:
            self.freeze_bn = bool(state_dict.pop(prefix + "freeze_bn"))
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing, unexpected, errors
        )

    # -- wiring ----------------------------------------------------------------
    @property
    def spec(self):
        return spec_for(self.march)

    @property
    def input_quants(self) -> tuple[FakeQuantize | None, ...]:
        """Fake quants of the tensor inputs, in argument order (flattened)."""
        return self._input_quants

    def set_input_quants(self, quants: Sequence[FakeQuantize | None]) -> None:
        """Link the fake quants that produce this module's tensor inputs.

        Stored as a plain tuple (not submodules): the fake quants belong to
        their producers.
        """
        self._input_quants = tuple(quants)
        self._link_zero_range_inputs()

    def _link_zero_range_inputs(self) -> None:
        """An all-zero output takes its scale from the inputs (``FakeQuantize.zero_range_inputs``)."""
        if self.has_output_quant:
            self.activation_post_process.zero_range_inputs = self._input_quants

    def make_standalone(self, num_inputs: int = 1) -> None:
        """Quantize the inputs here (for modules called from opaque code)."""
        self.standalone = True
        self.input_quant = nn.ModuleList(self.qconfig.activation() for _ in range(num_inputs))
        for fq in self.input_quant:
            if fq.is_high_precision:  # an int32 input is not a thing: use int8
                raise ValueError("a high-precision (int32) qconfig cannot quantize inputs")
        self._input_quants = tuple(self.input_quant)
        self._link_zero_range_inputs()

    def quantize_standalone_inputs(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        if not self.standalone:
            return list(tensors)
        return [fq(t) for fq, t in zip(self.input_quant, tensors)]

    def input_scale(self, index: int = 0) -> Tensor | None:
        quants = self._input_quants
        if (
            index < len(quants)
            and quants[index] is not None
            and not quants[index].is_high_precision
        ):
            return quants[index].scale
        return None

    # -- state -------------------------------------------------------------------
    def set_fake_quant_state(self, state: FakeQuantState | str) -> None:
        self.state = _as_state(state)
        if self.state is FakeQuantState.VALIDATION:
            _VALIDATING[id(self)] = weakref.ref(self)

    # -- VALIDATION: the integer computation itself ---------------------------------------
    #: In VALIDATION state, compute with the integer twin (bit-exact with the
    #: converted model). The debug tools switch it off to measure how far the
    #: float fake-quant computation is from the integer one.
    simulate_integer = True

    def validating(self) -> bool:
        return self.state is FakeQuantState.VALIDATION and self.simulate_integer

    def _twin_key(self) -> tuple:
        tensors = list(self.parameters()) + list(self.buffers())
        quants = [q for q in self._input_quants if q is not None]
        tensors += [q.scale for q in quants]
        out = getattr(self, "activation_post_process", None)
        offsets = tuple(getattr(q, "offset", 0) for q in [*quants, out] if q is not None)
        key = [(id(t), t._version) for t in tensors]
        if getattr(self, "_is_fsdp_managed_module", False):
            # FSDP2 refills the unsharded parameters at every forward without a version
            # bump: the sharded ones tell (fake_quantize._link_fsdp_parameters); a
            # parameter without its link rebuilds the twin every time
            links = self.__dict__.get("_fsdp_params", {})
            for name in self._parameters:
                link = links.get(name)
                sharded = getattr(link, "sharded_param", None)
                key.append(object() if sharded is None else (id(sharded), sharded._version))
        return (*key, offsets)

    def integer_twin(self) -> nn.Module:
        """The fxq.quantized module this one converts to, on this module's device.

        Cached while nothing changes: a new parameter or buffer value, a new
        input scale, or a move to another device or dtype builds it again. Under
        ``torch.compile`` it is fetched eagerly, inside ``fxq::validation_forward``
        (``run_validation``): building modules and reading tensor versions cannot be
        compiled, and a twin captured in the graph would miss values written without a
        version bump (DDP's broadcast of buffers).
        """
        from fxq.quantized.mapping import to_quantized

        key = self._twin_key()
        cached = self.__dict__.get("_twin")
        if cached is None or cached[0] != key:
            twin = to_quantized(self).to(self._device())
            twin.name = self.name
            cached = (key, twin)
            self.__dict__["_twin"] = cached
        return cached[1]

    def _device(self) -> torch.device | None:
        for t in self.buffers():
            return t.device
        for t in self.parameters():
            return t.device
        return None

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> nn.Module:
        self.__dict__.pop("_twin", None)  # built for the old device / dtype
        return super()._apply(fn, recurse)

    def run_validation(self, *args: Any, **kwargs: Any) -> Any:
        """``validation_forward``; under ``torch.compile`` as the opaque op
        ``fxq::validation_forward`` (one graph node, no graph break) that runs it eagerly,
        bit for bit as without compiling."""
        if torch.compiler.is_compiling():
            return _validation_in_graph(self, args, kwargs)
        return self.validation_forward(*args, **kwargs)

    def validation_forward(self, *args: Any, **kwargs: Any) -> Tensor:
        """Run the integer twin on the (exactly recovered) integer inputs; return float."""
        from fxq.qtensor import QTensor
        from fxq.quantized.base import quantize_tensors

        twin = self.integer_twin()
        args, kwargs = _exact_float_inputs((args, kwargs), self.standalone)
        if not self.standalone:
            quants = [q for q in self._input_quants if q is not None]
            args, kwargs = quantize_tensors(
                (args, kwargs),
                [q.scale for q in quants],
                [q.dtype for q in quants],
                self.spec.rounding,
                [q.offset for q in quants],
            )
        with torch.no_grad(), _autocast_off(self._device()):
            out = twin(*args, **kwargs)
        return out.dequantize() if isinstance(out, QTensor) else out

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_twin", None)  # a cache: not saved, not copied
        return state

    @property
    def output_dtype(self):
        return self.activation_post_process.dtype if self.has_output_quant else None

    @property
    def high_precision_output(self) -> bool:
        return self.has_output_quant and self.activation_post_process.dtype is qint32

    def quantize_output(self, y: Tensor, own: bool = False) -> Tensor:
        """The output fake quant applied to ``y``. ``own``: ``y`` is a tensor this module
        made and nothing else reads, so without autograd it may be rounded in place (one
        activation-sized allocation less per layer)."""
        fq = self.activation_post_process
        if own and quantize_in_place(fq, y):
            return fq(y, inplace=True)
        return fq(y)

    def extra_repr(self) -> str:
        parts = [f"state={self.state.value}"]
        if self.standalone:
            parts.append("standalone")
        return ", ".join(parts)


class _ClampSTE(torch.autograd.Function):
    """ReLU (``high`` None) or ReLU6 whose backward mask is a ``keep_mask`` (a compiled
    graph's masks stored as ``uint8``, see ``fxq.utils.grad_mask``). The gradient passes
    where torch's does: ``x > 0`` (and ``x < 6``), and at a NaN."""

    @staticmethod
    def forward(ctx, x, high):  # type: ignore[override]
        blocked = x <= 0.0 if high is None else (x <= 0.0) | (x >= high)
        ctx.save_for_backward(keep_mask(~blocked))
        return torch.relu(x) if high is None else torch.clamp(x, 0.0, high)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (mask,) = ctx.saved_tensors
        return pass_gradient(grad, mask), None


_CLAMP_HIGH = {"relu": None, "relu6": 6.0}


def activate(name: str, y: Tensor, inplace: bool = False) -> Tensor:
    """A fused module's activation (``fxq.fused.ACTIVATIONS``) on ``y``. In a compiled graph
    with autograd it keeps its gradient mask as ``uint8`` rather than ``bool`` (the same
    values and gradients; see ``fxq.utils.grad_mask``)."""
    if (
        name in _CLAMP_HIGH
        and y.requires_grad
        and torch.is_grad_enabled()
        and torch.compiler.is_compiling()
    ):
        return _ClampSTE.apply(y, _CLAMP_HIGH[name])
    return ACTIVATIONS[name](y, inplace=inplace)


def _exact_float_inputs(values: Any, integers_too: bool) -> Any:
    """float16 / bfloat16 tensors as float32 (their values are quantized in float32, not
    with a scale rounded to 16 bits); integer tensors too when ``integers_too`` (a
    standalone module's inputs, which its input fake quants quantize in QAT)."""
    leaves, spec = tree_flatten(values)
    changed = False
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, Tensor):
            continue
        if leaf.dtype in (torch.float16, torch.bfloat16) or (
            integers_too and not leaf.is_floating_point() and leaf.dtype is not torch.bool
        ):
            leaves[i] = leaf.to(torch.float32)
            changed = True
    return tree_unflatten(leaves, spec) if changed else values


def _autocast_enabled(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except (TypeError, RuntimeError):  # torch < 2.4 takes no argument; unknown device types
        return device_type == "cuda" and torch.is_autocast_enabled()


def _autocast_off(device: torch.device | None) -> contextlib.AbstractContextManager:
    """A context with autocast off on ``device`` (integer kernels must not run in 16-bit floats)."""
    if device is None or not _autocast_enabled(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)


def quantize_bias(
    bias: Tensor,
    input_scale: Tensor | None,
    weight_scale: Tensor,
    state: FakeQuantState,
    march: Any,
) -> Tensor:
    """Fake-quantize a bias to int32 at ``input_scale * weight_scale`` (per channel).

    Skipped (bias returned as is) in CALIBRATION state and when the input
    scale is unknown. The bias scale is the float32 product of the scales,
    never rounded to a 16-bit float; the result has the bias's dtype.
    """
    if state is FakeQuantState.CALIBRATION or input_scale is None:
        return bias
    scale = input_scale.reshape(()) * weight_scale  # float32, whatever the bias's dtype
    return fake_quantize_ste(bias, scale, qint32, spec_for(march).rounding, 0)


def _set_bn_frozen(module: nn.Module, frozen: bool) -> nn.Module:
    for m in module.modules():
        if hasattr(m, "freeze_bn"):
            m.freeze_bn = frozen
    return module


def freeze_bn_stats(module: nn.Module) -> nn.Module:
    """Stop updating BatchNorm statistics in fused QAT modules (also via ``model.apply``).

    Frozen modules fold the running statistics even in training mode, which
    is what the integer model computes; usual practice is to freeze for the
    last epochs of QAT.
    """
    return _set_bn_frozen(module, True)


def update_bn_stats(module: nn.Module) -> nn.Module:
    """Resume updating BatchNorm statistics in fused QAT modules."""
    return _set_bn_frozen(module, False)


class FunctionalQAT(QATModule):
    """An op without weights whose output is a new value (``+``, ``cat``, pooling, ...).

    The float computation is the original function, or the original
    (stateless) module for module-form ops such as ``nn.AvgPool2d``; the
    output goes through ``activation_post_process``. The forward signature is
    that of the replaced function, so prepare keeps the node's arguments.

    Args:
        qconfig: the resolved QConfig.
        fn: the functional op (for ``call_function`` / ``call_method`` nodes).
        module: the float module (for ``call_module`` nodes).
    """

    def __init__(self, qconfig: QConfig, fn: Any = None, module: nn.Module | None = None) -> None:
        super().__init__(qconfig)
        if (fn is None) == (module is None):
            raise ValueError(f"{type(self).__name__} needs exactly one of fn and module")
        self.fn = fn
        self.op = module

    def to_float(self) -> nn.Module:
        """The float module this QAT module replaced (module-form ops only)."""
        if self.op is None:
            raise TypeError(f"{type(self).__name__} replaced a function, not a module")
        return self.op

    def float_forward(self, *args: Any, **kwargs: Any) -> Tensor:
        if self.op is not None:
            return self.op(*args, **kwargs)
        return self.fn(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        if self.validating():
            return self.run_validation(*args, **kwargs)
        if self.standalone:
            args = tuple(self.quantize_standalone_inputs(args))
        return self.quantize_output(self.float_forward(*args, **kwargs))

    def extra_repr(self) -> str:
        name = getattr(self.fn, "__name__", None) if self.fn is not None else None
        base = super().extra_repr()
        return f"fn={name}, {base}" if name else base


# -- VALIDATION under torch.compile ----------------------------------------------------------
#
# A compiled VALIDATION forward calls each QAT module's integer twin through one custom op,
# ``fxq::validation_forward(call, tensors)``: the twin (integer arithmetic, scales read on the
# host, caches) runs eagerly inside it, so compiled and eager VALIDATION are the same
# computation. ``call`` names the module and the form of its arguments (where the tensors go
# among the constants), registered while dynamo traces (``torch.compiler.assume_constant_result``); the op's
# fake implementation gives the output's shapes by the module's fake-quant forward.

#: QAT modules put in VALIDATION, by id
_VALIDATING: dict[int, weakref.ref] = {}
#: registered calls: (module id, args template, kwargs template), by handle
_CALLS: list[tuple] = []
_HANDLES: dict[tuple, int] = {}
#: per handle, the output's form (``_output_form``), known once the fake implementation ran
_OUTPUT_FORMS: dict[int, tuple] = {}
#: where a tensor goes in an argument template
_TENSOR = "<fxq tensor>"


def _template(value: Any) -> Any:
    """``value`` with each tensor replaced by ``_TENSOR`` (lists and tuples tagged, so the
    template is hashable and says which it was)."""
    if isinstance(value, Tensor):
        return _TENSOR
    if isinstance(value, list):
        return ("<list>", tuple(_template(v) for v in value))
    if isinstance(value, tuple):
        return ("<tuple>", tuple(_template(v) for v in value))
    return value


def _collect(value: Any, out: list[Tensor]) -> None:
    if isinstance(value, Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect(v, out)


def _rebuild(template: Any, tensors: Iterator[Tensor]) -> Any:
    if isinstance(template, str) and template == _TENSOR:
        return next(tensors)
    if isinstance(template, tuple) and len(template) == 2 and template[0] == "<list>":
        return [_rebuild(t, tensors) for t in template[1]]
    if isinstance(template, tuple) and len(template) == 2 and template[0] == "<tuple>":
        return tuple(_rebuild(t, tensors) for t in template[1])
    return template


@torch.compiler.assume_constant_result
def _register_call(module_id: int, args_template: tuple, kwargs_template: tuple) -> int:
    key = (module_id, args_template, kwargs_template)
    handle = _HANDLES.get(key)
    if handle is None:
        handle = _HANDLES[key] = len(_CALLS)
        _CALLS.append(key)
    return handle


@torch.compiler.assume_constant_result
def _output_form(handle: int) -> tuple:
    return _OUTPUT_FORMS[handle]


def _validation_in_graph(module: QATModule, args: tuple, kwargs: dict) -> Any:
    tensors: list[Tensor] = []
    _collect(list(args), tensors)
    _collect(list(kwargs.values()), tensors)
    handle = _register_call(
        id(module),
        tuple(_template(a) for a in args),
        tuple((k, _template(v)) for k, v in kwargs.items()),
    )
    # contiguous inputs: the layout inductor gives them is then the one the op was traced with
    outputs = torch.ops.fxq.validation_forward(handle, [t.contiguous() for t in tensors])
    form = _output_form(handle)
    if form[0] == "tensor":
        return outputs[0]
    parts, i = [], 0
    for is_tensor in form[1]:
        parts.append(outputs[i] if is_tensor else None)
        i += int(is_tensor)
    return tuple(parts) if form[0] == "tuple" else parts


def _call(handle: int, tensors: list[Tensor]) -> tuple[QATModule, tuple, dict]:
    module_id, args_template, kwargs_template = _CALLS[handle]
    module = _VALIDATING[module_id]()
    if module is None:  # pragma: no cover - a compiled graph outlived its model
        raise RuntimeError("fxq::validation_forward: the QAT module of this graph is gone")
    it = iter(tensors)
    args = tuple(_rebuild(t, it) for t in args_template)
    kwargs = {k: _rebuild(t, it) for k, t in kwargs_template}
    return module, args, kwargs


def _flat_outputs(handle: int, out: Any) -> list[Tensor]:
    """The output's tensors, its form recorded (a tensor, or a flat tuple / list of tensors
    and Nones)."""
    if isinstance(out, Tensor):
        _OUTPUT_FORMS[handle] = ("tensor", ())
        return [out]
    if isinstance(out, (tuple, list)) and all(o is None or isinstance(o, Tensor) for o in out):
        kind = "tuple" if isinstance(out, tuple) else "list"
        _OUTPUT_FORMS[handle] = (kind, tuple(o is not None for o in out))
        return [o for o in out if o is not None]
    raise TypeError(  # pragma: no cover - no fxq QAT module returns another form
        f"fxq: a VALIDATION output of form {type(out).__name__} cannot be compiled"
    )


@torch.library.custom_op("fxq::validation_forward", mutates_args=())
def _validation_op(handle: int, tensors: list[Tensor]) -> list[Tensor]:
    """A QAT module's VALIDATION forward, run eagerly (its integer twin), as one graph node."""
    module, args, kwargs = _call(handle, tensors)
    outputs = _flat_outputs(handle, module.validation_forward(*args, **kwargs))
    # contiguous, as the fake outputs (a graph's compiled code checks strides), and none
    # the same tensor as an input
    return [o.clone() if any(o is t for t in tensors) else o.contiguous() for o in outputs]


@_validation_op.register_fake
def _(handle: int, tensors: list[Tensor]) -> list[Tensor]:
    # the output's shapes, dtypes and devices: the module's fake-quant forward on the fake
    # inputs, its own tensors read as fake ones, no check of their values
    module, args, kwargs = _call(handle, tensors)
    mode = torch._guards.detect_fake_mode(tensors)
    quants = [m for m in module.modules() if isinstance(m, FakeQuantize)]
    quants += [q for q in module._input_quants if q is not None]
    with (
        _attribute_set([module], "simulate_integer", False),
        _attribute_set(quants, "_checked_observed", True),
        _attribute_set([mode], "allow_non_fake_inputs", True),
    ):
        out = module(*args, **kwargs)
    return [
        torch.empty(o.shape, dtype=o.dtype, device=o.device) for o in _flat_outputs(handle, out)
    ]


def _count_inputs(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.inputs = len(inputs[1])


def _no_gradient(ctx: Any, grads: Any) -> tuple[None, list[None]]:
    return None, [None] * ctx.inputs  # as eager VALIDATION: the twin runs without autograd


_validation_op.register_autograd(_no_gradient, setup_context=_count_inputs)
