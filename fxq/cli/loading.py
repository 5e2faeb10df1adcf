"""What ``fxq`` commands read: models (a Python factory or an ONNX file) and data (a
folder of images, a ``.npy`` / ``.npz`` file, or a Python factory of batches)."""

from __future__ import annotations

import difflib
import importlib
import json
import os
import pickle
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fxq.cli.errors import CliError, error_text
from fxq.utils.sample_data import IMAGENET_MEAN, IMAGENET_STD

__all__ = [
    "import_object",
    "load_model",
    "load_data",
    "data_error",
    "describe_batches",
    "IMAGE_SUFFIXES",
    "parse_json_kwargs",
    "WEIGHTS_FORMATS",
]

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
            owner = getattr(obj, "__name__", type(obj).__name__)
            raise CliError(
                f"{what} {spec!r}: {owner!r} has no attribute {part!r}{_did_you_mean(obj, part)}"
            )
        obj = getattr(obj, part)
    return obj


def _did_you_mean(obj: Any, name: str) -> str:
    """`` (did you mean 'a' or 'b'?)``: ``obj``'s public callables closest to ``name``."""
    public = []
    for candidate in dir(obj):
        if candidate.startswith("_"):
            continue
        try:
            if callable(getattr(obj, candidate)):
                public.append(candidate)
        except Exception:  # a lazy attribute that fails to import is no suggestion
            continue
    close = [repr(c) for c in difflib.get_close_matches(name, public, n=3)]
    if not close:
        return ""
    listed = close[0] if len(close) == 1 else f"{', '.join(close[:-1])} or {close[-1]}"
    return f" (did you mean {listed}?)"


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
    except OSError as e:
        raise CliError(f"cannot read weights file {path}: {e.strerror or e}") from None
    except Exception as e:  # torch's message suggests weights_only=False: never do that
        raise CliError(_not_a_state_dict(path, e)) from None
    for key in ("state_dict", "model"):  # common checkpoint wrappers
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict):
        raise CliError(
            f"weights file {path} holds a {type(state).__name__}, not a state dict; {WEIGHTS_FORMATS}"
        )
    return state


#: what ``--weights`` takes (the end of its error messages)
WEIGHTS_FORMATS = (
    "give a file saved with torch.save(model.state_dict(), FILE), or a checkpoint dict "
    "holding one under 'state_dict' or 'model'"
)


def _not_a_state_dict(path: Path, error: Exception) -> str:
    """Why ``torch.load(path, weights_only=True)`` failed, and what ``--weights`` takes."""
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(error))
    if isinstance(error, pickle.UnpicklingError) and found:
        # a whole pickled object (torch.save(model)): unpickling it could run any code
        what = (
            f"holds a pickled Python object ({found.group(1)}; e.g. a whole model saved "
            "with torch.save(model)), not a torch state dict"
        )
    else:
        what = "is not a torch state dict"
    if path.suffix.lower() == ".onnx":
        return (
            f"weights file {path} {what}: an ONNX file is a MODEL of its own "
            f"(fxq quantize {path} --calib DATA); {WEIGHTS_FORMATS}"
        )
    return f"weights file {path} {what}; {WEIGHTS_FORMATS}"


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


# -- a model that fails on the data ---------------------------------------------------------
def _layout(batch: Any) -> str:
    """``shape (8, 3, 16, 16)``; tuples, lists and dicts of tensors by their shapes."""

    def shape(x: Any) -> str:
        return str(tuple(x.shape)) if hasattr(x, "shape") else type(x).__name__

    if isinstance(batch, (tuple, list)):
        return f"{type(batch).__name__}s of shapes {', '.join(shape(x) for x in batch)}"
    if isinstance(batch, Mapping):
        return "dicts of shapes " + ", ".join(f"{k}: {shape(v)}" for k, v in batch.items())
    return f"shape {shape(batch)}" if hasattr(batch, "shape") else type(batch).__name__


def describe_batches(batches: Sequence[Any]) -> str:
    """How data was read: ``2 batches of shape (8, 3, 16, 16), the last of shape (4, 3, 16, 16)``."""
    n = len(batches)
    text = f"{n} batch{'es' if n != 1 else ''} of {_layout(batches[0])}"
    last = _layout(batches[-1])
    if n > 1 and last != _layout(batches[0]):
        middle = {_layout(b) for b in batches[1:-1]}
        text += f", the last of {last}" if middle <= {_layout(batches[0])} else " and others"
    return text


def _layout_hint(spec: str) -> str:
    """What the data of ``spec``'s kind must look like (the end of ``data_error``)."""
    path = Path(spec)
    if path.is_dir():
        return (
            "images are read as RGB batches (N, 3, S, S) with S = --image-size: for a model "
            "that takes other input, give a .npy in its layout"
        )
    if path.suffix == ".npz":
        return (
            "a .npz holds one array per model input, in forward's order, each with the "
            "samples on its first axis"
        )
    if path.suffix == ".npy":
        return (
            "a .npy is one model input with the samples on its first axis: save it as "
            "(samples, *the input's shape), e.g. (N, 3, H, W) for images"
        )
    return (
        "DATA must yield batches the model takes: a tensor, a tuple of inputs (e.g. "
        "(images, labels)) or a dict of keyword arguments"
    )


def data_error(spec: str, batches: Sequence[Any], index: int, error: Exception) -> CliError:
    """The error for a float model that fails on batch ``index`` of the data ``spec``:
    the data, how it was read, the model's error, and the layout the data needs."""
    return CliError(
        f"calibration data {spec}, read as {describe_batches(batches)}, fails in the float "
        f"model (batch {index + 1}): {error_text(error)}; {_layout_hint(spec)}"
    )
