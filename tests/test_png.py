"""The mask PNG writer produces ordinary PNGs that decode to exactly the mask."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from training.data.images import image_size
from training.data.png import encode_gray_png


def decode(data: bytes) -> np.ndarray:
    return cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)


@pytest.mark.parametrize(("width", "height", "top"), [(1280, 720, 293), (320, 180, 0), (64, 64, 63), (33, 7, 5)])
def test_round_trip(width: int, height: int, top: int):
    rng = np.random.default_rng(width + top)
    band = (rng.random((height - top, width)) < 0.05).astype(np.uint8) * rng.integers(1, 5, (height - top, width),
                                                                                      dtype=np.uint8)
    data = encode_gray_png(band, top, height)
    expected = np.zeros((height, width), np.uint8)
    expected[top:] = band
    decoded = decode(data)
    assert decoded.dtype == np.uint8 and decoded.shape == (height, width)
    np.testing.assert_array_equal(decoded, expected)
    assert image_size(data) == (width, height)


def test_all_zero_mask():
    data = encode_gray_png(np.zeros((0, 100), np.uint8), 50, 50)
    np.testing.assert_array_equal(decode(data), np.zeros((50, 100), np.uint8))


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="does not end at row"):
        encode_gray_png(np.zeros((10, 10), np.uint8), 5, 20)
    with pytest.raises(ValueError, match="uint8"):
        encode_gray_png(np.zeros((10, 10), np.float32), 0, 10)
