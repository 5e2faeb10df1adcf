"""Colour-space helpers: BT.601 values for both swings, integer vs float agreement."""

import pytest
import torch

import fxq
from fxq.functional import bgr2centered_yuv, centered_yuv2bgr, centered_yuv2rgb, rgb2centered_yuv
from fxq.qtensor import QTensor

# (R, G, B) -> centered (Y, U, V), computed by hand from the BT.601 definitions:
#   studio: Y = 16 + (65.481 R + 128.553 G + 24.966 B) / 255,
#           U = 128 + (-37.797 R - 74.203 G + 112 B) / 255, V = 128 + (112 R - 93.786 G - 18.214 B) / 255
#   full:   Y = 0.299 R + 0.587 G + 0.114 B, U = 128 + (B - Y) / 1.772, V = 128 + (R - Y) / 1.402
#   then minus 128, rounded half up and clamped to the swing's range
CASES = {
    "studio": [
        ((0, 0, 0), (-112, 0, 0)),
        ((255, 255, 255), (107, 0, 0)),
        ((255, 0, 0), (-47, -38, 112)),  # Y = 81.481, U = 90.203, V = 240
        ((0, 255, 0), (17, -74, -94)),  # Y = 144.553, U = 53.797, V = 34.214
        ((0, 0, 255), (-87, 112, -18)),  # Y = 40.966, U = 240, V = 109.786
        ((100, 150, 200), (9, 29, -26)),  # Y = 16 + 30824.25/255 = 136.879, U = 29.372, V = -25.532
    ],
    "full": [
        ((0, 0, 0), (-128, 0, 0)),
        ((255, 255, 255), (127, 0, 0)),
        ((255, 0, 0), (-52, -43, 127)),  # Y = 76.245, U = 84.972, V = 255.5 -> clamped
        ((0, 0, 255), (-99, 127, -21)),  # Y = 29.07, V = 107.265
        ((100, 150, 200), (13, 33, -29)),  # Y = 140.75, U = 59.25/1.772 = 33.437, V = -29.066
    ],
}


@pytest.mark.parametrize("swing", ["studio", "full"])
def test_rgb_to_centered_yuv_matches_bt601(swing):
    rgb = torch.tensor([c[0] for c in CASES[swing]], dtype=torch.float32).reshape(-1, 3, 1, 1)
    expected = [list(c[1]) for c in CASES[swing]]
    assert rgb2centered_yuv(rgb, swing).reshape(-1, 3).tolist() == expected
    assert bgr2centered_yuv(rgb.flip(1), swing).reshape(-1, 3).tolist() == expected


def test_swing_ranges():
    rgb = torch.rand(4, 3, 32, 32) * 255
    studio, full = rgb2centered_yuv(rgb, "studio"), rgb2centered_yuv(rgb, "full")
    assert studio[:, 0].min() >= -112 and studio[:, 0].max() <= 107
    assert studio[:, 1:].min() >= -112 and studio[:, 1:].max() <= 112
    assert full.min() >= -128 and full.max() <= 127
    with pytest.raises(ValueError, match="unknown swing 'limited'"):
        rgb2centered_yuv(rgb, "limited")


@pytest.mark.parametrize("swing", ["studio", "full"])
def test_yuv_round_trip_recovers_rgb(bayes, swing):
    rgb = torch.randint(0, 256, (2, 3, 8, 8)).float()
    yuv = rgb2centered_yuv(rgb, swing, round=False)
    back = centered_yuv2rgb(yuv, swing, mean=0.0, std=1.0, q_scale=1.0)  # RGB itself, on a 1.0 grid
    assert torch.equal(back, rgb.clamp(max=127))  # int8 range caps the q_scale=1 output


@pytest.mark.parametrize("swing", ["studio", "full"])
@pytest.mark.parametrize("bgr", [False, True])
@pytest.mark.parametrize(
    "mean, std, q_scale",
    [
        ((128.0,), (128.0,), 1 / 128),
        ([123.675, 116.28, 103.53], torch.tensor([58.395, 57.12, 57.375]), 0.0213),
    ],
)
def test_integer_version_within_one_lsb_of_float(swing, bgr, mean, std, q_scale):
    fxq.set_march("bayes")
    yuv = rgb2centered_yuv(torch.rand(4, 3, 16, 16) * 255, swing)
    q = QTensor(yuv.to(torch.int8), torch.tensor([1.0]), fxq.qint8)
    fn = centered_yuv2bgr if bgr else centered_yuv2rgb
    integer = fn(q, swing, mean, std, q_scale)
    reference = fn(yuv, swing, mean, std, q_scale)
    assert isinstance(integer, QTensor) and integer.q_scale() == pytest.approx(q_scale)
    diff = (integer.dequantize() - reference).abs() / q_scale
    assert diff.max() <= 1.0 + 1e-4
    assert (diff < 0.5).float().mean() > 0.99


def test_integer_version_honours_the_input_scale(bayes):
    yuv = rgb2centered_yuv(torch.rand(2, 3, 8, 8) * 255, "full")
    at_one = centered_yuv2rgb(QTensor(yuv.to(torch.int8), torch.tensor([1.0]), fxq.qint8), "full")
    halved = QTensor(
        (yuv / 2).floor().to(torch.int8), torch.tensor([2.0]), fxq.qint8
    )  # coarser camera
    at_two = centered_yuv2rgb(halved, "full")
    assert ((at_one.dequantize() - at_two.dequantize()).abs() <= 2 * 2 / 128 + 1e-6).all()


def test_bad_normalisation_arguments(bayes):
    yuv = torch.zeros(1, 3, 2, 2)
    with pytest.raises(ValueError, match="mean must have one or three values"):
        centered_yuv2rgb(yuv, mean=(1.0, 2.0))
    with pytest.raises(ValueError, match="std must be positive"):
        centered_yuv2rgb(yuv, std=0.0)
    with pytest.raises(ValueError, match="3 channels"):
        centered_yuv2rgb(torch.zeros(1, 4, 2, 2))


def test_colour_ops_need_a_march():
    yuv = torch.zeros(1, 3, 2, 2)
    with pytest.raises(RuntimeError, match="need a march"):
        centered_yuv2rgb(yuv)
    bayes = centered_yuv2rgb(yuv, march="bayes")
    bernoulli2 = centered_yuv2rgb(yuv, march="bernoulli2")
    assert bayes.shape == bernoulli2.shape == (1, 3, 2, 2)
