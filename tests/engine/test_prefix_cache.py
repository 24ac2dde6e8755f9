"""Prefix caching over the fake paged model: the model reads every context token back through
the block tables, so a wrongly shared, evicted or overwritten page changes the output. Each
result is compared with the next-token rule computed straight from the token list."""

import asyncio

import pytest

from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import Engine
from freetoken.engine.kv_pool import PagePool
from freetoken.engine.prefix_cache import extend_keys, root_key
from freetoken.engine.request import SamplingParams
from tests.engine.fakes import CharTokenizer, FakeModel, expected_continuation

TOK = CharTokenizer()
BLOCK = 8
SYSTEM = TOK.encode("You are a careful agent. Tools, search, open, edit, run. " * 2)


@pytest.fixture
def make_engine():
    engines = []

    def make(num_tokens=1024, chunk=32, seqs=8, prefix_cache=True):
        engine = Engine(FakeModel(), TOK, EngineConfig(
            num_tokens=num_tokens, block_size=BLOCK, max_num_seqs=seqs, max_prefill_tokens=chunk,
            device="cpu", prefix_cache=prefix_cache)).start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


async def run(engine, prompt, max_tokens=12):
    outs = [o async for o in engine.generate(prompt, SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True))]
    return [t for o in outs for t in o.token_ids], outs[-1].usage


def tokens_run(engine, since: int = 0) -> int:
    """Tokens the model computed in the steps recorded from index `since` on."""
    return sum(batch.num_tokens for batch in engine.model.batches[since:])


def assert_all_released(engine):
    """Every page back at zero references: free or idle in the cache, none held."""
    pool = engine.pool
    pool.check_integrity([])
    assert sum(pool._refs) == 0, f"{sum(pool._refs)} references left on {pool.num_pages} pages"
    assert pool.num_free == pool.num_pages and engine.stats()["kv_pages_used"] == 0


def test_keys_are_a_chain_so_an_edit_keeps_the_pages_before_it():
    root = root_key("model-a")
    history = list(range(40))
    edited = history[:19] + [99] + history[20:]          # token 19 rewritten (page 2 of 8)
    dropped = history[:26] + history[30:]                 # tokens 26..29 dropped (page 3)
    keys = extend_keys([], history, 40, BLOCK, root)
    assert len(keys) == 5 and len(set(keys)) == 5
    assert extend_keys([], edited, 40, BLOCK, root)[:2] == keys[:2]
    assert not set(extend_keys([], edited, 40, BLOCK, root)[2:]) & set(keys)
    assert extend_keys([], dropped, 36, BLOCK, root)[:3] == keys[:3]
    assert extend_keys([], dropped, 36, BLOCK, root)[3] != keys[3]
    assert extend_keys([], history, 40, BLOCK, root_key("model-b"))[0] != keys[0]
    assert extend_keys(keys[:2], history, 40, BLOCK, root) == keys  # resumes where it stopped


def test_pool_shares_counts_and_evicts_least_recently_released_first():
    pool = PagePool(4, BLOCK)
    a = pool.allocate(2)
    pool.publish(a[0], b"k0")
    pool.publish(a[1], b"k1")
    assert pool.match([b"k0", b"k1", b"k2"]) == a            # a second holder of both
    pool.check_integrity([a, a])
    pool.free(reversed(a))
    pool.free(reversed(a))
    assert (pool.num_free, pool.num_idle, pool.num_used) == (4, 2, 0)
    other = pool.allocate(2)                                  # never-cached pages go first
    assert not set(other) & set(a) and pool.num_evictions == 0
    third = pool.allocate(1)                                  # then the idle tail, a[1]
    assert third == [a[1]] and pool.num_evictions == 1
    assert pool.match([b"k0", b"k1"]) == [a[0]]               # the head is still cached
    pool.free(other + third + [a[0]])
    pool.check_integrity([])
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free([a[0]])


def test_second_request_prefills_only_what_is_not_cached(make_engine):
    engine = make_engine(chunk=64)
    prompt = SYSTEM + TOK.encode("first question?")
    vocab = engine.model.config.vocab_size

    async def main():
        first = await run(engine, prompt)
        second = await run(engine, prompt)
        return first, second

    (ids1, usage1), (ids2, usage2) = asyncio.run(main())
    assert ids1 == ids2 == expected_continuation(prompt, 12, vocab)
    cached = (len(prompt) - 1) // BLOCK * BLOCK    # the last token is always recomputed
    assert (usage1.cached_tokens, usage2.cached_tokens) == (0, cached)
    # Each run: its prompt's uncached part, then 11 decode steps (the 12th token needs none).
    assert tokens_run(engine) == len(prompt) + 11 + (len(prompt) - cached) + 11
    stats = engine.stats()
    assert stats["prefix_cache_hit_tokens"] == cached
    assert stats["prefix_cache_queried_tokens"] == 2 * len(prompt)
    assert_all_released(engine)


def test_edited_history_reuses_everything_before_the_first_change(make_engine):
    engine = make_engine()
    turn = SYSTEM + TOK.encode("user, fix the bug. thinking, look at the code first. "
                               "tool, 120 lines. assistant, done.")
    cut = len(SYSTEM) + 20
    rewritten = turn[:cut] + TOK.encode("X") + turn[cut + 1:]       # one token changed
    dropped = turn[:cut] + turn[cut + 30:]                           # a block stripped

    async def main():
        await run(engine, turn)
        return [await run(engine, p) for p in (rewritten, dropped)]

    results = asyncio.run(main())
    vocab = engine.model.config.vocab_size
    for prompt, (ids, usage) in zip((rewritten, dropped), results):
        assert ids == expected_continuation(prompt, 12, vocab)
        assert usage.cached_tokens == cut // BLOCK * BLOCK   # full pages before token `cut`
    assert_all_released(engine)


def test_concurrent_requests_sharing_a_prefix_match_the_cache_off_run(make_engine):
    prompts = [SYSTEM + TOK.encode(f"task {i}, " + "check this " * (i % 4)) for i in range(12)]
    prompts += prompts[:4]                                  # exact repeats in flight together

    async def main(engine):
        return await asyncio.gather(*(run(engine, p, 20) for p in prompts))

    cached, uncached = make_engine(seqs=6), make_engine(seqs=6, prefix_cache=False)
    with_cache = asyncio.run(main(cached))
    without = asyncio.run(main(uncached))
    vocab = cached.model.config.vocab_size
    for prompt, (ids, _), (ids_off, usage_off) in zip(prompts, with_cache, without):
        assert ids == ids_off == expected_continuation(prompt, 20, vocab)
        assert usage_off.cached_tokens == 0
    assert sum(u.cached_tokens for _, u in with_cache) >= 6 * (len(SYSTEM) // BLOCK * BLOCK)
    assert uncached.stats()["prefix_cache_hit_tokens"] == 0
    assert uncached.stats()["kv_pages_cached"] == 0
    assert_all_released(cached)
    assert_all_released(uncached)


def test_eviction_and_preemption_in_a_small_pool_keep_outputs_exact(make_engine):
    engine = make_engine(num_tokens=24 * BLOCK, chunk=16, seqs=5)   # 24 pages
    prompts = [SYSTEM + TOK.encode(f"session {i % 5} " * (2 + i % 3)) for i in range(15)]

    async def main():
        first = await asyncio.gather(*(run(engine, p, 30) for p in prompts))
        again = [await run(engine, p, 30) for p in prompts[:3]]
        return first + again

    results = asyncio.run(main())
    vocab = engine.model.config.vocab_size
    for prompt, (ids, _) in zip(prompts + prompts[:3], results):
        assert ids == expected_continuation(prompt, 30, vocab)
    stats = engine.stats()
    assert stats["prefix_cache_evictions"] > 0 and stats["preemptions"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0
    assert_all_released(engine)


def test_chunked_prefill_split_inside_a_cached_prefix(make_engine):
    engine = make_engine(chunk=6)          # chunks of 6 cross every 8-token page boundary
    head = SYSTEM[:48]
    first, second = head + TOK.encode("alpha beta gamma"), head + TOK.encode("delta, epsilon")
    assert first[48] != second[48]

    async def main():
        one = asyncio.ensure_future(run(engine, first))
        await asyncio.sleep(0)
        two = asyncio.ensure_future(run(engine, second))   # may meet a half-published prefix
        await asyncio.gather(one, two)
        since = len(engine.model.batches)
        return one.result(), two.result(), await run(engine, second), since

    a, b, c, since = asyncio.run(main())
    vocab = engine.model.config.vocab_size
    assert a[0] == expected_continuation(first, 12, vocab)
    assert b[0] == c[0] == expected_continuation(second, 12, vocab)
    assert c[1].cached_tokens == (len(second) - 1) // BLOCK * BLOCK
    assert tokens_run(engine, since) == len(second) - c[1].cached_tokens + 11
    assert_all_released(engine)
