"""Quickstart: the whole pipeline on a real task (scikit-learn's handwritten digits).

    python tutorials/quickstart.py            # full settings
    python tutorials/quickstart.py --fast     # small settings (what the tests run)

1. train a small CNN in float;
2. calibrate it with ``fxq.calibration.ptq`` (post-training quantization: ranges,
   then the weights' rounding learned block by block);
3. fine-tune with QAT, starting from the calibrated model's state;
4. convert to the integer model;

and print the accuracy of the float, calibrated, QAT (VALIDATION state) and
integer models side by side. The QAT model in VALIDATION state computes
exactly what the integer model computes, so the last two columns agree.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import fxq
from fxq.calibration import ptq
from fxq.qconfig import default_calib_8bit_fake_quant_qconfig, default_qat_8bit_fake_quant_qconfig


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
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.dequant(self.fc(torch.flatten(x, 1)))


def load_data():
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return (x[:1400], y[:1400]), (x[1400:], y[1400:])


def train(model: nn.Module, data, epochs: int, lr: float) -> None:
    x, y = data
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(epochs):
        model.train()
        for i in range(0, len(x), 64):
            opt.zero_grad()
            F.cross_entropy(model(x[i : i + 64]), y[i : i + 64]).backward()
            opt.step()


@torch.no_grad()
def accuracy(model: nn.Module, data) -> float:
    x, y = data
    model.eval()
    return (model(x).argmax(1) == y).float().mean().item() * 100


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description="fxq quickstart on scikit-learn digits")
    parser.add_argument("--fast", action="store_true", help="fewer epochs")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    train_set, test_set = load_data()
    epochs, qat_epochs = (4, 1) if args.fast else (10, 3)

    # 1. float training
    model = DigitsNet()
    train(model, train_set, epochs, lr=3e-3)

    # 2. post-training calibration (ptq: the recipe to start with), then VALIDATION rounds
    #    with the frozen scales
    fxq.set_march("bayes")
    calib = fxq.prepare_qat_fx(model, {"": default_calib_8bit_fake_quant_qconfig})
    batches = [train_set[0][i : i + 128] for i in range(0, 512, 128)]
    ptq(calib, batches, show_progress=False)
    fxq.set_fake_quantize(calib, fxq.FakeQuantState.VALIDATION)

    # 3. QAT: a fresh QAT model starts from the calibrated model (scales, dtypes, weights)
    qat = fxq.prepare_qat_fx(model, {"": default_qat_8bit_fake_quant_qconfig})
    qat.load_state_dict(calib.state_dict())
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.QAT)
    train(qat, train_set, qat_epochs, lr=1e-4)
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)

    # 4. the integer model: int8 weights and activations, fixed-point requantization
    integer = fxq.convert_fx(qat)

    results = {
        "float": accuracy(model, test_set),
        "calibrated": accuracy(calib, test_set),
        "qat": accuracy(qat, test_set),
        "integer": accuracy(integer, test_set),
    }
    print("accuracy on held-out digits (%):")
    for name, value in results.items():
        print(f"  {name:<11s}{value:6.2f}")
    return results


if __name__ == "__main__":
    main()
