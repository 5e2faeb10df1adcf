"""Warnings are summaries: one per public call, naming the layers, not one per layer.

A finding about one module (a fake quant whose scale sits at the floor, a layer left
float) is reported with :func:`warn_per_module`. Inside a public call decorated with
:func:`summarises_warnings` the findings are collected, and when the outermost such call
returns (or raises) each kind of finding becomes one warning that counts and names the
modules::

    fxq.set_fake_quantize: 140 fake quants: the scale is clamped at fxq's smallest scale
    2**-23, so every value quantizes to 0: the output of 'head.0', ... and 130 more. The
    first: fxq: fake quant the output of 'head.0': it saw values in [...]; ...

A kind found in one module only is warned with that module's own message. Outside any
decorated call a finding is warned at once, as it is.

This module imports nothing from fxq: every layer may use it.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = ["summarises_warnings", "warn_per_module"]

#: how many module names a summary lists before "... and N more"
NAMES_SHOWN = 10

_F = TypeVar("_F", bound=Callable[..., Any])
_state = threading.local()


@dataclass
class _Group:
    """Findings of one kind: their modules and the first one's full message."""

    category: type[Warning]
    headline: str
    what: str
    first_message: str
    names: list[str] = field(default_factory=list)


class _Collector:
    def __init__(self) -> None:
        self.groups: dict[tuple[type[Warning], str, str], _Group] = {}

    def add(self, name: str, message: str, headline: str, what: str, category) -> None:
        key = (category, headline, what)
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = _Group(category, headline, what, message)
        group.names.append(name)

    def emit(self, call: str, stacklevel: int) -> None:
        for group in self.groups.values():
            warnings.warn(summary(call, group), group.category, stacklevel=stacklevel + 1)


def summary(call: str, group: _Group) -> str:
    """The one warning for ``group``'s findings made during ``call``."""
    if len(group.names) == 1:
        return group.first_message
    shown = ", ".join(group.names[:NAMES_SHOWN])
    more = len(group.names) - NAMES_SHOWN
    if more > 0:
        shown += f" ... and {more} more"
    return (
        f"{call}: {len(group.names)} {group.what}s: {group.headline}: {shown}. "
        f"The first: {group.first_message}"
    )


def warn_per_module(
    name: str,
    message: str,
    *,
    headline: str,
    what: str = "module",
    category: type[Warning] = UserWarning,
    stacklevel: int = 2,
) -> None:
    """Report a finding about one module: collected inside a call decorated with
    :func:`summarises_warnings`, warned at once (with ``stacklevel``) outside one.

    Args:
        name: the module (or fake quant) the finding is about, as the summary lists it.
        message: the full warning for this module alone.
        headline: what the findings of this kind share (findings with the same
            ``category``, ``headline`` and ``what`` become one warning).
        what: the noun for one such module in the summary ("fake quant", "layer").
        category: the warning class.
        stacklevel: as for :func:`warnings.warn`, counted from the caller.
    """
    collector = getattr(_state, "collector", None)
    if collector is None:
        warnings.warn(message, category, stacklevel=stacklevel + 1)
    else:
        collector.add(name, message, headline, what, category)


def summarises_warnings(call: str) -> Callable[[_F], _F]:
    """Decorate a public function so the per-module findings made while it runs
    (see :func:`warn_per_module`) become one warning per kind, issued at its caller.

    Calls nest: only the outermost decorated call warns.

    Args:
        call: the function's public name, which starts each summary.
    """

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if getattr(_state, "collector", None) is not None:
                return fn(*args, **kwargs)
            collector = _state.collector = _Collector()
            try:
                return fn(*args, **kwargs)
            finally:
                _state.collector = None
                collector.emit(call, stacklevel=2)

        return wrapper  # type: ignore[return-value]

    return decorate
