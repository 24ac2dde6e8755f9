"""Page allocator for the paged KV pool: pages are interchangeable, so there is no fragmentation."""

from __future__ import annotations

from collections.abc import Iterable


def pages_for(num_tokens: int, block_size: int) -> int:
    """Pages needed to hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


class PagePool:
    """Hands out KV pages (ids 0..num_pages-1) of `block_size` token slots each.

    A sequence owns a list of page ids; its token i lives at slot
    pages[i // block_size] * block_size + i % block_size of every layer's K/V pool.
    Not thread-safe: the engine calls it under its own lock.
    """

    def __init__(self, num_pages: int, block_size: int):
        if num_pages < 1 or block_size < 1:
            raise ValueError(f"a page pool needs >= 1 page of >= 1 token; got {num_pages} pages "
                             f"of {block_size} tokens")
        self.num_pages = num_pages
        self.block_size = block_size
        # NOTE: popped from the end: page 0 goes out first, freed pages are reused first.
        self._free = list(range(num_pages - 1, -1, -1))
        self._is_free = bytearray([1]) * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def occupancy(self) -> float:
        """Fraction of pages in use, 0.0 to 1.0."""
        return self.num_used / self.num_pages

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int) -> list[int] | None:
        """`num_pages` page ids, or None (allocating nothing) when too few are free."""
        if num_pages < 0:
            raise ValueError(f"cannot allocate {num_pages} pages")
        if num_pages > len(self._free):
            return None
        taken = [self._free.pop() for _ in range(num_pages)]
        for page in taken:
            self._is_free[page] = 0
        return taken

    def extend(self, pages: list[int], num_tokens: int) -> bool:
        """Grow `pages` in place to hold `num_tokens` tokens; False (no change) if it cannot."""
        missing = pages_for(num_tokens, self.block_size) - len(pages)
        if missing <= 0:
            return True
        new_pages = self.allocate(missing)
        if new_pages is None:
            return False
        pages.extend(new_pages)
        return True

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the pool; a page freed twice or out of range raises RuntimeError."""
        for page in pages:
            if not 0 <= page < self.num_pages:
                raise RuntimeError(f"page {page} is outside the pool of {self.num_pages} pages")
            if self._is_free[page]:
                raise RuntimeError(f"page {page} freed twice ({self.num_free} of "
                                   f"{self.num_pages} pages free)")
            self._is_free[page] = 1
            self._free.append(page)

    def check_integrity(self, owned: Iterable[Iterable[int]] = ()) -> None:
        """Raise RuntimeError unless free + owned pages are exactly the pool, each page once."""
        owned_list = [page for pages in owned for page in pages]
        owned_set = set(owned_list)
        free_set = set(self._free)
        problems = []
        if len(free_set) != len(self._free):
            problems.append(f"{len(self._free) - len(free_set)} duplicate ids in the free list")
        if len(owned_set) != len(owned_list):
            problems.append(f"{len(owned_list) - len(owned_set)} pages owned by two sequences")
        if owned_set & free_set:
            problems.append(f"{len(owned_set & free_set)} pages both owned and free")
        if len(free_set | owned_set) != self.num_pages:
            problems.append(f"{self.num_pages - len(free_set | owned_set)} pages leaked")
        flagged = sum(self._is_free)
        if flagged != len(self._free):
            problems.append(f"{flagged} pages flagged free but {len(self._free)} in the free list")
        if problems:
            raise RuntimeError(
                f"KV page pool corrupt: {'; '.join(problems)} (pool {self.num_pages} pages, "
                f"{len(self._free)} free, {len(owned_list)} owned)")
