"""The arguments a traced ``forward`` takes: decorated forwards and ``**kwargs``.

torch.fx makes one placeholder per parameter of the code object it calls.
That breaks on two common shapes of library code:

* a ``forward`` behind a ``functools.wraps`` decorator (Hugging Face's
  ``@merge_with_config_defaults``, ``@can_return_tuple``): torch.fx reads the
  names from the inner function but rewrites the *wrapper's* code to take them
  positionally, so the wrapper's own ``args`` and ``kwargs`` receive the first
  model inputs (``'Proxy' object does not support item assignment``);
* ``**kwargs``: it becomes a Proxy, and ``kwargs.get("output_attentions")``
  records a graph node instead of reading an option.

For such a ``forward`` fxq traces a small generated function with the
*inner* signature: one parameter per named argument, ``*args`` empty,
``**kwargs`` holding only the names the user gives in ``concrete_args`` (a
fixed value, or ``torch.fx.PH`` for a tensor input), and it calls the real
``forward`` (wrapper included) by keyword. The graph module then takes the
named arguments, in order, like the model.

A graph traced with example inputs checks, at each call, that it gets every
input it was traced with (``InputCheck``): calling a model prepared with
``example_inputs={"input_ids": ..., "attention_mask": ...}`` with
``input_ids`` only is a ``TypeError`` naming ``attention_mask``, not an error
deep inside the graph where the missing input (None) is first used.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch.fx

__all__ = ["InputCheck", "keyword_forward", "missing_inputs", "traced_parameters"]

_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _needs_keyword_forward(fn: Callable[..., Any], sig: inspect.Signature) -> bool:
    decorated = inspect.unwrap(fn) is not fn
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    return decorated or takes_kwargs


def traced_parameters(
    fn: Callable[..., Any], concrete_args: dict[str, Any] | None, is_module: bool = True
) -> list[inspect.Parameter]:
    """The parameters (``self`` excluded) that the traced graph takes, in placeholder order.

    For a plain ``forward`` these are its parameters without ``*args`` and
    ``**kwargs`` (torch.fx appends placeholders for those); for a decorated one
    or one with ``**kwargs`` they are the inner function's named parameters
    followed by the names in ``concrete_args`` that only ``**kwargs`` takes.
    """
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if is_module and params:
        params = params[1:]  # self
    named = [p for p in params if p.kind not in _VARIADIC]
    if not _needs_keyword_forward(fn, sig):
        return named
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    known = {p.name for p in named}
    extra = []
    if takes_kwargs:
        for name, value in (concrete_args or {}).items():
            if name not in known:
                default = None if _is_placeholder_marker(value) else value
                extra.append(
                    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
                )
    return named + extra


def _is_placeholder_marker(value: Any) -> bool:
    from torch.fx._symbolic_trace import PHBase

    return isinstance(value, PHBase)


def keyword_forward(
    fn: Callable[..., Any], concrete_args: dict[str, Any] | None, is_module: bool = True
) -> Callable[..., Any] | None:
    """A function with ``fn``'s real named parameters that calls ``fn`` by keyword.

    Returns None when ``fn`` can be traced as it is (not decorated, no
    ``**kwargs``). The generated function's code object has one positional
    parameter per traced parameter (torch.fx reads ``co_varnames``), defaults
    as in ``fn``, and annotations only where they are classes.
    """
    sig = inspect.signature(fn)
    if not _needs_keyword_forward(fn, sig):
        return None
    params = traced_parameters(fn, concrete_args, is_module)
    positional_only = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_ONLY]
    names = [p.name for p in params]
    for name in names:
        if not name.isidentifier() or name.startswith("_fxq_"):
            return None  # cannot be spelled as a parameter: leave it to torch.fx
    head = ["self"] if is_module else []
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    # a parameter without a default after one with a default is not valid Python: give those
    # (keyword-only in the original) a default of None; the graph input stays required in use
    seen_default = False
    spelled = []
    for p in params:
        if p.name in defaults:
            seen_default = True
            spelled.append(f"{p.name}=_fxq_defaults[{p.name!r}]")
        elif seen_default:
            defaults[p.name] = None
            spelled.append(f"{p.name}=None")
        else:
            spelled.append(p.name)
    call_positional = head + positional_only
    call_keyword = [f"{n}={n}" for n in names if n not in positional_only]
    source = (
        f"def forward({', '.join(head + spelled)}):\n"
        f"    return _fxq_forward({', '.join(call_positional + call_keyword)})\n"
    )
    namespace: dict[str, Any] = {"_fxq_forward": fn, "_fxq_defaults": defaults}
    exec(compile(source, f"<fxq keyword forward of {fn.__qualname__}>", "exec"), namespace)
    generated = namespace["forward"]
    generated.__qualname__ = getattr(fn, "__qualname__", "forward")
    generated.__annotations__ = {
        p.name: p.annotation for p in params if isinstance(p.annotation, type)
    }
    return generated


class InputCheck(torch.fx.CodeGen):
    """Code generation whose ``forward`` first checks that the traced inputs are given.

    An input traced with an example value but with a default in the model's
    signature (``attention_mask=None``) can be left out of a call, and the
    graph would then run on None. The generated ``forward`` starts with one
    ``is None`` test of those inputs and raises a ``TypeError`` naming the
    missing ones and what to do. Set on a graph with ``graph.set_codegen``; it
    is kept by ``copy.deepcopy`` (so by ``prepare_qat_fx`` and ``convert_fx``).

    Args:
        model: the traced model's class name, for the message.
        inputs: the names of the inputs the graph was traced with (a name the
            generated ``forward`` does not take is ignored).

    >>> import torch
    >>> def f(x, mask=None):
    ...     return x * mask
    >>> gm = torch.fx.symbolic_trace(f)
    >>> gm.graph.set_codegen(InputCheck("f", ["x", "mask"]))
    >>> _ = gm.recompile()
    >>> gm(torch.ones(1))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: f was traced with the inputs 'x', 'mask' and is called without 'mask': call ...
    """

    def __init__(self, model: str, inputs: Sequence[str]) -> None:
        super().__init__()
        self.model = model
        self.inputs = tuple(inputs)

    def gen_fn_def(self, free_vars: list[str], *args: Any, **kwargs: Any) -> str:
        fn_def = super().gen_fn_def(free_vars, *args, **kwargs)
        taken = {v.split(":")[0].split("=")[0].strip() for v in free_vars}
        names = [n for n in self.inputs if n in taken and n.isidentifier()]
        if not names:
            return fn_def
        return (
            f"{fn_def}\n"
            f"    if {' or '.join(f'{n} is None' for n in names)}:\n"
            f"        _fxq_missing_inputs({self.model!r}, {tuple(self.inputs)!r}, "
            f"{', '.join(f'{n}={n}' for n in names)})"
        )

    def _gen_python_code(self, *args: Any, **kwargs: Any) -> Any:
        # the failing call raises in a function, not in the generated code (where torch.fx
        # would print the generated source around the line to stderr)
        code = super()._gen_python_code(*args, **kwargs)
        code.globals["_fxq_missing_inputs"] = missing_inputs
        return code


def missing_inputs(model: str, traced: Sequence[str], **given: Any) -> NoReturn:
    """Raise the error of ``InputCheck``: ``model`` was called without some ``traced`` inputs.

    Raises:
        TypeError: always, naming the inputs of ``given`` that are None.
    """
    missing = ", ".join(repr(n) for n, v in given.items() if v is None)
    raise TypeError(
        f"{model} was traced with the inputs {', '.join(map(repr, traced))} and is called "
        f"without {missing}: call it with every input it was traced with, or trace it "
        "(fxq.symbolic_trace / fxq.prepare_qat_fx example_inputs=...) with only the inputs you "
        "will pass; the arguments example_inputs leaves out are traced at their defaults"
    )
