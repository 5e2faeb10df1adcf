"""YUV deployment: train on RGB, deploy on a camera that delivers centered YUV.

    python tutorials/yuv_deployment.py            # full settings
    python tutorials/yuv_deployment.py --fast     # small settings (what the tests run)

The camera's image pipeline hands the accelerator centered YUV444 (BT.601,
values -128..127); the model is trained on normalised RGB. The task is real:
recognise which of the photographs shipped with scikit-image a 32x32 crop was
taken from (colour matters: several photos are grey).

1. train a small CNN in float on RGB; half the batches first go through the
   camera's YUV rounding (``rgb2centered_yuv`` and back), so the model does not
   depend on colour detail the camera drops;
2. calibrate, fine-tune with QAT, convert;
3. insert ``centered_yuv2rgb`` after the quantize stub (``fxq.deploy.yuv_input``):
   integer YUV -> RGB -> normalisation -> requantization, all in integer
   arithmetic;
4. feed the integer model the camera's YUV of held-out crops
   (``rgb2centered_yuv``) and compare with the QAT model on the RGB crops.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import fxq
from fxq.functional import centered_yuv2rgb, rgb2centered_yuv
from fxq.qconfig import default_calib_8bit_fake_quant_qconfig, default_qat_8bit_fake_quant_qconfig
from fxq.utils.sample_data import PHOTOS, photo_crops

MEAN, STD = 128.0, 64.0  # normalisation of RGB in 0..255
SWING = "full"


class PhotoNet(nn.Module):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.quant = fxq.QuantStub()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        )  # fmt: skip
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, classes)
        self.dequant = fxq.DeQuantStub()

    def forward(self, x):
        x = self.features(self.quant(x))
        return self.dequant(self.fc(torch.flatten(self.pool(x), 1)))


def photo_dataset(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RGB crops in 0..255 and the index of the photo each comes from."""
    return photo_crops(n, size=32, seed=seed, normalize=False, min_scale=0.1) * 255.0, torch.arange(
        n
    ) % len(PHOTOS)


def normalize(rgb255: torch.Tensor) -> torch.Tensor:
    return (rgb255 - MEAN) / STD


def camera_round_trip(rgb255: torch.Tensor) -> torch.Tensor:
    """RGB after the camera's YUV rounding (exact inverse conversion, RGB rounded to integers)."""
    yuv = rgb2centered_yuv(rgb255, SWING)
    return centered_yuv2rgb(yuv, SWING, mean=128.0, std=1.0, q_scale=1.0) + 128.0


def train(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, epochs: int, lr: float
) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for epoch in range(epochs):
        model.train()
        perm = torch.randperm(len(images), generator=torch.Generator().manual_seed(epoch))
        for i in range(0, len(images), 32):
            idx = perm[i : i + 32]
            x = images[idx]
            if (i // 32) % 2:
                x = camera_round_trip(x)
            opt.zero_grad()
            F.cross_entropy(model(normalize(x)), labels[idx]).backward()
            opt.step()


@torch.no_grad()
def predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    return model(x).argmax(1)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description="fxq YUV deployment tutorial")
    parser.add_argument("--fast", action="store_true", help="fewer images and epochs")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    fxq.set_march("bayes")  # the target: its rounding also applies to the camera colour ops
    n_train, epochs, qat_epochs = (680, 6, 1) if args.fast else (2040, 12, 2)
    train_rgb, train_labels = photo_dataset(n_train, seed=0)
    test_rgb, test_labels = photo_dataset(340, seed=1)

    # 1. float training on RGB
    model = PhotoNet(len(PHOTOS))
    train(model, train_rgb, train_labels, epochs, lr=3e-3)

    # 2. calibrate, QAT, convert
    calib = fxq.prepare_qat_fx(model, {"": default_calib_8bit_fake_quant_qconfig})
    fxq.set_fake_quantize(calib, fxq.FakeQuantState.CALIBRATION)
    calib.eval()
    with torch.no_grad():
        calib(normalize(train_rgb[:256]))
    qat = fxq.prepare_qat_fx(model, {"": default_qat_8bit_fake_quant_qconfig})
    qat.load_state_dict(calib.state_dict())
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.QAT)
    train(qat, train_rgb, train_labels, qat_epochs, lr=1e-4)
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
    integer = fxq.convert_fx(qat)

    # 3. camera input: centered YUV into the integer model
    stub_scale = integer.quant.scale.item()
    fxq.deploy.yuv_input(integer, "quant", swing=SWING, mean=MEAN, std=STD)
    print(
        f"inserted centered_yuv2rgb(swing={SWING!r}) after 'quant', q_scale={stub_scale:.6g}; quant.scale is now 1.0"
    )
    if not args.fast:
        integer.graph.print_tabular()

    # 4. the camera's view of held-out crops
    camera_yuv = rgb2centered_yuv(test_rgb, SWING)
    float_pred = predict(model, normalize(test_rgb))
    qat_pred = predict(qat, normalize(test_rgb))
    integer_pred = predict(integer, camera_yuv)
    results = {
        "float (RGB) accuracy": (float_pred == test_labels).float().mean().item() * 100,
        "QAT (RGB) accuracy": (qat_pred == test_labels).float().mean().item() * 100,
        "integer (YUV) accuracy": (integer_pred == test_labels).float().mean().item() * 100,
        "integer (YUV) = QAT (RGB)": (integer_pred == qat_pred).float().mean().item() * 100,
    }
    print(f"{len(test_rgb)} held-out crops, {len(PHOTOS)} photos (%):")
    for name, value in results.items():
        print(f"  {name:<28s}{value:6.1f}")
    return results


if __name__ == "__main__":
    main()
