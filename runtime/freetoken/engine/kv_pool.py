"""Page allocator for the paged KV pool: reference-counted pages, and full pages kept after use
under a prefix-cache key until free pages run out (then evicted least recently used first)."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable


def pages_for(num_tokens: int, block_size: int) -> int:
    """Pages needed to hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


class PagePool:
    """Hands out KV pages (ids 0..num_pages-1) of `block_size` token slots each.

    A sequence owns a list of page ids; its token i lives at slot
    pages[i // block_size] * block_size + i % block_size of every layer's K/V pool.
    A page is held by `refs` sequences; a cached page (one with a key, see publish) is shared
    read-only by every sequence whose prompt starts with the same tokens. When its last holder
    lets go, a cached page stays "idle" with its KV intact, and allocate evicts idle pages, least
    recently released first, only when no never-cached free page is left.
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
        self._refs = [0] * num_pages
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Pages allocate can hand out: never-cached free pages plus idle cached ones."""
        return len(self._free) + len(self._idle)

    @property
    def num_used(self) -> int:
        """Pages some sequence holds."""
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages under a prefix-cache key (held or idle)."""
        return len(self._key_of)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    @property
    def occupancy(self) -> float:
        """Fraction of pages in use, 0.0 to 1.0."""
        return self.num_used / self.num_pages

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_free

    def allocate(self, num_pages: int) -> list[int] | None:
        """`num_pages` page ids, or None (allocating nothing) when too few are free."""
        if num_pages < 0:
            raise ValueError(f"cannot allocate {num_pages} pages")
        if num_pages > self.num_free:
            return None
        taken = [self._free.pop() if self._free else self._evict() for _ in range(num_pages)]
        for page in taken:
            self._refs[page] = 1
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
        """Drop one reference to each page; a page freed more often than it was taken or out
        of range raises RuntimeError. Release a sequence's pages last first, so the tail of a
        cached prefix is evicted before its head (a head without its tail is still useful)."""
        for page in pages:
            if not 0 <= page < self.num_pages:
                raise RuntimeError(f"page {page} is outside the pool of {self.num_pages} pages")
            if self._refs[page] == 0:
                raise RuntimeError(f"page {page} freed twice ({self.num_free} of "
                                   f"{self.num_pages} pages free)")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._idle[page] = None
                else:
                    self._free.append(page)

    def pages_held_from(self, num_pages: int) -> int:
        """Pages with an id >= num_pages that some sequence holds (they block a shrink)."""
        return sum(1 for r in self._refs[num_pages:] if r)

    def resize(self, num_pages: int) -> None:
        """Grow, or shrink when no page >= num_pages is held (ValueError naming how many
        are): idle cached pages past the end are dropped; page ids below stay as they are."""
        if num_pages < 1:
            raise ValueError(f"a page pool needs >= 1 page, got {num_pages}")
        held = self.pages_held_from(num_pages)
        if held:
            raise ValueError(f"{held} pages at or past page {num_pages} are in use")
        for page in range(num_pages, self.num_pages):
            if page in self._idle:
                del self._idle[page]
                del self._page_of[self._key_of.pop(page)]
        new = list(range(num_pages - 1, self.num_pages - 1, -1))   # handed out last
        self._free = new + [p for p in self._free if p < num_pages]
        self._refs = self._refs[:num_pages] + [0] * max(0, num_pages - self.num_pages)
        self.num_pages = num_pages

    # ---- prefix cache ------------------------------------------------------------------------

    def publish(self, page: int, key: bytes) -> None:
        """Make a held, full page findable under `key`. A key already cached elsewhere keeps
        its page (the duplicate returns to the free list when released)."""
        if self._refs[page] == 0:
            raise RuntimeError(f"page {page} is published but no sequence holds it")
        if key not in self._page_of and page not in self._key_of:
            self._page_of[key] = page
            self._key_of[page] = key

    def match(self, keys: Iterable[bytes]) -> list[int]:
        """Take a reference to the cached pages of the longest run of `keys` from the first;
        the caller owns them (read-only) and frees them like any other page."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            if self._refs[page] == 0:
                del self._idle[page]
            self._refs[page] += 1
            pages.append(page)
        return pages

    def _evict(self) -> int:
        page, _ = self._idle.popitem(last=False)
        del self._page_of[self._key_of.pop(page)]
        self.num_evictions += 1
        return page

    def check_integrity(self, owned: Iterable[Iterable[int]] = ()) -> None:
        """Raise RuntimeError unless every page's reference count equals the number of
        sequences that hold it, and each unheld page is free or idle exactly once."""
        holders = Counter(page for pages in owned for page in pages)
        free_set, idle_set = set(self._free), set(self._idle)
        problems = []
        if len(free_set) != len(self._free):
            problems.append(f"{len(self._free) - len(free_set)} duplicate ids in the free list")
        leaked = [p for p in range(self.num_pages) if holders[p] < self._refs[p]]
        over = [p for p in range(self.num_pages) if holders[p] > self._refs[p]]
        if leaked:
            problems.append(f"{len(leaked)} pages leaked (page {leaked[0]}: "
                            f"{self._refs[leaked[0]]} references, {holders[leaked[0]]} holders)")
        if over:
            problems.append(f"{len(over)} pages owned by more sequences than reference them "
                            f"(page {over[0]}: {self._refs[over[0]]} references, "
                            f"{holders[over[0]]} holders)")
        if (free_set | idle_set) & set(holders):
            problems.append(f"{len((free_set | idle_set) & set(holders))} pages both owned "
                            "and free")
        unheld = {p for p in range(self.num_pages) if self._refs[p] == 0}
        if free_set & idle_set or unheld != free_set | idle_set:
            problems.append(f"{len(unheld ^ (free_set | idle_set))} unheld pages neither free "
                            f"nor idle, {len(free_set & idle_set)} both")
        if not idle_set <= set(self._key_of) or len(self._page_of) != len(self._key_of):
            problems.append("cache keys and idle pages disagree")
        if problems:
            raise RuntimeError(
                f"KV page pool corrupt: {'; '.join(problems)} (pool {self.num_pages} pages, "
                f"{len(self._free)} free, {len(self._idle)} idle cached, "
                f"{sum(holders.values())} held)")
