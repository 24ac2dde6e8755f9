"""Image embeddings kept between steps and requests: an LRU over the vision tower's output keyed
by the image digest, bounded in embedding rows, so an image is encoded once while its prompt
is prefilled in chunks and again only after eviction (a repeated image in a later turn, with
its pages evicted from the prefix cache, is not re-encoded either while it stays here)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from freetoken.models.batch import MultimodalBatch


class EncoderCache:
    """Args: tower (has encode(images) -> one [tokens, hidden] array per image);
    capacity: embedding rows kept at most (the images of one step are kept regardless)."""

    def __init__(self, tower: Any, capacity: int):
        self.tower, self.capacity = tower, capacity
        self._rows: OrderedDict[str, Any] = OrderedDict()
        self._size = 0
        self.num_encoded = 0    # images run through the tower
        self.num_hits = 0       # images served from the cache

    def get(self, images: Sequence[Any]) -> list[Any]:
        """Embeddings of `images`, encoding the missing ones in one batch."""
        missing = list({im.digest: im for im in images if im.digest not in self._rows}.values())
        self.num_hits += len(images) - len(missing)
        if missing:
            for image, rows in zip(missing, self.tower.encode(missing)):
                self._rows[image.digest] = rows
                self._size += rows.shape[0]
            self.num_encoded += len(missing)
        found = [self._rows[im.digest] for im in images]
        for image in images:
            self._rows.move_to_end(image.digest)
        self._evict(keep={im.digest for im in images})
        return found

    def _evict(self, keep: set[str]) -> None:
        while self._size > self.capacity and self._rows:
            digest = next(iter(self._rows))
            if digest in keep:
                break
            self._size -= self._rows.pop(digest).shape[0]

    def fill(self, batch: MultimodalBatch) -> None:
        """Set batch.embeds from batch.pieces (slices of each image's embeddings: a chunked
        prefill may cut an image's placeholders across steps)."""
        images = [prompt.images[image] for _, prompt, image, _, _ in batch.pieces]
        rows = self.get(images)
        batch.embeds = [(row, embeds[first:first + count])
                        for (row, _, _, first, count), embeds in zip(batch.pieces, rows)]

    def stats(self) -> dict[str, int]:
        return {"vision_images_encoded": self.num_encoded,
                "vision_encoder_cache_hits": self.num_hits,
                "vision_encoder_cache_rows": self._size}
