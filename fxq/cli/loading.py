"""What ``fxq`` commands read: models (a Python factory or an ONNX file) and data (a
folder of images, a ``.npy`` / ``.npz`` file, or a Python factory of batches)."""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fxq.cli.errors import CliError
from fxq.utils.sample_data import IMAGENET_MEAN, IMAGENET_STD

__all__ = ["import_object", "load_model", "load_data", "IMAGE_SUFFIXES", "parse_json_kwargs"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp")


def import_object(spec: str, what: str) -> Any:
    """``package.module:name`` (``name`` may be dotted), imported; the current folder is
    importable, as it is for ``python -m``.

    Raises:
        CliError: a malformed spec, a module that cannot be imported, a missing name.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"{what} {spec!r} is neither a file nor a Python 'package.module:name'")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise CliError(f"cannot import {module_name!r} for {what} {spec!r}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise CliError(f"{what} {spec!r}: {obj.__name__!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


def parse_json_kwargs(text: str | None, flag: str) -> dict[str, Any]:
    """The keyword arguments a ``--model-kwargs '{"num_classes": 10}'`` flag holds."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise CliError(f"{flag}: not valid JSON ({e.msg} at column {e.colno}): {text}") from None
    if not isinstance(value, dict):
        raise CliError(f"{flag}: give a JSON object such as '{{\"num_classes\": 10}}', got {text}")
    return value


def _state_dict(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CliError(f"weights file {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CliError(f"cannot read weights file {path}: {type(e).__name__}: {e}") from None
    for key in ("state_dict", "model"):  # common checkpoint wrappers
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict):
        raise CliError(f"weights file {path} holds a {type(state).__name__}, not a state dict")
    return state


def load_model(
    spec: str, weights: str | None = None, model_kwargs: dict[str, Any] | None = None
) -> nn.Module:
    """The float model ``spec`` names, in eval mode.

    Args:
        spec: ``package.module:function`` (called with ``model_kwargs``; e.g.
            ``torchvision.models:mobilenet_v2``) or a ``.onnx`` file
            (``fxq.onnx_in.load_onnx``).
        weights: a state dict file loaded into the model (strictly).
        model_kwargs: keyword arguments of the factory.

    Raises:
        CliError: a missing file, an unimportable factory, a factory that fails or returns
            no ``nn.Module``, weights that do not fit.
    """
    if spec.endswith(".onnx"):
        if not Path(spec).is_file():
            raise CliError(f"model file {spec} does not exist")
        if weights or model_kwargs:
            raise CliError("--weights and --model-kwargs apply to Python factories, not ONNX files")
        try:
            from fxq.onnx_in import load_onnx
        except ImportError as e:
            raise CliError(f"reading ONNX models needs fxq.onnx_in: {e}") from None
        return load_onnx(spec).eval()
    factory = import_object(spec, "MODEL")
    if not callable(factory):
        raise CliError(f"MODEL {spec!r} is a {type(factory).__name__}, not a callable factory")
    try:
        model = factory(**(model_kwargs or {}))
    except Exception as e:
        raise CliError(f"MODEL {spec!r} failed: {type(e).__name__}: {e}") from None
    if not isinstance(model, nn.Module):
        raise CliError(f"MODEL {spec!r} returned a {type(model).__name__}, not a torch nn.Module")
    if weights is not None:
        result = model.load_state_dict(_state_dict(Path(weights)), strict=False)
        if result.missing_keys or result.unexpected_keys:
            parts = []
            for what, keys in (
                ("missing", result.missing_keys),
                ("unexpected", result.unexpected_keys),
            ):
                if keys:
                    more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
                    parts.append(f"{what} keys {', '.join(keys[:3])}{more}")
            raise CliError(
                f"weights file {weights} does not fit MODEL {spec!r}: {'; '.join(parts)}"
            )
    return model.eval()


# -- data ----------------------------------------------------------------------------------
def _image_batches(
    folder: Path, image_size: int, mean: Sequence[float], std: Sequence[float], batch_size: int
) -> list[torch.Tensor]:
    try:
        from PIL import Image
    except ImportError:
        raise CliError("reading a folder of images needs Pillow: pip install pillow") from None
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise CliError(f"no images in {folder} (looked for {', '.join(IMAGE_SUFFIXES)})")
    m = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
    images = []
    for f in files:
        try:
            with Image.open(f) as im:
                im = im.convert("RGB")
                w, h = im.size
                k = image_size / min(w, h)  # shorter side to image_size, then the centre
                im = im.resize(
                    (max(image_size, round(w * k)), max(image_size, round(h * k))), Image.BILINEAR
                )
                w, h = im.size
                left, top = (w - image_size) // 2, (h - image_size) // 2
                im = im.crop((left, top, left + image_size, top + image_size))
                pixels = np.asarray(im, dtype=np.float32) / 255.0
        except OSError as e:
            raise CliError(f"cannot read image {f}: {e}") from None
        images.append((torch.from_numpy(pixels).permute(2, 0, 1) - m) / s)
    x = torch.stack(images)
    return list(x.split(batch_size))


def _array_batches(path: Path, batch_size: int) -> list[Any]:
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise CliError(f"cannot read {path}: {e}") from None
    arrays = [loaded[k] for k in loaded.files] if path.suffix == ".npz" else [loaded]
    if not arrays or any(a.ndim == 0 for a in arrays):
        raise CliError(f"{path}: expected arrays whose first axis is the samples")
    n = len(arrays[0])
    if n == 0 or any(len(a) != n for a in arrays):
        raise CliError(f"{path}: the arrays must have the same, non-zero number of samples")
    tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    tensors = [t.float() if t.is_floating_point() else t for t in tensors]
    batches = [tuple(t[i : i + batch_size] for t in tensors) for i in range(0, n, batch_size)]
    return [b[0] if len(b) == 1 else b for b in batches]


def load_data(
    spec: str,
    batch_size: int = 8,
    image_size: int = 224,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    num_batches: int | None = None,
) -> list[Any]:
    """Calibration batches from ``spec``.

    Args:
        spec: a folder of images (resized so the shorter side is ``image_size``,
            centre-cropped, scaled to 0..1 and normalised with ``mean`` / ``std``),
            a ``.npy`` file (first axis: samples; one model input) or ``.npz`` (one
            array per model input, in the file's order), or ``package.module:function``
            returning an iterable of batches (``fxq.calibration.data``'s contract).
        batch_size: samples per batch (images and arrays).
        num_batches: keep only the first batches.

    Raises:
        CliError: a missing path, an unreadable file, no data.
    """
    path = Path(spec)
    if path.is_dir():
        batches = _image_batches(path, image_size, mean, std, batch_size)
    elif path.suffix in (".npy", ".npz"):
        if not path.is_file():
            raise CliError(f"calibration data {spec} does not exist")
        batches = _array_batches(path, batch_size)
    elif path.exists():
        raise CliError(f"calibration data {spec}: expected a folder of images, .npy or .npz")
    elif ":" in spec and not spec.startswith((".", "/")):
        factory = import_object(spec, "DATA")
        try:
            data = factory() if callable(factory) else factory
            batches = []
            for batch in data:
                if num_batches is not None and len(batches) >= num_batches:
                    break
                batches.append(batch)
        except Exception as e:
            raise CliError(f"DATA {spec!r} failed: {type(e).__name__}: {e}") from None
    else:
        raise CliError(f"calibration data {spec} does not exist")
    if num_batches is not None:
        batches = batches[:num_batches]
    if not batches:
        raise CliError(f"calibration data {spec} gave no batch")
    return batches
