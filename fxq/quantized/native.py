"""Optional native (C) kernels for the CPU, loaded with ctypes.

The requantization of a conv / linear accumulator is several elementwise
passes in torch (convert, multiply, round, clamp, convert); the C kernel in
``native_kernels.c`` does it in one. It is compiled on first use with the
system C compiler into ``~/.cache/fxq`` (or ``$FXQ_CACHE_DIR``) and computes
exactly what ``fxq.quantized.functional.requantize_exact`` computes in torch
(the tests compare both bit for bit). Without a compiler, or with
``FXQ_NATIVE=0``, fxq uses the torch path: same results, slower.
"""

from __future__ import annotations

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
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["available", "requantize", "requantize_add"]

_SOURCE = Path(__file__).with_name("native_kernels.c")
# -fno-math-errno / -fno-trapping-math let floor() vectorize; neither changes an
# IEEE result (unlike -ffast-math, which fxq must never use).
_FLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
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


def _build() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None or sys.platform == "win32":
        return None
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
                warnings.warn(
                    "fxq: could not build the native CPU kernels, using the (slower, identical) torch "
                    f"path: {result.stderr.strip()[:300]}",
                    stacklevel=3,
                )
                return None
            os.replace(out, target)
    lib = ctypes.CDLL(str(target))
    ptr, i64, f64, cint = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_int
    # (acc, [residual,] outer, channels, inner, r, [rr,] lo, hi, half_even, out, threads)
    signatures = [(_FUNCS.values(), [ptr, i64, i64, i64, ptr, f64, f64, cint, ptr, cint])]
    signatures.append(
        (_ADD_FUNCS.values(), [ptr, ptr, i64, i64, i64, ptr, ptr, f64, f64, cint, ptr, cint])
    )
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
                    warnings.warn(
                        f"fxq: native kernels unavailable ({e}); using the torch path", stacklevel=3
                    )
                    _LIB = None
            _TRIED = True
    return _LIB


def available() -> bool:
    """Whether the native CPU kernels are built and loaded."""
    return _library() is not None


class ExporterError(RuntimeError):
    """torch's own ONNX exporter was asked to export an fxq integer model."""


def _capturing(acc: Tensor) -> bool:
    """Whether a graph capture is running, in which the C kernel (opaque to torch) must not run.

    ``torch.jit.trace``, ``torch.export`` and ``torch.compile`` then record the torch path
    (identical results). ``torch.onnx.export`` raises ``ExporterError``: fxq's integer
    arithmetic (``frexp`` / ``ldexp``, float64 rounding) has no faithful ONNX translation
    there; ``fxq.export.to_onnx`` writes one that onnxruntime runs bit for bit.
    """
    if torch.onnx.is_in_onnx_export():
        raise ExporterError(
            "torch.onnx.export cannot export an fxq integer model faithfully (its integer "
            "arithmetic would be lost or the graph left empty). Use "
            "fxq.export.to_onnx(model, example_inputs, 'model.onnx'), which writes integer ONNX "
            "that onnxruntime runs bit for bit, or fxq.export.to_graph for fxq's integer graph"
        )
    return (
        torch.jit.is_tracing()
        or torch.compiler.is_compiling()
        or type(acc) is not Tensor  # fake / meta / subclass tensors: no data to read
        or acc.device.type == "meta"
    )


def requantize(
    acc: Tensor,
    r: Tensor,
    channel_axis: int | None,
    lo: int,
    hi: int,
    half_even: bool,
    out_dtype: torch.dtype,
) -> Tensor | None:
    """One-pass ``clamp(round(acc * r), lo, hi)`` on the CPU, or None when not applicable.

    Args:
        acc: float32 / float64 CPU tensor of exact integers.
        r: float64 per-channel (or single) factors ``m * 2**-shift``.
        channel_axis: the axis ``r`` runs along.
        out_dtype: int8 / int16 storage, or float32 for exact integers in float32.
    """
    func = _FUNCS.get((acc.dtype, out_dtype))
    if func is None or acc.device.type != "cpu" or r.device.type != "cpu" or _capturing(acc):
        return None
    lib = _library()
    if lib is None:
        return None
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

    ``out = clamp(round(sat32(acc + round(residual * rr)) * r), lo, hi)``.
    """
    func = _ADD_FUNCS.get(acc.dtype)
    if (
        func is None
        or residual.dtype is not torch.float32
        or residual.shape != acc.shape
        or acc.device.type != "cpu"
        or residual.device.type != "cpu"
        or _capturing(acc)
    ):
        return None
    lib = _library()
    if lib is None:
        return None
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
    acc: Tensor, r: Tensor, channel_axis: int | None
) -> tuple[Tensor, tuple[int, int, int]]:
    """``r`` as contiguous float64 and the (outer, channels, inner) blocks of ``acc``."""
    r = r.to(torch.float64).contiguous()
    if channel_axis is None:
        return r.reshape(1), (1, 1, acc.numel())
    axis = channel_axis % acc.dim()
    channels = acc.shape[axis]
    outer = math.prod(acc.shape[:axis])
    inner = math.prod(acc.shape[axis + 1 :])
    if r.numel() == 1:
        r = r.reshape(1).expand(channels).contiguous()
    return r, (outer, channels, inner)
