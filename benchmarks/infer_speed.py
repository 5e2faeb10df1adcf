"""Inference time of fxq's integer model, divided by the float model's, with
torch.ao's int8 model beside it, measured in the same run on the same inputs.

    python benchmarks/infer_speed.py                 # resnet18, mobilenet_v2; batch 8, 224x224
    python benchmarks/infer_speed.py --models resnet18 --iters 20
    python benchmarks/infer_speed.py --device cuda --batch 64   # on a GPU (no torch.ao: CPU only)
    python benchmarks/infer_speed.py --device cuda --batch 64 --profile   # + kernels per forward
    python benchmarks/infer_speed.py --device cuda --batch 64 --graph     # + CUDA graph replays

The fxq model is bit-exact with its QAT model; torch.ao uses the x86 default
PTQ qconfig mapping (fbgemm / onednn kernels, rounding of its own).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch
import torchvision
from tabulate import tabulate

import fxq
from fxq.qconfig import default_calib_8bit_fake_quant_qconfig


def fxq_integer(model: torch.nn.Module, calib: torch.Tensor) -> torch.nn.Module:
    fxq.set_march("bayes")
    qat = fxq.prepare_qat_fx(model, {"": default_calib_8bit_fake_quant_qconfig}).eval()
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    with torch.no_grad():
        qat(calib)
    return fxq.convert_fx(qat)


def torch_ao_int8(model: torch.nn.Module, calib: torch.Tensor) -> torch.nn.Module:
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare_fx(
            copy.deepcopy(model).eval(), get_default_qconfig_mapping("x86"), (calib[:1],)
        )
        with torch.no_grad():
            prepared(calib)
        return convert_fx(prepared)


def measure(
    models: dict[str, torch.nn.Module], x: torch.Tensor, iters: int, warmup: int
) -> dict[str, float]:
    def sync() -> None:
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)

    with torch.no_grad():
        for m in models.values():
            for _ in range(warmup):
                m(x)
        times: dict[str, list[float]] = {k: [] for k in models}
        for _ in range(iters):
            for name, m in models.items():  # interleaved so that noise hits every model alike
                sync()
                t0 = time.perf_counter()
                m(x)
                sync()
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def kernel_profile(model: torch.nn.Module, x: torch.Tensor, top: int = 0) -> tuple[int, float]:
    """Device kernels per forward and their total time (ms); prints the ``top`` costliest."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        model(x)
        torch.cuda.synchronize(x.device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(x)
            torch.cuda.synchronize(x.device)
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    total = sum(e.device_time for e in kernels) / 1e3
    if top:
        print_costliest(kernels, top)
    return len(kernels), total


def print_costliest(kernels: list, top: int, runs: int = 1) -> None:
    """The ``top`` kernels (profiler events) with the most device time, per run of the ``runs``
    profiled: total ms, calls and name (``qat_speed.py`` uses it too)."""
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:90], []).append(e.device_time / 1e3 / runs)
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"  {sum(times):7.2f} ms  {len(times) / runs:6g}x  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--device", default="cpu", help="cpu or cuda (torch.ao's int8 runs on the CPU only)"
    )
    parser.add_argument(
        "--graph",
        action="store_true",
        help="on CUDA: also both models replayed as CUDA graphs (fxq.utils.cuda_graph)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="on CUDA: kernels per forward and their time, and fxq's costliest kernels",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    rows = []
    for name in args.models:
        model = getattr(torchvision.models, name)().eval()
        calib = torch.randn(8, 3, args.size, args.size)
        x = torch.randn(args.batch, 3, args.size, args.size)
        integer = fxq_integer(model, calib)
        variants = {"float": model, "fxq": integer}
        if device.type == "cpu":
            variants["torch.ao"] = torch_ao_int8(model, calib)
        else:  # the integer model on the GPU computes what it computes on the CPU
            with torch.no_grad():
                expected = integer(x[:4])
        variants = {k: m.to(device) for k, m in variants.items()}
        x = x.to(device)
        if args.graph and device.type == "cuda":
            from fxq.utils.cuda_graph import graphed

            variants["float graph"] = graphed(variants["float"], x)
            variants["fxq graph"] = graphed(variants["fxq"], x)
        t = measure(variants, x, args.iters, args.warmup)
        row = [
            name,
            f"{t['float'] * 1e3:.1f}",
            f"{t['fxq'] * 1e3:.1f}",
            f"{t['fxq'] / t['float']:.2f}x",
        ]
        if "fxq graph" in t:
            row[2] += f" (graph {t['fxq graph'] * 1e3:.1f})"
            row[3] += (
                f" (graphs: {t['fxq graph'] / t['float graph']:.2f}x;"
                f" fxq graph / float eager {t['fxq graph'] / t['float']:.2f}x)"
            )
            row[1] += f" (graph {t['float graph'] * 1e3:.1f})"
        if "torch.ao" in t:
            row += [f"{t['torch.ao'] * 1e3:.1f}", f"{t['torch.ao'] / t['float']:.2f}x"]
        else:
            with torch.no_grad():
                exact = torch.equal(integer(x[:4]).cpu(), expected)
            row += [f"bit-exact with the CPU: {exact}", ""]
        if args.profile and device.type == "cuda":
            print(f"{name}: fxq's costliest kernels per forward")
            for variant in ("float", "fxq"):
                count, ms = kernel_profile(variants[variant], x, top=8 if variant == "fxq" else 0)
                row.append(f"{variant}: {count} kernels, {ms:.1f} ms")
        rows.append(row)
    print(
        f"inference on {args.device}, batch {args.batch}, {args.size}x{args.size}, "
        f"{torch.get_num_threads()} threads, "
        f"median of {args.iters}"
    )
    print(
        tabulate(
            rows,
            headers=[
                "model",
                "float ms",
                "fxq int ms",
                "fxq/float",
                "torch.ao int8 ms",
                "torch.ao/float",
                *(["float kernels", "fxq kernels"] if args.profile else []),
            ],
        )
    )


if __name__ == "__main__":
    main()
