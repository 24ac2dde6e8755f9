"""The decoding guide inside the engine: grammar masks and the thinking budget, checked
against the fake model's own rule (next = (sum * 7 + len) % vocab) replayed by hand."""

import asyncio
import threading

import numpy as np
import pytest

from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import Engine
from freetoken.engine.guide import Guide, ThinkRule
from freetoken.engine.request import SamplingParams
from tests.engine.fakes import ALPHABET, CharTokenizer, FakeModel, next_token

VOCAB = len(ALPHABET)
PROMPT = [5, 9, 2, 14]


def make_engine():
    return Engine(FakeModel(), CharTokenizer(), EngineConfig(
        num_tokens=512, block_size=8, max_num_seqs=4, max_prefill_tokens=32,
        device="cpu")).start()


def generate(engine, guide, count):
    async def run():
        stream = engine.submit(PROMPT, SamplingParams(temperature=0.0, max_tokens=count),
                               guide=guide)
        return [t async for out in stream for t in out.token_ids]
    return asyncio.run(run())


class EvenTokens:
    """A grammar that allows only even token ids, recording what it consumed and where its
    masks were computed."""

    def __init__(self):
        self.consumed: list[int] = []
        self.threads: set[str] = set()

    def consume(self, token_id: int) -> bool:
        self.consumed.append(token_id)
        return token_id % 2 == 0

    def allowed(self):
        self.threads.add(threading.current_thread().name)
        return np.arange(VOCAB) % 2 == 0


def test_grammar_mask_restricts_every_step():
    engine = make_engine()
    try:
        matcher = EvenTokens()
        tokens = generate(engine, Guide(matcher), 12)
    finally:
        engine.shutdown()
    context, expected = list(PROMPT), []
    for _ in range(12):
        wanted = next_token(context, VOCAB)
        # the fake model puts all its mass on `wanted`; masked, greedy takes the first
        # allowed id among the equal rest
        token = wanted if wanted % 2 == 0 else 0
        expected.append(token)
        context.append(token)
    assert tokens == expected
    assert matcher.consumed == expected
    assert matcher.threads == {next(iter(matcher.threads))} and \
        not matcher.threads & {"freetoken-engine", threading.current_thread().name}


def test_thinking_budget_forces_the_close_then_the_answer_follows():
    close = (ALPHABET.index("."), ALPHABET.index("!"))   # e.g. "\n" then "</think>"
    budget = 3
    engine = make_engine()
    try:
        guide = Guide(None, ThinkRule(None, close, budget, in_thinking=True))
        tokens = generate(engine, guide, 10)
    finally:
        engine.shutdown()
    context, expected = list(PROMPT), []
    for step in range(10):
        token = close[step - budget] if budget <= step < budget + len(close) else \
            next_token(context, VOCAB)
        expected.append(token)
        context.append(token)
    assert tokens == expected
    assert guide.phase == "answer" and guide.reasoning_tokens == budget


def test_grammar_waits_until_reasoning_ends():
    close = (ALPHABET.index("!"),)
    engine = make_engine()
    try:
        matcher = EvenTokens()
        guide = Guide(matcher, ThinkRule(None, close, 2, in_thinking=True))
        tokens = generate(engine, guide, 8)
    finally:
        engine.shutdown()
    assert tokens[2] == close[0]
    assert matcher.consumed == tokens[3:]            # reasoning never reached the grammar
    assert all(t % 2 == 0 for t in tokens[3:])


class FixedMask:
    def __init__(self, allowed):
        self.mask = allowed

    def consume(self, token_id: int) -> bool:
        return True

    def allowed(self):
        return self.mask


def _apply_on(device):
    import torch

    from freetoken.engine.guide import apply_guides

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 50)).astype(np.float32)
    allowed = rng.random(50) < 0.3
    guide = Guide(FixedMask(allowed)).start()
    expected = logits.copy()
    expected[1, ~allowed] = -np.inf
    on_device = torch.from_numpy(logits.copy()).to(device)
    apply_guides(logits, [None, guide, None])
    apply_guides(on_device, [None, guide, None])
    np.testing.assert_array_equal(logits, expected)
    np.testing.assert_array_equal(on_device.cpu().numpy(), expected)


def test_masks_apply_alike_to_numpy_and_torch_logits():
    _apply_on("cpu")


@pytest.mark.gpu
def test_masks_apply_to_cuda_logits():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    _apply_on("cuda")
