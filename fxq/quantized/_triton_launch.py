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

__all__ = ["Launcher"]

#: the current CUDA stream of a device as an address, as Triton and inductor read it (a
#: ``torch.cuda.Stream`` object per call costs more)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


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
    ``tl.constexpr`` ones included, positionally.

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
        self.compiled: dict[tuple, Any] = {}

    def key(self, device: int, args: tuple) -> tuple | None:
        """The specialisation of ``args`` (None: not one that is kept)."""
        constexpr = self.constexpr
        if constexpr is None or len(constexpr) != len(args):
            return None
        parts: list[Any] = [device]
        for is_constexpr, arg in zip(constexpr, args):
            if is_constexpr:
                parts.append(arg)
            elif isinstance(arg, Tensor):  # parameters too
                parts.append((arg.dtype, arg.data_ptr() & 15 == 0))
            elif type(arg) is int:
                parts.append((arg & 15 == 0, arg == 1, -(2**31) <= arg < 2**31))
            elif type(arg) is float:
                parts.append(float)
            else:  # bool, None, anything else: by value
                parts.append((type(arg), arg))
        return tuple(parts)

    def __call__(self, grid: tuple[int, ...], *args: Any) -> None:
        device = next(a for a in args if isinstance(a, Tensor)).device
        if device.type != "cuda":  # Triton's interpreter (``TRITON_INTERPRET=1``)
            self.kernel[grid](*args, **self.options)
            return
        if device.index != torch.cuda.current_device():
            with torch.cuda.device(device):  # Triton launches on the current device
                self(grid, *args)
            return
        self.launch(device.index, grid, args)

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
            grid[0], grid_y, grid_z, _raw_stream(device), compiled.function,
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
