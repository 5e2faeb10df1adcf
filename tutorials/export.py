"""Export: the integer model leaves Python three ways, and each computes what fxq computes.

    python tutorials/export.py            # full settings
    python tutorials/export.py --fast     # small settings (what the tests run)

1. train a small CNN on scikit-learn's handwritten digits, calibrate it, convert it;
2. export it as fxq's integer graph (``.fxq``: JSON + ``.npy``), as integer ONNX and as
   QDQ ONNX (``docs/integer_graph.md``);
3. run the integer graph with its numpy reference runtime (no torch), both ONNX files with
   onnxruntime, and compare every output with the integer model.

The integer graph and the integer ONNX equal the integer model bit for bit; the QDQ ONNX
(what other accelerator compilers ingest) rounds differently and is a few LSB away.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import fxq
import fxq.export
from fxq.qconfig import default_calib_8bit_fake_quant_qconfig


class DigitsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = fxq.QuantStub()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32 * 2 * 2, 10)
        self.dequant = fxq.DeQuantStub()

    def forward(self, x):
        x = self.quant(x)
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.hardswish(self.bn2(self.conv2(x)))
        x = F.avg_pool2d(x, 2)
        return self.dequant(self.fc(torch.flatten(x, 1)))


def load_data() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return (x[:1400], y[:1400]), (x[1400:], y[1400:])


def train(model: nn.Module, data, epochs: int) -> None:
    x, y = data
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(epochs):
        model.train()
        for i in range(0, len(x), 64):
            opt.zero_grad()
            F.cross_entropy(model(x[i : i + 64]), y[i : i + 64]).backward()
            opt.step()


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description="fxq export tutorial on scikit-learn digits")
    parser.add_argument("--fast", action="store_true", help="fewer epochs")
    parser.add_argument("--out", default=None, help="directory for the exported files")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    train_set, (x_test, y_test) = load_data()

    # 1. a float model, calibrated and converted to the integer model
    model = DigitsNet()
    train(model, train_set, 3 if args.fast else 10)
    model.eval()
    fxq.set_march("bayes")
    qat = fxq.prepare_qat_fx(model, {"": default_calib_8bit_fake_quant_qconfig})
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    with torch.no_grad():
        qat(train_set[0][:512])
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
    integer = fxq.convert_fx(qat)
    with torch.no_grad():
        expected = integer(x_test).numpy()

    # 2. export: the integer graph and two ONNX files (dimension 0 is a dynamic batch)
    out = Path(args.out or tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)  # --out may name a folder that does not exist yet
    example = x_test[:2]
    graph = fxq.export.to_graph(integer, example)
    graph.save(out / "digits.fxq")
    fxq.export.to_onnx(integer, example, out / "digits.onnx", input_names=["image"])
    fxq.export.to_onnx(integer, example, out / "digits_qdq.onnx", mode="qdq")
    graph.print_tabular()

    # 3. run each: numpy (no torch needed), onnxruntime
    import onnxruntime as ort

    x = x_test.numpy()
    outputs = {"integer graph (numpy)": fxq.export.load(out / "digits.fxq").run(x)[0]}
    for name, file in (("integer ONNX", "digits.onnx"), ("QDQ ONNX", "digits_qdq.onnx")):
        session = ort.InferenceSession(str(out / file), providers=["CPUExecutionProvider"])
        outputs[f"{name} (onnxruntime)"] = session.run(None, {session.get_inputs()[0].name: x})[0]

    lsb = graph.nodes[-1].attrs["scale"]  # the scale of the logits
    accuracy = (expected.argmax(1) == y_test.numpy()).mean() * 100
    print(f"\nfxq integer model: accuracy {accuracy:.2f}% on {len(x)} held-out digits")
    print(f"{'format':<32s}{'file KiB':>9s}{'bit-exact':>11s}{'max LSB':>9s}{'same class':>12s}")
    results = {"integer accuracy": float(accuracy)}
    files = {
        "integer graph": "digits.fxq",
        "integer ONNX": "digits.onnx",
        "QDQ ONNX": "digits_qdq.onnx",
    }
    for name, y in outputs.items():
        exact = bool(np.array_equal(y, expected))
        max_lsb = float(np.abs(y - expected).max() / lsb)
        same = float((y.argmax(1) == expected.argmax(1)).mean() * 100)
        size = (out / files[name.split(" (")[0]]).stat().st_size / 1024
        print(f"{name:<32s}{size:9.1f}{str(exact):>11s}{max_lsb:9.1f}{same:11.1f}%")
        results[f"{name} exact"] = exact
        results[f"{name} max LSB"] = max_lsb
        results[f"{name} same class"] = same
    return results


if __name__ == "__main__":
    main()
