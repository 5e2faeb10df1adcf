"""Triton im2col of ``conv_as_gemm`` (``fxq.quantized.functional``) on CUDA.

The integer model convolves on a GPU as one im2col copy and one GEMM per batch block.
torch's strided copy gathers the columns through a six-dimensional view (about half the
kernel time of a ResNet-18 forward at batch 64 on an H200, ``benchmarks/infer_speed.py
--profile``). These kernels write the same columns reading the input through its strides
(no contiguous copy first) and padding with zeros as they read (no padded copy first):

* ``rows``: a program per column row and up to 1024 output positions (long rows: large
  outputs; a division per element splits the position into its output row and column);
* ``tiles``: a program per tile of column rows by whole output rows (a power of two wide),
  so nothing is divided per element and short rows share a program (small outputs).

Neither is fastest everywhere, nor is torch's copy (``benchmarks/im2col_speed.py``), so
``conv_as_gemm`` times the three per geometry. Copies: the columns are the input's values,
bit for bit.

Imported only when a convolution runs on CUDA (or under ``TRITON_INTERPRET=1``, where the
tests compare it with the strided copy on the CPU): ``import fxq`` does not import Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fxq.quantized._triton_launch import Launcher, cdiv, next_power_of_2

__all__ = ["im2col"]

#: the most output positions one program of the row kernel copies
_MAX_BLOCK = 1024

#: elements one program of the tile kernel copies, and the most output positions among them
_TILE = 4096
_TILE_POSITIONS = 1024

#: the kernels ``im2col`` can copy with (``conv_as_gemm`` times them per convolution)
METHODS = ("rows", "tiles")


@triton.jit
def _tap(row, k_size, kh_size, kw_size, sxn, sxc, dil_h, dil_w, pad_h, pad_w):
    """For column rows ``row`` (image b, input channel c, kernel tap kh, kw): the input offset
    of their image and channel, and their tap's offset in input rows and columns."""
    b = row // k_size
    k = row % k_size
    taps = kh_size * kw_size
    c = k // taps
    tap = k % taps
    return b * sxn + c * sxc, (tap // kw_size) * dil_h - pad_h, (tap % kw_size) * dil_w - pad_w


@triton.jit
def _rows_kernel(
    x_ptr, cols_ptr, k_size, length, height, width, out_width, sxn, sxc, sxh, sxw,
    kh_size, kw_size, stride_h, stride_w, dil_h, dil_w, pad_h, pad_w, BLOCK: tl.constexpr,
):  # fmt: skip
    # one program: one column row over BLOCK output positions (long rows: large outputs)
    row = tl.program_id(0).to(tl.int64)
    base, h_off, w_off = _tap(row, k_size, kh_size, kw_size, sxn, sxc, dil_h, dil_w, pad_h, pad_w)
    pos = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = pos < length
    ih = (pos // out_width) * stride_h + h_off
    iw = (pos % out_width) * stride_w + w_off
    valid = inside & (ih >= 0) & (ih < height) & (iw >= 0) & (iw < width)
    v = tl.load(x_ptr + base + ih * sxh + iw * sxw, mask=valid, other=0.0)
    tl.store(cols_ptr + row * length + pos, v, mask=inside)


@triton.jit
def _tiles_kernel(
    x_ptr, cols_ptr, rows, k_size, height, width, out_height, out_width, sxn, sxc, sxh, sxw,
    kh_size, kw_size, stride_h, stride_w, dil_h, dil_w, pad_h, pad_w,
    BLOCK_R: tl.constexpr, BLOCK_OH: tl.constexpr, BLOCK_OW: tl.constexpr,
):  # fmt: skip
    # one program: BLOCK_R column rows by BLOCK_OH output rows of BLOCK_OW (>= out_width)
    # positions: the divisions run once per column row, none per element (the position
    # splits by a power of two)
    pid = tl.program_id(0)
    tiles_h = tl.cdiv(out_height, BLOCK_OH)
    row = (pid // tiles_h).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_OH * BLOCK_OW)
    oh = (pid % tiles_h) * BLOCK_OH + p // BLOCK_OW
    ow = p % BLOCK_OW
    base, h_off, w_off = _tap(row, k_size, kh_size, kw_size, sxn, sxc, dil_h, dil_w, pad_h, pad_w)
    ih = h_off[:, None] + (oh * stride_h)[None, :]
    iw = w_off[:, None] + (ow * stride_w)[None, :]
    inside = (row < rows)[:, None] & ((oh < out_height) & (ow < out_width))[None, :]
    valid = inside & (ih >= 0) & (ih < height) & (iw >= 0) & (iw < width)
    v = tl.load(x_ptr + base[:, None] + ih * sxh + iw * sxw, mask=valid, other=0.0)
    target = cols_ptr + (row * out_height * out_width)[:, None] + (oh * out_width + ow)[None, :]
    tl.store(target, v, mask=inside)


def _tile(out_height: int, out_width: int) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_OH, BLOCK_OW)`` of the tile kernel: whole output rows (a power of two
    at least ``out_width``), as many of them as make at most ``_TILE_POSITIONS`` positions,
    and as many column rows as make ``_TILE`` elements."""
    block_ow = next_power_of_2(out_width)
    block_oh = min(next_power_of_2(out_height), max(1, _TILE_POSITIONS // block_ow))
    return max(1, _TILE // (block_oh * block_ow)), block_oh, block_ow


def fits(out: tuple[int, int]) -> bool:
    """Whether the kernels' launch grids hold an output of ``out`` positions (the row kernel:
    65535 programs of 1024 per row; the tile kernel: rows of at most 4096 positions)."""
    return out[0] * out[1] <= 65535 * _MAX_BLOCK and out[1] <= _TILE


def im2col(
    x: Tensor,
    kernel: tuple[int, int],
    out: tuple[int, int],
    stride: tuple[int, int],
    dilation: tuple[int, int],
    pad_before: tuple[int, int],
    method: str = "tiles",
) -> Tensor:
    """The columns ``[N, C * kh * kw, out_h * out_w]`` of ``x`` ``[N, C, H, W]`` (any strides),
    zero outside it: row ``c * kh * kw + i * kw + j`` holds
    ``x[n, c, oh * stride_h + i * dil_h - pad_h, ow * stride_w + j * dil_w - pad_w]`` at
    column ``oh * out_w + ow``.

    ``method`` (``METHODS``): ``"rows"``, a program per column row and 1024 positions (fast
    on long rows), or ``"tiles"``, a program per tile of column rows by whole output rows
    (fast on short ones). The same values either way."""
    n, c, height, width = x.shape
    k_size = c * kernel[0] * kernel[1]
    length = out[0] * out[1]
    cols = torch.empty((n, k_size, length), dtype=x.dtype, device=x.device)
    if cols.numel() == 0:
        return cols
    geometry = (
        *x.stride(), kernel[0], kernel[1], stride[0], stride[1], dilation[0], dilation[1],
        pad_before[0], pad_before[1],
    )  # fmt: skip
    if method == "rows":
        block = min(_MAX_BLOCK, next_power_of_2(length))
        grid = (n * k_size, cdiv(length, block))
        _launch_rows(grid, x, cols, k_size, length, height, width, out[1], *geometry, BLOCK=block)
        return cols
    if method != "tiles":
        raise ValueError(f"im2col method {method!r}: one of {METHODS}")
    rows = n * k_size
    block_r, block_oh, block_ow = _tile(*out)
    grid = (cdiv(rows, block_r) * cdiv(out[0], block_oh),)
    _launch_tiles(
        grid, x, cols, rows, k_size, height, width, out[0], out[1], *geometry,
        BLOCK_R=block_r, BLOCK_OH=block_oh, BLOCK_OW=block_ow,
    )  # fmt: skip
    return cols


_launch_rows = Launcher(_rows_kernel)
_launch_tiles = Launcher(_tiles_kernel)
