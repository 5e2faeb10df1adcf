"""Speed of the exported model, each as a ratio to the float torch model, in one run:
float torch, fxq's integer model, onnxruntime on the integer ONNX, onnxruntime on the QDQ
ONNX, and the numpy reference runtime of the integer graph; plus the file sizes of the
three formats.

    python benchmarks/export_speed.py                      # resnet18, mobilenet_v2; batch 8, 224x224
    python benchmarks/export_speed.py --models mobilenet_v2 --size 112 --iters 3

Every exported integer model is checked bit-exact against fxq's integer model first.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
import torchvision
from tabulate import tabulate

import fxq
import fxq.export
from fxq.export.onnx import graph_to_onnx
from fxq.qconfig import default_calib_8bit_fake_quant_qconfig


def fxq_integer(model: torch.nn.Module, calib: torch.Tensor) -> torch.nn.Module:
    fxq.set_march("bayes")
    qat = fxq.prepare_qat_fx(model, {"": default_calib_8bit_fake_quant_qconfig}).eval()
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    with torch.no_grad():
        qat(calib)
    return fxq.convert_fx(qat)


def median_times(fns: dict[str, Callable[[], object]], iters: int, warmup: int) -> dict[str, float]:
    """Median wall time of each callable, measured interleaved (load changes hit all alike)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(iters):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def bench(name: str, args: argparse.Namespace, tmp: Path) -> tuple[list[str], list[str]]:
    """One model: (time ratios row, file sizes row)."""
    model = getattr(torchvision.models, name)().eval()
    calib = torch.randn(8, 3, args.size, args.size)
    x = torch.randn(args.batch, 3, args.size, args.size)
    integer = fxq_integer(model, calib)
    graph = fxq.export.to_graph(integer, x[:2])
    graph.save(tmp / f"{name}.fxq")
    graph_to_onnx(graph, tmp / f"{name}.onnx")
    graph_to_onnx(graph, tmp / f"{name}_qdq.onnx", mode="qdq")
    options = ort.SessionOptions()
    options.log_severity_level = 3
    sessions = {
        k: ort.InferenceSession(
            str(tmp / f"{name}{k}.onnx"), options, providers=["CPUExecutionProvider"]
        )
        for k in ("", "_qdq")
    }
    xn = x.numpy()
    inp = graph.inputs[0]
    with torch.no_grad():
        expected = integer(x).numpy()
    assert np.array_equal(sessions[""].run(None, {inp: xn})[0], expected)
    with torch.no_grad():
        t = median_times(
            {
                "float": lambda: model(x),
                "fxq": lambda: integer(x),
                "ort": lambda: sessions[""].run(None, {inp: xn}),
                "qdq": lambda: sessions["_qdq"].run(None, {inp: xn}),
            },
            args.iters,
            args.warmup,
        )
    out: list[np.ndarray] = []
    t0 = time.perf_counter()
    for _ in range(args.numpy_iters):
        out.append(graph.run(xn)[0])
    t["numpy"] = (time.perf_counter() - t0) / args.numpy_iters
    assert np.array_equal(out[-1], expected)
    row = [name, f"{t['float'] * 1e3:.0f}"] + [
        f"{t[k] / t['float']:.2f}x" for k in ("fxq", "ort", "qdq", "numpy")
    ]
    size_row = [name] + [
        f"{(tmp / f).stat().st_size / 2**20:.2f}"
        for f in (f"{name}.fxq", f"{name}.onnx", f"{name}_qdq.onnx")
    ]
    return row, size_row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--numpy-iters", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows, sizes = [], []
    tmp = Path(tempfile.mkdtemp())
    for name in args.models:
        row, size_row = bench(name, args, tmp)
        rows.append(row)
        sizes.append(size_row)
    print(
        f"batch {args.batch}, {args.size}x{args.size}, {torch.get_num_threads()} torch threads, "
        f"median of {args.iters} interleaved (numpy: mean of {args.numpy_iters}); integer ONNX and numpy checked "
        "bit-exact against the fxq integer model"
    )
    print(
        tabulate(
            rows,
            headers=[
                "model",
                "float ms",
                "fxq int / float",
                "ORT int ONNX / float",
                "ORT QDQ / float",
                "numpy ref / float",
            ],
        )
    )
    print()
    print(tabulate(sizes, headers=["model", ".fxq MiB", "integer .onnx MiB", "QDQ .onnx MiB"]))


if __name__ == "__main__":
    main()
