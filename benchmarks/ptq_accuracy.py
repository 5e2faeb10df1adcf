"""Post-training quantization accuracy on pretrained models and real photos.

    python benchmarks/ptq_accuracy.py                     # MobileNetV2 and EfficientNet-Lite0
    python benchmarks/ptq_accuracy.py --models mobilenet_v2 --calib 96 --eval 128

For each model, in one process and on the same data (calibration and
evaluation crops of the photographs shipped with scikit-image, with different
seeds), it prints for torch.ao's x86 default PTQ, a weight-only int8
reference, and fxq's observers (min_max, percentile, mse, kl, mix),
``auto_calibrate`` and ``weight_reconstruction``:

* SQNR of the logits against the float model (dB),
* top-1 agreement with the float model,
* top-1 agreement on the photos where the float model is confident (p > 0.5),
* calibration time.

fxq rows are measured on the converted integer model (bit-exact with the QAT
model in VALIDATION state).
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings
from collections.abc import Callable

import torch
from tabulate import tabulate
from torch import nn

import fxq
from fxq.calibration import auto_calibrate, calibrate, weight_reconstruction
from fxq.qconfig import get_default_qconfig
from fxq.utils.sample_data import imagenet_normalize, photo_crops, pretrained_mobilenet_v2


def load_model(name: str) -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """A pretrained model and the normalisation of RGB in [0, 1] it expects."""
    if name == "mobilenet_v2":
        return pretrained_mobilenet_v2(), imagenet_normalize
    if name == "efficientnet_lite0":
        from fxq.utils.efficientnet_lite import (
            efficientnet_lite0_normalize,
            pretrained_efficientnet_lite0,
        )

        return pretrained_efficientnet_lite0(), efficientnet_lite0_normalize
    raise ValueError(f"unknown model {name!r}")


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    noise = (ref.double() - out.double()).pow(2).mean()
    return float(10 * torch.log10(ref.double().pow(2).mean() / noise))


def torch_ao_int8(model: nn.Module, calib: list[torch.Tensor]) -> nn.Module:
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare_fx(
            copy.deepcopy(model).eval(), get_default_qconfig_mapping("x86"), (calib[0][:1],)
        )
        with torch.no_grad():
            for batch in calib:
                prepared(batch)
        return convert_fx(prepared)


def weight_only_int8(model: nn.Module) -> nn.Module:
    """Per-channel int8 weights (round half up), float activations: the reference ceiling."""
    out = copy.deepcopy(model)
    for m in out.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            with torch.no_grad():
                dims = tuple(range(1, m.weight.dim()))
                scale = (m.weight.abs().amax(dim=dims, keepdim=True) / 127).clamp(min=1e-12)
                m.weight.copy_(torch.floor(m.weight / scale + 0.5).clamp(-128, 127) * scale)
    return out


def fxq_method(model: nn.Module, calib: list[torch.Tensor], method: str, iters: int) -> nn.Module:
    fxq.set_march("bayes")
    observer = {
        "min_max": "min_max",
        "percentile": "percentile",
        "mse": "mse",
        "kl": "kl",
        "mix": "mix",
        "mean_min_max": "mean_min_max",
    }.get(method.split("+")[0], "min_max")
    prepared = fxq.prepare_qat_fx(model, {"": get_default_qconfig(activation_observer=observer)})
    if method == "auto_calibrate":
        auto_calibrate(prepared, calib, eval_batches=1, show=False, show_progress=False)
    else:
        calibrate(prepared, calib, show_progress=False)
    if method.endswith("+learned_rounding"):
        weight_reconstruction(prepared, calib, iters=iters, show=False, show_progress=False)
    fxq.set_fake_quantize(prepared, fxq.FakeQuantState.VALIDATION)
    return fxq.convert_fx(prepared)


def evaluate(
    quantized: nn.Module, held: torch.Tensor, ref: torch.Tensor, confident: torch.Tensor, batch: int
) -> tuple[float, float, str]:
    """SQNR (dB), top-1 agreement (%) and agreement where the float model is confident."""
    with torch.no_grad():
        out = torch.cat([quantized(b) for b in held.split(batch)])
    agree = out.argmax(1) == ref.argmax(1)
    sure = f"{100 * agree[confident].float().mean():.1f}" if confident.any() else "-"
    return sqnr(ref, out), 100 * float(agree.float().mean()), sure


METHODS = (
    "min_max",
    "mean_min_max",
    "percentile",
    "mse",
    "kl",
    "mix",
    "auto_calibrate",
    "percentile+learned_rounding",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mobilenet_v2", "efficientnet_lite0"])
    parser.add_argument("--calib", type=int, default=96, help="calibration crops")
    parser.add_argument("--eval", type=int, default=128, help="held-out evaluation crops")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument(
        "--iters", type=int, default=200, help="learned-rounding iterations per layer"
    )
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    args = parser.parse_args()
    torch.manual_seed(0)
    calib_rgb = photo_crops(args.calib, seed=0, normalize=False)
    eval_rgb = photo_crops(args.eval, seed=1, normalize=False)
    for name in args.models:
        model, normalize = load_model(name)
        calib = list(normalize(calib_rgb).split(args.batch))
        held = normalize(eval_rgb)
        with torch.no_grad():
            ref = model(held)
        confident = ref.softmax(1).amax(1) > 0.5
        rows: list[list[str]] = []

        def report(
            label: str,
            quantized: nn.Module,
            seconds: float,
            held=held,
            ref=ref,
            rows=rows,
            confident=confident,
        ) -> float:
            db, agree, sure = evaluate(quantized, held, ref, confident, args.batch)
            rows.append([label, f"{db:.2f}", f"{agree:.1f}", sure, f"{seconds:.1f}"])
            return db

        t0 = time.perf_counter()
        baseline = torch_ao_int8(model, calib)
        ao_db = report("torch.ao x86 default", baseline, time.perf_counter() - t0)
        ceiling = report("weight-only int8 (reference)", weight_only_int8(model), 0.0)
        results: dict[str, float] = {}
        for method in args.methods:
            t0 = time.perf_counter()
            quantized = fxq_method(model, calib, method, args.iters)
            results[method] = report(f"fxq {method}", quantized, time.perf_counter() - t0)
        print(
            f"\n{name}: {args.calib} calibration crops, {args.eval} held-out crops "
            f"({int(confident.sum())} where the float model is confident), {torch.get_num_threads()} threads"
        )
        print(
            tabulate(
                rows, headers=["method", "SQNR dB", "top-1 agree %", "confident agree %", "calib s"]
            )
        )
        if "min_max" in results:
            print(f"fxq default (min_max) vs torch.ao: {results['min_max'] - ao_db:+.2f} dB")
        best = max(results, key=results.get)
        print(
            f"best fxq ({best}) vs torch.ao: {results[best] - ao_db:+.2f} dB; "
            f"vs weight-only int8: {results[best] - ceiling:+.2f} dB"
        )


if __name__ == "__main__":
    main()
