"""A prompt with images: where each image's placeholder run sits, the multimodal rotary positions
of every prompt token (HF's get_rope_index for Qwen3.5/3.6), the decode offset (HF's
rope_deltas) and the token ids the prefix cache hashes (placeholders replaced by a value
derived from the image's digest, so two images never share a page's key).

Positions: text tokens count up from 0 with t = h = w; an image starting after position p-1
puts its (t, h, w) grid at p + (t, row, col) of the merged grid, and text after it continues
at p + max(rows, cols). A generated token at index i sits at i + rope_delta."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from freetoken.engine.request import RequestRejected
from freetoken.vision.inputs import ImageInput, VisionPreprocess


@dataclass(frozen=True, eq=False)
class MultimodalPrompt:
    images: tuple[ImageInput, ...]
    spans: tuple[tuple[int, int], ...]     # (first index, tokens) of each image's run
    positions: np.ndarray                  # int64 [prompt_len, 3]
    is_image: np.ndarray                   # bool [prompt_len]
    rope_delta: int
    key_prompt: tuple[int, ...]

    @property
    def prompt_len(self) -> int:
        return self.positions.shape[0]

    def chunk_positions(self, begin: int, end: int, scratch: int, rows: list) -> list[int]:
        """Rotary row indices of tokens [begin, end): text rows by position; each image token
        gets the next spare row from `scratch` on, its (t, h, w) appended to `rows`."""
        plen = self.prompt_len
        out = list(range(max(begin, plen) + self.rope_delta, end + self.rope_delta))
        if begin >= plen:
            return out
        stop = min(end, plen)
        head = self.positions[begin:stop, 0].copy()
        image = self.is_image[begin:stop]
        count = int(image.sum())
        if count:
            head[image] = np.arange(scratch + len(rows), scratch + len(rows) + count)
            rows.extend(self.positions[begin:stop][image])
        return head.tolist() + out

    def pieces(self, begin: int, end: int) -> list[tuple[int, int, int, int]]:
        """(image, first row of its embeddings, rows, offset in the chunk) for every image
        whose placeholders overlap tokens [begin, end)."""
        out = []
        for index, (start, length) in enumerate(self.spans):
            lo, hi = max(begin, start), min(end, start + length)
            if lo < hi:
                out.append((index, lo - start, hi - lo, lo - begin))
        return out

    def key_tokens(self, token_ids: list[int]) -> KeyTokens:
        return KeyTokens(self.key_prompt, token_ids)


class KeyTokens:
    """token_ids as the prefix cache sees them: the prompt part with image placeholders
    replaced (slices only, which is all extend_keys takes)."""

    def __init__(self, key_prompt: tuple[int, ...], token_ids: list[int]):
        self.key_prompt, self.token_ids = key_prompt, token_ids

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, s: slice) -> list[int]:
        start, stop, _ = s.indices(len(self.token_ids))
        plen = len(self.key_prompt)
        if stop <= plen:
            return list(self.key_prompt[start:stop])
        return list(self.key_prompt[start:plen]) + self.token_ids[max(start, plen):stop]


def _image_key(digest: str) -> int:
    """A negative int64 standing for the image in page keys (token ids are never negative)."""
    value = int.from_bytes(hashlib.blake2b(digest.encode(), digest_size=7).digest(), "little")
    return -1 - value


def placeholder_runs(prompt: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """(start, length) of every maximal run of image placeholder tokens."""
    runs, i = [], 0
    while i < len(prompt):
        if prompt[i] == image_token_id:
            j = i
            while j < len(prompt) and prompt[j] == image_token_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def _check_runs(runs, images, pre: VisionPreprocess) -> None:
    if len(runs) != len(images):
        raise RequestRejected(
            f"the prompt holds {len(runs)} image placeholder run(s) (token "
            f"{pre.image_token_id}) but {len(images)} image(s) were given")
    for n, ((_, length), image) in enumerate(zip(runs, images)):
        want = image.num_tokens(pre.merge_size)
        if length != want:
            raise RequestRejected(
                f"image {n} (grid {tuple(image.grid_thw)}) needs {want} placeholder tokens, "
                f"the prompt has a run of {length}")


def layout_images(prompt: list[int], images: Sequence[ImageInput],
                  pre: VisionPreprocess) -> MultimodalPrompt:
    """The layout of `prompt` with `images` in prompt order; RequestRejected when the
    placeholder runs and the images do not match one for one."""
    images = tuple(images)
    runs = placeholder_runs(prompt, pre.image_token_id)
    _check_runs(runs, images, pre)
    positions = np.zeros((len(prompt), 3), dtype=np.int64)
    is_image = np.zeros(len(prompt), dtype=bool)
    key_prompt = list(prompt)
    index = current = 0
    merge = pre.merge_size
    for (start, length), image in zip(runs, images):
        text = start - index
        positions[index:start] = (current + np.arange(text))[:, None]
        current += text
        t, h, w = image.grid_thw
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h // merge), np.arange(w // merge),
                                    indexing="ij"), axis=-1).reshape(-1, 3)
        positions[start:start + length] = grid + current
        is_image[start:start + length] = True
        key_prompt[start:start + length] = [_image_key(image.digest)] * length
        current += max(h, w) // merge
        index = start + length
    positions[index:] = (current + np.arange(len(prompt) - index))[:, None]
    delta = int(positions.max()) + 1 - len(prompt) if len(prompt) else 0
    return MultimodalPrompt(images, tuple(runs), positions, is_image, delta, tuple(key_prompt))
