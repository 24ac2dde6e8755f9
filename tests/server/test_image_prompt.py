"""Expanding each image's placeholder token into the tokens the image occupies."""

from __future__ import annotations

import numpy as np
import pytest

from freetoken.server.errors import APIError
from freetoken.server.images import expand_image_tokens
from freetoken.vision.inputs import ImageInput
from tests.vision.images import QWEN35

S, E, P = QWEN35.vision_start_token_id, QWEN35.vision_end_token_id, QWEN35.image_token_id


def image(grid: tuple[int, int, int]) -> ImageInput:
    rows = grid[0] * grid[1] * grid[2]
    return ImageInput(np.zeros((rows, 1536), np.float32), grid, "-")


def test_each_placeholder_becomes_its_images_tokens_in_order():
    ids = [10, S, P, E, 11, S, P, E, 12]
    out = expand_image_tokens(ids, (image((1, 4, 6)), image((1, 2, 2))), QWEN35)
    assert out == [10, S] + [P] * 6 + [E, 11, S, P, E, 12]


def test_no_images_no_placeholders_is_unchanged():
    assert expand_image_tokens([5, 6, 7], (), QWEN35) == [5, 6, 7]


@pytest.mark.parametrize("ids,count,fragment", [
    ([S, P, E, P], 1, "placeholder"),          # one more than images: the user typed it
    ([20, 21, 22], 1, "placed 0 of 1"),        # the template dropped the image item
    ([9, P, E], 1, "placed 1 of 1"),           # not framed by vision start/end
])
def test_mismatches_are_400s(ids, count, fragment):
    with pytest.raises(APIError, match=fragment) as caught:
        expand_image_tokens(ids, tuple(image((1, 2, 2)) for _ in range(count)), QWEN35)
    assert caught.value.status == 400 and caught.value.param == "messages"
