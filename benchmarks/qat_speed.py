"""QAT training-step time of fxq and torch.ao, each divided by the float step.

All three models are built from the same float model and timed in the same
run, on the same inputs, alternating so that machine noise hits all alike:

    python benchmarks/qat_speed.py                    # resnet18 and mobilenet_v2
    python benchmarks/qat_speed.py --models resnet18 --batch 16 --size 160
    python benchmarks/qat_speed.py --device cuda --batch 64   # on a GPU
    python benchmarks/qat_speed.py --device cuda --batch 64 --profile   # + kernels per step
    python benchmarks/qat_speed.py --device cuda --profile --top 12     # + costliest kernels
    python benchmarks/qat_speed.py --compile          # + each model under torch.compile
    python benchmarks/qat_speed.py --device cuda --compile --compile-mode reduce-overhead

Prints one row per model and variant: ms per step, its ratio to the float step and to
torch.ao's step (compiled variants: to the compiled float and torch.ao steps). torch.ao:
prepare_qat_fx with the x86 default QAT qconfig mapping. On CUDA the row "fxq torch ops"
is the same fxq model with its fused fake-quant kernels off (``torch_ops_only``, as
``FXQ_TRITON=0``).
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
import warnings

import torch
import torchvision
from infer_speed import print_costliest  # benchmarks/ is on sys.path when run
from tabulate import tabulate

import fxq
from fxq.qconfig import default_qat_8bit_fake_quant_qconfig
from fxq.quantized import fake_quant_ops


def torch_ao_qat(model: torch.nn.Module, example: torch.Tensor) -> torch.nn.Module:
    from torch.ao.quantization import get_default_qat_qconfig_mapping
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return prepare_qat_fx(
            copy.deepcopy(model).train(), get_default_qat_qconfig_mapping("x86"), (example,)
        )


def fxq_qat(model: torch.nn.Module, example: torch.Tensor) -> torch.nn.Module:
    fxq.set_march("bayes")
    qat = fxq.prepare_qat_fx(model, {"": default_qat_8bit_fake_quant_qconfig}).train()
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.QAT)
    return qat


def step_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, graphs: bool = False):
    """One SGD step of ``model`` on ``(x, y)``. ``graphs``: the model was compiled with CUDA
    graphs (``mode="reduce-overhead"``), whose step boundary is marked."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()

    step.model = model
    return step


def require_gradients(name: str, model: torch.nn.Module) -> None:
    """Stop when the last step left a weight without gradient: a step that does not train
    is not a QAT step to time (torch 2.11 compiled fxq's steps with zero gradients until
    its fake quants computed out of place in a compiled graph, and timed them faster than
    the float step)."""
    dead = [
        k
        for k, p in model.named_parameters()
        if p.requires_grad and p.dim() > 1 and (p.grad is None or not bool(p.grad.any()))
    ]
    if dead:
        raise SystemExit(
            f"{name}: {len(dead)} weights got no gradient in a step (first: {dead[:3]}); "
            "its time would not be a training step's"
        )


def measure(
    steps: dict[str, callable], iters: int, warmup: int, device: torch.device
) -> dict[str, float]:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for name, step in steps.items():
        for _ in range(warmup):
            step()
        if warmup and hasattr(step, "model"):  # the warm-up's last step left its gradients
            require_gradients(name, step.model)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(iters):
        for name, step in steps.items():  # interleaved: noise hits every variant alike
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def profile_steps(
    steps: dict[str, callable], device: torch.device, top: int = 0
) -> list[list[str]]:
    """Per variant: ops (CPU) or kernels (CUDA) per step, their time, and the host's time
    to issue a step (a step whose host time exceeds its kernel time is launch-bound).
    Prints each variant's ``top`` costliest kernels (CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    rows = []
    for name, step in steps.items():
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(2):
            step()
        issue = (time.perf_counter() - t0) / 2  # before the sync: the host's own time
        if cuda:
            torch.cuda.synchronize(device)
        with profile(activities=activities) as prof:
            for _ in range(2):
                step()
            if cuda:
                torch.cuda.synchronize(device)
        if cuda:
            events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            busy = sum(e.device_time for e in events) / 2e3
            if top:
                print(f"{name}: costliest kernels per step")
                print_costliest(events, top, runs=2)
        else:  # aten ops not called by another aten op
            events = [
                e
                for e in prof.events()
                if e.name.startswith("aten::")
                and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
            ]
            busy = float("nan")
        rows.append([name, str(len(events) // 2), f"{busy:.1f}", f"{issue * 1e3:.1f}"])
    return rows


def _ratio(seconds: float, baseline: float) -> str:
    return "-" if math.isnan(baseline) else f"{seconds / baseline:.2f}x"


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU, {torch.get_num_threads()} threads"


def _unfused(step: callable) -> callable:
    """``step`` with fxq's fused fake-quant kernels off (``torch_ops_only``): the torch ops."""

    def run() -> None:
        with fake_quant_ops.torch_ops_only():
            step()

    run.model = step.model
    return run


def _variants(model, x, device, compile_mode: str | None) -> dict[str, torch.nn.Module]:
    """The float, fxq and torch.ao models on ``device``; with ``compile_mode`` (a
    ``torch.compile`` mode, "default" for none given) each also compiled."""
    variants = {
        "float": copy.deepcopy(model),
        "fxq": fxq_qat(model, x[:1]),
        "torch.ao": torch_ao_qat(model, x[:1]),
    }
    variants = {k: m.to(device) for k, m in variants.items()}
    if compile_mode is not None:
        mode = None if compile_mode == "default" else compile_mode
        for name in ("float", "fxq", "torch.ao"):
            variants[f"{name} compiled"] = torch.compile(variants[name], mode=mode)
    return variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (models prepared on the CPU)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print kernels (ops on the CPU) per step, their time and the host's issue time",
    )
    parser.add_argument(
        "--top",
        type=int,
        default=0,
        help="with --profile on CUDA: print each variant's N costliest kernels per step",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time each model under torch.compile (compiled once, in the warm-up)",
    )
    parser.add_argument(
        "--compile-mode",
        default="default",
        choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"],
        help="torch.compile's mode for --compile (reduce-overhead: CUDA graphs)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="VARIANT",
        help='time only these variants (e.g. float fxq "fxq compiled"; default: all)',
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows, profiles = [], []
    for name in args.models:
        model = getattr(torchvision.models, name)(num_classes=1000).train()
        x = torch.randn(args.batch, 3, args.size, args.size)
        y = torch.randint(0, 1000, (args.batch,))
        variants = _variants(model, x, device, args.compile_mode if args.compile else None)
        x, y = x.to(device), y.to(device)
        graphs = args.compile_mode == "reduce-overhead"
        steps = {
            k: step_fn(m, x, y, graphs=graphs and k.endswith("compiled"))
            for k, m in variants.items()
        }
        if device.type == "cuda":  # the same model without the fused kernels
            steps["fxq torch ops"] = _unfused(step_fn(variants["fxq"], x, y))
        if args.only:
            unknown = set(args.only) - set(steps)
            if unknown:
                parser.error(f"--only: no variant {sorted(unknown)}; there are {list(steps)}")
            steps = {k: v for k, v in steps.items() if k in args.only}
        t = measure(steps, args.iters, args.warmup + (2 if args.compile else 0), device)
        if args.profile:
            profiles.extend([[name, *row] for row in profile_steps(steps, device, args.top)])
        for variant, seconds in t.items():
            compiled = variant.endswith("compiled")
            float_ms = t.get("float compiled" if compiled else "float", float("nan"))
            ao_ms = t.get("torch.ao compiled" if compiled else "torch.ao", float("nan"))
            rows.append(
                [
                    name,
                    variant,
                    f"{seconds * 1e3:.1f}",
                    _ratio(seconds, float_ms),
                    _ratio(seconds, ao_ms),
                ]
            )
    mode = f", torch.compile mode {args.compile_mode}" if args.compile else ""
    print(
        f"QAT training step on {_describe(device)}, batch {args.batch}, {args.size}x{args.size}, "
        f"median of {args.iters}{mode}"
    )
    print(
        tabulate(
            rows,
            headers=["model", "variant", "ms / step", "/ float", "/ torch.ao"],
        )
    )
    if profiles:
        unit = "kernels" if device.type == "cuda" else "aten ops"
        print()
        print(
            tabulate(
                profiles,
                headers=["model", "variant", f"{unit} / step", "kernel ms / step", "host issue ms"],
            )
        )


if __name__ == "__main__":
    main()
