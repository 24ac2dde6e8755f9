"""Speculative decoding (engine/speculative.py): prompt-lookup drafts against a brute-force
search, greedy verification token-identical to plain decoding through the engine (paging,
preemption, stop conditions, freed pages), rejection sampling that keeps the target's
distribution (chi-square over 10^5 draws on a tiny model's logits), stats and settings."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from freetoken.engine.config import EngineConfig, EngineConfigError
from freetoken.engine.engine import Engine
from freetoken.engine.request import SamplingParams
from freetoken.engine.speculative import (MIN_DRAFT_CHANCE, NGRAM_MAX, NGRAM_MIN, DraftControl,
                                          Governor, NgramIndex, accept_greedy,
                                          speculation_blocker, verify)
from tests.engine.fakes import CharTokenizer, FakeModel, expected_continuation, repeating_token

TOK = CharTokenizer()


def brute_force_lookup(ids: list[int], k: int) -> list[int]:
    """The tokens after the latest earlier occurrence of the longest suffix (n from NGRAM_MAX
    down to NGRAM_MIN) of `ids`, searched directly."""
    for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
        if len(ids) < n:
            continue
        suffix = ids[-n:]
        for end in range(len(ids) - 1, n - 1, -1):
            if ids[end - n:end] == suffix:
                return ids[end:end + k]
    return []


@pytest.mark.parametrize("vocab", [3, 6])
def test_ngram_index_proposes_what_a_direct_search_finds(vocab):
    rng = np.random.default_rng(vocab)
    ids = rng.integers(0, vocab, 8).tolist()
    index = NgramIndex()
    for _ in range(300):
        k = int(rng.integers(1, 5))
        assert index.propose(ids, k) == brute_force_lookup(ids, k), ids
        ids.append(int(rng.integers(0, vocab)))


def test_ngram_index_takes_a_long_prompt_at_once_then_token_by_token():
    ids = list(range(50)) * 3 + [7, 8, 9]
    index = NgramIndex()
    assert index.propose(ids, 3) == [10, 11, 12]
    assert index.propose(ids + [10], 2) == [11, 12]
    assert NgramIndex().propose([1, 2, 3, 4], 2) == []


def test_accept_greedy_keeps_the_agreeing_prefix_and_the_targets_next_token():
    assert accept_greedy([5, 6, 7], [5, 6]) == [5, 6, 7]       # all accepted, bonus 7
    assert accept_greedy([5, 9, 7], [5, 6]) == [5, 9]          # second rejected: target's 9
    assert accept_greedy([4, 6, 7], [5, 6]) == [4]             # first rejected
    assert accept_greedy([3, 1], [3]) == [3, 1]


def test_draft_control_pauses_after_failures_and_resumes_after_a_probe():
    control = DraftControl()
    for failures in range(1, 4):   # a fresh request gets a few chances
        control.record(4, 0)
        if control.skip:
            break
    assert control.skip and failures > 1
    skips = []
    for _ in range(4):   # each further failure doubles the pause
        while not control.allows():
            pass
        control.record(4, 0)
        skips.append(control.skip)
    assert skips == [2, 4, 8, 16]
    while not control.allows():
        pass
    control.record(4, 4)
    control.record(4, 4)
    assert control.allows() and control.pause == 1


def test_draft_length_follows_the_per_token_acceptance():
    """Drafts are accepted as runs: with per-token acceptance alpha the j-th draft token lands
    with chance alpha^j; a draft stops where that falls below MIN_DRAFT_CHANCE."""
    control = DraftControl()
    assert control.length(4) == 4                      # a new request drafts in full
    for _ in range(30):                                # 1 of 4 accepted: alpha -> 1/2
        control.record(4, 1)
    alpha = control.accepted_tokens / (control.accepted_tokens + control.rejections)
    assert alpha == pytest.approx(0.5, abs=0.02)
    assert control.length(4) == 1                      # 0.5^2 = 0.25 < MIN_DRAFT_CHANCE
    for _ in range(30):                                # 2 of 4: alpha -> 2/3 (from below)
        control.record(4, 2)
    assert MIN_DRAFT_CHANCE == 0.3 and control.length(4) == 2    # (2/3)^3 < 0.3 <= (2/3)^2
    for _ in range(30):                                # every draft accepted: alpha -> 1
        control.record(4, 4)
    assert control.length(4) == 4 and control.length(2) == 2


# ---- the engine, with a model whose next token is known ----------------------------------


def spec_engine(speculative="ngram", k=3, num_tokens=512, seqs=8, chunk=32, eos=(),
                rule=repeating_token, prefix_cache=False, overlap=False):
    engine = Engine(FakeModel(rule=rule), TOK, EngineConfig(
        num_tokens=num_tokens, block_size=8, max_num_seqs=seqs, max_prefill_tokens=chunk,
        device="cpu", speculative=speculative, num_speculative_tokens=k,
        prefix_cache=prefix_cache), None, eos)
    if overlap:   # as on a GPU (the CPU runs the overlapped steps' logic synchronously)
        engine.overlap = engine.scheduler.governor is not None
    return engine.start()


async def collect(engine, prompt, **params):
    outs = [o async for o in engine.generate(prompt, SamplingParams(**params))]
    return outs, [t for o in outs for t in o.token_ids], "".join(o.text for o in outs)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_speculation_gives_the_plain_tokens_under_preemption(k):
    engine = spec_engine(k=k, num_tokens=192, seqs=6, chunk=16)   # too few pages for all
    prompts = [TOK.encode(f"abcde request {i} " * (1 + i % 3)) for i in range(8)]
    lengths = [40 + 7 * i for i in range(8)]

    async def main():
        return await asyncio.gather(*(collect(engine, p, max_tokens=n, temperature=0.0)
                                      for p, n in zip(prompts, lengths)))

    try:
        results = asyncio.run(main())
        vocab = engine.model.config.vocab_size
        for prompt, n, (outs, ids, text) in zip(prompts, lengths, results):
            assert ids == expected_continuation(prompt, n, vocab, rule=repeating_token)
            assert text == TOK.decode(ids)
            assert outs[-1].finish_reason == "length"
            assert outs[-1].usage.completion_tokens == n     # never past max_tokens
        stats = engine.stats()
        assert stats["preemptions"] >= 1
        assert stats["kv_pages_used"] == 0 and stats["running"] == stats["waiting"] == 0
        # the rule repeats with period 5 but breaks every 11th token: drafts are mostly
        # accepted, some rejected
        assert stats["speculative"] == "ngram" and stats["num_speculative_tokens"] == k
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
        assert stats["spec_acceptance_rate"] > 0.5
        assert stats["tokens_generated"] == sum(lengths)
        # a verify step ran fewer forwards than tokens
        assert stats["steps"] < sum(lengths)
        # every verify step's input: the last token and its drafts, logits for each
        verify_steps = [b for b in engine.model.batches if b.logits_indices.shape[0] > b.num_seqs]
        assert verify_steps
    finally:
        engine.shutdown()


def test_greedy_speculation_stops_at_eos_and_stop_strings_inside_accepted_drafts():
    prompt = TOK.encode("xyzab xyzab xyzab")
    plain = expected_continuation(prompt, 60, FakeModel().config.vocab_size, rule=repeating_token)
    eos = plain[23]                 # a token the drafts predict, deep into the output
    engine = spec_engine(eos=(eos,))
    try:
        outs, ids, _ = asyncio.run(collect(engine, prompt, max_tokens=60, temperature=0.0))
        assert ids == plain[:plain.index(eos) + 1] and outs[-1].finish_reason == "stop"
        stop = TOK.decode(plain[30:32])
        outs, ids, text = asyncio.run(collect(engine, prompt, max_tokens=60, temperature=0.0,
                                              ignore_eos=True, stop=(stop,)))
        want = TOK.decode(plain)
        assert text == want[:want.index(stop)] and outs[-1].finish_reason == "stop"
        assert engine.stats()["kv_pages_used"] == 0
    finally:
        engine.shutdown()


def test_requests_that_need_per_token_host_work_decode_one_token_at_a_time():
    engine = spec_engine()
    prompt = TOK.encode("abcde abcde abcde")
    try:
        for extra in (dict(logprobs=2), dict(presence_penalty=0.5)):
            before = engine.stats()["spec_draft_tokens"]
            outs, ids, _ = asyncio.run(collect(engine, prompt, max_tokens=20,
                                               temperature=0.0, **extra))
            assert len(ids) == 20
            assert engine.stats()["spec_draft_tokens"] == before
    finally:
        engine.shutdown()


def test_sampled_speculation_completes_seeded_requests_with_freed_pages():
    engine = spec_engine(prefix_cache=True)
    prompt = TOK.encode("abcde abcde abcde")
    try:
        async def main():
            return await asyncio.gather(*(collect(engine, prompt, max_tokens=50,
                                                  temperature=0.7, top_p=0.9, seed=s)
                                          for s in range(4)))
        runs = asyncio.run(main())
        again = asyncio.run(collect(engine, prompt, max_tokens=50, temperature=0.7,
                                    top_p=0.9, seed=0))
        # the fake's logits put 10 on one token: at temperature 0.7 it has p > 0.999
        for outs, ids, _ in runs:
            assert len(ids) == 50 and outs[-1].finish_reason == "length"
        assert again[1] == runs[0][1]          # seeded: the same tokens again
        stats = engine.stats()
        assert stats["spec_accepted_tokens"] > 0 and stats["running"] == 0
        engine.pool.check_integrity([])
    finally:
        engine.shutdown()


def test_off_and_blocked_engines_report_why():
    engine = spec_engine(speculative="off")
    try:
        stats = engine.stats()
        assert stats["speculative"] == "off" and "spec_draft_tokens" not in stats
    finally:
        engine.shutdown()
    auto, ngram = (SimpleNamespace(speculative=m) for m in ("auto", "ngram"))
    fake = SimpleNamespace(states=object(), expert_cache=None, model=SimpleNamespace(),
                           config=auto)
    assert speculation_blocker(fake) is None     # hybrid states are rolled back
    fake = SimpleNamespace(states=None, expert_cache=None, config=ngram,
                           model=SimpleNamespace(tensor_parallel_size=2))
    assert "tensor parallelism" in speculation_blocker(fake)
    # offloaded experts: auto leaves drafting off, an explicit method drafts
    fake = SimpleNamespace(states=None, expert_cache=object(), model=SimpleNamespace(),
                           config=auto)
    assert "offloaded" in speculation_blocker(fake)
    assert speculation_blocker(SimpleNamespace(**{**vars(fake), "config": ngram})) is None


@pytest.mark.parametrize("settings", [dict(speculative="eagle"), dict(num_speculative_tokens=0),
                                      dict(num_speculative_tokens=5)])
def test_bad_speculative_settings_are_refused_by_name(settings):
    name = next(iter(settings))
    with pytest.raises(EngineConfigError, match=name):
        EngineConfig(**settings)


def test_serve_refuses_bad_speculative_flags():
    from click.testing import CliRunner

    from freetoken.cli.main import main as cli

    for args in (["--speculative", "eagle"], ["--num-speculative-tokens", "9"]):
        result = CliRunner().invoke(cli, ["serve", "x.gguf", *args])
        assert result.exit_code == 2 and args[0] in result.output


def test_metrics_carry_the_speculative_totals():
    from freetoken.server.speculative_metrics import SpeculativeCollector

    stats = {"spec_draft_tokens": 10, "spec_accepted_tokens": 7, "spec_verify_steps": 4,
             "spec_acceptance_rate": 0.7, "spec_mean_accepted_length": 2.75}
    families = {f.name: f.samples[0].value for f in SpeculativeCollector(lambda: stats).collect()}
    assert families["freetoken_spec_draft_tokens"] == 10
    assert families["freetoken_spec_accepted_tokens"] == 7
    assert families["freetoken_spec_mean_accepted_length"] == 2.75


# ---- rejection sampling keeps the target's distribution ------------------------------------


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int,
                    top_p: float) -> torch.Tensor:
    """The distribution a plain step samples from, written directly: softmax at the
    temperature over the top_k logits, then the most likely tokens while the mass before
    each is below top_p, renormalised."""
    scaled = logits.double() / temperature
    keep = torch.zeros_like(scaled, dtype=torch.bool)
    order = torch.argsort(scaled, descending=True, stable=True)
    keep[order[:top_k]] = True
    probs = torch.where(keep, torch.softmax(scaled.masked_fill(~keep, -math.inf), -1), 0.0)
    sorted_probs = probs[order]
    before = torch.cumsum(sorted_probs, 0) - sorted_probs
    nucleus = torch.zeros_like(keep)
    nucleus[order[before < top_p]] = True
    probs = torch.where(nucleus & keep, probs, 0.0)
    return probs / probs.sum()


def chi_square_ok(counts: np.ndarray, probs: np.ndarray, total: int) -> tuple[float, float]:
    """(statistic, critical value at p = 1e-6) with cells of expected count < 5 pooled."""
    expected = probs * total
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    z = 4.753   # upper 1e-6 quantile of the standard normal (Wilson-Hilferty)
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, crit


@pytest.fixture(scope="module")
def tiny_rows(tmp_path_factory):
    """A tiny random llama's float32 logits after each of 3 consecutive tokens."""
    from tests.models.helpers import tiny_hf_model

    model = tiny_hf_model("llama", tmp_path_factory.mktemp("spec-llama"), seed=3)
    with torch.no_grad():
        logits = model(torch.tensor([[5, 17, 9, 40, 3]])).logits[0, -3:]
    return (logits * 4.0).float()   # sharper than random weights give: drafts get accepted


def test_rejection_sampling_keeps_the_target_distribution(tiny_rows):
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, max_tokens=8).resolve(
        None, 8)
    probs = [reference_probs(row, 0.8, 40, 0.95).numpy() for row in tiny_rows]
    # drafts: the second most likely token at step 0 (accepted about p0(d0) of the time), the
    # most likely at step 1
    d0 = int(np.argsort(-probs[0])[1])
    d1 = int(np.argmax(probs[1]))
    draft = (d0, d1)
    rows = tiny_rows.numpy()
    rng = np.random.default_rng(0)
    vocab = rows.shape[1]
    first = np.zeros(vocab)
    second = np.zeros(vocab)
    third = np.zeros(vocab)
    total = 100_000
    for _ in range(total):
        out = verify(rows, draft, params, rng)
        first[out[0]] += 1
        if out[0] == d0:
            second[out[1]] += 1
            if len(out) == 3:
                third[out[2]] += 1
        assert len(out) == 3 or out[-1] != draft[len(out) - 1]
    # every emitted token is distributed as the target's: the first as p0; the second, given
    # the first was the draft, as p1 (emitted whether d1 was accepted or replaced); the
    # bonus token after both drafts as p2
    for counts, p in ((first, probs[0]), (second, probs[1]), (third, probs[2])):
        n = int(counts.sum())
        assert n > 2000
        stat, crit = chi_square_ok(counts, p, n)
        assert stat < crit, (stat, crit)
    assert first[d0] / total == pytest.approx(probs[0][d0], abs=5 * math.sqrt(
        probs[0][d0] / total))


def decoding_rows(batch) -> list[int]:
    """The query rows of each decoding sequence of a step (1 + its drafts): the sequences
    every one of whose rows returns logits (a prompt chunk returns at most its last)."""
    starts = np.asarray(batch.query_start_loc).tolist()
    rows = np.asarray(batch.logits_indices)
    out = []
    for a, b in zip(starts, starts[1:]):
        if int(((rows >= a) & (rows < b)).sum()) == b - a:
            out.append(b - a)
    return out


def test_steps_wider_than_max_drafting_draft_nothing():
    """Scheduler.max_drafting: a step with more decoding sequences than that drafts for none
    of them (a GPU verifies at most VERIFY_MAX_BATCH sequences in its graphs); narrower steps
    draft for every one."""
    engine = spec_engine(k=2, seqs=4)
    engine.scheduler.max_drafting = 2
    prompts = [TOK.encode(f"abcde abcde {i}") for i in range(3)]

    async def run(batch):
        return await asyncio.gather(*(collect(engine, p, max_tokens=30, temperature=0.0)
                                      for p in batch))

    try:
        wide = []
        for _ in range(5):    # the three must meet in a step: the engine may run one ahead
            engine.model.batches.clear()
            asyncio.run(run(prompts))       # three decode together: no step of all three drafts
            # (a step where one still prefills has two decoding sequences, which may draft)
            wide += [rows for rows in map(decoding_rows, engine.model.batches) if len(rows) == 3]
            if wide:
                break
        assert wide and all(rows == [1, 1, 1] for rows in wide), wide
        engine.model.batches.clear()
        asyncio.run(run(prompts[:2]))   # two: both draft
        assert any(b.num_seqs == 2 and b.logits_indices.shape[0] > 2
                   for b in engine.model.batches)
        assert engine.stats()["kv_pages_used"] == 0
    finally:
        engine.shutdown()


def test_governor_keeps_the_faster_mode_per_batch_size_and_probes_again():
    governor = Governor()
    n = Governor.PROBE_STEPS
    # each batch size measures drafting first, then plain decoding
    assert [governor.allows(1) for _ in range(1)] == [True]
    for _ in range(n):
        governor.record(1, True, tokens=3, seconds=0.01)      # 300 tok/s with drafts
    assert governor.allows(1) is False
    for _ in range(n):
        governor.record(1, False, tokens=1, seconds=0.005)    # 200 tok/s without
    assert governor.allows(1) is True and governor.allows(4) is True   # batch 4: unmeasured
    assert governor.as_dict() == {"spec_auto_speedup_batch_1": 1.5}
    # the slower mode is measured again after REPROBE_STEPS decisions
    decisions = [governor.allows(1) for _ in range(Governor.REPROBE_STEPS + 1)]
    assert decisions[-1] is False and all(decisions[:-2])


def test_a_probe_whose_drafts_are_never_accepted_ends_early():
    """Drafting steps that accept nothing emit a token a sequence at a verify step's cost:
    after BARREN_STEPS of them the probe ends with drafting off at that batch size, even where
    their timing looked no slower; a batch size first seen right after (a batch ramping up)
    starts with drafting off too; the next probe starts afresh."""
    governor = Governor()
    for _ in range(Governor.BARREN_STEPS):
        assert governor.allows(4) is True
        governor.record(4, True, tokens=4, seconds=0.001, proposed=8)   # none accepted
    assert governor.allows(4) is False                         # probing plain decoding now
    for _ in range(Governor.PROBE_STEPS):
        governor.record(4, False, tokens=4, seconds=0.01)     # plain: slower by the clock
    assert governor.allows(4) is False and governor.would_allow(4) is False
    assert governor.would_allow(5) is False and governor.allows(5) is False   # inherited
    for _ in range(Governor.PROBE_STEPS):
        governor.record(5, False, tokens=5, seconds=0.01)
    assert governor.allows(5) is False and "spec_auto_speedup_batch_5" not in governor.as_dict()
    # the next probe measures drafting at batch 4 again
    decisions = [governor.allows(4) for _ in range(Governor.REPROBE_STEPS)]
    assert not any(decisions[:-1]) and governor.allows(4) is True


def test_a_barren_verdict_holds_for_a_while_and_until_a_draft_is_accepted():
    governor = Governor()
    for _ in range(Governor.BARREN_STEPS):
        governor.allows(1)
        governor.record(1, True, tokens=1, seconds=0.01, proposed=2)
    assert governor.allows(2) is False                         # within INHERIT_STEPS
    for _ in range(Governor.INHERIT_STEPS):
        governor.allows(1)
    assert governor.allows(3) is True                          # later: its own probe
    # steps that drafted nothing are no evidence; one accepted draft breaks the run
    for _ in range(Governor.BARREN_STEPS):
        governor.record(3, True, tokens=3, seconds=0.01)
    governor.record(3, True, tokens=3, seconds=0.01, proposed=4)
    governor.record(3, True, tokens=4, seconds=0.01, proposed=4)
    governor.record(3, True, tokens=3, seconds=0.01, proposed=4)
    assert governor.allows(3) is True
    # a barren probe at batch 6, then an accepted draft at batch 3: new sizes probe again
    for _ in range(Governor.BARREN_STEPS):
        governor.allows(6)
        governor.record(6, True, tokens=6, seconds=0.01, proposed=6)
    governor.record(3, True, tokens=5, seconds=0.01, proposed=4)
    assert governor.allows(7) is True


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("draft_row_seconds, drafts_win", [(0.01, False), (0.0, True)])
def test_auto_turns_drafting_off_where_it_measures_slower(draft_row_seconds, drafts_win,
                                                          overlap):
    """A model whose verify steps cost 5x a plain step per draft token makes drafting ~5x
    slower however many drafts are accepted: auto stops drafting; a model whose steps cost the
    same at any width (drafts ~3x faster here) keeps it. With overlap scheduling, the plain
    steps overlap (timed by their period) and the drafting ones never do."""
    engine = spec_engine(speculative="auto", k=3, overlap=overlap)
    engine.model.step_seconds, engine.model.draft_row_seconds = 0.002, draft_row_seconds
    launched = []
    launch = engine._launch

    def counting_launch(plan, *args, **kwargs):
        launched.append(plan)
        return launch(plan, *args, **kwargs)
    engine._launch = counting_launch
    prompt = TOK.encode("abcde abcde abcde")
    try:
        _, ids, _ = asyncio.run(collect(engine, prompt, max_tokens=120, temperature=0.0))
        assert not any(c.draft for plan in launched for c in plan)
        assert (len(launched) >= Governor.PROBE_STEPS) == overlap, len(launched)
        if overlap and not drafts_win:      # nearly every step after the probes overlapped
            assert len(launched) > 60, len(launched)
        assert ids == expected_continuation(prompt, 120, engine.model.config.vocab_size,
                                            rule=repeating_token)
        stats = engine.stats()
        speedup = stats["spec_auto_speedup_batch_1"]
        assert (speedup > 1.0) == drafts_win, stats
        # after both probes, the steps draft only if drafting won
        late = engine.model.batches[-20:]
        assert any(b.num_tokens > b.num_seqs for b in late) == drafts_win
    finally:
        engine.shutdown()
