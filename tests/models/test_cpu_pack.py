"""The default model's Q4_1 / Q8_0 projections repacked at load (FREETOKEN_CPU_PACK) and in
the file's GGUF layout, each against transformers on the same file dequantized to f32.

Both layouts round activations to int8 per 32-block, so one product differs between them by
float summation order only; but an activation that lands the other side of a rounding step
moves by a whole step (max|x| / 127), so through 30 layers the two differ from each other about
as much as each differs from f32: both are held to test_smollm2's bound against transformers."""

from __future__ import annotations

import pytest
import torch

from freetoken.kernel import ops
from freetoken.models.forward.linear import QuantLinear
from tests.models.helpers import PagedRunner

pytestmark = [pytest.mark.needs_weights,
              pytest.mark.skipif(ops.cpu_isa() != "avx512",
                                 reason="packed weights need AVX-512 VNNI")]


def quant_linears(decoder) -> list[QuantLinear]:
    """Every QuantLinear of the decoder (layers' projections, parts and the LM head)."""
    found, stack = [], [decoder._lm_head, *decoder.layers]
    while stack:
        obj = stack.pop()
        if isinstance(obj, QuantLinear):
            found.append(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("freetoken.models"):
            stack.extend(vars(obj).values())
        elif isinstance(obj, list):
            stack.extend(obj)
    return found


from tests.models.test_smollm2 import KL_LIMIT  # noqa: E402


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    log_p, log_q = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    return float((log_p.exp() * (log_p - log_q)).sum())


def test_packed_and_gguf_layouts_both_match_transformers(monkeypatch):
    from pathlib import Path

    from freetoken.models.loader import load_model
    from tests.models.helpers import transformers_from_gguf

    packed = load_model(None)
    monkeypatch.setenv("FREETOKEN_CPU_PACK", "0")
    plain = load_model(None)
    # 30 layers x (qkv, o, gate_up, down) and the Q8_0 LM head
    assert [q.packed for q in quant_linears(packed.model)] == [True] * 121
    assert not any(q.packed for q in quant_linears(plain.model))
    reference, _ = transformers_from_gguf(Path(packed.source))
    tok = packed.tokenizer
    ids = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about the sea."}]), add_special_tokens=False)
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0].float()
    head = len(ids) - 8
    for loaded in (packed, plain):   # the last 8 prompt positions one step at a time, as decode
        runner = PagedRunner(loaded.model, num_blocks=16)
        runner.step([(0, ids[:head])])
        for i in range(head, len(ids)):
            got = runner.step([(0, [ids[i]])])[0]
            assert kl(want[i], got) < KL_LIMIT, (loaded is packed, i)
