"""Post-training quantization accuracy on pretrained models and real photos, against peers.

    python benchmarks/ptq_accuracy.py                     # MobileNetV2 and EfficientNet-Lite0
    python benchmarks/ptq_accuracy.py --models mobilenet_v2 --calib 96 --eval 140
    python benchmarks/ptq_accuracy.py --methods default best --peers nncf --markdown out.md
    python benchmarks/ptq_accuracy.py --device cuda --peers   # fxq on a GPU, no peers

For each model, in one process and on the same data (calibration and
evaluation crops of the photographs shipped with scikit-image, with different
seeds), it measures

* peers (each skipped with a printed note when its package is missing; they
  are in the ``bench`` extra): NNCF's ``nncf.quantize`` default, and the same
  model with every activation quantizer forced signed after the fact, scales
  kept (fxq's marches have signed activations only); torchao's PT2E ``X86InductorQuantizer`` (torch.ao's PT2E
  when torchao is absent); torch.ao's FX x86 default; a weight-only int8
  reference;
* fxq: ``ptq`` (``default`` and ``best``), the observers alone
  (``min_max``, the qconfig default, ``mean_min_max``, ``percentile``, ``mse``,
  ``kl``, ``mix``), ``auto_calibrate``, ``percentile+learned_rounding``, and
  int16 mixed precision (``mixed_int16``: ``mixed_precision`` with a 10% budget
  on a model calibrated by ``ptq`` default without its learned rounding
  (``iters=0``), then ``ptq`` default; ``mixed_int16+best``: ranked with float
  weights (``float_weights=True``), then ``ptq`` best; ``mixed_int16_bytes+best``:
  the same with the budget counted in activation bytes (``budget_unit="bytes"``);
  ``mixed_int16+tuned``: the same int16 choice, then ``ptq`` best learning the
  rounding longer with float activations and tuning the biases
  (``MIXED_TUNED``); their time includes the sensitivity);

and reports the SQNR of the logits against the float model (dB), top-1
agreement with the float model, agreement where the float model is confident
(p > 0.5), and the calibration time. fxq rows are measured on the converted
integer model (bit-exact with the QAT model in VALIDATION state), march bayes.
With ``--device cuda`` the fxq methods calibrate and run on the GPU (the peers
and the reference stay on the CPU).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import time
import warnings
from collections.abc import Callable

import torch
from tabulate import tabulate
from torch import nn

import fxq
from fxq.calibration import (
    auto_calibrate,
    calibrate,
    mixed_precision,
    ptq,
    weight_reconstruction,
)
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


def pt2e_x86(model: nn.Module, calib: list[torch.Tensor]) -> nn.Module:
    """PT2E with the X86Inductor quantizer's default config (torchao's, else torch.ao's)."""
    if importlib.util.find_spec("torchao") is not None:
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
        from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as xiq
    else:
        from torch.ao.quantization.quantize_pt2e import convert_pt2e, prepare_pt2e
        from torch.ao.quantization.quantizer import x86_inductor_quantizer as xiq
    quantizer = xiq.X86InductorQuantizer().set_global(
        xiq.get_default_x86_inductor_quantization_config()
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = torch.export.export(copy.deepcopy(model).eval(), (calib[0],)).module()
        prepared = prepare_pt2e(exported, quantizer)
        with torch.no_grad():
            for batch in calib:
                prepared(batch)
        return _FixedBatch(convert_pt2e(prepared), calib[0].shape[0])


class _FixedBatch(nn.Module):
    """Runs a model exported for batches of ``size`` on smaller batches (zero padding)."""

    def __init__(self, model: nn.Module, size: int) -> None:
        super().__init__()
        self.model, self.size = model, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if n == self.size:
            return self.model(x)
        padded = torch.cat([x, x.new_zeros((self.size - n, *x.shape[1:]))])
        return self.model(padded)[:n]


def nncf_int8(model: nn.Module, calib: list[torch.Tensor], signed: bool) -> nn.Module:
    """``nncf.quantize`` with its defaults, fed one image at a time (its range estimator is a
    mean over samples); ``signed`` then forces every per-tensor (activation) quantizer signed,
    keeping its scale: fxq's marches have signed activations only (NNCF's own
    ``signedness_to_force`` conflicts with its default hardware config)."""
    os.environ.setdefault("NNCF_EXTENSION_LOAD_TIMEOUT", "0")  # slow builds on a busy machine
    import nncf

    images = [image[None] for batch in calib for image in batch]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = nncf.quantize(
            copy.deepcopy(model).eval(), nncf.Dataset(images), subset_size=len(images)
        )
    if signed:
        for m in quantized.modules():
            if type(m).__name__ == "SymmetricQuantizer" and not m.per_channel:
                m.signed = True
    return quantized


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


# the int16 recipe that reaches 25 dB on MobileNetV2 (docs/accuracy_log.md, fourteenth session):
# the rounding learned longer with the activations float, then the biases tuned on the output
MIXED_TUNED = {"float_activations": True, "iters": 120, "lr": 0.1, "tune_biases": 8}

OBSERVER_METHODS = ("min_max", "mean_min_max", "percentile", "mse", "kl", "mix")


def fxq_method(model: nn.Module, calib: list[torch.Tensor], method: str, iters: int) -> nn.Module:
    fxq.set_march("bayes")
    base = method.split("+")[0]
    observer = base if base in OBSERVER_METHODS else "min_max"
    qconfig_dict = {"": get_default_qconfig(activation_observer=observer)}
    if method.startswith("mixed_int16"):
        # ranked on the default's ranges without its learned rounding (iters=0), which
        # writes the rounded weights into the float ones (float_weights would not see float),
        # and on the signed grid (offset=False): the ranking made with the unsigned ReLU
        # outputs chose worse on MobileNetV2 (22.30 against 23.21 dB; Lite0 26.00 / 25.43)
        prepared = ptq(
            fxq.prepare_qat_fx(model, qconfig_dict),
            calib,
            iters=0,
            offset=False,
            show_progress=False,
        )
        sample = [torch.cat(calib)[::3]]  # a third of the crops rank the activations
        qconfig_dict = mixed_precision(
            model,
            prepared,
            sample,
            int16_budget=0.1,
            float_weights=method.endswith(("best", "tuned")),
            budget_unit="bytes" if method.startswith("mixed_int16_bytes") else "tensors",
        )
    prepared = fxq.prepare_qat_fx(model, qconfig_dict)
    if method == "mixed_int16+tuned":
        ptq(prepared, calib, method="best", show_progress=False, **MIXED_TUNED)
    elif method in ("default", "best") or method.startswith("mixed_int16"):
        recipe = "best" if method.endswith("best") else "default"
        ptq(prepared, calib, method=recipe, show_progress=False)
    elif method == "auto_calibrate":
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
    device = next(iter(quantized.buffers())).device
    with torch.no_grad():
        out = torch.cat([quantized(b.to(device)).cpu() for b in held.split(batch)])
    agree = out.argmax(1) == ref.argmax(1)
    sure = f"{100 * agree[confident].float().mean():.1f}" if confident.any() else "-"
    return sqnr(ref, out), 100 * float(agree.float().mean()), sure


METHODS = (
    "default",
    "best",
    "mixed_int16",
    "mixed_int16+best",
    "mixed_int16+tuned",
    "mixed_int16_bytes+best",
    "min_max",
    "mean_min_max",
    "percentile",
    "mse",
    "kl",
    "mix",
    "auto_calibrate",
    "percentile+learned_rounding",
)
LABELS = {
    "default": "fxq ptq default",
    "best": "fxq ptq best",
    "mixed_int16": "fxq mixed precision (10% int16)",
    "mixed_int16+best": "fxq mixed precision (10% int16) + ptq best",
    "mixed_int16+tuned": "fxq mixed precision (10% int16) + ptq best, float-activation "
    "rounding (120 steps) + bias tuning (8 epochs)",
    "mixed_int16_bytes+best": "fxq mixed precision (10% of activation bytes int16) + ptq best",
    "min_max": "fxq min_max (qconfig default, calibrate)",
}
PEERS = {
    "nncf": ("NNCF default", "nncf", lambda m, c: nncf_int8(m, c, signed=False)),
    "nncf_signed": ("NNCF, signed activations", "nncf", lambda m, c: nncf_int8(m, c, signed=True)),
    "pt2e": ("PT2E X86InductorQuantizer", None, pt2e_x86),
    "torch_ao": ("torch.ao FX x86 default", None, torch_ao_int8),
}

PHOTO_SETS = {
    "benchmark": "scikit-image's (the settings were chosen on these)",
    "held_out": "held out (scikit-learn's and matplotlib's; no setting was chosen on these)",
}


def measure(
    args: argparse.Namespace,
    name: str,
    model: nn.Module,
    calib: list[torch.Tensor],
    held: torch.Tensor,
    device: torch.device,
    sync: Callable[[], float],
) -> tuple[str, list[list[str]]]:
    """Every peer and fxq method on one model and one set of crops: a title and table rows."""
    with torch.no_grad():
        ref = model(held)
    confident = ref.softmax(1).amax(1) > 0.5
    rows: list[list[str]] = []

    def report(label: str, quantized: nn.Module, seconds: float | None) -> None:
        db, agree, sure = evaluate(quantized, held, ref, confident, args.batch)
        secs = "-" if seconds is None else f"{seconds:.1f}"
        rows.append([label, f"{db:.2f}", f"{agree:.1f}", sure, secs])
        print(f"  {name}: {label}: {db:.2f} dB, {secs} s", flush=True)

    for key in args.peers:
        label, package, build = PEERS[key]
        if package is not None and importlib.util.find_spec(package) is None:
            print(
                f"  {name}: {label} skipped: `{package}` is not installed (pip install "
                "-e .[bench] -c constraints.txt)"
            )
            continue
        t0 = time.perf_counter()
        try:
            quantized = build(model, calib)
        except Exception as e:  # a peer that cannot take the model is reported, not fatal
            print(f"  {name}: {label} failed: {type(e).__name__}: {e}")
            continue
        report(label, quantized, time.perf_counter() - t0)
    report("weight-only int8 (reference)", weight_only_int8(model), None)
    on_device = copy.deepcopy(model).to(device)
    device_calib = [b.to(device) for b in calib]
    for method in args.methods:
        t0 = sync()
        quantized = fxq_method(on_device, device_calib, method, args.iters)
        report(LABELS.get(method, f"fxq {method}"), quantized, sync() - t0)
    title = (
        f"{name}: {args.calib} calibration crops, {args.eval} held-out crops "
        f"({int(confident.sum())} where the float model is confident), "
        f"{torch.get_num_threads()} threads"
        + (f", fxq on {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "")
    )
    return title, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mobilenet_v2", "efficientnet_lite0"])
    parser.add_argument("--calib", type=int, default=96, help="calibration crops")
    parser.add_argument("--eval", type=int, default=140, help="held-out evaluation crops")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument(
        "--iters", type=int, default=200, help="learned-rounding iterations per layer"
    )
    parser.add_argument("--methods", nargs="*", default=list(METHODS))
    parser.add_argument("--peers", nargs="*", default=list(PEERS))
    parser.add_argument("--markdown", help="also write the tables as markdown to this file")
    parser.add_argument("--device", default="cpu", help="where fxq calibrates: cpu or cuda")
    parser.add_argument(
        "--photos",
        nargs="+",
        default=list(PHOTO_SETS),
        choices=list(PHOTO_SETS),
        help="which photographs the crops come from (calibration and evaluation alike)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)

    def sync() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    markdown: list[str] = []
    crops = {  # RGB in [0, 1], calibration and evaluation, for every model
        photos: (
            photo_crops(args.calib, seed=0, normalize=False, photos=photos),
            photo_crops(args.eval, seed=1, normalize=False, photos=photos),
        )
        for photos in args.photos
    }
    for name in args.models:
        model, normalize = load_model(name)
        for photos in args.photos:
            torch.manual_seed(0)
            calib_rgb, eval_rgb = crops[photos]
            calib = list(normalize(calib_rgb).split(args.batch))
            held = normalize(eval_rgb)
            title, rows = measure(args, name, model, calib, held, device, sync)
            title += f", photos: {PHOTO_SETS[photos]}"
            headers = ["method", "SQNR dB", "top-1 agree %", "confident agree %", "calib s"]
            print(f"\n{title}")
            print(tabulate(rows, headers=headers))
            markdown += [f"### {title}", "", tabulate(rows, headers=headers, tablefmt="github"), ""]
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(markdown))


if __name__ == "__main__":
    main()
