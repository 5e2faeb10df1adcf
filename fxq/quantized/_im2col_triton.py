"""Triton im2col of ``conv_as_gemm`` (``fxq.quantized.functional``) on CUDA.

The integer model convolves on a GPU as one im2col copy and one GEMM per batch block.
torch's strided copy gathers the columns through a six-dimensional view (about half the
kernel time of a ResNet-18 forward at batch 64 on an H200, ``benchmarks/infer_speed.py
--profile``); this kernel writes the same columns with two-dimensional indexing, reads the
input through its strides (no contiguous copy first) and pads with zeros as it reads (no
padded copy first). A copy: the columns are the input's values, bit for bit.

Imported only when a convolution runs on CUDA (or under ``TRITON_INTERPRET=1``, where the
tests compare it with the strided copy on the CPU): ``import fxq`` does not import Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["im2col"]

#: the most output positions one program copies
_MAX_BLOCK = 1024


@triton.jit
def _im2col_kernel(
    x_ptr,
    cols_ptr,
    k_size,
    length,
    height,
    width,
    out_width,
    sxn,
    sxc,
    sxh,
    sxw,
    kh_size,
    kw_size,
    stride_h,
    stride_w,
    dil_h,
    dil_w,
    pad_h,
    pad_w,
    BLOCK: tl.constexpr,
):
    # one program: one column row (image b, input channel c, kernel tap kh, kw) over BLOCK
    # output positions
    row = tl.program_id(0).to(tl.int64)
    b = row // k_size
    k = row % k_size
    taps = kh_size * kw_size
    c = k // taps
    tap = k % taps
    kh = tap // kw_size
    kw = tap % kw_size
    pos = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = pos < length
    oh = pos // out_width
    ow = pos % out_width
    ih = oh * stride_h + kh * dil_h - pad_h
    iw = ow * stride_w + kw * dil_w - pad_w
    valid = inside & (ih >= 0) & (ih < height) & (iw >= 0) & (iw < width)
    v = tl.load(x_ptr + b * sxn + c * sxc + ih * sxh + iw * sxw, mask=valid, other=0.0)
    tl.store(cols_ptr + row * length + pos, v, mask=inside)


def im2col(
    x: Tensor,
    kernel: tuple[int, int],
    out: tuple[int, int],
    stride: tuple[int, int],
    dilation: tuple[int, int],
    pad_before: tuple[int, int],
) -> Tensor:
    """The columns ``[N, C * kh * kw, out_h * out_w]`` of ``x`` ``[N, C, H, W]`` (any strides),
    zero outside it: row ``c * kh * kw + i * kw + j`` holds
    ``x[n, c, oh * stride_h + i * dil_h - pad_h, ow * stride_w + j * dil_w - pad_w]`` at
    column ``oh * out_w + ow``."""
    n, c, height, width = x.shape
    k_size = c * kernel[0] * kernel[1]
    length = out[0] * out[1]
    cols = torch.empty((n, k_size, length), dtype=x.dtype, device=x.device)
    if cols.numel() == 0:
        return cols
    block = min(_MAX_BLOCK, triton.next_power_of_2(length))
    grid = (n * k_size, triton.cdiv(length, block))
    _im2col_kernel[grid](
        x,
        cols,
        k_size,
        length,
        height,
        width,
        out[1],
        *x.stride(),
        kernel[0],
        kernel[1],
        stride[0],
        stride[1],
        dilation[0],
        dilation[1],
        pad_before[0],
        pad_before[1],
        BLOCK=block,
    )
    return cols
