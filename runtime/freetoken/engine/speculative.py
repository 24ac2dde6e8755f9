"""Speculative decoding: draft up to K tokens for a decoding sequence, run its last token and
the drafts in one forward of K+1 tokens, keep the drafts the target agrees with and one token
more (the target's own choice after the last accepted draft).

Drafts come from prompt lookup: the longest recent n-gram of the request's own prompt and
output that ends like the sequence does now, followed by the tokens that came after it there
(coding agents rewrite what they just read, so the next tokens are often already in the
prompt). Verification keeps the output distribution exactly: a greedy request accepts a draft
token only when it is the target's argmax, so its output is the same token for token; a
sampled request accepts draft d with probability p(d) under the target's processed
distribution p (temperature, top-k, top-p, as sampling.sample_row draws) and otherwise draws
from p with d removed. That is rejection sampling for a draft that puts all its mass on d, so
each emitted token is distributed as p.

Drafting is off for requests whose sampling needs host work per token (penalties, logprobs,
a grammar) and for prompts with images. A hybrid model's recurrent states are rolled back past
rejected drafts (engine/state_rollback.py). A request whose drafts keep failing pauses drafting
and probes again later (DraftControl), so a failed draft costs little over time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from freetoken.engine.config import MAX_SPECULATIVE_TOKENS
from freetoken.engine.request import Request, SamplingParams
from freetoken.engine.sampling import draw_candidates, row_candidates, sample_row

# prompt lookup matches the last NGRAM_MAX..NGRAM_MIN tokens, longest first: a 1-token match
# predicts too little to pay for its verification
NGRAM_MIN, NGRAM_MAX = 2, 4
# DraftControl: drafting pauses when the recent share of accepted draft tokens falls below this
MIN_ACCEPTANCE = 0.3
MAX_PAUSE_STEPS = 64
# ... and a prompt-lookup draft stops at the token whose chance of being reached and accepted
# (alpha^j, alpha the request's measured per-token acceptance) falls below this: verifying it
# costs a row of the step for less than this share of a token
MIN_DRAFT_CHANCE = 0.3
# weight of past steps in the per-token acceptance estimate (recent steps count most)
ACCEPTANCE_MEMORY = 0.9
# GPU verify steps run in CUDA graphs up to this many sequences (engine/cuda_graph.py); wider
# steps draft nothing (Scheduler.max_drafting): such a batch keeps the GPU busy on its own
VERIFY_MAX_BATCH = 16


class NgramIndex:
    """For n in NGRAM_MIN..NGRAM_MAX, where each n-gram of a growing token list last ended,
    indexed incrementally (each token is indexed once, however long the prompt)."""

    def __init__(self) -> None:
        self._ends: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(NGRAM_MIN, NGRAM_MAX + 1)}
        self._indexed = 0   # n-grams ending before this position are in _ends

    def propose(self, ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix
        of `ids` that occurred before; [] when none did."""
        length = len(ids)
        for end in range(max(self._indexed, NGRAM_MIN), length):   # the suffix itself: not yet
            for n, ends in self._ends.items():
                if end >= n:
                    ends[tuple(ids[end - n:end])] = end
        self._indexed = max(self._indexed, length)
        for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            if length < n:
                continue
            end = self._ends[n].get(tuple(ids[length - n:]))
            if end is not None and end < length:
                return list(ids[end:end + k])
        return []


@dataclass
class DraftControl:
    """Per request: after a draft step, the share of its draft tokens accepted feeds a moving
    average; below MIN_ACCEPTANCE drafting pauses for `pause` steps, doubling (up to
    MAX_PAUSE_STEPS) each time it fails again, and a good step resets the pause.

    It also sets how long a draft is worth verifying (length): drafts are accepted as a run
    that stops at the first rejected token, so with per-token acceptance alpha the j-th draft
    token is accepted with chance alpha^j. alpha is estimated as accepted / (accepted +
    rejections) over recent steps (the estimate of a geometric run's parameter), starting from
    one accepted token, so a new request drafts in full."""

    acceptance: float = 1.0
    pause: int = 1
    skip: int = 0
    accepted_tokens: float = 1.0
    rejections: float = 0.0

    def allows(self) -> bool:
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def length(self, k: int) -> int:
        """Draft tokens worth verifying, of at most k: the longest run whose last token is
        reached and accepted with chance >= MIN_DRAFT_CHANCE (at least 1)."""
        alpha = self.accepted_tokens / (self.accepted_tokens + self.rejections)
        chance, n = alpha, 1
        while n < k and chance * alpha >= MIN_DRAFT_CHANCE:
            chance *= alpha
            n += 1
        return n

    def record(self, drafted: int, accepted: int) -> None:
        self.accepted_tokens = ACCEPTANCE_MEMORY * self.accepted_tokens + accepted
        self.rejections = ACCEPTANCE_MEMORY * self.rejections + (accepted < drafted)
        self.acceptance = 0.6 * self.acceptance + 0.4 * accepted / drafted
        if self.acceptance < MIN_ACCEPTANCE:
            self.skip = self.pause
            self.pause = min(2 * self.pause, MAX_PAUSE_STEPS)
            self.acceptance = MIN_ACCEPTANCE    # the probe after the pause decides afresh
        elif accepted:
            self.pause = 1


class Governor:
    """`--speculative auto`: drafting stays on only at batch sizes where it measures faster.

    Per batch size (decoding sequences in a step) it keeps a moving average of the tokens a
    decode step emits per second with drafting allowed and without (allowed: the MTP block
    runs, and a request drafts unless its DraftControl pauses it). Each mode is first measured
    for PROBE_STEPS steps; then the faster one runs, and every REPROBE_STEPS steps the slower one
    is measured again (acceptance and step costs change with the requests). Drafting turned
    off stops the MTP block's steps too (its drafts are what costs there); the block's K/V
    misses those positions, which only lowers its acceptance until they leave the window.

    A drafting step that verifies drafts and accepts none emits one token a sequence, as a plain
    step does, at a verify step's cost or more: it cannot be faster. BARREN_STEPS such steps in
    a row end the drafting probe early with drafting off at that batch size (until its next
    probe), so a block that never agrees costs 2 steps instead of PROBE_STEPS. Acceptance does
    not depend on the batch size, so for the next INHERIT_STEPS steps (while the same requests
    likely run: a batch ramping up 1, 2, ... 8) a batch size seen for the first time skips its
    drafting probe too; a drafting step that accepts a draft lifts that at once."""

    PROBE_STEPS = 8
    REPROBE_STEPS = 512
    BARREN_STEPS = 2
    INHERIT_STEPS = 64

    def __init__(self) -> None:
        self._rate: dict[tuple[int, bool], float] = {}
        self._samples: dict[tuple[int, bool], int] = {}
        self._since_probe: dict[int, int] = {}
        self._barren: dict[int, int] = {}     # drafting steps in a row that accepted nothing
        self._losing: set[int] = set()        # batch sizes whose drafting probe ended barren
        self._steps = 0                       # decode steps counted by allows()
        self._barren_until = -1               # new batch sizes skip drafting up to this step

    def allows(self, batch: int) -> bool:
        """Whether a step of `batch` decoding sequences drafts; counts the step."""
        self._steps += 1
        if (probing := self._probing(batch)) is not None:
            return probing
        faster = self._drafting_faster(batch)
        since = self._since_probe.get(batch, 0) + 1
        self._since_probe[batch] = since
        if since >= self.REPROBE_STEPS:     # measure the slower mode afresh
            self._since_probe[batch] = 0
            self._samples[batch, not faster] = 0
            self._losing.discard(batch)
            self._barren[batch] = 0
        return faster

    def would_allow(self, batch: int) -> bool:
        """What allows(batch) would answer, without counting a step."""
        if (probing := self._probing(batch)) is not None:
            return probing
        return self._drafting_faster(batch)

    def _drafting_faster(self, batch: int) -> bool:
        return batch not in self._losing and self._rate[batch, True] >= self._rate[batch, False]

    def _probing(self, batch: int) -> bool | None:
        """The mode still short of PROBE_STEPS samples at `batch` (drafting first), or None. A
        batch size first seen soon after a barren probe starts with drafting off."""
        if (batch, True) not in self._samples and self._steps <= self._barren_until:
            self._samples[batch, True] = self.PROBE_STEPS
            self._losing.add(batch)
        for mode in (True, False):
            if self._samples.get((batch, mode), 0) < self.PROBE_STEPS:
                return mode
        return None

    def record(self, batch: int, drafted: bool, tokens: int, seconds: float,
               proposed: int = 0) -> None:
        """A decode step of `batch` sequences, with drafts or not, emitted `tokens`; `proposed`:
        the draft tokens it verified."""
        if seconds <= 0:
            return
        key, rate = (batch, drafted), tokens / seconds
        n = self._samples.get(key, 0)
        old = self._rate.get(key, rate)
        self._rate[key] = rate if n == 0 else 0.75 * old + 0.25 * rate
        self._samples[key] = n + 1
        if not (drafted and proposed):    # no drafts verified (no n-gram match, say): no evidence
            return
        barren = self._barren[batch] = self._barren.get(batch, 0) + 1 if tokens <= batch else 0
        if not barren:                    # a draft was accepted: new batch sizes probe again
            self._barren_until = -1
        if barren >= self.BARREN_STEPS and n + 1 < self.PROBE_STEPS:
            self._samples[key] = self.PROBE_STEPS      # the probe has its answer: drafting off
            self._losing.add(batch)
            self._barren_until = self._steps + self.INHERIT_STEPS

    def as_dict(self) -> dict:
        """Per batch size measured both ways: drafting's share of plain decoding's speed."""
        return {f"spec_auto_speedup_batch_{b}":
                round(self._rate[b, True] / self._rate[b, False], 3)
                for b, mode in self._rate if mode and (b, False) in self._rate}


@dataclass
class DraftState:
    """A request's drafting state (Request.draft_state)."""

    index: NgramIndex = field(default_factory=NgramIndex)
    control: DraftControl = field(default_factory=DraftControl)
    mtp_draft: tuple[int, ...] = ()   # the MTP block's drafts for the next step


@dataclass
class SpeculativeStats:
    """Totals for /v1/stats and /metrics."""

    steps: int = 0           # sequences verified with at least one draft token
    drafted: int = 0         # draft tokens verified
    accepted: int = 0        # of which accepted
    replays: int = 0         # hybrid models: sequences whose states were rolled back

    def as_dict(self) -> dict:
        return {"spec_verify_steps": self.steps, "spec_draft_tokens": self.drafted,
                "spec_accepted_tokens": self.accepted, "spec_replays": self.replays,
                "spec_acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                # tokens a verify step emits: its accepted drafts and the target's next token
                "spec_mean_accepted_length": (1 + self.accepted / self.steps) if self.steps
                else 0.0}


def speculation_blocker(engine) -> str | None:
    """Why this engine does not verify drafts (None when it does): tensor parallelism (a
    step is not one local forward); with offloaded experts, `auto` (a verify step's K + 1
    tokens route to more experts than one token, so it misses more; not yet measured at a low
    cache rate); an explicit method runs there, verify steps taking the expert cache's decode
    path eagerly."""
    if getattr(engine.model, "tensor_parallel_size", 1) > 1:
        return "tensor parallelism"
    if engine.expert_cache is not None and engine.config.speculative == "auto":
        return ("the MoE experts are offloaded: a verify step's tokens miss more experts "
                "(--speculative ngram or mtp drafts all the same)")
    return None


class Drafter:
    """Proposes each step's drafts (Scheduler.drafter): by prompt lookup ("ngram"), or the
    drafts the model's MTP block made after the last step ("mtp", engine/mtp_drafts.py); keeps
    the totals."""

    def __init__(self, num_tokens: int, method: str = "ngram"):
        if not 1 <= num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, "
                             f"got {num_tokens}")
        self.num_tokens, self.method = num_tokens, method
        self.stats = SpeculativeStats()

    def draft(self, request: Request, budget: int) -> tuple[int, ...]:
        """Up to num_tokens draft tokens for a decoding request (none past its max_tokens or
        the step's token `budget`)."""
        room = min(self.num_tokens, budget, request.params.max_tokens - request.num_output - 1)
        if room <= 0 or not can_draft(request):
            return ()
        state = request.draft_state
        if state is None:
            state = request.draft_state = DraftState()
        if self.method == "mtp":
            draft, state.mtp_draft = state.mtp_draft, ()
            return draft[:room] if state.control.allows() else ()
        if not state.control.allows():
            return ()
        # prompt lookup: as long a draft as the request's acceptance makes worth verifying
        # (MTP drafts keep K: the block made them already, and hybrid verify graphs take K)
        return tuple(state.index.propose(request.token_ids, state.control.length(room)))

    def record(self, request: Request, drafted: int, accepted: int) -> None:
        self.stats.steps += 1
        self.stats.drafted += drafted
        self.stats.accepted += accepted
        request.draft_state.control.record(drafted, accepted)


def can_draft(request: Request) -> bool:
    """Whether a request's tokens can be verified several at a time: sampling without host
    work between tokens (penalties, logprobs, a grammar), a text-only prompt."""
    params = request.params
    return (not params.has_penalties and params.logprobs is None and request.guide is None
            and request.mm is None)


def verify(rows, draft: Sequence[int], params: SamplingParams,
           generator: np.random.Generator) -> list[int]:
    """The tokens a verify step emits for one sequence: the accepted prefix of `draft`, then
    one token from the target. `rows` are the target's float32 logits [len(draft) + 1, vocab]
    (numpy) at the sequence's last token and at each draft token."""
    if params.temperature <= 0:
        return accept_greedy(rows.argmax(-1).tolist(), draft)
    out: list[int] = []
    for i, token in enumerate(draft):
        ids, weights = row_candidates(rows[i], params)
        here = ids == token
        if generator.random() * weights.sum() < weights[here].sum():
            out.append(int(token))
            continue
        out.append(draw_candidates(ids, np.where(here, 0.0, weights), generator.random()))
        return out
    out.append(sample_row(rows[len(draft)], params, generator.random()))
    return out


def accept_greedy(targets: Sequence[int], draft: Sequence[int]) -> list[int]:
    """Greedy verification given the target's argmax after each of the K+1 tokens: drafts up
    to the first disagreement, then the target's token there (or after the last draft)."""
    out: list[int] = []
    for token, target in zip(draft, targets):
        out.append(int(target))
        if target != token:
            return out
    out.append(int(targets[len(draft)]))
    return out
