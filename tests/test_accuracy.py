"""Accuracy on real data: a pretrained ImageNet model on real photos, and QAT on a real task."""

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import fxq
from fxq.qconfig import default_calib_8bit_fake_quant_qconfig, default_qat_8bit_fake_quant_qconfig
from fxq.utils.sample_data import photo_crops, pretrained_mobilenet_v2
from tests.helpers import calibrate, sqnr


def test_pretrained_mobilenet_v2_calibration_on_real_photos(bayes):
    model = pretrained_mobilenet_v2()
    calib = photo_crops(32, seed=0)
    held_out = photo_crops(32, seed=1)
    prepared = fxq.prepare_qat_fx(model, {"": default_calib_8bit_fake_quant_qconfig})
    calibrate(prepared, calib.split(16))
    fxq.set_fake_quantize(prepared, "validation")
    with torch.no_grad():
        ref = model(held_out)
        qat_out = prepared(held_out)
        integer = fxq.convert_fx(prepared)(held_out)
    agreement = (ref.argmax(1) == integer.argmax(1)).float().mean().item()
    # min/max calibration, symmetric int8 (measured here: 9.98 dB, 69% top-1 agreement)
    assert sqnr(ref, integer) > 9.0
    assert agreement >= 0.59
    # the integer model and the QAT model in VALIDATION agree: same SQNR (bit for bit, in fact)
    assert abs(sqnr(ref, integer) - sqnr(ref, qat_out)) < 0.1
    assert torch.equal(integer, qat_out)


class DigitsNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 16, 3, padding=1)
        self.b1 = nn.BatchNorm2d(16)
        self.c2 = nn.Conv2d(16, 32, 3, padding=1)
        self.b2 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32 * 2 * 2, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.b1(self.c1(x))), 2)
        x = F.max_pool2d(F.relu(self.b2(self.c2(x))), 2)
        return self.fc(torch.flatten(x, 1))


def _train(model, x, y, epochs, lr):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(epochs):
        model.train()
        for i in range(0, len(x), 64):
            opt.zero_grad()
            F.cross_entropy(model(x[i : i + 64]), y[i : i + 64]).backward()
            opt.step()


def _accuracy(model, x, y) -> float:
    model.eval()
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item() * 100


def test_qat_on_digits_reaches_float_accuracy(bayes):
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]

    model = DigitsNet()
    _train(model, x_train, y_train, epochs=8, lr=3e-3)
    float_acc = _accuracy(model, x_test, y_test)
    assert float_acc > 95.0

    qat = fxq.prepare_qat_fx(model, {"": default_qat_8bit_fake_quant_qconfig})
    calibrate(qat, [x_train[:256]])
    fxq.set_fake_quantize(qat, "qat")
    _train(qat, x_train, y_train, epochs=2, lr=1e-4)
    fxq.set_fake_quantize(qat, "validation")
    qat_acc = _accuracy(qat, x_test, y_test)
    assert qat_acc >= float_acc - 1.0
