"""Run time of ``fxq.debug.sensitivity`` on a pretrained MobileNetV2.

    OMP_NUM_THREADS=2 python benchmarks/sensitivity_speed.py             # 96 crops, batches of 16
    OMP_NUM_THREADS=2 python benchmarks/sensitivity_speed.py --batch 8 --crops 16

MobileNetV2 with its ImageNet weights, min/max calibration on 16 photo crops
(224x224), then ``sensitivity`` on ``--crops`` other crops split in batches of
``--batch``, once for every quantized value (``kinds=None``) and once for the
activations only (``kinds=("activation",)``). It prints the settings, the
number of quantized values, the time of one float forward of a batch (the
yardstick: the run times are about ``2 + V/2`` of them per batch), and for
each run the wall time and the process CPU time. The load average is printed
too: on a shared machine the wall time grows with it.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import fxq
from fxq.debug.sensitivity import quantized_values, sensitivity
from fxq.qconfig import default_calib_8bit_fake_quant_qconfig
from fxq.utils.sample_data import photo_crops, pretrained_mobilenet_v2


def timed(fn, *args, **kwargs):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - wall, time.process_time() - cpu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--crops", type=int, default=96, help="crops sensitivity runs on")
    parser.add_argument("--batch", type=int, default=16, help="crops per batch")
    parser.add_argument("--size", type=int, default=224, help="crop size in pixels")
    args = parser.parse_args(argv)

    fxq.set_march(fxq.March.BAYES)
    torch.manual_seed(0)
    model = pretrained_mobilenet_v2().eval()
    prepared = fxq.prepare_qat_fx(model, {"": default_calib_8bit_fake_quant_qconfig})
    fxq.calibration.calibrate(
        prepared, photo_crops(16, size=args.size, seed=0).split(16), show_progress=False
    )
    fxq.set_fake_quantize(prepared, "validation")
    data = list(photo_crops(args.crops, size=args.size, seed=2).split(args.batch))
    values = quantized_values(prepared)

    print(
        f"MobileNetV2, {args.crops} crops of {args.size}x{args.size} in {len(data)} batches of "
        f"{args.batch}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs"
    )
    print(
        f"quantized values: {len(values)} "
        f"({sum(v.kind == 'activation' for v in values)} activations, "
        f"{sum(v.kind == 'weight' for v in values)} weights, "
        f"{sum(v.kind.startswith('input') for v in values)} standalone inputs)"
    )
    with torch.no_grad():
        model(data[0])
        _, forward, _ = timed(model, data[0])
    print(f"one float forward of a batch: {forward:.2f} s")
    for kinds in (None, ("activation",)):
        load = os.getloadavg()[0]
        rows, wall, cpu = timed(sensitivity, model, prepared, data, kinds=kinds)
        print(
            f"sensitivity kinds={kinds}: {len(rows)} values, {wall:.1f} s wall, {cpu:.1f} s CPU "
            f"(load average {load:.1f} before, {os.getloadavg()[0]:.1f} after); "
            f"worst: {rows[0]['name']} {rows[0]['kind']} {rows[0]['sqnr']:.2f} dB"
        )


if __name__ == "__main__":
    main()
