import pytest

from freetoken.engine.kv_pool import PagePool, pages_for


def test_allocate_and_free_round_trip():
    pool = PagePool(8, 16)
    pages = pool.allocate(5)
    assert len(set(pages)) == 5 and pool.num_used == 5 and pool.num_free == 3
    assert pool.allocate(4) is None and pool.num_used == 5  # all-or-nothing
    pool.free(pages)
    assert pool.num_free == 8 and pool.occupancy == 0.0
    pool.check_integrity()


def test_extend_grows_to_cover_tokens():
    pool = PagePool(4, 16)
    pages: list[int] = []
    assert pool.extend(pages, 1) and len(pages) == 1
    assert pool.extend(pages, 16) and len(pages) == 1
    assert pool.extend(pages, 17) and len(pages) == 2
    assert not pool.extend(pages, 16 * 5) and len(pages) == 2  # no partial growth
    assert pages_for(33, 16) == 3


def test_fragmented_pool_still_serves_a_large_request():
    pool = PagePool(10, 4)
    singles = [pool.allocate(1) for _ in range(10)]
    for page_list in singles[::2]:  # free every other page: no two free pages are adjacent
        pool.free(page_list)
    big: list[int] = []
    assert pool.extend(big, 20)  # 5 pages, none contiguous
    assert sorted(big) == sorted(p for pl in singles[::2] for p in pl)
    pool.check_integrity([big] + singles[1::2])


def test_double_free_and_out_of_range_raise():
    pool = PagePool(4, 16)
    pages = pool.allocate(2)
    pool.free(pages)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(pages[:1])
    with pytest.raises(RuntimeError, match="outside the pool"):
        pool.free([7])


def test_integrity_check_reports_numbers():
    pool = PagePool(6, 16)
    owned = pool.allocate(3)
    pool.check_integrity([owned])
    with pytest.raises(RuntimeError, match=r"3 pages leaked"):
        pool.check_integrity([])  # nobody claims the 3 used pages
    with pytest.raises(RuntimeError, match=r"1 pages owned by more sequences than reference them"):
        pool.check_integrity([owned, owned[:1]])
    with pytest.raises(RuntimeError, match=r"both owned and free"):
        pool.check_integrity([owned + [pool._free[0]]])


def test_bad_pool_size_rejected():
    with pytest.raises(ValueError):
        PagePool(0, 16)
