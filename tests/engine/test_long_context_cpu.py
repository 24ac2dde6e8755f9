"""Long context on the CPU: a 16,384-token prompt through the paged forward, against HF
transformers on the same tiny random Qwen3 (qk-norm) weights.

The prompt is prefilled in 2048-token chunks (as the engine chunks it with
max_prefill_tokens=2048) over scattered 16-slot KV pages, then decoded greedily. Transformers
runs the same prompt in float32 with its own KV cache (also fed in 2048-token chunks, which
only keeps its attention scores small: the math is the full causal forward) and then steps
token by token. The logits at the last prompt position and at every decoded step must agree
within the rounding bound of the KV dtype, stated where it is computed.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from freetoken.models.loader import load_model
from tests.models.helpers import PagedRunner, tiny_hf_model
from tests.tolerances import eps

PROMPT_LEN = 16_384
CHUNK = 2048              # the engine's max_prefill_tokens in this test
DECODE_STEPS = 16
BLOCK = 16
CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              max_position_embeddings=20_480, rope_theta=1e6)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-qwen3-long")
    hf = tiny_hf_model("qwen3", directory, seed=7, **CONFIG)
    hf.config._attn_implementation = "sdpa"
    return directory, hf


@pytest.fixture(scope="module")
def prompt(checkpoint):
    vocab = checkpoint[1].config.vocab_size
    gen = torch.Generator().manual_seed(11)
    return torch.randint(3, vocab, (PROMPT_LEN,), generator=gen).tolist()


@pytest.fixture(scope="module")
def reference(checkpoint, prompt):
    """Transformers' float32 logits at the last prompt position, then along its own greedy
    continuation (KV cache, one token a step): [DECODE_STEPS + 1, vocab] and the tokens."""
    from transformers import DynamicCache

    hf = checkpoint[1]
    cache = DynamicCache(config=hf.config)
    rows, tokens = [], []
    with torch.no_grad():
        for start in range(0, PROMPT_LEN, CHUNK):
            ids = torch.tensor([prompt[start:start + CHUNK]])
            out = hf(ids, cache=cache, use_cache=True, logits_to_keep=1)
        rows.append(out.logits[0, -1].float())
        for _ in range(DECODE_STEPS):
            tokens.append(int(rows[-1].argmax()))
            out = hf(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
            rows.append(out.logits[0, -1].float())
    assert cache.get_seq_length() == PROMPT_LEN + DECODE_STEPS
    return torch.stack(rows), tokens


def logit_bound(kv_dtype: str, config, n_ctx: int, magnitude: float) -> float:
    """The largest logit difference rounding explains, for logits of size `magnitude`.

    float16 KV: each stored K and V element is rounded once, relative error <= u = 2^-11
    (half of float16's eps). A softmax-weighted average of values each off by <= u relative is
    off by <= u x its magnitude, however many keys (16k) it averages: the errors do not add up
    over the context, they average. K's rounding moves each score s_i by <= u |s_i|, which moves
    the softmax output by <= 2 u max|s| relative (d p_i = p_i (d s_i - sum_j p_j d s_j)); with
    qk-norm the scores are O(1-10). Each layer's attention is then one more relative error of
    order eps16 carried linearly to the logits through o_proj, the MLP and the head (sums over
    hidden whose own float32 rounding is negligible beside it). So: 8 ulps of float16 at the
    logit magnitude, growing like sqrt(layers) -- the repository's float16-KV rule
    (tests/models/helpers.assert_logits_close) -- independent of the context length.

    float32 KV: float32 rounding of reductions whose lengths are the hidden and MLP widths and
    the context (the scores' softmax sum and the weighted sum of 16k values), in every layer:
    8 ulps of float32 at the logit magnitude times sqrt(those terms).
    """
    if kv_dtype == "float16":
        return 8 * eps("float16") * magnitude * math.sqrt(config.num_layers)
    terms = (config.hidden_size + config.intermediate_size + n_ctx) * config.num_layers
    return 8 * eps("float32") * magnitude * math.sqrt(terms)


@pytest.mark.parametrize("kv_dtype", ["float16", "float32"])
def test_16k_prompt_matches_transformers(checkpoint, prompt, reference, kv_dtype):
    directory, _ = checkpoint
    expected, hf_tokens = reference
    began = time.perf_counter()
    loaded = load_model(str(directory), device="cpu")
    assert loaded.config.qk_norm == "head" and loaded.model.dtype == "float32"
    assert loaded.config.max_position >= PROMPT_LEN + DECODE_STEPS
    blocks = -(-(PROMPT_LEN + DECODE_STEPS) // BLOCK) + 4
    runner = PagedRunner(loaded.model, num_blocks=blocks, block_size=BLOCK, kv_dtype=kv_dtype)
    assert str(runner.kv.k[0].dtype).endswith(kv_dtype)

    for start in range(0, PROMPT_LEN, CHUNK):
        logits = runner.step([(0, prompt[start:start + CHUNK])])[0].clone()
    # the whole prompt is in the KV: positions 0..16383 in 1024 pages
    assert runner.lengths[0] == PROMPT_LEN
    assert len(runner.pages[0]) == PROMPT_LEN // BLOCK
    # Decode along transformers' greedy tokens, so every step's logits see the same context
    # even past a near-tie; our own greedy pick at each step is each row's argmax.
    rows = [logits]
    for token in hf_tokens:
        rows.append(runner.step([(0, [token])])[0].clone())
    assert runner.lengths[0] == PROMPT_LEN + DECODE_STEPS
    # ...and the last decoded token's K really went to its slot at position 16383 + 16
    last = PROMPT_LEN + DECODE_STEPS - 1
    slot = runner.pages[0][last // BLOCK] * BLOCK + last % BLOCK
    assert torch.as_tensor(runner.kv.k[0][slot]).abs().max() > 0
    ours = torch.stack(rows).float()
    tokens = ours.argmax(dim=1).tolist()

    magnitude = float(expected.abs().max())
    limit = logit_bound(kv_dtype, loaded.config, PROMPT_LEN + DECODE_STEPS, magnitude)
    diff = (ours - expected).abs()
    worst = diff.max(dim=1)
    print(f"\n{kv_dtype} KV: {time.perf_counter() - began:.1f}s, max|logit| {magnitude:.3g}, "
          f"bound {limit:.3g}, max|diff| per step {[f'{d:.2g}' for d in worst.values.tolist()]}")
    bad = (worst.values > limit).nonzero().flatten().tolist()
    assert not bad, (
        f"{kv_dtype} KV: logits beyond the rounding bound {limit:.3g} at steps {bad} "
        f"(step 0 = last prompt position {PROMPT_LEN - 1}); worst |diff| "
        f"{float(worst.values.max()):.3g} at step {int(worst.values.argmax())}, "
        f"vocab index {int(worst.indices[worst.values.argmax()])}")

    # Greedy tokens: equal until the first near-tie, where rounding within the bound may pick
    # either of the top two (and the sequences diverge: nothing after it is comparable). Each
    # of the two logits may move by the bound, so a gap of up to twice it can flip.
    for step in range(DECODE_STEPS):
        top2 = expected[step].topk(2).values
        if float(top2[0] - top2[1]) <= 2 * limit:
            print(f"near-tie at step {step}: top-2 gap {float(top2[0] - top2[1]):.3g}; "
                  f"tokens not compared from there on")
            break
        assert tokens[step] == hf_tokens[step], (
            f"{kv_dtype} KV: greedy token {step} differs ({tokens[step]} vs transformers' "
            f"{hf_tokens[step]}) though the top-2 gap {float(top2[0] - top2[1]):.3g} exceeds "
            f"twice the bound {limit:.3g}; tokens are compared only up to the first near-tie")
