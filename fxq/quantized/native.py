"""Optional native (C) kernels for the CPU, loaded with ctypes.

The requantization of a conv / linear accumulator is several elementwise
passes in torch (convert, multiply, round, clamp, convert); the C kernel in
``native_kernels.c`` does it in one. It is compiled on first use with the
system C compiler into ``~/.cache/fxq`` (or ``$FXQ_CACHE_DIR``) and computes
exactly what ``fxq.quantized.functional.requantize_exact`` computes in torch
(the tests compare both bit for bit). QAT training's fake quantization of float32
(``fake_quantize``: scale, round, clamp, rescale and the gradient mask) is one pass of the
same library instead of five torch passes. Without a compiler, or when the build
fails, fxq warns once with the reason and uses the torch path: same results,
slower; ``FXQ_NATIVE=0`` chooses the torch path without a warning.

Graph captures: the kernels are also the torch custom ops ``fxq::requantize``
and ``fxq::requantize_add`` (``torch.library``, with fake implementations), so
``torch.export`` and ``torch.compile`` record each requantization as one op
instead of running opaque C code on fake tensors. The ops run the C kernel where
it is loaded and otherwise the same computation in torch; an exported program
that contains them needs ``import fxq`` to run (or to ``torch.export.load``).
``torch.jit.trace`` records the torch path; ``torch.onnx.export`` raises
``ExporterError`` (see ``refuse_onnx_export``).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

__all__ = [
    "available",
    "requantize",
    "requantize_add",
    "fake_quantize",
    "ExporterError",
    "refuse_onnx_export",
]

_SOURCE = Path(__file__).with_name("native_kernels.c")
# -fno-math-errno / -fno-trapping-math let floor() vectorize; neither changes an
# IEEE result (unlike -ffast-math, which fxq must never use).
_FLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffp-contract=off",  # no FMA: each ``a * b + c`` rounds twice, as torch's two ops do
    "-shared",
    "-fPIC",
]
_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_TRIED = False

_FUNCS = {
    (torch.float32, torch.int8): "fxq_requant_f32_i8",
    (torch.float32, torch.int16): "fxq_requant_f32_i16",
    (torch.float64, torch.int8): "fxq_requant_f64_i8",
    (torch.float64, torch.int16): "fxq_requant_f64_i16",
    (torch.float32, torch.float32): "fxq_requant_f32_f32",
    (torch.float64, torch.float32): "fxq_requant_f64_f32",
}


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _cache_dir() -> Path:
    return Path(os.environ.get("FXQ_CACHE_DIR") or Path.home() / ".cache" / "fxq")


class BuildError(RuntimeError):
    """The native kernels cannot be built here; the message says why."""


def _compiler() -> str:
    """The C compiler to build with: ``$CC``, else ``cc`` or ``gcc`` on the PATH.

    Raises:
        BuildError: when there is none, or ``$CC`` names no program.
    """
    if sys.platform == "win32":
        raise BuildError("fxq builds its native kernels on Linux and macOS only")
    chosen = os.environ.get("CC")
    if chosen:
        found = shutil.which(chosen)
        if found is None:
            raise BuildError(f"the C compiler CC={chosen!r} was not found")
        return found
    found = shutil.which("cc") or shutil.which("gcc")
    if found is None:
        raise BuildError("no C compiler was found (CC is not set; neither cc nor gcc is on PATH)")
    return found


def _first_error(stderr: str) -> str:
    """The compiler's first error line (else its first line) from ``stderr``."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["no message"])[0][:300]


def _build() -> ctypes.CDLL:
    """Compile (once per source, CPU and compiler; cached on disk) and load the kernels.

    Raises:
        BuildError: no compiler, or the compiler failed (with its first error line).
    """
    compiler = _compiler()
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(
        source + _cpu_signature().encode() + compiler.encode() + " ".join(_FLAGS).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"fxq_native_{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            cmd = [compiler, *_FLAGS, str(_SOURCE), "-o", str(out), "-lm"]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise BuildError(f"{compiler} failed: {_first_error(result.stderr)}")
            os.replace(out, target)
    lib = ctypes.CDLL(str(target))
    ptr, i64, f64, cint = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_int
    # (acc, [residual,] outer, channels, inner, r, [rr,] lo, hi, half_even, out, threads)
    signatures = [(_FUNCS.values(), [ptr, i64, i64, i64, ptr, f64, f64, cint, ptr, cint])]
    signatures.append(
        (_ADD_FUNCS.values(), [ptr, ptr, i64, i64, i64, ptr, ptr, f64, f64, cint, ptr, cint])
    )
    # (x, outer, channels, inner, r, s, lo, hi, out, mask, threads)
    fq = [ptr, i64, i64, i64, ptr, ptr, ctypes.c_float, ctypes.c_float, ptr, ptr, cint]
    signatures.append((["fxq_fake_quant_f32"], fq))
    for names, argtypes in signatures:
        for name in names:
            fn = getattr(lib, name)
            fn.restype = None
            fn.argtypes = argtypes
    return lib


_ADD_FUNCS = {
    torch.float32: "fxq_requant_add_f32_f32",
    torch.float64: "fxq_requant_add_f64_f32",
}


def _library() -> ctypes.CDLL | None:
    global _LIB, _TRIED
    if _TRIED:
        return _LIB
    with _LOCK:
        if not _TRIED:
            if os.environ.get("FXQ_NATIVE", "1") != "0":
                try:
                    _LIB = _build()
                except Exception as e:  # a broken toolchain must not break fxq
                    reason = str(e) if isinstance(e, BuildError) else f"{type(e).__name__}: {e}"
                    warnings.warn(fallback_message(reason), stacklevel=3)
                    _LIB = None
            _TRIED = True
    return _LIB


def fallback_message(reason: str) -> str:
    """The one warning fxq gives when the native kernels cannot be used, and why."""
    return (
        "fxq: the native CPU kernels are not available, so integer models and QAT fake "
        f"quants on the CPU run the torch path (same results, slower): {reason}. To build "
        "them, install a C compiler with OpenMP (e.g. `apt install gcc`) or point CC at one; "
        "to use the torch path without this warning, set FXQ_NATIVE=0"
    )


def available() -> bool:
    """Whether the native CPU kernels are built and loaded."""
    return _library() is not None


class ExporterError(RuntimeError):
    """torch's own ONNX exporter was asked to export an fxq integer model."""


def refuse_onnx_export() -> None:
    """Raise ``ExporterError`` while ``torch.onnx.export`` (either exporter) traces.

    fxq's integer arithmetic (float64 rounding, ``ldexp``, the custom ops) has no
    faithful translation in torch's ONNX exporters; ``fxq.export.to_onnx`` writes
    integer ONNX that onnxruntime runs bit for bit.

    Raises:
        ExporterError: pointing to ``fxq.export.to_onnx``.
    """
    if torch.onnx.is_in_onnx_export():
        raise ExporterError(
            "torch.onnx.export cannot export an fxq integer model faithfully (its integer "
            "arithmetic would be lost or the graph left empty). Use "
            "fxq.export.to_onnx(model, example_inputs, 'model.onnx'), which writes integer ONNX "
            "that onnxruntime runs bit for bit, or fxq.export.to_graph for fxq's integer graph"
        )


def _capture() -> str | None:
    """How a graph capture that is running wants the requantization, if one is running.

    ``"op"``: ``torch.export`` / ``torch.compile`` record the custom op. ``"torch"``:
    ``torch.jit.trace`` records the torch path (it cannot see into the C kernel), and
    so do fake / meta tensors met outside a capture (no data to read).

    Raises:
        ExporterError: under ``torch.onnx.export``.
    """
    refuse_onnx_export()
    if torch.compiler.is_compiling():
        return "op"
    return "torch" if torch.jit.is_tracing() else None


def requantize(
    acc: Tensor,
    r: Tensor,
    channel_axis: int | None,
    lo: int,
    hi: int,
    half_even: bool,
    out_dtype: torch.dtype,
) -> Tensor | None:
    """One-pass ``clamp(round(acc * r), lo, hi)``, or None when not applicable.

    Eager CPU tensors run the C kernel; under ``torch.export`` / ``torch.compile`` the
    result is the custom op ``fxq::requantize``; otherwise (no kernel, another device,
    ``torch.jit.trace``) None, and the caller computes the same in torch.

    Args:
        acc: float32 / float64 tensor of exact integers.
        r: float64 per-channel (or single) factors ``m * 2**-shift``.
        channel_axis: the axis ``r`` runs along.
        out_dtype: int8 / int16 storage, or float32 for exact integers in float32.

    Raises:
        ExporterError: under ``torch.onnx.export``.
    """
    func = _FUNCS.get((acc.dtype, out_dtype))
    if func is None:
        return None
    capture = _capture()
    if capture == "op":
        return torch.ops.fxq.requantize(
            acc, r, channel_axis, int(lo), int(hi), bool(half_even), out_dtype
        )
    if capture:
        return None
    if _eager_cuda(acc, r):
        return triton_requantize(acc, r, channel_axis, lo, hi, half_even, out_dtype)
    if not _eager_cpu(acc, r):
        return None
    lib = _library()
    if lib is None:
        return None
    return _run_requantize(lib, func, acc, r, channel_axis, lo, hi, half_even, out_dtype)


def fake_quantize(
    x: Tensor,
    scale: Tensor,
    ch_axis: int | None,
    qmin: int,
    qmax: int,
    with_mask: bool,
    inplace: bool = False,
) -> tuple[Tensor, Tensor | None] | None:
    """QAT training's fake quantization in one pass on the CPU, or None when not applicable.

    ``clamp(floor(x * (1 / scale) + 0.5), qmin, qmax) * scale`` and, ``with_mask``, the bool
    mask ``round == clamp``: what ``fxq.quantized.functional.fake_quantize`` computes with
    ``exact=False`` and ``HALF_UP`` in five torch passes (the tests compare both bit for
    bit). Eager contiguous float32 CPU tensors only; None under a graph capture (whose
    compiler fuses the torch ops itself), on other devices and dtypes, or without the
    kernels. ``inplace``: the result is written into ``x``.

    Raises:
        ExporterError: under ``torch.onnx.export``.
    """
    if (
        x.dtype is not torch.float32
        or scale.dtype is not torch.float32
        or _capture()
        or not _eager_cpu(x, scale)
        or not x.is_contiguous()
        or x.numel() == 0
    ):
        return None
    lib = _library()
    if lib is None:
        return None
    if scale.numel() not in (1, 1 if ch_axis is None else x.shape[ch_axis % x.dim()]):
        return None
    scale, (outer, channels, inner) = _layout(x, scale, ch_axis, torch.float32)
    reciprocal = scale.reciprocal()
    out = x if inplace else torch.empty_like(x)
    mask = torch.empty(x.shape, dtype=torch.bool) if with_mask else None
    lib.fxq_fake_quant_f32(
        x.data_ptr(),
        outer,
        channels,
        inner,
        reciprocal.data_ptr(),
        scale.data_ptr(),
        float(qmin),
        float(qmax),
        out.data_ptr(),
        None if mask is None else mask.data_ptr(),
        torch.get_num_threads(),
    )
    return out, mask


def requantize_add(
    acc: Tensor,
    residual: Tensor,
    rr: Tensor,
    r: Tensor,
    channel_axis: int,
    lo: int,
    hi: int,
    half_even: bool,
) -> Tensor | None:
    """One-pass requantization with a fused residual, as float32 exact integers, or None.

    ``out = clamp(round(sat32(acc + round(residual * rr)) * r), lo, hi)``; the custom
    op ``fxq::requantize_add`` under ``torch.export`` / ``torch.compile`` (as ``requantize``).

    Raises:
        ExporterError: under ``torch.onnx.export``.
    """
    func = _ADD_FUNCS.get(acc.dtype)
    if func is None or residual.dtype is not torch.float32 or residual.shape != acc.shape:
        return None
    capture = _capture()
    if capture == "op":
        return torch.ops.fxq.requantize_add(
            acc, residual, rr, r, channel_axis, int(lo), int(hi), bool(half_even)
        )
    if capture:
        return None
    if _eager_cuda(acc, residual, r, rr):
        return triton_requantize_add(acc, residual, rr, r, channel_axis, lo, hi, half_even)
    if not _eager_cpu(acc, residual, r, rr):
        return None
    lib = _library()
    if lib is None:
        return None
    return _run_requantize_add(lib, func, acc, residual, rr, r, channel_axis, lo, hi, half_even)


#: blocks of ``torch_ops_only`` entered and not left
_TORCH_OPS_ONLY = 0


@contextlib.contextmanager
def torch_ops_only() -> Iterator[None]:
    """Within the block fxq's Triton kernels (the fused QAT fake quant, the CUDA
    requantizations) are off and the torch definitions run, as everywhere with
    ``FXQ_TRITON=0`` (to compare the two, or time them). Re-entrant."""
    global _TORCH_OPS_ONLY
    _TORCH_OPS_ONLY += 1
    try:
        yield
    finally:
        _TORCH_OPS_ONLY -= 1


def triton_switched_off() -> bool:
    """``FXQ_TRITON=0``, or inside ``torch_ops_only``."""
    return bool(_TORCH_OPS_ONLY) or os.environ.get("FXQ_TRITON") == "0"


def triton_runs_on(x: Tensor) -> bool:
    """Whether fxq's Triton kernels may run on ``x``'s device: CUDA, or the CPU under
    ``TRITON_INTERPRET=1`` (Triton's interpreter, which the tests use), and not switched off
    (``triton_switched_off``). Whether Triton imports is the caller's to ask."""
    if triton_switched_off():
        return False
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _cuda_kernels():
    """The Triton kernels of ``_requant_triton``, or None: Triton cannot be imported, or it
    is switched off (``triton_switched_off``)."""
    if triton_switched_off():
        return None
    try:
        from fxq.quantized import _requant_triton
    except ImportError:
        return None
    return _requant_triton


def triton_requantize(
    acc: Tensor,
    r: Tensor,
    channel_axis: int | None,
    lo: int,
    hi: int,
    half_even: bool,
    out_dtype: torch.dtype,
) -> Tensor:
    """``requantize`` by the Triton kernel (CUDA, or the CPU under ``TRITON_INTERPRET=1``)."""
    acc = acc.contiguous()
    r, blocks = _layout(acc, r.to(acc.device), channel_axis)
    return _cuda_kernels().requantize(acc, r, blocks, lo, hi, half_even, out_dtype)


def triton_requantize_add(
    acc: Tensor,
    residual: Tensor,
    rr: Tensor,
    r: Tensor,
    channel_axis: int,
    lo: int,
    hi: int,
    half_even: bool,
) -> Tensor:
    """``requantize_add`` by the Triton kernel (as ``triton_requantize``)."""
    acc, residual = acc.contiguous(), residual.contiguous()
    r, blocks = _layout(acc, r.to(acc.device), channel_axis)
    rr, _ = _layout(acc, rr.to(acc.device), channel_axis)
    return _cuda_kernels().requantize_add(acc, residual, rr, r, blocks, lo, hi, half_even)


def _eager_cuda(*tensors: Tensor) -> bool:
    """Plain CUDA tensors with data (the accumulator's first), and Triton to run on them."""
    if tensors[0].device.type != "cuda":
        return False
    return all(type(t) is Tensor for t in tensors) and _cuda_kernels() is not None


def _eager_cpu(*tensors: Tensor) -> bool:
    """Plain CPU tensors with data (not fake, meta or a subclass)."""
    return all(type(t) is Tensor and t.device.type == "cpu" for t in tensors)


def _run_requantize(
    lib: ctypes.CDLL,
    func: str,
    acc: Tensor,
    r: Tensor,
    channel_axis: int | None,
    lo: int,
    hi: int,
    half_even: bool,
    out_dtype: torch.dtype,
) -> Tensor:
    acc = acc.contiguous()
    r, (outer, channels, inner) = _layout(acc, r, channel_axis)
    out = torch.empty(acc.shape, dtype=out_dtype)
    getattr(lib, func)(
        acc.data_ptr(),
        outer,
        channels,
        inner,
        r.data_ptr(),
        float(lo),
        float(hi),
        int(half_even),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def _run_requantize_add(
    lib: ctypes.CDLL,
    func: str,
    acc: Tensor,
    residual: Tensor,
    rr: Tensor,
    r: Tensor,
    channel_axis: int,
    lo: int,
    hi: int,
    half_even: bool,
) -> Tensor:
    acc, residual = acc.contiguous(), residual.contiguous()
    r, (outer, channels, inner) = _layout(acc, r, channel_axis)
    rr, _ = _layout(acc, rr, channel_axis)
    if r.numel() != rr.numel():
        r, rr = r.expand(channels).contiguous(), rr.expand(channels).contiguous()
    out = torch.empty(acc.shape, dtype=torch.float32)
    getattr(lib, func)(
        acc.data_ptr(),
        residual.data_ptr(),
        outer,
        channels,
        inner,
        r.data_ptr(),
        rr.data_ptr(),
        float(lo),
        float(hi),
        int(half_even),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def _layout(
    acc: Tensor, r: Tensor, channel_axis: int | None, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, tuple[int, int, int]]:
    """``r`` as contiguous ``dtype`` and the (outer, channels, inner) blocks of ``acc``."""
    r = r.to(dtype).contiguous()
    if channel_axis is None:
        return r.reshape(1), (1, 1, acc.numel())
    axis = channel_axis % acc.dim()
    channels = acc.shape[axis]
    outer = math.prod(acc.shape[:axis])
    inner = math.prod(acc.shape[axis + 1 :])
    if r.numel() == 1:
        r = r.reshape(1).expand(channels).contiguous()
    return r, (outer, channels, inner)


# -- the kernels as torch custom ops (graph captures) ----------------------------------------


def _broadcast(r: Tensor, ndim: int, channel_axis: int | None) -> Tensor:
    r = r.to(torch.float64)
    if channel_axis is None or r.numel() == 1:
        return r.reshape(())
    shape = [1] * ndim
    shape[channel_axis % ndim] = r.numel()
    return r.reshape(shape)


def _round(v: Tensor, half_even: bool) -> Tensor:
    """The C kernel's rounding of exact float64 products: ``nearbyint`` or ``floor(v + 0.5)``."""
    return v.round_() if half_even else v.add_(0.5).floor_()


@torch.library.custom_op("fxq::requantize", mutates_args=())
def _requantize_op(
    acc: Tensor,
    r: Tensor,
    channel_axis: Optional[int],  # noqa: UP045 (torch.library reads the annotation)
    lo: int,
    hi: int,
    half_even: bool,
    out_dtype: torch.dtype,
) -> Tensor:
    """``requantize`` as one op: the C kernel on the CPU where loaded, else torch (same values)."""
    func = _FUNCS.get((acc.dtype, out_dtype))
    lib = _library() if func is not None and acc.device.type == "cpu" else None
    if lib is not None:
        return _run_requantize(lib, func, acc, r.cpu(), channel_axis, lo, hi, half_even, out_dtype)
    v = _round(acc.to(torch.float64) * _broadcast(r, acc.dim(), channel_axis), half_even)
    return v.clamp_(lo, hi).to(out_dtype).contiguous()


@_requantize_op.register_fake
def _(acc, r, channel_axis, lo, hi, half_even, out_dtype):
    return torch.empty_like(acc, dtype=out_dtype, memory_format=torch.contiguous_format)


@torch.library.custom_op("fxq::requantize_add", mutates_args=())
def _requantize_add_op(
    acc: Tensor,
    residual: Tensor,
    rr: Tensor,
    r: Tensor,
    channel_axis: int,
    lo: int,
    hi: int,
    half_even: bool,
) -> Tensor:
    """``requantize_add`` as one op: the C kernel on the CPU where loaded, else torch."""
    func = _ADD_FUNCS.get(acc.dtype)
    lib = _library() if func is not None and acc.device.type == "cpu" else None
    if lib is not None:
        return _run_requantize_add(
            lib, func, acc, residual, rr.cpu(), r.cpu(), channel_axis, lo, hi, half_even
        )
    term = _round(residual.to(torch.float64) * _broadcast(rr, acc.dim(), channel_axis), half_even)
    total = (acc.to(torch.float64) + term).clamp_(-(1 << 31), (1 << 31) - 1)
    v = _round(total * _broadcast(r, acc.dim(), channel_axis), half_even)
    return v.clamp_(lo, hi).to(torch.float32).contiguous()


@_requantize_add_op.register_fake
def _(acc, residual, rr, r, channel_axis, lo, hi, half_even):
    return torch.empty_like(acc, dtype=torch.float32, memory_format=torch.contiguous_format)
