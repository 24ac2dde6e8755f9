"""A coding agent's session at depth, over the fake paged model (its next token is a function
of the whole context read back through the block tables, so a wrong page changes the output):
ten turns growing to ~100k tokens, a tool result in the middle rewritten on the way. Each turn
prefills only what its cached prefix does not hold (the new turn, or everything from the
edit on); a second session beside it in a pool too small for both evicts cached pages, every
request completes with the exact output, and a prompt that needs every page of a pool full of
cached pages is served by eviction."""

import asyncio
import random

from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import Engine
from freetoken.engine.request import SamplingParams
from tests.engine.fakes import ALPHABET, CharTokenizer, FakeModel, expected_continuation

TOK = CharTokenizer()
BLOCK = 16
CONTEXT = 131_072
ANSWER = 8          # tokens the model answers each turn


def text(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(len(ALPHABET)) for _ in range(n)]


def make_engine(num_tokens: int, seqs: int = 2) -> Engine:
    return Engine(FakeModel(max_position=CONTEXT), TOK, EngineConfig(
        num_tokens=num_tokens, block_size=BLOCK, max_num_seqs=seqs, max_prefill_tokens=8192,
        device="cpu", prefix_cache=True)).start()


async def turn(engine, prompt):
    outs = [o async for o in engine.generate(prompt, SamplingParams(
        temperature=0.0, max_tokens=ANSWER, ignore_eos=True))]
    assert outs[-1].finish_reason == "length", outs[-1]   # never an error for lack of pages
    return [t for o in outs for t in o.token_ids], outs[-1].usage


def computed(engine, since: int) -> int:
    return sum(b.num_tokens for b in engine.model.batches[since:])


class Session:
    """An agent conversation: a system prompt with tools, then per turn a user message and
    a tool result of ~10k tokens; the model's answers are appended as they come."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.history = text(self.rng, 8000)
        self.tool_results: list[tuple[int, int]] = []   # (start, length) in history

    def next_prompt(self) -> list[int]:
        self.history += text(self.rng, 200)              # the user's message
        start, n = len(self.history), 9600
        self.history += text(self.rng, n)                # a file the agent read
        self.tool_results.append((start, n))
        return list(self.history)

    def rewrite_middle(self) -> int:
        """Replace the middle tool result with a shorter one (the agent re-read the file
        after editing it); returns the first changed position."""
        start, n = self.tool_results[len(self.tool_results) // 2]
        self.history[start:start + n] = text(self.rng, n - 1200)
        self.tool_results = [(s, m) for s, m in self.tool_results if s < start] + [
            (start, n - 1200)] + [(s - 1200, m) for s, m in self.tool_results if s > start]
        return start


def test_a_100k_session_prefills_only_its_new_tokens_and_edits():
    engine = make_engine(num_tokens=CONTEXT)
    session = Session(seed=1)
    vocab = engine.model.config.vocab_size
    try:
        for number in range(10):
            edited_at = session.rewrite_middle() if number == 6 else None
            previous = len(session.history)
            prompt = session.next_prompt()
            since = len(engine.model.batches)
            ids, usage = asyncio.run(turn(engine, prompt))
            assert ids == expected_continuation(prompt, ANSWER, vocab)
            # the cached prefix: every full page before the first token whose K/V the last
            # turn did not compute (the new messages; the answer's last token, never fed
            # back) or before the rewritten tool result; the last prompt token is recomputed
            first_new = edited_at if edited_at is not None else previous - 1
            want = min(first_new, len(prompt) - 1) // BLOCK * BLOCK if number else 0
            assert usage.cached_tokens == want, (number, usage.cached_tokens, want)
            # the step's work: the uncached prompt tokens and ANSWER - 1 decode steps
            assert computed(engine, since) == len(prompt) - want + ANSWER - 1
            session.history += ids
        assert len(session.history) > 100_000
        stats = engine.stats()
        # the pool (one full context) filled with the pages the edit left stale: those went,
        # least recently used first, and every turn still found its whole prefix
        assert stats["prefix_cache_evictions"] > 0 and stats["kv_pages_used"] == 0
    finally:
        engine.shutdown()


def test_two_sessions_in_too_small_a_pool_evict_and_complete():
    # room for one ~60k-token session and a half: the other session's cached pages go
    engine = make_engine(num_tokens=90_000)
    sessions = [Session(seed=2), Session(seed=3)]
    vocab = engine.model.config.vocab_size
    try:
        for _ in range(5):
            prompts = [s.next_prompt() for s in sessions]

            async def both():
                return await asyncio.gather(*(turn(engine, p) for p in prompts))

            for session, prompt, (ids, usage) in zip(sessions, prompts, asyncio.run(both())):
                assert ids == expected_continuation(prompt, ANSWER, vocab)
                session.history += ids
        stats = engine.stats()
        assert stats["prefix_cache_evictions"] > 0
        # a prompt needing nearly every page while the pool holds cached pages only
        assert stats["kv_pages_used"] == 0 and stats["kv_pages_cached"] > 0
        big = text(random.Random(4), 90_000 - 2 * BLOCK - ANSWER)
        ids, usage = asyncio.run(turn(engine, big))
        assert ids == expected_continuation(big, ANSWER, vocab)
        assert engine.stats()["kv_pages_used"] == 0
    finally:
        engine.shutdown()
