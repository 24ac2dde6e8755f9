"""Drafting with a checkpoint's MTP block (engine/mtp_drafts.py): the engine's first draft token
after each step is the argmax of an independent float64 reference of the block fed by
transformers' own hidden states of the target, greedy output stays the target's, and the
totals say MTP drafted."""

import pytest
import torch

from freetoken.engine.config import EngineConfig, EngineConfigError
from freetoken.engine.engine import Engine
from freetoken.models.loader import load_model
from tests.engine.test_speculative_hybrid import generate
from tests.models.test_hybrid_hf import build_hybrid, float64_reference
from tests.models.test_mtp import ARCHS, mtp_checkpoint, mtp_reference  # noqa: F401 (fixture)

NEW_TOKENS = 12


@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_drafts_are_the_blocks_argmax_and_greedy_output_is_kept(arch, mtp_checkpoint,
                                                                   moe_ops, monkeypatch):
    from freetoken.engine.speculative import Governor

    # a random block's drafts are rarely accepted: auto's governor would stop drafting after
    # its first barren steps, and this test needs several drafts to compare
    monkeypatch.setattr(Governor, "BARREN_STEPS", 10**9)
    directory, hf, tensors = mtp_checkpoint(arch)
    loaded = load_model(str(directory))
    assert loaded.model.mtp is not None
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, loaded.config.vocab_size, (n,), generator=gen).tolist()
               for n in (9, 17)]

    def engine(speculative):
        return Engine.from_loaded(loaded, EngineConfig(
            num_tokens=512, block_size=8, max_num_seqs=4, max_prefill_tokens=16,
            kv_dtype="float32", speculative=speculative, num_speculative_tokens=2)).start()

    plain = engine("off")
    try:
        expected = generate(plain, prompts, max_tokens=NEW_TOKENS)
    finally:
        plain.shutdown()
    spec = engine("auto")            # auto: the model has an MTP block
    drafts = []                      # (token ids at drafting time, the draft)
    draft = spec.scheduler.drafter

    def record(request, budget):
        out = draft(request, budget)
        if out:
            drafts.append((list(request.token_ids), out))
        return out

    spec.scheduler.drafter = record
    try:
        got = generate(spec, prompts, max_tokens=NEW_TOKENS)
        stats = spec.stats()
    finally:
        spec.shutdown()
    assert got == expected
    assert stats["speculative"] == "mtp" and stats["spec_draft_tokens"] > 0
    assert stats["state_slots_used"] == 0 and stats["kv_pages_used"] == 0
    # each first draft token: the reference block over the whole sequence so far, fed
    # transformers' final-normed hidden states h_0..h_{n-2} and tokens x_1..x_{n-1}
    reference = float64_reference(hf)
    renormalize = loaded.config.moe.renormalize
    assert len(drafts) >= 4
    for ids, tokens in drafts[:6]:
        with torch.no_grad():
            hidden = reference.model(input_ids=torch.tensor([ids[:-1]])).last_hidden_state[0]
        logits, _ = mtp_reference(tensors, hf, ids[1:], hidden.numpy(),
                                  list(range(len(ids) - 1)), renormalize)
        assert tokens[0] == int(logits[-1].argmax()), (ids, tokens)


def test_mtp_without_a_block_is_refused_by_name(tmp_path):
    build_hybrid("qwen3_5_moe", tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.model.mtp is None
    with pytest.raises(EngineConfigError, match="no multi-token-prediction block"):
        Engine.from_loaded(loaded, EngineConfig(num_tokens=256, block_size=8,
                                                speculative="mtp"))
    engine = Engine.from_loaded(loaded, EngineConfig(num_tokens=256, block_size=8,
                                                     speculative="auto"))
    assert engine.stats()["speculative"] == "ngram"
