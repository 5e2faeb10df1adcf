"""The real photographs the tests and benchmarks use (``fxq.utils.sample_data``)."""

import pytest
import torch

from fxq.utils.sample_data import HELD_OUT_PHOTOS, PHOTOS, photo_crops


def test_held_out_crops_are_other_photographs():
    held = photo_crops(len(HELD_OUT_PHOTOS), seed=0, normalize=False, photos="held_out")
    bench = photo_crops(len(HELD_OUT_PHOTOS), seed=0, normalize=False)
    assert held.shape == (3, 3, 224, 224) and held.dtype is torch.float32
    assert float(held.min()) >= 0.0 and float(held.max()) <= 1.0
    assert float(held.std()) > 0.1  # photographs, not flat frames
    # the same seed crops the same places of different pictures
    assert float((held - bench).abs().mean()) > 0.1
    assert torch.equal(held, photo_crops(3, seed=0, normalize=False, photos="held_out"))
    assert not set(HELD_OUT_PHOTOS) & set(PHOTOS)


def test_an_unknown_photo_set_is_refused():
    with pytest.raises(ValueError, match="photos must be 'benchmark' or 'held_out', got 'test'"):
        photo_crops(2, photos="test")
