"""Checks a pool's driver-copy spans on the CPU: the spans applied with memmove (what
cuMemcpyHtoDAsync does with them on a GPU) leave the pool's tensors byte for byte as the
pool's own torch copies do."""

from __future__ import annotations

import ctypes

import torch


def apply_spans(pool, layer: int, expert: int, slot: int) -> int:
    spans, nbytes = pool.copy_spans(layer)
    for dst, dst_step, src, src_step, size in spans:
        ctypes.memmove(dst + slot * dst_step, src + expert * src_step, size)
    return nbytes


def tensors(pool) -> list:
    for names in (("parts",), ("pool",), ("w13", "w2")):
        if all(getattr(pool, n, None) is not None for n in names):
            got = [getattr(pool, n) for n in names]
            return [t for g in got for t in (g if isinstance(g, list) else [g])]
    raise AssertionError(f"no pool tensors on {type(pool).__name__}")


def assert_spans_copy_as_torch(make_pool, slots: int, moves) -> None:
    """make_pool() -> a fresh pool (host experts given); moves: (layer, expert, slot)."""
    by_spans, by_torch = make_pool(), make_pool()
    for pool in (by_spans, by_torch):
        pool.alloc(torch, "cpu", slots)
        for t in tensors(pool):
            t.view(torch.uint8).zero_()
    for layer, expert, slot in moves:
        assert apply_spans(by_spans, layer, expert, slot) == \
            by_torch.copy_expert(layer, expert, slot)
    for a, b in zip(tensors(by_spans), tensors(by_torch)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert any(t.view(torch.uint8).any() for t in tensors(by_spans))


class MemmoveDriver:
    """driver_copies.DriverCopies on the CPU: the same spans and uploads, applied by memmove;
    `fail` makes every call refused, as a driver error would."""

    def __init__(self, fail: bool = False):
        self.fail, self.copies, self.uploads = fail, 0, 0

    def copy(self, spans, expert: int, slot: int) -> None:
        from freetoken.engine.driver_copies import DriverCopyError

        if self.fail:
            raise DriverCopyError("cuMemcpyHtoDAsync failed with CUresult 201")
        for dst, dst_step, src, src_step, size in spans:
            ctypes.memmove(dst + slot * dst_step, src + expert * src_step, size)
        self.copies += 1

    def upload(self, dst, src, device) -> None:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
        self.uploads += 1
