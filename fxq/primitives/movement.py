"""Data movement inside an integer module: concatenation, a new axis, a reshape, a transpose.

These move integers without computing them. Their IR ops (``concat``, ``reshape``,
``transpose``) are the graph's data-movement vocabulary, which ``fxq.export`` defines with
the rest of its movement machinery (every pass-through op that moves integers is exported
by it); the functions below are what an integer module's ``forward`` calls for the moves
it makes itself (``torch.cat`` of operands it requantized, ``einsum``'s transposes), so that
an export records them like any primitive call.
"""

from __future__ import annotations

from collections.abc import Sequence

from fxq.primitives.core import Call, ir_dtype, is_recording, record

try:
    import torch
except ImportError:  # the numpy runtime without torch
    torch = None

__all__ = ["concat", "stack", "swap_last", "reshape", "permute"]


if torch is not None:
    from torch import Tensor

    from fxq.dtypes import QDType

    def _ir(dtype: QDType | str) -> str:
        return dtype if isinstance(dtype, str) else ir_dtype(dtype)

    def concat(values: Sequence[Tensor], axis: int, dtype: QDType) -> Tensor:
        """``torch.cat`` of integers on one grid (``dtype``)."""
        y = torch.cat(list(values), axis)
        if is_recording():
            d = ir_dtype(dtype)
            record(Call("concat", list(values), [y], [d], {"axis": axis % y.dim()}))
        return y

    def stack(values: Sequence[Tensor], axis: int, dtype: QDType, scale: Tensor) -> Tensor:
        """``torch.stack`` of integers on one grid (``dtype``, ``scale``): each operand gets
        the new axis (a ``reshape``), then one ``concat``."""
        axis = axis % (values[0].dim() + 1)
        d = ir_dtype(dtype)
        moved = []
        for v in values:
            u = v.unsqueeze(axis)
            if is_recording():
                shape = list(u.shape)
                keeps = axis > 0  # the batch axis stays first
                record(
                    Call(
                        "reshape",
                        [v],
                        [u],
                        [d],
                        {"shape": shape},
                        {},
                        [float(scale)],
                        keeps_batch=keeps,
                    )
                )
            moved.append(u)
        return concat(moved, axis, dtype)

    def swap_last(v: Tensor, dtype: QDType, scale: Tensor | None = None) -> Tensor:
        """``v.transpose(-2, -1)``: integers of ``dtype`` (on a grid of ``scale`` where the
        result stays inside the module)."""
        y = v.transpose(-2, -1)
        if is_recording():
            rank = v.dim()
            perm = [*range(rank - 2), rank - 1, rank - 2]
            scales = [None if scale is None else float(scale)]
            attrs = {"perm": perm}
            record(
                Call(
                    "transpose",
                    [v],
                    [y],
                    [ir_dtype(dtype)],
                    attrs,
                    {},
                    scales,
                    keeps_batch=rank > 2,
                )
            )
        return y

    def reshape(
        v: Tensor,
        shape: Sequence[int],
        dtype: QDType | str,
        scale: Tensor | None = None,
        keeps_batch: bool = False,
    ) -> Tensor:
        """``v.reshape(shape)`` of integers of ``dtype`` (an IR dtype such as ``"bool"`` for a
        plain tensor: a mask), on a grid of ``scale`` where the result stays inside the module.

        Args:
            keeps_batch: whether the result's axis 0 is ``v``'s (a dynamic batch stays
                dynamic: the exported shape has 0 there).
        """
        y = v.reshape(shape)
        if is_recording():
            attrs = {"shape": [int(s) for s in y.shape]}
            scales = [None if scale is None else float(scale)]
            record(
                Call("reshape", [v], [y], [_ir(dtype)], attrs, {}, scales, keeps_batch=keeps_batch)
            )
        return y

    def permute(
        v: Tensor, perm: Sequence[int], dtype: QDType | str, scale: Tensor | None = None
    ) -> Tensor:
        """``v.permute(perm)`` of integers of ``dtype`` (as ``reshape``); a dynamic batch stays
        dynamic where axis 0 stays first."""
        perm = [int(p) % v.dim() for p in perm]
        y = v.permute(perm)
        if is_recording():
            scales = [None if scale is None else float(scale)]
            record(
                Call(
                    "transpose",
                    [v],
                    [y],
                    [_ir(dtype)],
                    {"perm": perm},
                    {},
                    scales,
                    keeps_batch=perm[0] == 0,
                )
            )
        return y
