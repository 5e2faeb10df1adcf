"""A failed ``load_state_dict`` leaves an fxq model as it was.

torch's ``Module.load_state_dict`` copies each tensor as it goes and raises at the end, so a
failed load leaves the tensors it copied before the failure; fxq's fake quants also adopt a
saved dtype, offset or scale shape, and weighted modules a saved bias, while they load.
``guard_loads(model)`` registers two hooks on the model's root: before the load it keeps the
model's state (each module's attributes, its parameter, buffer and child dicts, and a copy
of every parameter's and buffer's values, on their device: the memory of one more copy of
the model while the load runs), after the load (its root's post hook, which sees every key
and error) it puts that state back when the load will raise: an error was recorded (a
shape, a dtype the march cannot run, a scale it cannot represent), or missing or unexpected
keys under ``strict=True``. A whole GraphModule pickled and loaded (``torch.save(model)``)
comes back without its root's hooks (torch.fx rebuilds the root); ``guard_loads`` it again.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from torch import nn

__all__ = ["guard_loads"]

#: the attribute of the model's ``__dict__`` holding what a running load may put back
_KEPT = "_fxq_load_kept"


def guard_loads(model: nn.Module) -> nn.Module:
    """Make a failed ``model.load_state_dict`` put ``model`` back as it was (once per model;
    a deep copy guards itself)."""
    if not any(isinstance(getattr(h, "hook", None), _Keep) for h in _pre_hooks(model)):
        # without ``with_module``: torch's wrapper would pickle the module within itself
        model._register_load_state_dict_pre_hook(_Keep(model))
        model.register_load_state_dict_post_hook(_restore_if_failed)
    return model


def _pre_hooks(model: nn.Module) -> list[Any]:
    return list(model._load_state_dict_pre_hooks.values())


class _Keep:
    """The pre hook: keeps the state of the model it guards (held weakly) before a load."""

    def __init__(self, model: nn.Module | None) -> None:
        self.model = None if model is None else weakref.ref(model)

    def __deepcopy__(self, memo: dict) -> _Keep:
        # a GraphModule's deep copy is in ``memo`` before its hooks are copied
        model = None if self.model is None else self.model()
        return _Keep(memo.get(id(model)))

    def __reduce__(self) -> tuple:
        return (_Keep, (None,))  # torch.fx rebuilds a pickled root without its hooks anyway

    def __call__(
        self,
        state_dict: dict,
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing: list[str],
        unexpected: list[str],
        errors: list[str],
    ) -> None:
        module = None if self.model is None else self.model()
        if module is None:
            return
        module.__dict__.pop(_KEPT, None)  # left by a load that raised before its end
        if prefix:  # a submodule of the model being loaded: the outer model's load decides
            return
        # the restore decides last: a post hook registered later may forgive missing keys
        hooks = module._load_state_dict_post_hooks
        for key, hook in list(hooks.items()):
            if hook is _restore_if_failed:
                hooks.move_to_end(key)
        kept = []
        for m in module.modules():
            values = {}
            with torch.no_grad():
                for group in (m._parameters, m._buffers):
                    for t in group.values():
                        if t is not None and t.device.type != "meta":
                            values[id(t)] = (t, t.detach().clone())
            kept.append(
                (
                    m,
                    dict(m.__dict__),
                    dict(m._parameters),
                    dict(m._buffers),
                    dict(m._modules),
                    values,
                )
            )
        module.__dict__[_KEPT] = (kept, errors)


def _restore_if_failed(module: nn.Module, incompatible: Any) -> None:
    found = module.__dict__.pop(_KEPT, None)
    if found is None:
        return
    kept, errors = found
    keys = incompatible.missing_keys or incompatible.unexpected_keys
    if not errors and not (keys and _strict()):
        return
    for m, attributes, parameters, buffers, children, _ in kept:
        m.__dict__.clear()
        m.__dict__.update(attributes)
        for saved, now in (
            (parameters, m._parameters),
            (buffers, m._buffers),
            (children, m._modules),
        ):
            now.clear()
            now.update(saved)
    with torch.no_grad():
        for *_, values in kept:
            for tensor, value in values.values():
                tensor.copy_(value)


def _strict() -> bool:
    """The ``strict`` of the ``nn.Module.load_state_dict`` call running (the hooks see only
    the ``True`` it passes every module's ``_load_from_state_dict``); False when it cannot be
    found: missing or unexpected keys then leave the load as torch made it."""
    code = nn.Module.load_state_dict.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return bool(frame.f_locals.get("strict", False))
        frame = frame.f_back
    return False
