"""Reading ``.fxq`` files safely (``docs/integer_graph.md``, 1): sizes, ``.npy`` headers, schema.

``load`` in ``fxq.export.graph`` reads a file through ``read_members`` (member sizes checked
against a limit before anything is decompressed, ``.npy`` headers parsed here with
``ast.literal_eval`` and checked before their data is read, never pickle) and checks the result
with ``check_graph`` (the JSON schema, every node's attributes and arrays against its op). Every
failure is an ``IntegerGraphFormatError`` naming the file and the member or node.

This module imports numpy, the standard library and ``fxq.primitives``' numpy side (no torch).
"""

from __future__ import annotations

import ast
import json
import math
import re
import struct
import zipfile
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from fxq.primitives import PRIMITIVES
from fxq.primitives.schema import (
    ARRAY_DTYPES as _ARRAY_DTYPES,
)
from fxq.primitives.schema import (
    INT_DTYPES as _I,
)
from fxq.primitives.schema import (
    KINDS as _KINDS,
)
from fxq.primitives.schema import (
    MARCH_LIMITS,
    IntegerGraphFormatError,
)
from fxq.primitives.schema import (
    MAX_RANK as _MAX_RANK,
)
from fxq.primitives.schema import (
    PLAIN as _PLAIN,
)
from fxq.primitives.schema import (
    QUANT as _QUANT,
)
from fxq.primitives.schema import (
    Ctx as _Ctx,
)
from fxq.primitives.schema import (
    OpSpec as _OpSpec,
)
from fxq.primitives.schema import (
    Param as _Param,
)
from fxq.primitives.schema import (
    geometry as _geometry,
)
from fxq.primitives.schema import (
    is_float as _is_float,
)
from fxq.primitives.schema import (
    is_int as _is_int,
)
from fxq.primitives.schema import (
    is_ints as _ints,
)
from fxq.primitives.schema import (
    optional as _opt,
)

__all__ = [
    "IntegerGraphFormatError",
    "DEFAULT_MAX_BYTES",
    "MARCH_LIMITS",
    "read_members",
    "check_graph",
]

#: the most bytes ``load`` decompresses from one file (all members together) unless told otherwise
DEFAULT_MAX_BYTES = 1 << 30


# -- members: zip entries and .npy arrays -------------------------------------------------------
_ZIP_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    EOFError,
    zlib.error,
    struct.error,
    NotImplementedError,
    RuntimeError,  # an encrypted member
    ValueError,
    OverflowError,
    UnicodeDecodeError,
    OSError,
)


def read_members(path: Any, max_bytes: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``graph.json`` (parsed) and every ``.npy`` member of the zip at ``path`` (as arrays).

    The declared uncompressed size of every member is summed and checked against ``max_bytes``
    before any member is read; a member's data is never longer than it declares.

    Raises:
        IntegerGraphFormatError: not a zip, a member too large, damaged, not JSON or not a
            plain ``.npy`` array.
    """
    where = str(path)
    with open(path, "rb") as f:  # a missing file is the OSError it is
        try:
            with zipfile.ZipFile(f) as z:
                infos = z.infolist()
                _check_sizes(where, infos, max_bytes)
                meta = _read_json(where, z)
                arrays = {
                    i.filename: _read_npy(where, i.filename, _read(z, i))
                    for i in infos
                    if i.filename != "graph.json"
                }
        except IntegerGraphFormatError:
            raise
        except _ZIP_ERRORS as e:
            raise IntegerGraphFormatError(
                f"{where}: not a readable fxq integer graph (a zip of graph.json and .npy "
                f"files): {type(e).__name__}: {e}; the file is damaged: export it again"
            ) from None
    return meta, arrays


def _check_sizes(where: str, infos: list[zipfile.ZipInfo], max_bytes: int) -> None:
    names = [i.filename for i in infos]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise IntegerGraphFormatError(f"{where}: members {dup} appear more than once")
    total = 0
    for i in infos:
        total += i.file_size
        if total > max_bytes:
            raise IntegerGraphFormatError(
                f"{where}: member {i.filename!r} declares {i.file_size} bytes, which takes the "
                f"file's contents above the limit of {max_bytes} bytes; if you trust the file, "
                "pass a larger max_bytes to fxq.export.load"
            )
    if "graph.json" not in names:
        raise IntegerGraphFormatError(f"{where}: no member 'graph.json'; not an fxq integer graph")


def _read(z: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    with z.open(info) as m:
        data = m.read(info.file_size + 1)
    if len(data) != info.file_size:
        raise zipfile.BadZipFile(f"member {info.filename!r} is not the size it declares")
    return data


def _read_json(where: str, z: zipfile.ZipFile) -> Any:
    data = _read(z, z.getinfo("graph.json"))
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, huge ints
        raise IntegerGraphFormatError(
            f"{where}: member 'graph.json' is not valid JSON ({type(e).__name__}: {e}); the file "
            "is damaged: export it again"
        ) from None


_NPY_MAGIC = b"\x93NUMPY"


def _read_npy(where: str, member: str, data: bytes) -> np.ndarray:
    """A plain numeric ``.npy`` array; the header is checked against the member's size before
    the data is touched (no pickle, no object arrays)."""

    def bad(reason: str) -> IntegerGraphFormatError:
        return IntegerGraphFormatError(
            f"{where}: member {member!r} is not a plain .npy array: {reason}; the file is damaged "
            "or was not written by fxq: export it again"
        )

    if not member.endswith(".npy") or not member.startswith("params/"):
        raise IntegerGraphFormatError(
            f"{where}: unexpected member {member!r} (an integer graph holds graph.json and "
            "params/<node>/<param>.npy only)"
        )
    if data[:6] != _NPY_MAGIC or len(data) < 10:
        raise bad("no .npy magic")
    major = data[6]
    if major == 1:
        (hlen,), start = struct.unpack("<H", data[8:10]), 10
    elif major in (2, 3) and len(data) >= 12:
        (hlen,), start = struct.unpack("<I", data[8:12]), 12
    else:
        raise bad(f"unknown .npy version {major}")
    if hlen > 4096 or start + hlen > len(data):
        raise bad(f"a header of {hlen} bytes")
    try:
        header = ast.literal_eval(data[start : start + hlen].decode("latin1"))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise bad("an unreadable header") from None
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise bad("a header without exactly descr, fortran_order, shape")
    descr, order, shape = header["descr"], header["fortran_order"], header["shape"]
    if not isinstance(descr, str) or not isinstance(order, bool):
        raise bad(f"descr {descr!r}, fortran_order {order!r}")
    if not isinstance(shape, tuple) or not all(_is_int(s) and s >= 0 for s in shape):
        raise bad(f"shape {shape!r}")
    if len(shape) > _MAX_RANK:
        raise bad(f"rank {len(shape)} (at most {_MAX_RANK})")
    try:
        dtype = np.dtype(descr)
    except (TypeError, ValueError):
        raise bad(f"dtype {descr!r}") from None
    native = dtype.newbyteorder("=") if dtype.byteorder in "<>" else dtype
    if native.name not in _ARRAY_DTYPES:
        raise bad(f"dtype {descr!r} (arrays are {', '.join(_ARRAY_DTYPES)})")
    count = math.prod(shape)
    body = len(data) - start - hlen
    if count * dtype.itemsize != body:
        raise bad(
            f"shape {list(shape)} of {dtype.name} needs {count * dtype.itemsize} bytes, the "
            f"member holds {body}"
        )
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=start + hlen)
    return flat.reshape(shape, order="F" if order else "C").astype(native, order="C")


def _check_ranges(c: _Ctx) -> None:
    """Shifts and multipliers of every op, wherever they are stored."""
    for k, v in c.attrs.items():
        vals = v if isinstance(v, list) else [v]
        if not all(_is_int(e) for e in vals if e is not None):
            continue
        vals = [e for e in vals if e is not None]
        if k == "shift" or k.endswith("_shift"):
            c.shift(f"attribute {k!r}", vals)
        elif k in ("multiplier", "multipliers") or k.endswith("_multiplier"):
            c.multiplier(f"attribute {k!r}", vals)
    for k, p in c.params.items():
        if k == "shift" or "shift_" in k or k.endswith("_shift"):
            c.shift(f"param {k!r}", p)
        elif k == "multiplier" or "multiplier_" in k or k.endswith("_multiplier"):
            c.multiplier(f"param {k!r}", p)


def _check_pool(c: _Ctx) -> None:
    a = c.attrs
    d = len(a["kernel"])
    if d == 0 or d > c.rank() or any(len(a[k]) != d for k in ("stride", "padding", "dilation")):
        raise c.fail("kernel, stride, padding and dilation are not one entry per pooled axis")
    if min(a["kernel"] + a["stride"] + a["dilation"]) < 1 or min(a["padding"]) < 0:
        raise c.fail("kernel, stride and dilation must be positive, padding non-negative")
    _geometry(c, ("kernel", "stride", "padding", "dilation"))


def _check_adaptive(c: _Ctx) -> None:
    size = c.attrs["output_size"]
    if not 1 <= len(size) <= c.rank() or min(size) < 1:
        raise c.fail(f"output_size {size} for a rank-{c.rank()} input")
    _geometry(c, ("output_size",))


def _check_reshape(c: _Ctx) -> None:
    shape = c.attrs["shape"]
    if len(shape) > _MAX_RANK or min(shape, default=0) < -1 or shape.count(-1) > 1:
        raise c.fail(f"shape {shape} (sizes >= 0, at most one -1)")


def _check_transpose(c: _Ctx) -> None:
    if sorted(c.attrs["perm"]) != list(range(c.rank())):
        raise c.fail(f"perm {c.attrs['perm']} is not a permutation of {c.rank()} axes")


def _check_gather(c: _Ctx) -> None:
    shape, idx = c.attrs["shape"], c.params["index"]
    if min(shape, default=0) < 0 or math.prod(shape) != idx.size:
        raise c.fail(f"shape {shape} for {idx.size} indices")
    src = c.in_shapes[0][1:] if c.attrs["per_sample"] else c.in_shapes[0]
    if (
        idx.size
        and all(_is_int(s) for s in src)
        and (idx.min() < -1 or idx.max() >= math.prod(src))
    ):
        raise c.fail(f"indices outside -1..{math.prod(src) - 1}")


def _check_concat(c: _Ctx) -> None:
    rank = c.rank()
    if any(len(s) != rank for s in c.in_shapes):
        raise c.fail("inputs of different ranks")
    c.axis("axis", c.attrs["axis"])


def _check_float(c: _Ctx) -> None:
    fns = _runtime_names("FLOAT_FNS")
    if c.attrs["fn"] not in fns:
        raise c.fail(f"fn {c.attrs['fn']!r} is not one of {list(fns)}")
    dtype = c.attrs.get("dtype") or "float32"
    if dtype not in ("float32", "int32", "int64"):
        raise c.fail(f"dtype {dtype!r} (float32, int32 or int64)")
    if dtype != "float32" and (c.attrs["fn"] == "div" or not _opt(_is_int)(c.attrs.get("scalar"))):
        raise c.fail(f"{c.attrs['fn']} in {dtype} with scalar {c.attrs.get('scalar')!r}")
    if len(c.node["inputs"]) + (c.attrs.get("scalar") is not None) != (
        1 if c.attrs["fn"] == "neg" else 2
    ):
        raise c.fail(f"{len(c.node['inputs'])} inputs and a scalar for {c.attrs['fn']}")


def _check_constant(c: _Ctx) -> None:
    value, out = c.params["value"], c.outputs[0]
    if value.dtype.name != out["dtype"]:
        raise c.fail(f"a {value.dtype.name} value for a {out['dtype']} output")
    batch = c.attrs["batch"]
    dynamic = c.attrs.get("dynamic") or []
    n_in = len(c.node["inputs"])
    if not isinstance(dynamic, list) or not all(
        isinstance(e, list) and len(e) == 3 and all(_is_int(v) for v in e) for e in dynamic
    ):
        raise c.fail(f"dynamic {dynamic!r} (a list of [axis, input, input_axis])")
    if not dynamic and n_in != batch:
        raise c.fail(f"batch {batch} with {n_in} inputs (one when batch)")
    used = {i for _, i, _ in dynamic} | ({0} if batch else set())
    if n_in < batch or used != set(range(n_in)):
        raise c.fail(f"batch {batch} and dynamic {dynamic} with {n_in} inputs")
    for axis, i, in_axis in dynamic:
        if not 0 <= axis < value.ndim or not 0 <= in_axis < len(c.in_shapes[i]):
            raise c.fail(f"dynamic entry {[axis, i, in_axis]} outside the ranks")
    cut = {axis for axis, _, _ in dynamic}
    shape = [
        1 if batch and i == 0 else (value.shape[i] if i in cut else d)
        for i, d in enumerate(out["shape"])
    ]
    if len(shape) != value.ndim or any(_is_int(d) and d != v for d, v in zip(shape, value.shape)):
        raise c.fail(f"a value of shape {list(value.shape)} for an output of shape {out['shape']}")


def _check_cast(c: _Ctx) -> None:
    if c.attrs["dtype"] not in _PLAIN or c.in_dtypes[0] not in (*_PLAIN, *_QUANT):
        raise c.fail(f"a cast from {c.in_dtypes[0]} to {c.attrs['dtype']!r} (dtypes {_PLAIN})")


def _check_compare(c: _Ctx) -> None:
    a = c.attrs
    if a["fn"] not in _runtime_names("COMPARE_FNS"):
        raise c.fail(f"fn {a['fn']!r} is not one of {list(_runtime_names('COMPARE_FNS'))}")
    if a["compute_dtype"] not in (*_PLAIN, *_QUANT, "float64"):
        raise c.fail(f"compute_dtype {a['compute_dtype']!r}")
    if len(c.node["inputs"]) + (a.get("scalar") is not None) != 2:
        raise c.fail(f"{len(c.node['inputs'])} inputs and scalar {a.get('scalar')!r}")
    if c.outputs[0]["dtype"] != "bool":
        raise c.fail(f"a {c.outputs[0]['dtype']} output (comparisons make bool)")


def _check_logical(c: _Ctx) -> None:
    fn = c.attrs["fn"]
    if fn not in _runtime_names("LOGICAL_FNS"):
        raise c.fail(f"fn {fn!r} is not one of {list(_runtime_names('LOGICAL_FNS'))}")
    if len(c.node["inputs"]) != (1 if fn == "not" else 2):
        raise c.fail(f"{len(c.node['inputs'])} inputs for {fn}")
    if any(d != "bool" for d in c.in_dtypes + [c.outputs[0]["dtype"]]):
        raise c.fail("inputs or output not bool")


def _fn(*names: str) -> Callable[[_Ctx], None]:
    def check(c: _Ctx) -> None:
        if c.attrs["fn"] not in names:
            raise c.fail(f"fn {c.attrs['fn']!r} is not one of {list(names)}")

    return check


def _check_reduce(c: _Ctx) -> None:
    _fn("amax", "amin")(c)
    for i, axis in enumerate(c.attrs["axes"]):
        c.axis(f"axes[{i}]", axis)


def _check_arg(c: _Ctx) -> None:
    _fn("argmax", "argmin")(c)
    if c.attrs["axis"] is not None:
        c.axis("axis", c.attrs["axis"])


# -- the float ops of float regions (format version 3) ----------------------------------------
def _float_io(c: _Ctx) -> None:
    dtypes = [*c.in_dtypes, *(t["dtype"] for t in c.outputs)]
    if any(d != "float32" for d in dtypes):
        raise c.fail(f"inputs / output of dtypes {dtypes} (float ops take and make float32)")


def _float_sizes(c: _Ctx, n: Any, names: tuple[str, ...]) -> None:
    """Per-channel float params of ``n`` entries (when ``n`` is known), one per channel."""
    for k in names:
        p = c.params.get(k)
        if p is not None and (p.ndim != 1 or (_is_int(n) and p.size != n)):
            raise c.fail(f"param {k!r} of shape {list(p.shape)} for {n} channels")


def _check_float_conv(c: _Ctx) -> None:
    _float_io(c)
    a, w = c.attrs, c.params["weight"]
    d, g = a["dim"], a["groups"]
    if not 1 <= d <= 3 or w.ndim != d + 2 or c.rank() != d + 2:
        raise c.fail(f"dim {d}, a rank-{w.ndim} weight and a rank-{c.rank()} input")
    if any(len(a[k]) != d or min(a[k]) < 1 for k in ("stride", "dilation")):
        raise c.fail(f"stride {a['stride']} / dilation {a['dilation']}: {d} positive integers")
    pads = a["pads"]
    if not (
        isinstance(pads, list)
        and len(pads) == d
        and all(_ints(p) and len(p) == 2 and min(p) >= 0 for p in pads)
    ):
        raise c.fail(f"pads {pads!r} is not {d} pairs of integers >= 0")
    if g < 1 or w.shape[0] % g or min(w.shape, default=1) < 1:
        raise c.fail(f"groups {g} for a weight of shape {list(w.shape)}")
    _geometry(c, ("stride", "dilation", "pads"))
    channels = c.in_shapes[0][1]
    if _is_int(channels) and channels != w.shape[1] * g:
        raise c.fail(f"{channels} input channels, the weight takes {w.shape[1] * g}")
    _float_sizes(c, w.shape[0], ("bias",))


def _check_float_linear(c: _Ctx) -> None:
    _float_io(c)
    w = c.params["weight"]
    k = c.in_shapes[0][-1] if c.rank() else None
    if c.rank() == 0 or (_is_int(k) and k != w.shape[1]):
        raise c.fail(f"an input of shape {c.in_shapes[0]} for a weight of shape {list(w.shape)}")
    _float_sizes(c, w.shape[0], ("bias",))


def _check_float_matmul(c: _Ctx) -> None:
    _float_io(c)
    a, b = c.in_shapes
    if not a or not b:
        raise c.fail("a matmul of a rank-0 input")
    k_a, k_b = a[-1], b[-2] if len(b) > 1 else b[0]
    if _is_int(k_a) and _is_int(k_b) and k_a != k_b:
        raise c.fail(f"a matmul of shapes {a} and {b}")


def _check_float_batch_norm(c: _Ctx) -> None:
    _float_io(c)
    if c.rank() < 2 or c.attrs["eps"] < 0:
        raise c.fail(f"a rank-{c.rank()} input (channels on axis 1), eps {c.attrs['eps']}")
    n = c.params["mean"].size
    channels = c.in_shapes[0][1]
    _float_sizes(c, channels if _is_int(channels) else n, ("mean", "var", "weight", "bias"))


def _check_float_layer_norm(c: _Ctx) -> None:
    _float_io(c)
    k = c.attrs["ndim"]
    if not 1 <= k <= c.rank() or c.attrs["eps"] < 0:
        raise c.fail(f"ndim {k} for a rank-{c.rank()} input, eps {c.attrs['eps']}")
    trailing = c.in_shapes[0][-k:]
    for name in ("weight", "bias"):
        p = c.params.get(name)
        if p is not None and (
            p.ndim != k or any(_is_int(t) and t != s for t, s in zip(trailing, p.shape))
        ):
            raise c.fail(f"param {name!r} of shape {list(p.shape)} for trailing sizes {trailing}")


def _check_float_unary(c: _Ctx) -> None:
    _float_io(c)
    fn, fns = c.attrs["fn"], _runtime_names("UNARY_FNS", "runtime_float")
    if fn not in fns:
        raise c.fail(f"fn {fn!r} is not one of {list(fns)}")
    if fn != "clamp" and (c.attrs.get("lo") is not None or c.attrs.get("hi") is not None):
        raise c.fail(f"bounds lo / hi for fn {fn!r} (clamp only)")


def _check_float_softmax(c: _Ctx) -> None:
    _float_io(c)
    c.axis("axis", c.attrs["axis"])


def _check_float_pool(c: _Ctx) -> None:
    _float_io(c)
    a = c.attrs
    if a["fn"] not in _runtime_names("POOL_FNS", "runtime_float"):
        raise c.fail(f"fn {a['fn']!r} is not max or avg")
    d = len(a["kernel"])
    if not 1 <= d <= 3 or c.rank() != d + 2:
        raise c.fail(f"a {d}-d pooling of a rank-{c.rank()} input")
    if any(len(a[k]) != d for k in ("stride", "padding", "dilation")):
        raise c.fail("kernel, stride, padding and dilation are not one entry per pooled axis")
    if min(a["kernel"] + a["stride"] + a["dilation"]) < 1 or min(a["padding"]) < 0:
        raise c.fail("kernel, stride and dilation must be positive, padding non-negative")
    if any(2 * p > k for p, k in zip(a["padding"], a["kernel"])):
        raise c.fail(f"padding {a['padding']} above half the kernel {a['kernel']}")
    if a["fn"] == "avg" and max(a["dilation"]) != 1:
        raise c.fail(f"an average pooling with dilation {a['dilation']}")
    _geometry(c, ("kernel", "stride", "padding", "dilation"))


def _check_float_adaptive(c: _Ctx) -> None:
    _float_io(c)
    size = c.attrs["output_size"]
    if not 1 <= len(size) <= min(c.rank(), 3) or min(size) < 1:
        raise c.fail(f"output_size {size} for a rank-{c.rank()} input")
    _geometry(c, ("output_size",))


def _check_float_interpolate(c: _Ctx) -> None:
    _float_io(c)
    a = c.attrs
    if a["mode"] not in ("nearest", "linear"):
        raise c.fail(f"mode {a['mode']!r} (nearest or linear)")
    size, factors = a["size"], a["scale_factor"]
    if not 1 <= len(size) <= min(c.rank() - 2, 3) or min(size) < 1:
        raise c.fail(f"size {size} for a rank-{c.rank()} input")
    if factors is not None and len(factors) != len(size):
        raise c.fail(f"scale_factor {factors} for size {size}")
    _geometry(c, ("size",))


def _check_float_reduce(c: _Ctx) -> None:
    _float_io(c)
    fns = _runtime_names("REDUCE_FNS", "runtime_float")
    if c.attrs["fn"] not in fns:
        raise c.fail(f"fn {c.attrs['fn']!r} is not one of {list(fns)}")
    axes = c.attrs["axes"]
    for i, axis in enumerate(axes):
        c.axis(f"axes[{i}]", axis)
    if len({a % max(c.rank(), 1) for a in axes}) != len(axes):
        raise c.fail(f"axes {axes} name an axis twice")


_F32 = ("float32",)
_F32_VECTOR = _Param(_F32, (1,), False)

#: the float ops (``fxq.export.runtime_float``; ``docs/integer_graph.md``, 2, "Float regions")
FLOAT_OP_SPECS: dict[str, _OpSpec] = {
    "float_conv": _OpSpec(
        (1,),
        {"dim": "int", "stride": "ints", "dilation": "ints", "groups": "int", "pads": "any"},
        {"weight": _Param(_F32), "bias": _F32_VECTOR},
        _check_float_conv,
    ),
    "float_linear": _OpSpec(
        (1,), {}, {"weight": _Param(_F32, (2,)), "bias": _F32_VECTOR}, _check_float_linear
    ),
    "float_matmul": _OpSpec((2,), {}, {}, _check_float_matmul),
    "float_batch_norm": _OpSpec(
        (1,),
        {"eps": "float"},
        {
            "mean": _Param(_F32, (1,)),
            "var": _Param(_F32, (1,)),
            "weight": _F32_VECTOR,
            "bias": _F32_VECTOR,
        },
        _check_float_batch_norm,
    ),
    "float_layer_norm": _OpSpec(
        (1,),
        {"ndim": "int", "eps": "float"},
        {"weight": _Param(_F32, None, False), "bias": _Param(_F32, None, False)},
        _check_float_layer_norm,
    ),
    "float_unary": _OpSpec(
        (1,), {"fn": "str", "lo": "float?", "hi": "float?"}, {}, _check_float_unary
    ),
    "float_softmax": _OpSpec((1,), {"axis": "int", "log": "bool"}, {}, _check_float_softmax),
    "float_pool": _OpSpec(
        (1,),
        {
            "fn": "str",
            "kernel": "ints",
            "stride": "ints",
            "padding": "ints",
            "dilation": "ints",
            "ceil_mode": "bool",
            "count_include_pad": "bool",
        },
        {},
        _check_float_pool,
    ),
    "float_adaptive_pool": _OpSpec((1,), {"output_size": "ints"}, {}, _check_float_adaptive),
    "float_interpolate": _OpSpec(
        (1,),
        {"mode": "str", "align_corners": "bool", "size": "ints", "scale_factor": "floats?"},
        {},
        _check_float_interpolate,
    ),
    "float_reduce": _OpSpec(
        (1,), {"fn": "str", "axes": "ints", "keepdim": "bool"}, {}, _check_float_reduce
    ),
}

#: op -> what a file may hold for it (``docs/integer_graph.md``, 2)
OP_SPECS: dict[str, _OpSpec] = {
    "clip": _OpSpec((1,), {"lo": "int?", "hi": "int?"}, {}),
    "max_pool": _OpSpec(
        (1,),
        {
            "kernel": "ints",
            "stride": "ints",
            "padding": "ints",
            "dilation": "ints",
            "ceil_mode": "bool",
        },
        {},
        _check_pool,
    ),
    "adaptive_max_pool": _OpSpec((1,), {"output_size": "ints"}, {}, _check_adaptive),
    "reshape": _OpSpec((1,), {"shape": "ints"}, {}, _check_reshape),
    "transpose": _OpSpec((1,), {"perm": "ints"}, {}, _check_transpose),
    "gather": _OpSpec(
        (1,), {"shape": "ints", "per_sample": "bool"}, {"index": _Param(_I, (1,))}, _check_gather
    ),
    "concat": _OpSpec(tuple(range(1, 65)), {"axis": "int"}, {}, _check_concat),
    "float": _OpSpec(
        (1, 2),
        {"fn": "str", "scalar": "float?", "scalar_first": "any", "dtype": "str?"},
        {},
        _check_float,
    ),
    "constant": _OpSpec(
        (0, 1, 2),
        {"batch": "bool", "dynamic": "any"},
        {"value": _Param(_ARRAY_DTYPES[:-1])},
        _check_constant,
    ),
    "cast": _OpSpec((1,), {"dtype": "str"}, {}, _check_cast),
    "compare": _OpSpec(
        (1, 2),
        {"fn": "str", "compute_dtype": "str", "scalar": "float?", "scalar_first": "any"},
        {},
        _check_compare,
    ),
    "logical": _OpSpec((1, 2), {"fn": "str"}, {}, _check_logical),
    "reduce_extreme": _OpSpec(
        (1,), {"fn": "str", "axes": "ints", "keepdim": "bool"}, {}, _check_reduce
    ),
    "arg_extreme": _OpSpec((1,), {"fn": "str", "axis": "int?", "keepdim": "bool"}, {}, _check_arg),
    **FLOAT_OP_SPECS,
}

#: ops whose output dtype is their ``dtype`` (or ``out_dtype``) attribute
_OUT_DTYPE = ("dtype", "out_dtype")


def _runtime_names(name: str, module: str = "runtime") -> tuple[str, ...]:
    """A tuple of names the runtime defines (``FLOAT_FNS``, ``COMPARE_FNS``, ...; the float
    ops' ``UNARY_FNS``, ... in ``runtime_float``)."""
    import importlib

    try:
        found = importlib.import_module(f".{module}", __package__) if __package__ else None
    except ImportError:  # pragma: no cover - loaded as a standalone file
        found = None
    if found is None:  # pragma: no cover - loaded as a standalone file
        found = importlib.import_module(module)
    return getattr(found, name)


# -- the graph ------------------------------------------------------------------------------------
_TOP = {
    "format": str,
    "version": int,
    "march": str,
    "dynamic_batch": bool,
    "inputs": list,
    "outputs": list,
    "tensors": dict,
    "nodes": list,
}
#: a tensor size may be a symbol: "N" (the batch), a declared dim, a product "H*W" of them, or
#: a size that follows them ("H.1")
_SYMBOL = re.compile(r"(N|[A-Za-z_][A-Za-z0-9_]*(\*[A-Za-z_][A-Za-z0-9_]*)*(\.[0-9]+)?)\Z")
_TENSOR_DTYPES = ("int8", "int16", "int32", "int64", "float32", "float64", "bool")


def check_graph(
    where: str, meta: Any, arrays: dict[str, np.ndarray], format_name: str, version: int
) -> None:
    """Check a parsed ``graph.json`` and its arrays (``docs/integer_graph.md``, 1 and 2).

    Raises:
        IntegerGraphFormatError: naming ``where`` and the key, tensor, node or member at fault.
    """

    def fail(reason: str) -> IntegerGraphFormatError:
        return IntegerGraphFormatError(
            f"{where}: graph.json: {reason}; the file is damaged or was written by another fxq: "
            "export it again"
        )

    if not isinstance(meta, dict):
        raise fail(f"the top level is {type(meta).__name__}, not an object")
    if meta.get("format") != format_name:
        raise IntegerGraphFormatError(
            f"{where}: not an fxq integer graph (format {meta.get('format')!r}, expected "
            f"{format_name!r})"
        )
    v = meta.get("version")
    if not _is_int(v) or v < 1:
        raise fail(f"version {v!r} is not a positive integer")
    if v > version:
        raise IntegerGraphFormatError(
            f"{where}: integer graph version {v} is newer than this fxq reads ({version}); "
            "upgrade fxq"
        )
    for k, t in _TOP.items():
        if k not in meta:
            raise fail(f"no key {k!r}")
        if not isinstance(meta[k], t) or (t is int and isinstance(meta[k], bool)):
            raise fail(f"{k!r} is {type(meta[k]).__name__}, expected {t.__name__}")
    if meta["march"] not in (*MARCH_LIMITS, ""):
        raise fail(f"unknown march {meta['march']!r} (known: {', '.join(MARCH_LIMITS)})")
    tensors = meta["tensors"]
    dims = _check_dims(fail, meta.get("dims", {}), v)
    for name, t in tensors.items():
        _check_tensor(fail, name, t)
        for s in t["shape"]:
            if isinstance(s, str) and not _symbol_known(s, dims):
                raise fail(
                    f"tensor {name!r} has size {s!r}, which is not 'N' nor made of the declared "
                    f"dims {sorted(dims)}"
                )
    for name in meta.get("inputs", []):
        if isinstance(name, str) and isinstance(tensors.get(name), dict):
            bad = [
                s for s in tensors[name]["shape"] if isinstance(s, str) and s not in (*dims, "N")
            ]
            if bad:
                raise fail(f"input {name!r} has size {bad[0]!r} (inputs take 'N' or declared dims)")
    for k in ("inputs", "outputs"):
        for name in meta[k]:
            if not isinstance(name, str) or name not in tensors:
                raise fail(f"{k} names {name!r}, which is not in 'tensors'")
    known = set(meta["inputs"])
    seen: set[str] = set()
    used: set[str] = set()
    for i, node in enumerate(meta["nodes"]):
        _check_node(where, fail, i, node, tensors, known, seen, arrays, meta["march"], used)
    for name in meta["outputs"]:
        if name not in known:
            raise fail(f"output {name!r} is produced by no node")
    unused = sorted(set(arrays) - used)
    if unused:
        raise IntegerGraphFormatError(
            f"{where}: member {unused[0]!r} is named by no node ({len(unused)} such member(s)); "
            "the file is damaged or was written by another fxq: export it again"
        )


def _check_dims(fail: Callable[[str], Exception], dims: Any, version: int) -> dict:
    """The top-level ``dims`` (version 4): symbol -> ``{"min": int >= 0, "max": int | null}``."""
    if not isinstance(dims, dict) or (dims and version < 4):
        raise fail(f"'dims' is {dims!r} (an object, in version 4 and later)")
    for k, d in dims.items():
        if (
            not isinstance(k, str)
            or not re.match(r"[A-Za-z_][A-Za-z0-9_]*\Z", k)
            or k == "N"
            or not isinstance(d, dict)
            or set(d) != {"min", "max"}
            or not (_is_int(d["min"]) and d["min"] >= 0)
            or not (d["max"] is None or (_is_int(d["max"]) and d["max"] >= d["min"]))
        ):
            raise fail(
                f"dims[{k!r}] is {d!r} (a name other than 'N' -> {{'min': int, 'max': int or null}})"
            )
    return dims


def _symbol_known(s: str, dims: dict) -> bool:
    if not _SYMBOL.match(s):
        return False
    return s == "N" or all(p in dims for p in s.split(".")[0].split("*"))


def _check_tensor(fail: Callable[[str], Exception], name: str, t: Any) -> None:
    if not isinstance(t, dict) or not {"dtype", "shape"} <= set(t):
        raise fail(f"tensor {name!r} is not an object with 'dtype' and 'shape'")
    if t["dtype"] not in _TENSOR_DTYPES:
        raise fail(f"tensor {name!r} has dtype {t['dtype']!r} (one of {list(_TENSOR_DTYPES)})")
    shape = t["shape"]
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_RANK
        or not all((_is_int(s) and s >= 0) or (isinstance(s, str) and s) for s in shape)
    ):
        raise fail(f"tensor {name!r} has shape {shape!r} (sizes >= 0 or symbols such as 'N')")
    scale = t.get("scale")
    if scale is not None and not (_is_float(scale) and scale > 0):
        raise fail(f"tensor {name!r} has scale {scale!r} (a finite number > 0, or null)")
    if not _is_int(t.get("offset", 0)):
        raise fail(f"tensor {name!r} has offset {t.get('offset')!r} (an integer)")


def _check_node(
    where: str,
    fail: Callable[[str], Exception],
    index: int,
    node: Any,
    tensors: dict,
    known: set[str],
    seen: set[str],
    arrays: dict[str, np.ndarray],
    march: str,
    used: set[str],
) -> None:
    fields = {
        "name": str,
        "op": str,
        "inputs": list,
        "outputs": list,
        "attrs": dict,
        "params": dict,
        "source": str,
    }
    if not isinstance(node, dict):
        raise fail(f"nodes[{index}] is {type(node).__name__}, not an object")
    for k, t in fields.items():
        if not isinstance(node.get(k), t):
            raise fail(
                f"nodes[{index}] ({node.get('name')!r}): {k!r} is {node.get(k)!r}, "
                f"expected {t.__name__}"
            )
    name, op = node["name"], node["op"]
    if name in seen:
        raise fail(f"node name {name!r} appears twice")
    seen.add(name)
    primitive = PRIMITIVES.get(op)  # fxq.primitives: the spec beside the kernels
    spec = primitive.spec if primitive is not None else OP_SPECS.get(op)
    if spec is None:
        raise fail(
            f"node {name!r} has op {op!r}, which this fxq does not run (ops: "
            f"{', '.join(sorted({*OP_SPECS, *PRIMITIVES}))}); upgrade fxq"
        )
    for t in node["inputs"]:
        if not isinstance(t, str) or t not in known:
            raise fail(f"node {name!r} reads {t!r}, which no earlier node or graph input makes")
    for t in node["outputs"]:
        if not isinstance(t, str) or t not in tensors or t in known:
            raise fail(f"node {name!r} writes {t!r}: not in 'tensors', or written twice")
        known.add(t)
    c = _Ctx(
        where,
        node,
        {},
        [tensors[t] for t in node["inputs"]],
        march,
        [tensors[t] for t in node["outputs"]],
    )
    if len(node["inputs"]) not in spec.inputs or len(node["outputs"]) != spec.outputs:
        raise c.fail(f"{len(node['inputs'])} inputs and {len(node['outputs'])} outputs")
    for k, kind in spec.attrs.items():
        check, what = _KINDS[kind]
        if k not in node["attrs"] and not kind.endswith("?") and kind != "any":
            raise c.fail(f"no attribute {k!r}")
        if k in node["attrs"] and not check(node["attrs"][k]):
            raise c.fail(f"attribute {k!r} is {node['attrs'][k]!r}, expected {what}")
    c.params = _node_params(c, spec, node, arrays, used)
    for k in _OUT_DTYPE:
        want = node["attrs"].get(k) if k in spec.attrs else None
        got = tensors[node["outputs"][0]]["dtype"]
        if isinstance(want, str) and got != want:
            raise c.fail(f"output {node['outputs'][0]!r} is {got}, the op makes {want}")
    _check_ranges(c)
    if spec.check is not None:
        spec.check(c)


def _node_params(
    c: _Ctx, spec: _OpSpec, node: dict, arrays: dict[str, np.ndarray], used: set[str]
) -> dict[str, np.ndarray]:
    params = {}
    for k, member in node["params"].items():
        p = spec.params.get(k)
        if p is None and not (spec.extra_params and k.startswith(spec.extra_params)):
            raise c.fail(f"unknown param {k!r} (params: {', '.join(spec.params)})")
        if not isinstance(member, str) or member not in arrays:
            raise c.fail(f"param {k!r} names member {member!r}, which the file does not hold")
        a = arrays[member]
        used.add(member)
        dtypes = _I if p is None else p.dtypes
        if a.dtype.name not in dtypes or (p is not None and p.ranks and a.ndim not in p.ranks):
            raise IntegerGraphFormatError(
                f"{c.where}: member {member!r} (node {node['name']!r}, op {node['op']!r}, param "
                f"{k!r}) is {a.dtype.name} of shape {list(a.shape)}, expected "
                f"{'/'.join(dtypes)}{'' if p is None or not p.ranks else f' of rank {p.ranks}'}; "
                "the file is damaged or was written by another fxq: export it again"
            )
        params[k] = a
    for k, p in spec.params.items():
        if p.required and k not in params:
            raise c.fail(f"no param {k!r}")
    return params
