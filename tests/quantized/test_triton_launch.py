"""``fxq.quantized._triton_launch.Launcher``: a Triton kernel's compiled launcher called
directly once Triton compiled it for a specialisation, through Triton otherwise.

On the CPU the choice between the two is checked with a stand-in kernel (Triton's launcher
needs a GPU) and the key with fxq's real kernels; on CUDA the kernels launched directly are
checked against the unfused fake quant, bit for bit, on aligned and misaligned inputs.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

pytest.importorskip("triton")

from fxq.quantized import _fake_quant_triton, _triton_launch, fake_quant_ops  # noqa: E402
from fxq.quantized._triton_launch import Launcher  # noqa: E402


class _Compiled:
    """What ``JITFunction.run`` returns: a compiled kernel with its launcher."""

    function = "cu-function"
    packed_metadata = ("packed",)

    def __init__(self):
        self.launches = []

    def run(self, *args):
        self.launches.append(args)


class _Kernel:
    """A ``JITFunction`` stand-in: ``params`` and ``kernel[grid](*args, **options)``."""

    def __init__(self, constexpr):
        self.params = [types.SimpleNamespace(is_constexpr=c) for c in constexpr]
        self.arg_names = [f"ARG{i}" if c else f"arg{i}" for i, c in enumerate(constexpr)]
        self.through_triton = []
        self.compiled = []

    def __getitem__(self, grid):
        def run(*args, **options):
            self.through_triton.append((grid, args, options))
            self.compiled.append(_Compiled())
            return self.compiled[-1]

        return run


def test_the_key_tells_apart_what_triton_specialises_on():
    """Per tensor: dtype and 16-byte alignment; per integer: multiple of 16, 1, 32 bits; per
    constexpr: its value; floats not at all; the device."""
    launcher = _fake_quant_triton._launch_fake_quant
    # x, scale, out, mask, n, qmin, qmax, BLOCK
    assert launcher.constexpr == (False,) * 7 + (True,)
    x = torch.zeros(1040)
    scale = torch.ones(1)
    mask = torch.zeros(1040, dtype=torch.bool)

    def key(x=x, n=1024, qmin=-128.0, block=1024, device=0, out=x):
        return launcher.key(device, (x, scale, out, mask, n, qmin, 127.0, block))

    assert key() == key(x=torch.zeros(7), out=torch.zeros(9))  # fresh tensors are aligned
    assert key() == key(qmin=-32768.0)
    different = [
        key(x=x[1:]),  # 4 bytes off: not a multiple of 16
        key(out=x.to(torch.float64)),
        key(n=1000),
        key(n=1),
        key(n=2**31 + 16),
        key(block=512),
        key(device=1),
    ]
    assert len({key(), *different}) == len(different) + 1
    assert key(x=x[4:]) == key()  # 16 bytes off: aligned again


def test_a_kept_kernel_is_launched_directly_on_the_current_stream(monkeypatch):
    monkeypatch.setattr(_triton_launch, "raw_stream", lambda device: 1000 + device)
    kernel = _Kernel([False, False, False, True])
    launcher = Launcher(kernel, enable_fp_fusion=False)
    x = torch.zeros(64)
    launcher.launch(0, (4,), (x, 64, 0.5, 8))
    launcher.launch(0, (4,), (x, 64, 0.25, 8))
    assert kernel.through_triton == [((4,), (x, 64, 0.5, 8), {"enable_fp_fusion": False})]
    assert kernel.compiled[0].launches == [
        (4, 1, 1, 1000, "cu-function", ("packed",), None, None, None, x, 64, 0.25, 8)
    ]
    launcher.launch(0, (4, 2), (x[1:], 63, 0.5, 8))  # misaligned, not a multiple of 16
    launcher.launch(2, (4, 2), (x, 64, 0.5, 8))  # another device
    assert len(kernel.through_triton) == 3
    launcher.launch(2, (4, 2, 3), (x, 64, 0.5, 8))
    assert kernel.compiled[2].launches == [
        (4, 2, 3, 1002, "cu-function", ("packed",), None, None, None, x, 64, 0.5, 8)
    ]


def test_launches_go_through_triton_while_a_launch_hook_is_set(monkeypatch):
    """A profiler's hook (Triton's proton adds to the hook chain) is called by Triton's
    launch only: with one set, no launch is direct."""
    chain = types.SimpleNamespace(calls=[])
    runtime = types.SimpleNamespace(launch_enter_hook=chain, launch_exit_hook=None)
    monkeypatch.setattr(_triton_launch, "_RUNTIME", runtime)
    monkeypatch.setattr(_triton_launch, "raw_stream", lambda device: 0)
    kernel = _Kernel([False])
    launcher = Launcher(kernel)
    x = torch.zeros(16)
    launcher.launch(0, (1,), (x,))
    chain.calls.append(print)
    launcher.launch(0, (1,), (x,))
    assert len(kernel.through_triton) == 2
    chain.calls.clear()
    launcher.launch(0, (1,), (x,))
    assert len(kernel.through_triton) == 2 and len(kernel.compiled[0].launches) == 1


def test_a_kernel_without_parameters_or_launcher_is_always_launched_by_triton(monkeypatch):
    monkeypatch.setattr(_triton_launch, "raw_stream", lambda device: 0)
    x = torch.zeros(16)
    kernel = _Kernel([False])
    del kernel.params
    launcher = Launcher(kernel)
    assert launcher.constexpr is None
    for _ in range(2):
        launcher.launch(0, (1,), (x,))
    assert len(kernel.through_triton) == 2

    class _NoLauncher(_Kernel):
        def __getitem__(self, grid):
            run = super().__getitem__(grid)
            return lambda *args, **options: run(*args, **options) and None  # as an interpreter

    kernel = _NoLauncher([False])
    launcher = Launcher(kernel)
    for _ in range(2):
        launcher.launch(0, (1,), (x,))
    assert len(kernel.through_triton) == 2 and not launcher.compiled


def test_the_last_arguments_may_be_named_and_are_passed_in_the_kernels_order():
    kernel = _Kernel([False, False, True, True])
    x = torch.zeros(16)  # on the CPU: launched by Triton (its interpreter)
    Launcher(kernel, enable_fp_fusion=False)((2,), x, 16, ARG3=8, ARG2=4)
    assert kernel.through_triton == [((2,), (x, 16, 4, 8), {"enable_fp_fusion": False})]
    with pytest.raises(TypeError, match=r"takes \['ARG2', 'ARG3'\] by name, not \['ARG3'\]"):
        Launcher(kernel)((2,), x, 16, ARG3=8)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_kernels_launched_directly_equal_the_unfused_fake_quant_on_cuda():
    """Aligned and misaligned inputs (another specialisation), sizes a multiple of 16 and
    not: every call after the first of a specialisation is a direct launch, and equals the
    torch ops bit for bit."""
    from tests.quantized.test_fake_quant_ops import _fake_quant

    for name, shape in (("moving", (4096,)), ("moving", (1000,)), ("weight", (16, 8, 3, 3))):
        fq = _fake_quant(name).cuda()
        ref = copy.deepcopy(fq)
        numel = int(torch.Size(shape).numel())
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            base = (torch.randn(numel + 1, generator=g) * (step + 1)).cuda()
            for x in (base[:-1].view(shape), base[1:].view(shape)):  # aligned, then 4 bytes off
                out = fq(x)
                with fake_quant_ops.torch_ops_only():
                    expected = ref(x)
                assert torch.equal(out, expected), (name, shape, step)
                assert torch.equal(fq.scale, ref.scale), (name, shape, step)
    for launcher in (
        _fake_quant_triton._launch_observe,
        _fake_quant_triton._launch_fake_quant,
        _fake_quant_triton._launch_rows,
    ):  # kept for aligned and misaligned inputs at least
        assert len(launcher.compiled) >= 2, launcher.kernel
