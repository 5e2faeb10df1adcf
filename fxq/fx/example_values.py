"""Python values while tracing: proxies that know their example's metadata and constants.

Library code decides a lot in Python from tensor metadata: ``if mask.ndim == 2``,
``len(mask.shape) == 4``, ``torch.finfo(x.dtype).min``, ``if seq_len > max_len``.
Plain torch.fx fails on each (a Proxy has no Python value). fxq's tracer runs
every recorded op a second time, in one of two ways, and answers such
questions from the result:

* **fake values**: with example inputs, on fake tensors
  (``torch._subclasses.FakeTensorMode``: shapes, dtypes and devices, no data).
  ``x.dtype`` and ``x.ndim`` are the example's (a graph's dtypes and ranks do
  not change); ``x.shape``, ``x.size()`` and ``x.device`` stay graph values
  (recorded, so the graph follows the batch size, sequence length and the
  model's device), but ``bool``, ``len`` and iteration of them use the
  example's. Control flow on tensor *data* (``if mask.all():``) still fails:
  fxq never specialises a graph on the example's data.
* **constant values**: ops on buffers and constants only (no model input),
  run on copies of the buffers. Buffers are graph values (``get_attr``), so
  ``self.position_ids[:, :seq_length]`` records a slice, while
  ``float(self.num_batches_tracked)`` still reads the buffer's value, as it
  would when the buffer is read during tracing by plain torch.fx.

Branches taken on shapes are those of the example inputs; a call with another
rank may need a new trace (the contract of ``torch.export`` with static ranks).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.fx import Node, Proxy
from torch.fx.proxy import TraceError

__all__ = ["ExampleValues", "MetaProxy", "NO_VALUE", "setitem_"]

NO_VALUE: Any = object()  # the value of a node is unknown

#: tensor attributes answered with the example's Python value instead of a graph node
_STATIC_ATTRS = frozenset({"dtype", "ndim", "layout", "is_sparse", "is_quantized", "is_nested"})
#: tensor attributes that are recorded at once (not a method call), so that len() and bool() see them
_RECORDED_ATTRS = frozenset({"shape", "device", "T", "mT", "real", "imag"})


class ExampleValues:
    """Fake-tensor values (from example inputs) and constant values of the nodes a tracer records.

    Args:
        inputs: example value per placeholder name (tensors are made fake;
            other values are kept); empty when the tracer has none, and then
            only constants (ops on buffers) and the fake values derived from
            them are known.
    """

    def __init__(self, inputs: Mapping[str, Any], active_tracers: list | None = None) -> None:
        """``active_tracers``: the tracer's list of tracers now recording (emptied while a
        node's values are computed, so that code run here is not recorded)."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.active_tracers = active_tracers if active_tracers is not None else []

        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.fakes: dict[Node, Any] = {}
        self.constants: dict[Node, Any] = {}
        self.inputs = {name: self.fake(v) for name, v in inputs.items()}

    def fake(self, value: Any) -> Any:
        """``value`` with every tensor replaced by a fake tensor of the same metadata."""
        return torch.utils._pytree.tree_map_only(torch.Tensor, self._fake_tensor, value)

    def _fake_tensor(self, t: torch.Tensor) -> torch.Tensor:
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(t, FakeTensor):
            return t
        return self.mode.from_tensor(t)

    def fake_of(self, node: Node) -> Any:
        return self.fakes.get(node, NO_VALUE)

    def constant_of(self, node: Node) -> Any:
        return self.constants.get(node, NO_VALUE)

    def record(self, node: Node, root: nn.Module, opaque: bool) -> None:
        """Compute ``node``'s values from its inputs' (unknown where any input's is).

        ``opaque`` calls (``@fx_wrap()`` code) are not run: their values stay unknown.
        """
        if opaque:
            return
        from torch.fx._symbolic_trace import _maybe_revert_all_patches

        active = list(self.active_tracers)
        self.active_tracers.clear()  # code run here is not recorded
        try:
            with _maybe_revert_all_patches():  # module calls and attributes as outside tracing
                constant = self._constant(node, root)
                if constant is not NO_VALUE:
                    self.constants[node] = constant
                fake = self._fake(node, root, constant)
                if fake is not NO_VALUE:
                    self.fakes[node] = fake
        finally:
            self.active_tracers[:] = active

    def _constant(self, node: Node, root: nn.Module) -> Any:
        if node.op == "get_attr":
            try:
                value = _get_attr(root, str(node.target))
            except AttributeError:
                return NO_VALUE
            # a copy: in-place ops recorded on the buffer must not change the model's own
            return value.detach().clone() if isinstance(value, torch.Tensor) else value
        if node.op not in ("call_function", "call_method"):
            return NO_VALUE  # a model input, or a module (it may update its own state)
        args = _map_values(node.args, self.constants)
        kwargs = _map_values(node.kwargs, self.constants)
        if args is NO_VALUE or kwargs is NO_VALUE:
            return NO_VALUE
        with torch.no_grad():
            return _run(node, root, args, kwargs)

    def _fake(self, node: Node, root: nn.Module, constant: Any) -> Any:
        if node.op == "placeholder":
            return self.inputs.get(str(node.target), NO_VALUE)
        if constant is not NO_VALUE:
            return self.fake(constant)
        args = _map_values(node.args, self.fakes)
        kwargs = _map_values(node.kwargs, self.fakes)
        if args is NO_VALUE or kwargs is NO_VALUE:
            return NO_VALUE
        with self.mode, torch.no_grad():
            return _run(node, root, args, kwargs)


def _map_values(arg: Any, values: dict[Node, Any]) -> Any:
    """``arg`` with its nodes replaced by their values; NO_VALUE when one is unknown."""
    missing = False

    def value_of(n: Node) -> Any:
        nonlocal missing
        v = values.get(n, NO_VALUE)
        missing = missing or v is NO_VALUE
        return v

    mapped = torch.fx.node.map_arg(arg, value_of)
    return NO_VALUE if missing else mapped


def _run(node: Node, root: nn.Module, args: tuple, kwargs: dict) -> Any:
    try:
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        if node.op == "call_module":  # in eval mode: no running statistics or counters change
            module = root.get_submodule(node.target)
            modes = {m: m.training for m in module.modules()}
            module.eval()
            try:
                return module(*args, **kwargs)
            finally:
                for m, mode in modes.items():
                    m.training = mode
    except Exception:  # data-dependent, unsupported on fake tensors, ...: unknown
        return NO_VALUE
    return NO_VALUE


def _get_attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _values(proxy: Proxy) -> ExampleValues | None:
    return getattr(proxy.tracer, "example_values", None)


def constant_value(proxy: Proxy) -> Any:
    """The real value of ``proxy`` when it depends on buffers and constants only."""
    values = _values(proxy)
    return NO_VALUE if values is None else values.constant_of(proxy.node)


def fake_value(proxy: Proxy) -> Any:
    """The fake (metadata-only) value of ``proxy``; ``NO_VALUE`` when unknown."""
    values = _values(proxy)
    return NO_VALUE if values is None else values.fake_of(proxy.node)


def setitem_(tensor: torch.Tensor, index: Any, value: Any) -> torch.Tensor:
    """``tensor[index] = value``, returning ``tensor``: how a graph records item assignment.

    torch.fx cannot record ``x[index] = value`` (a ``Proxy`` has no
    ``__setitem__``); fxq's tracer records this in-place op instead, which
    ``fxq.fx.inplace.functionalize_inplace`` treats like ``x.add_(y)``: the
    later readers of ``x`` read this node's result.

    >>> t = torch.zeros(3)
    >>> setitem_(t, slice(1, None), 2.0) is t, t.tolist()
    (True, [0.0, 2.0, 2.0])
    """
    tensor[index] = value
    return tensor


class MetaProxy(Proxy):
    """A Proxy whose metadata questions are answered from its fake value, data from its constant."""

    def __getattr__(self, k: str) -> Any:
        value = fake_value(self)
        if isinstance(value, torch.Tensor) and k in _STATIC_ATTRS:
            return getattr(value, k)
        if value is not NO_VALUE and k in _RECORDED_ATTRS:
            return self.tracer.create_proxy("call_function", getattr, (self, k), {})
        return super().__getattr__(k)

    def __setitem__(self, index: Any, value: Any) -> None:
        """``x[index] = value`` is recorded as ``setitem_(x, index, value)`` (see there)."""
        self.tracer.create_proxy("call_function", setitem_, (self, index, value), {})

    def __len__(self) -> int:
        value = fake_value(self)
        if value is NO_VALUE or not hasattr(value, "__len__"):
            return super().__len__()
        return len(value)

    def __float__(self) -> float:
        return float(self._constant("float"))

    def __int__(self) -> int:
        return int(self._constant("int"))

    def __index__(self) -> int:
        return operator.index(self._constant("an index"))

    def _constant(self, what: str) -> Any:
        value = constant_value(self)
        if value is NO_VALUE:
            raise TypeError(
                f"{what}() of a traced value ({self.node.name}): its Python value depends on "
                "the model's inputs"
            )
        return value


def to_bool(proxy: Proxy) -> bool | None:
    """``bool`` of a proxy from its constant or its fake value; None when neither is known.

    Raises:
        TraceError: when only the fake value is known and it is a tensor (its
            truth depends on the inputs' data).
    """
    constant = constant_value(proxy)
    if constant is not NO_VALUE:
        return bool(constant)
    value = fake_value(proxy)
    if value is NO_VALUE:
        return None
    if isinstance(value, torch.Tensor):
        raise TraceError(
            "symbolically traced variables cannot be used as inputs to control flow "
            "(this condition depends on tensor values)"
        )
    return bool(value)


def iterate(proxy: Proxy) -> Iterator[Any] | None:
    """Iterate a proxy of known length (a shape, a tuple of tensors): getitem proxies."""
    value = fake_value(proxy)
    if value is NO_VALUE or not hasattr(value, "__len__"):
        return None
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return None
    if isinstance(value, Mapping):
        return iter(value.keys())
    return iter([operator.getitem(proxy, i) for i in range(len(value))])


def keys(proxy: Proxy) -> Any:
    value = fake_value(proxy)
    if isinstance(value, Mapping):
        return value.keys()
    return NO_VALUE
