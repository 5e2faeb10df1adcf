"""Launching fxq's Triton kernels with less host work than ``kernel[grid](...)``.

An eager CUDA QAT step is bound by the host (``benchmarks/RESULTS.md``): its kernels take
less time than the host takes to issue them. ``JITFunction.run``, what ``kernel[grid](...)``
calls, does per launch: it binds and specialises every argument, builds the cache key,
reads Triton's settings (``triton.knobs``, each read a few Python calls) and looks the
compiled kernel up; on the H100 and H200 machines this was about 80 Python calls a launch,
6,900 a ResNet-18 step (eighth session). ``Launcher`` goes through ``JITFunction.run`` the
first time it sees a specialisation, keeps the compiled kernel it returns, and later
launches that kernel with the compiled launcher (``CompiledKernel.run``, C), as torch
inductor's generated launchers do.

The key under which a compiled kernel is kept is at least as fine as Triton's
specialisation, so that a kept kernel is the one Triton would pick: per tensor its dtype
and whether its address is a multiple of 16, per integer whether it is a multiple of 16,
whether it is 1 and whether it fits in 32 bits, per ``tl.constexpr`` its value, plus the
device. Where that cannot be made (an interpreter, a Triton without ``params`` or
``packed_metadata``) every launch goes through ``kernel[grid](...)`` as before, and so does
any launch while a launch hook is set (a profiler's, e.g. Triton's proton): Triton calls it.
(Triton's own launch calls its hook chains and builds their metadata every time, empty or
not.) A tensor on another CUDA device than the current one is launched with that device
made current (Triton launches on the current device).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
from torch import Tensor

__all__ = ["Launcher", "cdiv", "next_power_of_2", "raw_stream"]

#: the current CUDA stream of a device as an address, as Triton and inductor read it (a
#: ``torch.cuda.Stream`` object per call costs more)
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for grids: ``triton.cdiv`` is a ``ConstexprFunction`` in Triton 3.8,
    whose call from Python costs microseconds."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two at least ``n`` (1 for ``n <= 1``), as
    ``triton.next_power_of_2`` for positive ``n``, without its call's cost."""
    return 1 << max(n - 1, 0).bit_length()


#: Triton's runtime settings (``triton.knobs.runtime``; None in a Triton without them)
_RUNTIME = getattr(getattr(triton, "knobs", None), "runtime", None)


def _hook_set(hook: Any) -> bool:
    """Whether a launch hook does something: in Triton 3.6 and 3.8 the hooks are chains
    (``HookChain``), empty unless a profiler added to them; in older ones a function or
    None."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or bool(calls)


def _launch_hooks_set() -> bool:
    """Whether a launch hook is set (a profiler's): launches then go through Triton, which
    calls it."""
    if _RUNTIME is None:
        return True  # a Triton whose hooks are elsewhere: do not guess
    return _hook_set(_RUNTIME.launch_enter_hook) or _hook_set(_RUNTIME.launch_exit_hook)


class Launcher:
    """``kernel[grid](*args, **options)`` with the host work of a repeated launch cut to a key
    and the compiled launcher's call. ``args``: every parameter of the kernel in order,
    ``tl.constexpr`` ones included, the first a tensor (its device is the launch's); the
    last ones may be given by name (all of those after the positional ones).

    The launch is on the current CUDA stream, as Triton's.
    """

    def __init__(self, kernel: Any, **options: Any) -> None:
        self.kernel = kernel
        self.options = options
        params = getattr(kernel, "params", None)
        #: per parameter whether it is a ``tl.constexpr`` (None: never keep compiled kernels)
        self.constexpr: tuple[bool, ...] | None = (
            tuple(bool(p.is_constexpr) for p in params) if params is not None else None
        )
        #: the parameters' names (for those given by name)
        self.names: tuple[str, ...] = tuple(getattr(kernel, "arg_names", ()))
        self.compiled: dict[tuple, Any] = {}
        #: per tuple of argument types: where ``key`` finds what it keys by (``_plan``)
        self.plans: dict[tuple[type, ...], tuple] = {}

    def key(self, device: int, args: tuple) -> tuple | None:
        """The specialisation of ``args`` (None: not one that is kept)."""
        kinds = tuple(map(type, args))
        plan = self.plans.get(kinds)
        if plan is None:
            plan = self.plans[kinds] = self._plan(kinds)
        if not plan:
            return None
        tensors, ints, by_value = plan
        parts: list[Any] = [device, kinds]
        addresses = 0
        for i in tensors:
            tensor = args[i]
            addresses |= tensor.data_ptr()
            parts.append(tensor.dtype)
        if addresses & 15:  # some tensor is not aligned to 16 bytes: which
            parts.append(tuple(args[i].data_ptr() & 15 == 0 for i in tensors))
        for i in ints:
            v = args[i]
            parts.append((v & 15 == 0) + 2 * (v == 1) + 4 * (-(2**31) <= v < 2**31))
        for i in by_value:
            parts.append(args[i])
        return tuple(parts)

    def _plan(self, kinds: tuple[type, ...]) -> tuple[tuple[int, ...], ...] | tuple[()]:
        """Where ``key`` finds the tensors, the integers and the arguments it keys by value
        (constexprs, bools, None) in arguments of these types; ``()``: not kept."""
        constexpr = self.constexpr
        if constexpr is None or len(constexpr) != len(kinds):
            return ()
        tensors, ints, by_value = [], [], []
        for i, (is_constexpr, kind) in enumerate(zip(constexpr, kinds)):
            if is_constexpr:
                by_value.append(i)
            elif issubclass(kind, Tensor):  # parameters too
                tensors.append(i)
            elif kind is int:
                ints.append(i)
            elif kind is not float:  # a float is a float32 argument, whatever its value
                by_value.append(i)
        return tuple(tensors), tuple(ints), tuple(by_value)

    def __call__(self, grid: tuple[int, ...], *args: Any, **named: Any) -> None:
        if named:  # the last parameters by name (the constexprs, for the reader)
            args = self._positional(args, named)
        device = args[0].device  # fxq's kernels take a tensor first
        if device.type != "cuda":  # Triton's interpreter (``TRITON_INTERPRET=1``)
            self.kernel[grid](*args, **self.options)
            return
        if device.index != torch.cuda.current_device():
            with torch.cuda.device(device):  # Triton launches on the current device
                self(grid, *args)
            return
        self.launch(device.index, grid, args)

    def _positional(self, args: tuple, named: dict[str, Any]) -> tuple:
        names = self.names[len(args) :]
        try:
            if len(named) == len(names):
                return args + tuple([named[name] for name in names])
        except KeyError:
            pass
        raise TypeError(
            f"{getattr(self.kernel, '__name__', self.kernel)}: after {len(args)} positional "
            f"arguments the kernel takes {list(names)} by name, not {list(named)}"
        )

    def launch(self, device: int, grid: tuple[int, ...], args: tuple) -> None:
        """Launch on CUDA device ``device``, the current one."""
        key = self.key(device, args)
        compiled = None if key is None else self.compiled.get(key)
        if compiled is None or _launch_hooks_set():
            kernel = self.kernel[grid](*args, **self.options)
            if key is not None and compiled is None and self._launchable(kernel):
                self.compiled[key] = kernel
            return
        grid_y = grid[1] if len(grid) > 1 else 1
        grid_z = grid[2] if len(grid) > 2 else 1
        compiled.run(
            grid[0], grid_y, grid_z, raw_stream(device), compiled.function,
            compiled.packed_metadata, None, None, None, *args,
        )  # fmt: skip

    @staticmethod
    def _launchable(kernel: Any) -> bool:
        """Whether ``kernel`` (what ``JITFunction.run`` returned) is a compiled kernel whose
        launcher can be called directly."""
        return (
            kernel is not None
            and getattr(kernel, "function", None) is not None
            and hasattr(kernel, "packed_metadata")
            and callable(getattr(kernel, "run", None))
        )
