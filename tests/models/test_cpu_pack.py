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


def test_release_view_keeps_the_bytes_readable(tmp_path):
    """Dropping a mapped view's pages (after its bytes were packed elsewhere) must not change
    what a later read sees: the pages map again from the file. Owned arrays are left alone."""
    import mmap

    import numpy as np

    from freetoken.models.checkpoint.gguf_file import release_view

    data = np.random.default_rng(0).integers(0, 256, 5 * mmap.PAGESIZE, dtype=np.uint8)
    path = tmp_path / "blob"
    path.write_bytes(data.tobytes())
    with open(path, "rb") as f:
        mapped = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), dtype=np.uint8)
    view = mapped[100:4 * mmap.PAGESIZE + 7].reshape(-1, 1)
    assert np.array_equal(view[:, 0], data[100:4 * mmap.PAGESIZE + 7])
    release_view(view)
    assert np.array_equal(mapped, data)
    owned = data.copy()
    release_view(owned)
    assert np.array_equal(owned, data)
