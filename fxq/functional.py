"""User-facing functional ops: the colour-space helpers for YUV camera input.

Cameras hand the accelerator *centered* YUV444 (BT.601, each component minus
128, so values lie in -128..127) while most models are trained on RGB.

* ``rgb2centered_yuv`` / ``bgr2centered_yuv``: training-time preprocessing.
  RGB (or BGR) in 0..255 -> the integers a camera would produce.
* ``centered_yuv2rgb`` / ``centered_yuv2bgr``: deployment. Inserted after the
  model's quantize stub in the *converted* model, they turn the camera's
  integers into normalised RGB (or BGR) at the scale the first layer expects,
  entirely in integer arithmetic (one fixed-point matrix, a clamp to 0..255,
  normalisation folded into one requantization per channel). On a float
  tensor they compute the same formula in float64 and round to ``q_scale``,
  which is the reference the integer version matches within 1 LSB.

Swings (BT.601): ``"studio"`` puts Y in -112..107 and U, V in -112..112
(Y 16..235, C 16..240 before centering); ``"full"`` uses all of -128..127.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fxq.dtypes import qint8
from fxq.march import March, MarchSpec, get_march, spec_for
from fxq.qtensor import QTensor
from fxq.quantized import functional as qf

__all__ = ["rgb2centered_yuv", "bgr2centered_yuv", "centered_yuv2rgb", "centered_yuv2bgr"]

_KR, _KB = 0.299, 0.114  # BT.601 luma weights
_FRACTION_BITS = 14  # fixed-point precision of the YUV -> RGB matrix

# (luma range, chroma range, centered luma offset) per swing: Y_c = range_y * Y' - offset
_SWINGS = {
    "studio": (219.0 / 255.0, 224.0 / 255.0, 112.0),
    "full": (1.0, 1.0, 128.0),
}
_LIMITS = {"studio": ((-112.0, 107.0), (-112.0, 112.0)), "full": ((-128.0, 127.0), (-128.0, 127.0))}


def _swing(swing: str) -> tuple[float, float, float]:
    try:
        return _SWINGS[swing]
    except KeyError:
        raise ValueError(f"unknown swing {swing!r}; use 'studio' or 'full'") from None


def _rgb_to_yuv_matrix(swing: str) -> tuple[Tensor, Tensor]:
    """Centered YUV = M @ RGB + o (float64), RGB in 0..255."""
    ry, rc, oy = _swing(swing)
    kg = 1.0 - _KR - _KB
    luma = torch.tensor([_KR, kg, _KB], dtype=torch.float64)
    blue = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)
    red = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    u = (blue - luma) / (2.0 * (1.0 - _KB))
    v = (red - luma) / (2.0 * (1.0 - _KR))
    m = torch.stack([ry * luma, rc * u, rc * v])
    o = torch.tensor([-oy, 0.0, 0.0], dtype=torch.float64)
    return m, o


def _yuv_to_rgb_matrix(swing: str) -> tuple[Tensor, Tensor]:
    """RGB = A @ centered YUV + b (float64), the exact inverse of ``_rgb_to_yuv_matrix``."""
    m, o = _rgb_to_yuv_matrix(swing)
    a = torch.linalg.inv(m)
    return a, -(a @ o)


def _channels(x: Tensor) -> int:
    if x.dim() < 3 or x.shape[-3] != 3:
        raise ValueError(f"expected images with 3 channels at dim -3, got shape {tuple(x.shape)}")
    return x.dim() - 3


def _apply(matrix: Tensor, offset: Tensor, x: Tensor) -> Tensor:
    axis = _channels(x)
    moved = x.to(torch.float64).movedim(axis, -1)
    m = matrix.to(x.device)
    # elementwise, in a fixed order: a matmul's summation order (and its FMAs) differ by
    # device, and the camera's rounding of exact half-way values must not
    terms = [moved[..., k : k + 1] * m[:, k] for k in range(3)]
    out = (terms[0] + terms[1]) + terms[2] + offset.to(x.device)
    return out.movedim(-1, axis)


def rgb2centered_yuv(input: Tensor, swing: str = "studio", round: bool = True) -> Tensor:
    """RGB (0..255, channels at dim -3) -> centered BT.601 YUV444, as a camera delivers it.

    Args:
        input: float or integer RGB images, ``[..., 3, H, W]``.
        swing: ``"studio"`` (Y -112..107, U/V -112..112) or ``"full"`` (-128..127).
        round: round half up to integers and clamp to the swing's range, like the
            camera (True), or return the exact float conversion.

    Returns:
        float32 centered YUV with the input's shape.
    """
    m, o = _rgb_to_yuv_matrix(swing)
    yuv = _apply(m, o, input)
    if round:
        yuv = torch.floor(yuv + 0.5)
        (ylo, yhi), (clo, chi) = _LIMITS[swing]
        axis = _channels(input)
        lo = torch.tensor([ylo, clo, clo], dtype=yuv.dtype, device=yuv.device)
        hi = torch.tensor([yhi, chi, chi], dtype=yuv.dtype, device=yuv.device)
        shape = [1] * yuv.dim()
        shape[axis] = 3
        yuv = torch.maximum(torch.minimum(yuv, hi.reshape(shape)), lo.reshape(shape))
    return yuv.to(torch.float32)


def bgr2centered_yuv(input: Tensor, swing: str = "studio", round: bool = True) -> Tensor:
    """BGR (0..255) -> centered BT.601 YUV444; see ``rgb2centered_yuv``."""
    return rgb2centered_yuv(input.flip(_channels(input)), swing, round)


def _per_channel(value: float | Sequence[float] | Tensor, name: str) -> Tensor:
    t = torch.as_tensor(value, dtype=torch.float64).reshape(-1)
    if t.numel() == 1:
        t = t.expand(3)
    if t.numel() != 3:
        raise ValueError(f"{name} must have one or three values, got {t.numel()}")
    return t.clone()


def _yuv_to_normalized(
    input: Tensor | QTensor,
    swing: str,
    mean: float | Sequence[float] | Tensor,
    std: float | Sequence[float] | Tensor,
    q_scale: float | Tensor,
    bgr: bool,
    march: March | str | None,
) -> Tensor | QTensor:
    a, b = _yuv_to_rgb_matrix(swing)
    if bgr:
        a, b = a.flip(0), b.flip(0)
    mean_t, std_t = _per_channel(mean, "mean"), _per_channel(std, "std")
    if (std_t <= 0).any():
        raise ValueError(f"std must be positive, got {std_t.tolist()}")
    q_scale = float(q_scale)
    spec = _spec(march)
    if isinstance(input, QTensor):
        return _integer_yuv_to_normalized(input, a, b, mean_t, std_t, q_scale, spec)
    rgb = _apply(a, b, input).clamp(0.0, 255.0)
    axis = _channels(input)
    shape = [1] * rgb.dim()
    shape[axis] = 3
    normalized = (rgb - mean_t.reshape(shape).to(rgb.device)) / std_t.reshape(shape).to(rgb.device)
    # a tensor divisor: CUDA divides by a Python number as a product with its reciprocal
    step = torch.tensor(q_scale, dtype=normalized.dtype, device=normalized.device)
    q = qf.round_float(normalized / step, spec.rounding).clamp(qint8.qmin, qint8.qmax)
    return (q * q_scale).to(torch.float32)


def _spec(march: March | str | None) -> MarchSpec:
    """The march whose rounding and multipliers apply: the argument, else the global one."""
    march = march if march is not None else get_march()
    if march is None:
        raise RuntimeError(
            "centered_yuv2rgb / centered_yuv2bgr need a march for their rounding and "
            "multipliers: pass march=... (e.g. the converted model's march) or call fxq.set_march"
        )
    return spec_for(march)


def _integer_yuv_to_normalized(
    x: QTensor, a: Tensor, b: Tensor, mean: Tensor, std: Tensor, q_scale: float, spec
) -> QTensor:
    """Fixed-point YUV -> RGB, clamp to 0..255, normalise and requantize per channel."""
    x._per_tensor("centered_yuv2rgb")
    one = float(1 << _FRACTION_BITS)
    s_in = x.scale.to(torch.float64).cpu()
    coef = torch.floor(a * s_in * one + 0.5)  # RGB per input step, in 2**-14 units
    bias = torch.floor(b * one + 0.5)
    axis = _channels(x)
    q = x.values().to(torch.float64).movedim(axis, -1)
    rgb = q @ coef.T.to(q.device) + bias.to(q.device)  # exact: |terms| < 2**53
    rgb = rgb.clamp(0.0, 255.0 * one) - torch.floor(mean * one + 0.5).to(q.device)
    m, s = qf.quantize_multiplier(1.0 / (one * std * q_scale), spec)  # on the CPU
    out = qf.requantize_exact(rgb, m, s, qint8, spec.rounding, channel_axis=-1, as_float=True)
    return QTensor(out.movedim(-1, axis).contiguous(), torch.tensor([q_scale]), qint8)


def centered_yuv2rgb(
    input: Tensor | QTensor,
    swing: str = "studio",
    mean: float | Sequence[float] | Tensor = (128.0,),
    std: float | Sequence[float] | Tensor = (128.0,),
    q_scale: float | Tensor = 1 / 128,
    march: March | str | None = None,
) -> Tensor | QTensor:
    """Centered YUV444 -> normalised RGB quantized with ``q_scale``.

    On a ``QTensor`` (the quantize stub's output in a converted model, usually
    with its scale set to 1.0 so that the integers are the camera's) this is
    integer arithmetic and returns a ``QTensor`` (int8 at ``q_scale``). On a
    float tensor it evaluates the same formula in float64, rounds to the
    ``q_scale`` grid and returns float32: the reference.

    Args:
        input: centered YUV, channels at dim -3.
        swing: ``"studio"`` or ``"full"`` (how the camera encoded it).
        mean, std: the training normalisation of RGB in 0..255, one or three values.
        q_scale: the scale the first quantized layer expects (the training
            quantize stub's scale).
        march: the march whose rounding and multiplier widths apply; the
            current one (``fxq.set_march``) when None. ``fxq.deploy.yuv_input``
            passes the converted model's.

    Raises:
        ValueError: for a bad swing, mean/std length, non-positive std, or
            input without 3 channels.
        RuntimeError: when no march is given and none is set.
    """
    return _yuv_to_normalized(input, swing, mean, std, q_scale, bgr=False, march=march)


def centered_yuv2bgr(
    input: Tensor | QTensor,
    swing: str = "studio",
    mean: float | Sequence[float] | Tensor = (128.0,),
    std: float | Sequence[float] | Tensor = (128.0,),
    q_scale: float | Tensor = 1 / 128,
    march: March | str | None = None,
) -> Tensor | QTensor:
    """Centered YUV444 -> normalised BGR; see ``centered_yuv2rgb``."""
    return _yuv_to_normalized(input, swing, mean, std, q_scale, bgr=True, march=march)
