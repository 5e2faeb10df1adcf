"""The integer model's convolutions on CUDA: each im2col way of ``conv_as_gemm`` timed.

``fxq.quantized.functional.conv_as_gemm`` makes a convolution's columns with torch's strided
copy or one of two Triton kernels (``fxq/quantized/_im2col_triton.py``: "rows", "tiles") and
times them on the first convolution of each geometry, keeping the fastest. This prints, for
ResNet-18's convolution shapes, each way's time (im2col and GEMM, ms per convolution), the
time of the timed choice and the way it picked (medians, the ways interleaved); every way's
output must be equal:

    python benchmarks/im2col_speed.py               # batch 64 on cuda
    python benchmarks/im2col_speed.py --batch 32 --iters 50
"""

from __future__ import annotations

import argparse
import functools

import torch
from qat_speed import measure  # benchmarks/ is on sys.path when run
from tabulate import tabulate

from fxq.quantized import functional as qf

#: ResNet-18's convolutions: in / out channels, input size, kernel, stride, padding
SHAPES = [
    (3, 64, 224, 7, 2, 3),
    (64, 64, 56, 3, 1, 1),
    (64, 128, 56, 3, 2, 1),
    (128, 128, 28, 3, 1, 1),
    (256, 256, 14, 3, 1, 1),
    (512, 512, 7, 3, 1, 1),
    (128, 256, 28, 1, 2, 0),
    (256, 512, 14, 1, 2, 0),
]

WAYS = ("rows", "tiles", "strided", None)


def _convolve(way: str | None, *conv) -> torch.Tensor:
    """``conv_as_gemm(*conv)`` with ``way`` forced (None: the timed choice)."""
    qf.IM2COL_METHOD = way
    try:
        return qf.conv_as_gemm(*conv)
    finally:
        qf.IM2COL_METHOD = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if torch.device(args.device).type != "cuda" or not torch.cuda.is_available():
        parser.error("the Triton im2col kernels run on CUDA: a GPU is needed")
    torch.manual_seed(0)
    rows, totals = [], dict.fromkeys(WAYS, 0.0)
    for c, o, size, k, stride, pad in SHAPES:
        x = torch.randint(-128, 128, (args.batch, c, size, size), device=args.device).float()
        w = torch.randint(-2, 3, (o, c, k, k), device=args.device).float()
        conv = (x, w, None, (stride, stride), [[pad, pad]] * 2, (1, 1), 1)
        plan = qf.plan_accumulation(8, int(w.abs().sum((1, 2, 3)).max()))
        with qf._tensor_core_gemms(plan):
            results = {way: _convolve(way, *conv) for way in WAYS}
            steps = {way: functools.partial(_convolve, way, *conv) for way in WAYS}
            times = measure(steps, args.iters, 3, torch.device(args.device))
        for way in WAYS:
            totals[way] += times[way] * 1e3
        equal = all(torch.equal(results["strided"], r) for r in results.values())
        picked = next(reversed(qf._IM2COL_CHOICES.values()))
        rows.append(
            [f"{c} -> {o}, {k}x{k} / {stride}, {size} px"]
            + [f"{times[way] * 1e3:.3f}" for way in WAYS]
            + [picked, equal]
        )
    rows.append(["sum"] + [f"{totals[way]:.2f}" for way in WAYS] + ["", ""])
    print(f"conv_as_gemm on {torch.cuda.get_device_name()}, batch {args.batch}, ms per convolution")
    print(
        tabulate(
            rows, headers=["convolution", "rows", "tiles", "strided", "timed", "picked", "equal"]
        )
    )


if __name__ == "__main__":
    main()
