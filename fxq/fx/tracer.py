"""Tracing: ``fxq.symbolic_trace`` and ``@fxq.fx_wrap()``.

``fx_wrap`` marks code that must not be traced into:

* a module-level function becomes one ``call_function`` node;
* a method becomes one node too; at run time it is called on the real module,
  so ``self.training`` branches and data-dependent Python run at call time,
  and the submodules it uses through ``self`` are the (swapped) modules of the
  graph module;
* a module class becomes a leaf: each instance is one ``call_module`` node.

Example::

    class Detector(nn.Module):
        def forward(self, x):
            return self.postprocess(self.head(self.backbone(x)))

        @fxq.fx_wrap()
        def postprocess(self, out):
            if self.training:
                return out
            return decode(out, self.anchors)          # arbitrary Python

    gm = fxq.symbolic_trace(Detector())   # postprocess is one node

When tracing meets control flow that depends on tensor values, the error
names the source line and says which code to wrap.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import linecache
import operator
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar, overload

import torch
import torch.fx
from torch import nn
from torch.fx import GraphModule
from torch.fx.proxy import TraceError

from fxq.fx.example_values import NO_VALUE, ExampleValues, MetaProxy
from fxq.fx.example_values import iterate as example_iterate
from fxq.fx.example_values import keys as example_keys
from fxq.fx.example_values import to_bool as example_to_bool
from fxq.fx.signature import InputCheck, keyword_forward, traced_parameters
from fxq.registry import registry_class

__all__ = [
    "fx_wrap",
    "Tracer",
    "symbolic_trace",
    "FxqTraceError",
    "call_wrapped_method",
    "is_fx_wrapped",
    "concrete_args_for",
    "bind_root",
    "SELF",
    "SizeQuestionError",
    "reads_only_sizes",
    "size_reads",
    "is_size_read",
    "check_decided",
]

T = TypeVar("T")

_ACTIVE: list[Tracer] = []  # tracers currently tracing (innermost last)
#: ``GraphModule.meta`` key: the model name and inputs of its ``InputCheck`` (kept by pickle)
_INPUT_CHECK = "fxq_input_check"


class _SelfRef:
    """Stands for the traced root module in a graph; generated code prints it as ``self``."""

    _instance: _SelfRef | None = None

    def __new__(cls) -> _SelfRef:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "self"

    def __reduce__(self):
        return (_SelfRef, ())


SELF = _SelfRef()


class FxqTraceError(TraceError):
    """Tracing failed; the message names the source line and what to wrap."""


class SizeQuestionError(TraceError):
    """Python asked about traced tensor sizes (``if x.shape[-1] != w:``) with no example inputs.

    ``fxq.symbolic_trace`` reports it as an ``FxqTraceError`` that advises
    ``example_inputs`` first: with them such conditions are decided.
    """


#: tensor methods and attributes whose results are sizes, not data
_SIZE_METHODS = frozenset({"size", "dim", "ndimension", "numel", "nelement"})
_SIZE_ATTRS = frozenset({"shape", "ndim"})


def is_size_read(node: torch.fx.Node) -> bool:
    """``x.size()``, ``x.dim()``, ``x.numel()``, ``x.shape``, ``x.ndim`` or ``len(x)``."""
    if node.op == "call_method":
        return node.target in _SIZE_METHODS
    if node.op != "call_function":
        return False
    if node.target is getattr:
        return len(node.args) > 1 and node.args[1] in _SIZE_ATTRS
    return node.target in (len, torch.numel)


def _is_python_arithmetic(target: Any) -> bool:
    """``operator``, ``math`` and builtin functions (``ne``, ``ceil``, ``getitem``, ``min``)."""
    return getattr(target, "__module__", None) in ("_operator", "operator", "math", "builtins")


def reads_only_sizes(node: torch.fx.Node) -> bool:
    """Whether ``node`` is computed from tensor sizes only (``shape``, ``size()``, ``dim()``...).

    Walks the node's inputs back to the size reads; a path that reaches a
    tensor's data (a graph input, a module's or an op's output) makes it False.

    >>> gm = torch.fx.symbolic_trace(lambda x: x.shape[-1] * 2 != x.size(0))
    >>> reads_only_sizes(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    True
    >>> gm = torch.fx.symbolic_trace(lambda x: x.sum() > x.size(0))
    >>> reads_only_sizes(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    False
    """
    return bool(size_reads(node))


def size_reads(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The size reads (``is_size_read``) ``node`` is computed from through Python arithmetic,
    or None where a path reaches a tensor's data."""
    seen: set[torch.fx.Node] = set()
    work = [node]
    reads = []
    while work:
        n = work.pop()
        if n in seen:
            continue
        seen.add(n)
        if is_size_read(n):
            reads.append(n)
        elif n.op == "call_function" and _is_python_arithmetic(n.target):
            work.extend(n.all_input_nodes)
        else:
            return None  # a graph input, a module, a buffer or a tensor op: data
    return reads


_NO_ARGUMENT: Any = object()  # fx_wrap() called with no argument: the decorator factory


def is_fx_wrapped(obj: Any) -> bool:
    """True for functions, methods and module classes marked with ``@fxq.fx_wrap()``."""
    return bool(getattr(obj, "_fxq_fx_wrap", False))


def is_opaque_call(node: torch.fx.Node, module: nn.Module | None = None) -> bool:
    """Whether ``node`` runs ``@fx_wrap()`` code (a wrapped function, method or module class).

    Such code is float by the user's choice; modules it calls are quantized standalone.
    """
    if module is not None:
        return is_fx_wrapped(type(module))
    return node.target is call_wrapped_method or is_fx_wrapped(node.target)


@overload
def fx_wrap() -> Callable[[T], T]: ...


@overload
def fx_wrap(obj: T, /) -> T: ...


def fx_wrap(obj: Any = _NO_ARGUMENT, /) -> Any:
    """Decorator: keep a function, a method or a module class as one graph node.

    Written ``@fxq.fx_wrap()``, as in the vendor plugin; the bare form
    ``@fxq.fx_wrap`` is accepted too and does exactly the same.

    Args:
        obj: given only by the bare form: the function, method or class
            being decorated.

    Returns:
        ``@fxq.fx_wrap()``: a decorator. Applied to a function or method it
        returns a wrapper that behaves exactly like the original outside
        tracing; applied to an ``nn.Module`` subclass it marks the class as a
        leaf and returns it. ``@fxq.fx_wrap``: that decorator's result.

    Raises:
        TypeError: when applied to something that is neither callable nor a
            module class.
    """

    def decorator(obj: T) -> T:
        if isinstance(obj, type):
            if not issubclass(obj, nn.Module):
                raise TypeError(
                    f"@fxq.fx_wrap() on a class needs an nn.Module subclass, got {obj!r}"
                )
            obj._fxq_fx_wrap = True  # type: ignore[attr-defined]
            return obj
        if isinstance(obj, (staticmethod, classmethod)) or not callable(obj):
            raise TypeError(
                f"@fxq.fx_wrap() applies to functions, methods and nn.Module classes, got {obj!r}"
            )
        fn = obj

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if _ACTIVE:
                return _ACTIVE[-1].record_wrapped_call(wrapper, args, kwargs)
            return fn(*args, **kwargs)

        wrapper._fxq_fx_wrap = True  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    if obj is _NO_ARGUMENT:
        return decorator
    return decorator(obj)  # the bare form, @fxq.fx_wrap


# Module internals, i.e. everything that is not a user attribute.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)


class _RootState(nn.Module):
    """The traced root's class and plain attributes, for its wrapped methods.

    A wrapped method of the root module runs on a view of the graph module:
    an instance of the root's class whose submodules, parameters, buffers and
    ``training`` flag are the graph module's own, and whose plain attributes
    (thresholds, lists, ...) are those held here. Kept as a submodule so that
    deepcopy, ``torch.save`` and ``.to()`` carry it along.
    """

    def __init__(self, root: nn.Module) -> None:
        super().__init__()
        self.root_class = type(root)
        for key, value in root.__dict__.items():
            if key not in _MODULE_INTERNALS and key not in self.__dict__:
                self.__dict__[key] = value

    def plain_attributes(self) -> dict[str, Any]:
        return {
            k: v
            for k, v in self.__dict__.items()
            if k not in _MODULE_INTERNALS and k != "root_class"
        }

    def extra_repr(self) -> str:
        return self.root_class.__qualname__


def _root_view(gm: nn.Module, state: _RootState) -> nn.Module:
    view = object.__new__(state.root_class)
    d = state.plain_attributes()
    for key in _MODULE_INTERNALS:
        if key in gm.__dict__:
            d[key] = gm.__dict__[key]
    object.__setattr__(view, "__dict__", d)
    return view


def bind_root(gm: nn.Module, args: tuple) -> tuple:
    """Replace the root placeholder in a ``call_wrapped_method`` node's arguments by ``gm``.

    Generated code passes ``self`` (the graph module); a ``torch.fx.Interpreter``
    sees the graph's ``SELF`` marker instead and must bind it with this.
    """
    return tuple(gm if a is SELF else a for a in args)


@fx_wrap()
def call_wrapped_method(owner: nn.Module, name: str, *args: Any, **kwargs: Any) -> Any:
    """Run ``owner.<name>(*args, **kwargs)``: how graphs call wrapped methods.

    ``owner`` is a submodule of the graph module, or the graph module itself
    for methods of the traced root (then the method runs on a view whose class
    is the root's class).
    """
    state = owner._modules.get("_fxq_self") if isinstance(owner, GraphModule) else None
    if isinstance(state, _RootState):
        owner = _root_view(owner, state)
    return getattr(owner, name)(*args, **kwargs)


#: torch.nn modules made of other layers: torch.fx keeps every torch.nn module as a leaf
_TORCH_COMPOSITES = (
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
    nn.TransformerEncoder,
    nn.TransformerDecoder,
    nn.Transformer,
)


def _is_torch_fx_wrapped(target: Any) -> bool:
    """A Python function registered with ``torch.fx.wrap`` (torchvision's swin helpers...)."""
    from torch.fx._symbolic_trace import _wrapped_fns_to_patch

    module_globals = getattr(target, "__globals__", None)
    name = getattr(target, "__name__", None)
    if module_globals is None or name is None:
        return False
    return (id(module_globals), name) in _wrapped_fns_to_patch


def _torchvision_leaves() -> tuple[type, ...]:
    if "torchvision" not in sys.modules:  # a model holds its modules only once it is imported
        return ()
    try:
        from torchvision.ops import StochasticDepth
    except Exception:  # torchvision is optional
        return ()
    return (StochasticDepth,)


_FXQ_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
#: frames in these are not the user's code (the trailing separator keeps torchvision out)
_INTERNAL_PREFIXES = (_FXQ_DIR + os.sep, _TORCH_DIR + os.sep, "<")


def _is_internal(filename: str) -> bool:
    """True for frames of fxq, of torch itself (not torchvision, timm...) and of ``<string>``."""
    return filename.startswith(_INTERNAL_PREFIXES)


class Tracer(torch.fx.Tracer):
    """torch.fx tracer that honours ``@fxq.fx_wrap()`` and fxq's leaf modules.

    Buffers are graph values (``get_attr``); Python questions about traced
    values (``bool``, ``len``, ``float``, ``x.dtype``) are answered from fake
    values of the example inputs and from constants (``fxq.fx.example_values``).
    """

    proxy_buffer_attributes = True

    def __init__(
        self,
        extra_leaf_types: tuple[type, ...] = (),
        example_inputs: Mapping[str, Any] | None = None,
    ) -> None:
        # a graph's checks of conditions decided at tracing stay nodes when torch.fx traces
        # its code again (an unpickled graph module)
        super().__init__(autowrap_functions=(check_decided,))
        self.extra_leaf_types = extra_leaf_types + _torchvision_leaves()
        self.uses_root_methods = False
        #: fake and constant values of the recorded nodes (``fxq.fx.example_values``)
        self.example_values = ExampleValues(example_inputs or {}, _ACTIVE)
        self.has_example_inputs = bool(example_inputs)
        #: condition nodes decided in Python with the example inputs, and their answers (each
        #: becomes a check of the answer after tracing: ``_check_decided_conditions``)
        self.decided: list[tuple[torch.fx.Node, bool]] = []
        #: the result nodes of ``inline_fx_wrapped``
        self.inlined: list[torch.fx.Node] = []

    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        return MetaProxy(node, self)

    def create_proxy(self, kind: str, target: Any, args: tuple, kwargs: dict, *rest, **kw):
        """As torch.fx, and compute the node's fake and constant values (``example_values``).

        A function marked with ``torch.fx.wrap`` is traced into when that works
        (see ``inline_fx_wrapped``), and is one node otherwise.
        """
        if kind == "call_function" and _is_torch_fx_wrapped(target):
            inlined = self.inline_fx_wrapped(target, args, kwargs)
            if inlined is not None:
                return inlined
        proxy = super().create_proxy(kind, target, args, kwargs, *rest, **kw)
        opaque = kind == "call_function" and (
            target is call_wrapped_method or is_fx_wrapped(target)
        )
        self.example_values.record(proxy.node, self.root, opaque=opaque)
        return proxy

    def inline_fx_wrapped(
        self, fn: Callable[..., Any], args: tuple, kwargs: dict
    ) -> torch.fx.Proxy | None:
        """Trace into a ``torch.fx.wrap`` function; None (and nothing recorded) when that fails.

        Libraries mark functions with ``torch.fx.wrap`` because plain FX cannot
        answer their shape questions (torchvision's ``shifted_window_attention``
        pads to the window size and decides whether to shift from the feature
        map's size). fxq's tracer answers them from the example inputs, and the
        ops inside (linear layers, matmuls, softmax) can then be quantized. When
        tracing into the function fails (no example inputs, control flow on
        tensor values) or it returns something other than one tensor, the nodes
        it recorded are erased and the call becomes one node, as in torch.fx.
        """
        graph = self.graph
        # reversed(nodes) is an iterable, not an iterator, before torch 2.14
        last = next(iter(reversed(graph.nodes)), None)
        decided = len(self.decided)
        try:
            result = fn(*args, **kwargs)
        except Exception:
            result = None
        if isinstance(result, torch.fx.Proxy) and result.tracer is self:
            if "is_wrapped" not in result.node.meta:
                # torch.fx marks the node it gets back as the wrapped call, and code generation
                # would then register its target with torch.fx.wrap: unmarked after tracing
                self.inlined.append(result.node)
            return result
        added = []
        node = last.next if last is not None else next(iter(graph.nodes), None)
        while node is not None and node is not graph._root:
            added.append(node)
            node = node.next
        for node in reversed(added):
            if node.op != "get_attr" and not node.users:  # torch.fx may cache get_attr proxies
                graph.erase_node(node)
        del self.decided[decided:]
        return None

    def to_bool(self, obj: torch.fx.Proxy) -> bool:
        """A condition on shapes or dtypes is decided with the example inputs' metadata.

        Raises:
            SizeQuestionError: the condition reads only sizes and there are no
                example inputs to answer it.
        """
        known = example_to_bool(obj)
        if known is None:
            self._check_size_question(obj)
            return super().to_bool(obj)
        self.decided.append((obj.node, bool(known)))
        return known

    def iter(self, obj: torch.fx.Proxy) -> Iterator[Any]:
        found = example_iterate(obj)
        if found is None:
            self._check_size_question(obj)
            return super().iter(obj)
        return found

    def _check_size_question(self, obj: torch.fx.Proxy) -> None:
        """Raise ``SizeQuestionError`` for a Python question on sizes that example inputs answer."""
        if not self.has_example_inputs and reads_only_sizes(obj.node):
            raise SizeQuestionError(
                "symbolically traced variables cannot be used as inputs to control flow "
                "(this condition reads tensor sizes, and no example inputs were given)"
            )

    def keys(self, obj: torch.fx.Proxy) -> Any:
        found = example_keys(obj)
        return super().keys(obj) if found is NO_VALUE else found

    def create_node(self, *args: Any, **kwargs: Any) -> torch.fx.Node:
        """Record the user's source line of every node (``node.meta["fxq_source"]``)."""
        node = super().create_node(*args, **kwargs)
        frame = sys._getframe(1)
        while frame is not None:
            filename = frame.f_code.co_filename
            if not _is_internal(filename):
                node.meta["fxq_source"] = f"{filename}:{frame.f_lineno}"
                break
            frame = frame.f_back
        return node

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if is_fx_wrapped(type(m)) or getattr(m, "_fxq_leaf", False):
            return True
        if isinstance(m, self.extra_leaf_types):
            return True
        if registry_class(type(m)) is not None:
            return True  # a registry op, or a subclass of one that keeps its forward
        from torch.ao.quantization import DeQuantStub, QuantStub

        if isinstance(m, (QuantStub, DeQuantStub)):
            return True
        if type(m) in _TORCH_COMPOSITES and self.has_example_inputs:
            # traced through, so that its linear layers, attention and norms quantize (its
            # mask checks need the example inputs; without them it stays one float node)
            return False
        return super().is_leaf_module(m, module_qualified_name)

    def create_args_for_root(
        self,
        root_fn: Callable[..., Any],
        is_module: bool,
        concrete_args: dict[str, Any] | tuple[Any, ...] | None = None,
    ) -> tuple[Any, list[Any]]:
        """As torch.fx, but a decorated ``forward`` or one with ``**kwargs`` is traced by keyword.

        See ``fxq.fx.signature``: the graph takes the inner function's named
        arguments, and ``**kwargs`` holds only what ``concrete_args`` names.
        """
        if not isinstance(concrete_args, tuple):
            generated = keyword_forward(root_fn, concrete_args, is_module)
            if generated is not None:
                root_fn = generated
        fn, args = super().create_args_for_root(root_fn, is_module, concrete_args)

        @functools.wraps(fn)
        def returning_graph_values(*a: Any) -> Any:
            return _graph_output(fn(*a))

        return returning_graph_values, args

    def create_arg(self, a: Any) -> Any:
        if a is getattr(self, "root", None) and isinstance(a, nn.Module):
            return SELF
        return super().create_arg(a)

    def record_wrapped_call(self, wrapper: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Emit the node for a call to an ``fx_wrap``-ed function or method."""
        name = wrapper.__name__
        owner = args[0] if args else None
        is_method = (
            isinstance(owner, nn.Module)
            and wrapper is not call_wrapped_method
            and getattr(type(owner), name, None) is wrapper
        )
        if is_method:
            if owner is self.root:
                self.uses_root_methods = True
            elif not any(m is owner for m in self.root.modules()):
                raise FxqTraceError(
                    f"@fx_wrap() method {type(owner).__qualname__}.{name} was called on a module that "
                    "is not part of the traced model; register that module as a submodule"
                )
            return self.create_proxy(
                "call_function", call_wrapped_method, (owner, name, *args[1:]), kwargs
            )
        if wrapper is call_wrapped_method and args and args[0] is self.root:
            self.uses_root_methods = True
        return self.create_proxy("call_function", wrapper, args, kwargs)

    def trace(
        self, root: nn.Module | Callable[..., Any], concrete_args: dict[str, Any] | None = None
    ):
        _ACTIVE.append(self)
        try:
            graph = super().trace(root, concrete_args)
            for node in self.inlined:
                node.meta.pop("is_wrapped", None)
            saved = getattr(root, "meta", None)
            if isinstance(saved, dict) and _INPUT_CHECK in saved:
                # an unpickled graph module (torch.fx traces its code again): keep its check
                graph.set_codegen(InputCheck(*saved[_INPUT_CHECK]))
            return graph
        except FxqTraceError:
            raise
        except Exception as e:
            located = self._locate(e)
            if located is None:
                raise
            raise FxqTraceError(located) from e
        finally:
            _ACTIVE.remove(self)

    def _locate(self, error: BaseException) -> str | None:
        """Describe where in user code ``error`` happened, with advice."""
        user_frame = None
        for frame, lineno in traceback.walk_tb(error.__traceback__):
            filename = os.path.abspath(frame.f_code.co_filename)
            if _is_internal(frame.f_code.co_filename) or _is_internal(filename):
                continue
            user_frame = (frame, lineno)
        if user_frame is None:
            return None
        frame, lineno = user_frame
        filename = frame.f_code.co_filename
        line = linecache.getline(filename, lineno).strip()
        func = (
            frame.f_code.co_qualname
            if hasattr(frame.f_code, "co_qualname")
            else frame.f_code.co_name
        )
        module_note = ""
        self_obj = frame.f_locals.get("self")
        if isinstance(self_obj, nn.Module) and isinstance(getattr(self, "root", None), nn.Module):
            for path, m in self.root.named_modules():
                if m is self_obj:
                    module_note = f" (module '{path or '<root>'}', {type(m).__name__})"
                    break
        cause = _cause(frame, line, error, sizes_known=self.has_example_inputs)
        return (
            f"fxq.symbolic_trace failed: {type(error).__name__}: {error}\n"
            f"  at {filename}:{lineno}, in {func}{module_note}:\n"
            f"      {line}\n{cause}{_package_note(filename)}"
        )


#: leaves a graph can return (torch.fx's base types, and what its ``create_arg`` takes as is)
_OUTPUT_LEAVES = (
    *torch.fx.node.base_types,
    enum.Enum,
    type(None),
    type(...),
    slice,
    range,
    torch.Size,
    torch.fx.Proxy,
)


def _graph_output(out: Any) -> Any:
    """``out`` as a graph can return it, or an error naming what it cannot hold.

    A graph returns tensors, Python scalars and lists, tuples and dicts of
    them (a dict subclass such as Hugging Face's ``ModelOutput`` becomes a
    plain dict). An object built during tracing that holds traced values
    (Hugging Face's ``DynamicCache`` when ``use_cache`` is on) cannot be
    returned, and the ops that fill it would run on every call.

    Raises:
        FxqTraceError: naming each such object and how not to build it.
    """
    found: list[str] = []

    def check(value: Any, path: str) -> None:
        if isinstance(value, dict):  # before dataclasses: a ModelOutput is both
            for k, v in value.items():
                check(v, f"{path}[{k!r}]")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                check(v, f"{path}[{i}]")
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                check(getattr(value, field.name), f"{path}.{field.name}")
        elif not isinstance(value, _OUTPUT_LEAVES):
            found.append(f"output{path} ({type(value).__name__})")

    check(out, "")
    if found:
        raise FxqTraceError(
            f"fxq.symbolic_trace: the model returns {', '.join(found)}, which a graph cannot "
            "return (it is not a tensor, a Python scalar or a list, tuple or dict of them). "
            "Make concrete the argument that asks for it, e.g. for a Hugging Face cache "
            "concrete_args={'use_cache': False} (or prepare_qat_fx(..., concrete_args=...)), "
            "or trace a wrapper module that returns its tensors."
        )
    return out


_WRAP_ADVICE = (
    "Wrap the function or method containing this line with @fxq.fx_wrap() so it runs at call "
    "time as one graph node (or put @fxq.fx_wrap() on its module class to keep the whole module "
    "as a leaf)."
)


def _argument_proxies(frame: Any) -> dict[str, torch.fx.Proxy]:
    """Local variables of ``frame`` that are the traced model's own arguments."""
    found = {}
    for name, value in frame.f_locals.items():
        if isinstance(value, torch.fx.Proxy) and value.node.op == "placeholder":
            found[name] = value
    return found


def _is_optional_argument(proxy: torch.fx.Proxy) -> bool:
    """An argument with a default value (``mask=None``) or a ``*args`` / ``**kwargs``."""
    return bool(proxy.node.args) or str(proxy.node.target).startswith("*")


def _cause(frame: Any, line: str, error: BaseException, sizes_known: bool = False) -> str:
    """Why tracing failed here: an argument that should be concrete, a question on sizes
    that example inputs answer (unless ``sizes_known``: the tracer has them), or tensor
    control flow."""
    arguments = _argument_proxies(frame)
    mentioned = {n: p for n, p in arguments.items() if re.search(rf"\b{re.escape(n)}\b", line)}
    optional = {n: p for n, p in (mentioned or arguments).items() if _is_optional_argument(p)}
    if optional and (mentioned or not isinstance(error, TraceError)):
        shown = ", ".join(
            f"{p.node.target!r}" + (f" (default {p.node.args[0]!r})" if p.node.args else "")
            for p in optional.values()
        )
        example = ", ".join(
            f"{str(p.node.target).lstrip('*')!r}: {p.node.args[0] if p.node.args else '{}'!r}"
            for p in optional.values()
        )
        return (
            f"The model argument(s) {shown} became graph inputs (proxies), but this code needs "
            "their Python value (an `is None` check, a dict of options, ...). This is an "
            "argument that should be concrete, not control flow on tensor values: pass "
            f"concrete_args={{{example}}} to fxq.symbolic_trace / fxq.prepare_qat_fx (as in "
            "torch.fx.symbolic_trace), or give prepare_qat_fx example_inputs as a dict of the "
            "keyword inputs you use (the arguments not given are made concrete)."
        )
    structured = {
        n: p for n, p in mentioned.items() if not _is_optional_argument(p) and "iter" in str(error)
    }
    if structured:
        names = ", ".join(repr(p.node.target) for p in structured.values())
        return (
            f"The model input(s) {names} are used as Python containers (a list or dict of "
            "tensors that this code iterates), which a graph cannot record. Trace the part of "
            "the model that takes plain tensors (e.g. its backbone and heads), or "
            + _WRAP_ADVICE[0].lower()
            + _WRAP_ADVICE[1:]
        )
    if _is_size_question(error, sizes_known):
        return (
            "This condition reads tensor sizes (shape, size(), dim()), which the tracer answers "
            "from example inputs: pass example_inputs=... (inputs like those you will call the "
            "model with) to fxq.prepare_qat_fx / fxq.symbolic_trace so sizes are known and the branch "
            "is decided while the sizes stay graph values; or w" + _WRAP_ADVICE[1:]
        )
    if isinstance(error, TraceError) or "Proxy" in str(error):
        return (
            "This code depends on tensor values (an `if`/`while` on a tensor, len(), iterating "
            "a tensor or other data-dependent Python), which a graph cannot record. " + _WRAP_ADVICE
        )
    return _WRAP_ADVICE


def _is_size_question(error: BaseException, sizes_known: bool) -> bool:
    """A condition on sizes (``SizeQuestionError``), or ``len()`` of a traced value (a size)."""
    if isinstance(error, SizeQuestionError):
        return True
    is_len = isinstance(error, RuntimeError) and "'len' is not supported" in str(error)
    return is_len and not sizes_known


def _package_note(filename: str) -> str:
    """Advice for a line in an installed package (torchvision, timm...) the user cannot edit."""
    parts = os.path.abspath(filename).split(os.sep)
    for marker in ("site-packages", "dist-packages"):
        if marker in parts and parts.index(marker) + 1 < len(parts):
            package = parts[parts.index(marker) + 1].removesuffix(".py")
            return (
                f"\nThis line is in the installed package {package!r}, which you cannot edit: "
                "wrap without editing, e.g. `fxq.fx_wrap()(SomeClass)` to make a module class a "
                "leaf, or a subclass whose overriding method carries @fxq.fx_wrap() (see "
                "'Quantizing models you cannot edit' in docs/guide.md)."
            )
    return ""


def symbolic_trace(
    model: nn.Module,
    concrete_args: dict[str, Any] | None = None,
    example_inputs: Sequence[Any] | Mapping[str, Any] | None = None,
) -> GraphModule:
    """Trace ``model`` into a ``torch.fx.GraphModule``, honouring ``@fxq.fx_wrap()``.

    Like ``torch.fx.symbolic_trace`` the result shares submodules with
    ``model``; ``prepare_qat_fx`` copies before it changes anything.

    Args:
        model: the float module.
        concrete_args: arguments of ``model.forward`` to specialise, as in
            ``torch.fx.symbolic_trace``: ``{"attention_mask": None}`` traces the
            branch for that value. The graph module takes the argument as
            before (calling it with another value fails its check) and its
            default becomes the traced value, so it may be left out.
        example_inputs: optional example inputs (positional, or a dict by
            argument name; the arguments they leave out (with a sequence: the
            arguments after them) are traced at their defaults, as with
            ``concrete_args``). Only their metadata is used (shapes, dtypes,
            ranks; see ``fxq.fx.example_values``): Python conditions on it,
            such as ``if mask.ndim == 2`` or ``torch.finfo(x.dtype)``, are
            decided with the example's values, while conditions on tensor
            data still fail with advice.

    Raises:
        FxqTraceError: when tracing fails, with the source line and advice
            (an argument that should be in ``concrete_args``, or control flow
            on tensor values to wrap with ``@fxq.fx_wrap()``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fxq.symbolic_trace expects an nn.Module, got {type(model).__name__}")
    if concrete_args is not None:
        _check_concrete_args(model, concrete_args)
    if isinstance(example_inputs, Mapping):  # keyword inputs: the arguments not given are concrete
        concrete_args = {**concrete_args_for(model, dict(example_inputs)), **(concrete_args or {})}
    elif example_inputs is not None:  # positional: the arguments after them, at their defaults
        defaults = _defaults_after(model, example_inputs, concrete_args)
        concrete_args = {**defaults, **(concrete_args or {})} if defaults else concrete_args
    examples = _inputs_by_name(model, example_inputs, concrete_args)
    tracer = Tracer(example_inputs=examples)
    graph = tracer.trace(model, concrete_args)
    _check_decided_conditions(graph, tracer.decided)
    for node in list(graph.nodes):
        # attributes read only for Python checks (nn.TransformerEncoderLayer's fast-path test
        # of its weights) or by a failed inline_fx_wrapped: a later pass may swap the module
        # that holds them
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    _mark_concrete_placeholders(graph, model, concrete_args or {})
    if examples:  # calls must give every input the graph was traced with
        traced = [
            n.target
            for n in graph.nodes
            if n.op == "placeholder" and n.target in examples and not n.meta.get("fxq_concrete")
        ]
        graph.set_codegen(InputCheck(type(model).__name__, traced))
    gm = GraphModule(model, graph, type(model).__name__)
    if examples:  # a pickled graph module is traced again from its code: see Tracer.trace
        gm.meta[_INPUT_CHECK] = (type(model).__name__, tuple(traced))
    if tracer.uses_root_methods:
        _attach_root_state(gm, model)
    return gm


#: Python arithmetic that a decided condition may have been computed with
_PURE_PYTHON = frozenset(
    {getattr, len}
    | {getattr(operator, n) for n in ("eq", "ne", "lt", "le", "gt", "ge", "add", "sub", "mul")}
    | {getattr(operator, n) for n in ("floordiv", "mod", "neg", "not_", "getitem", "and_", "or_")}
)


def _check_decided_conditions(
    graph: torch.fx.Graph, decided: list[tuple[torch.fx.Node, bool]]
) -> None:
    """Make each condition decided in Python while tracing a check of its answer at run time.

    ``if new_h != H:`` on sizes records ``ne = getitem != getitem`` and is answered from the
    example inputs: the graph holds the branch taken. A call whose sizes answer otherwise
    would run that branch silently; ``check_decided(ne, True, ...)`` after the condition
    raises instead. A condition that reads something other than sizes and Python arithmetic
    (an attribute such as a dtype decided from the example) is erased with the arithmetic
    only it read, as before.
    """
    for node, answer in decided:
        if node.graph is not graph or node.users or node.op != "call_function":
            continue
        if reads_only_sizes(node):
            where = node.meta.get("fxq_source", "an unknown line")
            with graph.inserting_after(node):
                check = graph.call_function(check_decided, (node, answer, where))
            check.meta["fxq_source"] = where
            continue
        work = [node]
        while work:
            n = work.pop()
            if n.graph is not graph or n.users or n.op != "call_function":
                continue
            if n.target not in _PURE_PYTHON:
                continue
            inputs = n.all_input_nodes
            graph.erase_node(n)
            work.extend(inputs)


def check_decided(condition: Any, answer: bool, where: str) -> None:
    """Raise when a condition on sizes that tracing decided from the example inputs answers
    otherwise at run time (the graph holds only the branch the example took)."""
    # branching on the condition itself: under torch.compile with dynamic sizes it is a
    # SymBool, whose ``bool`` is a guard, not the singleton True or False
    if (not condition) if answer else condition:
        raise RuntimeError(
            f"{where}: this condition on tensor sizes was {answer} for the example inputs the "
            f"model was traced with, and is {not answer} for these inputs; the traced graph "
            "holds only the branch the example took. Trace with example_inputs of the sizes "
            "you run, or wrap the function with the branch in @fxq.fx_wrap()"
        )


def _defaults_after(
    model: nn.Module, example_inputs: Sequence[Any], concrete_args: dict[str, Any] | None
) -> dict[str, Any]:
    """The arguments of ``forward`` after the positional example inputs, at their defaults.

    ``prepare_qat_fx(vit, example_inputs=(x,))`` on timm's
    ``forward(x, attn_mask=None, is_causal=False)`` traces the branch the
    call ``vit(x)`` takes (no mask) instead of making ``attn_mask`` a graph
    input. Arguments without a default, and any ``forward`` taking
    ``*args``, are left as graph inputs.
    """
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    forward = type(model).forward
    params = list(inspect.signature(forward).parameters.values())[1:]  # self
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return {}
    named = traced_parameters(forward, concrete_args)
    return {
        p.name: p.default
        for p in named[len(example_inputs) :]
        if p.default is not inspect.Parameter.empty and p.name not in (concrete_args or {})
    }


def _inputs_by_name(
    model: nn.Module,
    example_inputs: Sequence[Any] | Mapping[str, Any] | None,
    concrete_args: dict[str, Any] | None,
) -> dict[str, Any] | None:
    """Example inputs keyed by the graph's argument names (None when not given)."""
    if example_inputs is None:
        return None
    if isinstance(example_inputs, Mapping):
        return dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    params = traced_parameters(type(model).forward, concrete_args)
    names = [p.name for p in params]
    signature = inspect.signature(type(model).forward).parameters.values()
    varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in signature)
    if not varargs and len(example_inputs) > len(names):
        raise TypeError(
            f"example_inputs holds {len(example_inputs)} inputs, but "
            f"{type(model).__name__}.forward takes {len(names)} ({', '.join(names) or 'none'}"
            f"{' besides concrete_args' if concrete_args else ''}); pass one example per "
            "input, in forward's order (a tuple: (x,) for one input)"
        )
    return dict(zip(names, example_inputs))


def _check_concrete_args(model: nn.Module, concrete_args: dict[str, Any]) -> None:
    if not isinstance(concrete_args, dict):
        raise TypeError(
            f"concrete_args must be a dict of argument name -> value, got {type(concrete_args).__name__}"
        )
    _check_forward_takes(model, concrete_args, "concrete_args")


def _check_forward_takes(model: nn.Module, names: Iterable[str], what: str) -> None:
    """Raise for a name in ``names`` that ``model.forward`` does not take (it has no ``**kwargs``)."""
    params = inspect.signature(model.forward).parameters
    variadic = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [k for k in names if k not in params]
    if unknown and not variadic:
        raise ValueError(
            f"{what} names {unknown}, which {type(model).__name__}.forward does not take "
            f"(its arguments: {list(params)})"
        )


def _mark_concrete_placeholders(
    graph: torch.fx.Graph, model: nn.Module, concrete_args: dict[str, Any]
) -> None:
    """Concrete arguments are Python values: mark them, keep their names, default to the value.

    torch.fx renames a concrete argument's placeholder (``mask_1``); the
    graph module keeps the argument's own name so keyword calls still work.
    """
    params = traced_parameters(type(model).forward, concrete_args)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, param in zip(placeholders, params):
        if param.name not in concrete_args:
            continue
        value = concrete_args[param.name]
        if _holds_placeholder_marker(value):
            continue  # a structure of PH: its leaves are real inputs
        node.meta["fxq_concrete"] = True
        node.target = param.name
        node.args = (value,)


def _holds_placeholder_marker(value: Any) -> bool:
    from torch.fx._symbolic_trace import PH

    if value is PH:
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_placeholder_marker(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_placeholder_marker(v) for v in value.values())
    return False


def concrete_args_for(model: nn.Module, keyword_inputs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of ``model.forward`` that ``keyword_inputs`` leaves out, at their defaults.

    ``prepare_qat_fx(example_inputs={"input_ids": ids})`` traces with every
    other argument concrete (``attention_mask=None``, ...).

    Raises:
        ValueError: for a keyword that ``forward`` does not take, or an
            argument without a default that is not given.
    """
    _check_forward_takes(model, keyword_inputs, "example_inputs")
    params = inspect.signature(model.forward).parameters
    concrete: dict[str, Any] = {}
    for name, p in params.items():
        if name in keyword_inputs or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is inspect.Parameter.empty:
            raise ValueError(
                f"example_inputs gives no value for {name!r}, which "
                f"{type(model).__name__}.forward needs (it has no default)"
            )
        concrete[name] = p.default
    return concrete


def _attach_root_state(gm: GraphModule, root: nn.Module) -> None:
    """Give ``gm`` everything the root's wrapped methods may reach through ``self``."""
    for name, child in root.named_children():
        held = gm._modules.get(name)
        # GraphModule holds a traced-through child as a bare nn.Module with only the parts the
        # graph calls; wrapped methods need the real one (``self.inner.decode(...)``)
        if held is None or (type(held) is nn.Module and type(child) is not nn.Module):
            gm.add_module(name, child)
    for name, p in root.named_parameters(recurse=False):
        if name not in gm._parameters:
            gm.register_parameter(name, p)
    for name, b in root.named_buffers(recurse=False):
        if name not in gm._buffers:
            gm.register_buffer(name, b, persistent=name not in root._non_persistent_buffers_set)
    gm.add_module("_fxq_self", _RootState(root))
