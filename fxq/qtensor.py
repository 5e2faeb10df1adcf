"""QTensor: integer data with a scale, as the converted model passes them around.

A ``QTensor`` holds integers (``data`` / ``int_repr()``: int8 / int16 / int32
torch tensors, not torch's quantized dtypes), a float32 scale (per tensor, or
per channel along ``axis``) and its ``fxq`` dtype. Its value is
``data * scale``; the zero point is 0, except on the output of a producer whose
unsigned range ``fxq.calibration.offset_activations`` stores shifted (``offset``:
the value is ``(data + offset) * scale``). Such a tensor feeds only convolutions
and linear layers, which undo the shift in their biases; any other op refuses it.

The integers may also be carried as exact float32 values (``values()``):
integer kernels that run on float hardware paths (conv, linear) read and
write that form directly instead of converting at every layer. Each form is
made from the other on first use and cached; both always hold the same
integers.

Operations that only move or select values (view, reshape, permute, flatten,
transpose, slicing, chunk / split, max pooling, ReLU, nearest resampling,
padding with zeros, dropout in eval mode, ...) return QTensors without
rounding. Every other torch function raises a ``TypeError`` naming the op: a
QTensor never dequantizes silently. Call ``dequantize()`` to leave the integer
domain on purpose.

>>> q = QTensor(torch.tensor([[-3, 4]], dtype=torch.int8), torch.tensor([0.5]), fxq.qint8)
>>> q.dequantize()
tensor([[-1.5000,  2.0000]])
>>> q.flatten().int_repr()
tensor([-3,  4], dtype=torch.int8)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from fxq.dtypes import QDType, as_qdtype

__all__ = ["QTensor", "implements", "is_handled", "passthrough_method", "passthrough_function"]

_HANDLED: dict[Callable, Callable] = {}


def implements(*funcs: Callable) -> Callable:
    """Register the QTensor implementation of torch functions."""

    def decorator(impl: Callable) -> Callable:
        for f in funcs:
            _HANDLED[f] = impl
        return impl

    return decorator


class QTensor:
    """Integer tensor + scale.

    Args:
        data: the integers, either in their storage dtype (int8, int16, int32)
            or as a float32 tensor of exact integers (kernel output).
        scale: float32 tensor, one element (per tensor) or one per channel.
        dtype: the quantized dtype (``fxq.qint8`` ...); integer ``data`` must
            be in its storage dtype.
        axis: channel axis of a per-channel scale.
        offset: the value is ``(data + offset) * scale`` (an unsigned range stored
            in a signed dtype; see the module docstring).

    Raises:
        TypeError / ValueError: for mismatched storage, dtype or scale shape.
    """

    __slots__ = ("_int", "_float", "scale", "qdtype", "axis", "offset")

    def __init__(
        self,
        data: Tensor,
        scale: Tensor,
        dtype: QDType | str,
        axis: int | None = None,
        offset: int = 0,
    ) -> None:
        qdtype = as_qdtype(dtype)
        if data.is_floating_point():
            if data.dtype is not torch.float32:
                raise TypeError(f"a QTensor carries exact integers in float32, got {data.dtype}")
            self._float, self._int = data, None
        else:
            if data.dtype is not qdtype.storage:
                raise TypeError(
                    f"QTensor of {qdtype.name} needs {qdtype.storage} storage, got {data.dtype}"
                )
            self._int, self._float = data, None
        scale = torch.as_tensor(scale, dtype=torch.float32, device=data.device)
        if scale.dim() != 1:  # no op on a [1] / [C] scale (under torch.export it stays real)
            scale = scale.reshape(-1)
        if scale.numel() != 1:
            if axis is None:
                raise ValueError("a per-channel QTensor needs its channel axis")
            if scale.numel() != data.shape[axis]:
                raise ValueError(
                    f"per-channel scale has {scale.numel()} entries for {data.shape[axis]} channels"
                )
        self.scale = scale
        self.qdtype = qdtype
        self.axis = axis if scale.numel() != 1 else None
        self.offset = int(offset)

    @property
    def data(self) -> Tensor:
        """The integers in their storage dtype (int8 / int16 / int32)."""
        if self._int is None:
            self._int = self._float.to(self.qdtype.storage)
        return self._int

    def values(self) -> Tensor:
        """The integers as exact float32 values (int32 data keeps its own dtype)."""
        if self._float is None:
            if self.qdtype.bits > 24:
                return self._int
            self._float = self._int.to(torch.float32)
        return self._float

    def _primary(self) -> Tensor:
        return self._float if self._float is not None else self._int

    # -- construction / leaving the integer domain --------------------------
    @classmethod
    def quantize(
        cls, x: Tensor, scale: Tensor, dtype: QDType | str, rounding, offset: int = 0
    ) -> QTensor:
        """Quantize a tensor with fxq's one quantize formula (``fxq.quantized.functional.quantize``).

        ``x`` may have any real dtype: half-precision floats and integers of up to
        16 bits (e.g. uint8 camera frames) quantize exactly as the same values in
        float32 would; the scale keeps its float32 value whatever ``x``'s dtype.
        With an ``offset``, ``x`` is quantized onto ``[qmin + offset, qmax + offset]``
        and stored less ``offset``.
        """
        from fxq.quantized import functional as qf

        dtype = as_qdtype(dtype)
        q = qf.quantize(x, scale, dtype, rounding, as_float=dtype.bits <= 24, offset=offset)
        return cls(q, scale, dtype, offset=offset)

    def dequantize(self) -> Tensor:
        """``(data + offset) * scale`` as float32."""
        from fxq.quantized.functional import broadcast_scale

        v = self._primary().to(torch.float32)
        if self.offset:
            v = v + self.offset
        return v * broadcast_scale(self.scale, v.dim(), self.axis)

    def int_repr(self) -> Tensor:
        return self.data

    def q_scale(self) -> float:
        if self.axis is not None:
            raise ValueError("a per-channel QTensor has several scales; use q_per_channel_scales()")
        return float(self.scale.item())

    def q_per_channel_scales(self) -> Tensor:
        return self.scale

    def q_per_channel_axis(self) -> int | None:
        return self.axis

    # -- tensor-like metadata -----------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return self._primary().shape

    @property
    def ndim(self) -> int:
        return self._primary().dim()

    @property
    def device(self) -> torch.device:
        return self._primary().device

    @property
    def dtype(self) -> QDType:
        return self.qdtype

    @property
    def is_quantized(self) -> bool:
        return True

    def size(self, dim: int | None = None):
        v = self._primary()
        return v.size() if dim is None else v.size(dim)

    def dim(self) -> int:
        return self._primary().dim()

    def numel(self) -> int:
        return self._primary().numel()

    def __len__(self) -> int:
        return len(self._primary())

    def __repr__(self) -> str:
        scale = (
            f"scale={self.q_scale():.6g}"
            if self.axis is None
            else f"scales={self.scale.tolist()}, axis={self.axis}"
        )
        offset = f", offset={self.offset}" if self.offset else ""
        return f"QTensor({self.data!r}, {scale}, dtype={self.qdtype.name}{offset})"

    # -- value-preserving operations -------------------------------------------
    def _like(self, data: Tensor) -> QTensor:
        self._no_offset("this op")
        return QTensor(data, self.scale, self.qdtype)

    def _map(self, fn: Callable[[Tensor], Any]) -> Any:
        """Apply a value-preserving op to the integers (in whichever form is at hand)."""
        self._no_offset("this op")
        return _wrap_like(self, fn(self._primary()))

    def _no_offset(self, op: str) -> None:
        if self.offset:
            raise TypeError(
                f"{op} got a QTensor stored with offset {self.offset} (an unsigned range, "
                "fxq.calibration.offset_activations), which only convolutions and linear layers "
                "take; dequantize() it, or leave this producer's output without an offset"
            )

    def _per_tensor(self, op: str) -> None:
        if self.axis is not None:
            raise TypeError(
                f"{op} on a per-channel QTensor would lose track of its channel axis; dequantize() it first"
            )

    def contiguous(self, *args: Any, **kwargs: Any) -> QTensor:
        return QTensor(
            self._primary().contiguous(*args, **kwargs),
            self.scale,
            self.qdtype,
            self.axis,
            self.offset,
        )

    def clone(self) -> QTensor:
        # the scale is shared, as by every other op that keeps it (and stays real under export)
        return QTensor(self._primary().clone(), self.scale, self.qdtype, self.axis, self.offset)

    def detach(self) -> QTensor:
        return self

    def view_as(self, other: Any) -> QTensor:
        return self.view(other.shape)

    def reshape_as(self, other: Any) -> QTensor:
        return self.reshape(other.shape)

    def expand_as(self, other: Any) -> QTensor:
        return self.expand(other.shape)

    def to(self, *args: Any, **kwargs: Any) -> QTensor:
        """Move to a device (a dtype change is refused: it would leave the integer grid)."""
        target = torch.empty(0).to(*args, **kwargs)
        if target.dtype is not torch.float32 and target.dtype is not self.qdtype.storage:
            raise TypeError(
                f"QTensor.to({target.dtype}) would change the integer dtype; dequantize() first"
            )
        return QTensor(
            self._primary().to(target.device),
            self.scale.to(target.device),
            self.qdtype,
            self.axis,
            self.offset,
        )

    def cpu(self) -> QTensor:
        return self.to("cpu")

    def cuda(self, device: Any = None) -> QTensor:
        return self.to(torch.device("cuda") if device is None else device)

    def relu(self) -> QTensor:
        return self._like(self._primary().clamp(min=0))

    relu_ = relu

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"QTensor has no integer version of .{name}(); this value is quantized. Call "
            f".dequantize() to use float ops, or keep the region in float with a qconfig of None"
        )

    # -- torch functions ---------------------------------------------------
    @classmethod
    def __torch_function__(
        cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        for a in (*args, *kwargs.values()):
            if isinstance(a, QTensor):
                a._no_offset(_op_name(func))
        impl = _HANDLED.get(func)
        if impl is None:
            raise TypeError(
                f"{_op_name(func)} has no integer meaning for a QTensor; fxq does not dequantize "
                "silently. Call .dequantize() explicitly, or give this op a qconfig of None so it "
                "runs in float"
            )
        return impl(*args, **kwargs)


def is_handled(func: Callable) -> bool:
    """Whether QTensor has an implementation of the torch function ``func``."""
    try:
        return func in _HANDLED
    except TypeError:
        return False


def passthrough_method(name: str) -> Callable:
    """A QTensor method that runs ``Tensor.<name>`` on the integers and keeps the scale.

    Only for ops that move or select values (reshapes, slicing...); the op
    registry installs one for every pass-through row's method names.
    """

    def method(self: QTensor, *args: Any, **kwargs: Any) -> Any:
        self._per_tensor(f"QTensor.{name}")
        return self._map(lambda v: getattr(v, name)(*_unwrap(args), **kwargs))

    method.__name__ = name
    method.__doc__ = f"``Tensor.{name}`` on the integer data; the scale is kept."
    return method


def passthrough_function(func: Callable) -> Callable:
    """The QTensor implementation of a value-moving torch function (``torch.flatten``...)."""

    def impl(input: QTensor, *args: Any, **kwargs: Any) -> Any:
        input._per_tensor(_op_name(func))
        return input._map(lambda v: func(v, *_unwrap(args), **kwargs))

    return impl


def _op_name(func: Callable) -> str:
    """A readable name for a torch function (``torch.exp``, ``torch.nn.functional.gelu``)."""
    name = getattr(func, "__name__", None) or repr(func)
    for prefix, namespace in (
        ("torch", torch),
        ("torch.nn.functional", F),
        ("torch.Tensor", torch.Tensor),
    ):
        if getattr(namespace, name, None) is func:
            return f"{prefix}.{name}"
    module = getattr(func, "__module__", None)
    return f"{module}.{name}" if module else name


def _unwrap(values: Any) -> Any:
    if isinstance(values, QTensor):
        return values._primary()
    if isinstance(values, (list, tuple)):
        return type(values)(_unwrap(v) for v in values)
    return values


def _wrap_like(ref: QTensor, out: Any) -> Any:
    if isinstance(out, Tensor):
        return QTensor(out, ref.scale, ref.qdtype)
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap_like(ref, o) for o in out)
    return out


# -- torch functions that keep the integer grid --------------------------------------
def _delegate(name: str) -> Callable:
    def impl(input: QTensor, *args: Any, **kwargs: Any) -> Any:
        return getattr(input, name)(*args, **kwargs)

    return impl


for _fn, _name in (
    (torch.clone, "clone"),
    (torch.Tensor.view, "view"),
    (torch.Tensor.reshape, "reshape"),
    (torch.Tensor.contiguous, "contiguous"),
    (torch.Tensor.size, "size"),
    (torch.Tensor.dim, "dim"),
    (torch.Tensor.numel, "numel"),
):
    implements(_fn)(_delegate(_name))


def _arg_extreme(op: Callable) -> Callable:
    """``argmax`` / ``argmin`` on the integers: int64 indices (a plain tensor, not quantized);
    a positive scale keeps the order, so they are the float op's indices on the grid."""

    def impl(input: QTensor, *args: Any, **kwargs: Any) -> Tensor:
        input._per_tensor(getattr(op, "__name__", "op"))
        return op(input.values(), *_unwrap(args), **kwargs)

    impl.__name__ = getattr(op, "__name__", "op")
    return impl


for _fn in (torch.argmax, torch.argmin):
    implements(_fn, getattr(torch.Tensor, _fn.__name__))(_arg_extreme(_fn))
    setattr(QTensor, _fn.__name__, _arg_extreme(_fn))


def _float_roundtrip(op: Callable, input: QTensor, *args: Any, **kwargs: Any) -> QTensor:
    """Run a value-selecting op on the exact float32 form of the integers (int16 fits)."""
    input._per_tensor(getattr(op, "__name__", "op"))
    out = op(input.values(), *args, **kwargs)
    if isinstance(out, tuple):  # return_indices=True
        return (input._like(out[0]),) + tuple(out[1:])
    return input._like(out)


@implements(F.relu, torch.relu)
def _relu(input: QTensor, inplace: bool = False) -> QTensor:
    input._per_tensor("relu")
    return input._like(input._primary().clamp(min=0))


for _pool in (
    F.max_pool1d,
    F.max_pool2d,
    F.max_pool3d,
    F.adaptive_max_pool1d,
    F.adaptive_max_pool2d,
    F.adaptive_max_pool3d,
    F.max_pool1d_with_indices,
    F.max_pool2d_with_indices,
    F.max_pool3d_with_indices,
    F.pixel_shuffle,
    F.pixel_unshuffle,
    torch.channel_shuffle,
):
    implements(_pool)(functools.partial(_float_roundtrip, _pool))


@implements(F.interpolate)
def _interpolate(
    input: QTensor, size=None, scale_factor=None, mode: str = "nearest", *args: Any, **kwargs: Any
):
    if mode not in ("nearest", "nearest-exact"):
        raise TypeError(
            f"F.interpolate(mode={mode!r}) on a QTensor needs the integer interpolation module "
            "(fxq.quantized.Interpolate); only nearest resampling keeps the integer grid"
        )
    return _float_roundtrip(F.interpolate, input, size, scale_factor, mode, *args, **kwargs)


@implements(F.pad)
def _pad(input: QTensor, pad, mode: str = "constant", value: float | None = None) -> QTensor:
    if mode == "constant" and value not in (None, 0, 0.0):
        raise TypeError(f"F.pad with value {value} is not on the integer grid of a QTensor")
    if mode == "constant":
        return input._like(F.pad(input._primary(), pad))
    return _float_roundtrip(F.pad, input, pad, mode)


@implements(
    F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout
)
def _dropout(
    input: QTensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> QTensor:
    if training and p > 0:
        raise TypeError("dropout in training mode has no integer meaning; call model.eval()")
    return input
