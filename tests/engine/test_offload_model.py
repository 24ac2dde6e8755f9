"""The offload wiring end to end on the CPU: a tiny qwen3_moe whose experts were placed in host
torch tensors (the load_model plan hook), run through the expert cache with the real CPU MoE
kernel, gives the resident model's logits at every prefill (streamed layers) and decode (LRU)
step. torch CPU tensors stand in for the GPU pool; pinning needs CUDA, so it is stubbed."""

from __future__ import annotations

import pytest
import torch

from tests.models.helpers import PagedRunner, tiny_hf_model
from tests.tolerances import EPS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("offload-cpu-moe")
    tiny_hf_model("qwen3_moe", directory, seed=3, num_experts=16, num_experts_per_tok=2,
                  num_hidden_layers=3)
    return directory


def build(model_dir, plan=None):
    from freetoken.arrays import TorchArrays, parse_device
    from freetoken.models import loader
    from freetoken.models.checkpoint.hf import read_hf_dir
    from freetoken.models.checkpoint.weights import Placement

    config, tensors, _, _ = read_hf_dir(model_dir)
    place = Placement(TorchArrays(parse_device("cpu")), "float32")
    return loader._build_model(tensors, config, place, plan)


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("rate", [0.25, 0.05, 1.0])
def test_offloaded_forward_gives_the_resident_logits(model_dir, monkeypatch, rate, prefetch):
    from freetoken.engine import offload_setup
    from freetoken.engine.offload_setup import OffloadDecision, attach_expert_cache

    monkeypatch.setattr(offload_setup, "pin", lambda t, total=0: t)
    resident = build(model_dir)
    offloaded = build(model_dir, plan=lambda cfg, dtype, weights: True)
    assert offloaded.layers[0].mlp.w13.device.type == "cpu"
    cache = attach_expert_cache(offloaded, OffloadDecision(rate, 1024, None, None, False,
                                                           prefetch))
    assert (cache.predictors[0] is not None) == prefetch and cache.predictors[-1] is None
    assert cache.num_slots == max(2, int(rate * 48)) and offloaded.layers[0].mlp.w13 is None
    ours, ref = (PagedRunner(m, num_blocks=32, block_size=16) for m in (offloaded, resident))
    prompt = list(range(5, 45))
    a, b = ref.step([(0, prompt), (1, prompt[::-1])]), ours.step([(0, prompt), (1, prompt[::-1])])
    for _ in range(8):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        torch.testing.assert_close(b, a, rtol=0, atol=64 * EPS["float32"] * a.abs().max())
        nxt = [int(t) for t in a.argmax(-1)]
        a = ref.step([(0, nxt[:1]), (1, nxt[1:])])
        b = ours.step([(0, nxt[:1]), (1, nxt[1:])])
    stats = cache.stats.as_dict()
    assert stats["expert_streamed_layers"] == 3                 # the one prefill step
    assert stats["expert_hits"] + stats["expert_misses"] > 0
    copied = 3 * 16 + stats["expert_misses"] + stats["expert_prefetched"]
    assert stats["expert_bytes_h2d"] == copied * cache.expert_bytes
    assert stats["expert_prefetch_hits"] <= stats["expert_prefetched"]
    if prefetch and rate == 0.25:     # room beside a layer's experts: misses were copied ahead
        assert stats["expert_prefetched"] > 0
    if not prefetch:
        assert stats["expert_prefetched"] == 0
    cache.check_integrity()


def test_a_pinning_failure_names_memlock_the_bytes_and_the_fix():
    from freetoken.engine.memory_plan import MemoryPlanError
    from freetoken.engine.offload_setup import pin

    class Unpinnable:
        def numel(self):
            return 3 << 28

        def element_size(self):
            return 2

        def pin_memory(self):
            raise RuntimeError("CUDA error: out of memory")

    with pytest.raises(MemoryPlanError) as info:
        pin(Unpinnable(), total=40 << 30)
    text = str(info.value)
    for words in ("RLIMIT_MEMLOCK", "40.00 GiB in all", "1.50 GiB tensor", "ulimit -l unlimited",
                  "LimitMEMLOCK=infinity"):
        assert words in text, (words, text)


def slot_kernel(out, x, w13, w2, ids, weights, emap, workspace):
    """moe_experts as the GPU kernel computes it, in float64: a pair whose slot is -1 adds
    nothing (the CPU kernel refuses such a map, so co-execution runs on a GPU only)."""
    inter, acc = w2.shape[2], torch.zeros(x.shape, dtype=torch.float64)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            s = int(emap[int(ids[t, k])])
            if s >= 0:
                gu = w13[s].double() @ x[t].double()
                act = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
                acc[t] += float(weights[t, k]) * (w2[s].double() @ act)
    out.copy_(acc.to(out.dtype))


@pytest.mark.parametrize("factor", [1.0, 0.0, 2.0], ids=["co-executed", "dropped", "doubled"])
def test_the_gpu_tests_layer_check_passes_co_execution_only(model_dir, monkeypatch, factor):
    """tests/engine/test_offload_gpu.py checks co-execution per MoE layer against the resident
    experts; here on the CPU (the GPU kernel's -1 slots emulated): it must pass the real CPU
    partial sums and fail them dropped or doubled."""
    from freetoken.engine import offload_policy, offload_setup
    from freetoken.engine.offload_policy import CoExecPolicy, Throughput, cpu_experts
    from freetoken.engine.offload_setup import OffloadDecision, attach_expert_cache
    from tests.engine.test_offload_gpu import check_co_executed_layers

    monkeypatch.setattr(offload_setup, "pin", lambda t, total=0: t)
    monkeypatch.setattr(offload_policy, "cpu_experts", lambda *a: factor * cpu_experts(*a))
    model = build(model_dir, plan=lambda cfg, dtype, weights: True)
    cache = attach_expert_cache(model, OffloadDecision(0.5, 1024, None, None, False))
    cache.kernel = slot_kernel
    cache.policy = CoExecPolicy(Throughput(1e8, 1e12, 1e14), cache.expert_bytes,
                                6 * cache.hidden * cache.inter)
    checked = check_co_executed_layers(cache)
    runner = PagedRunner(model, num_blocks=32, block_size=16)
    logits = runner.step([(s, list(range(5 + s, 25 + s))) for s in range(3)])

    def decode():
        nonlocal logits
        for _ in range(4):
            nxt = torch.as_tensor(logits).argmax(-1).tolist()
            logits = runner.step([(s, [t]) for s, t in enumerate(nxt)])

    if factor == 1.0:
        decode()
        assert checked and sum(n for _, n in checked) == cache.stats.cpu_experts
    else:
        with pytest.raises(AssertionError, match="rounding bound"):
            decode()
