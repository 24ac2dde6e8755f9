import numpy as np
import pytest
import torch

from freetoken.engine.request import InvalidSamplingParams, SamplingParams
from freetoken.engine.sampling import create_generator, sample_tokens
from freetoken.models.config import GenerationDefaults


def resolved(**kw) -> SamplingParams:
    return SamplingParams(**kw).resolve(None, 100)


@pytest.fixture(params=["numpy", "torch"], autouse=True)
def kind(request):
    """Every test runs on CPU logits (numpy) and on torch logits (the GPU implementation)."""
    return request.param


def as_kind(logits: torch.Tensor, kind: str):
    return logits.numpy() if kind == "numpy" else logits


def random_logits(kind, rows=4, vocab=1000, seed=0):
    return as_kind(torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3,
                   kind)


def test_greedy_is_argmax(kind):
    logits = random_logits(kind)
    params = [resolved(temperature=0)] * 4
    tokens = sample_tokens(logits, params, [create_generator(i) for i in range(4)])
    assert tokens == logits.argmax(-1).tolist()


def test_top_k_one_is_argmax_at_any_temperature(kind):
    logits = random_logits(kind)
    params = [resolved(temperature=5.0, top_k=1)] * 4
    for seed in range(5):
        tokens = sample_tokens(logits, params, [create_generator(seed + i) for i in range(4)])
        assert tokens == logits.argmax(-1).tolist()


def test_seed_is_reproducible_and_independent_of_batch_mates(kind):
    logits = random_logits(kind, rows=3)
    params = [resolved(temperature=1.0, seed=7)] * 3

    def draw(batch_params, batch_logits):
        gens = [create_generator(p.seed) for p in batch_params]
        return [sample_tokens(batch_logits, batch_params, gens) for _ in range(20)]

    first, second = draw(params, logits), draw(params, logits)
    assert first == second
    # row 0 alone, next to different neighbours, draws the same sequence
    alone = draw(params[:1], logits[:1])
    assert [row[0] for row in first] == [row[0] for row in alone]
    mixed = [resolved(temperature=0)] + params[:1]
    gens = [create_generator(None), create_generator(7)]
    both = [sample_tokens(logits[[1, 0]], mixed, gens) for _ in range(20)]
    assert [tokens[1] for tokens in both] == [row[0] for row in alone]
    assert {tokens[0] for tokens in both} == {int(np.asarray(logits[1]).argmax())}  # greedy row
    assert len({row[0] for row in first}) > 1  # it really samples


def test_top_p_restricts_to_the_nucleus(kind):
    logits = as_kind(torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log(), kind)
    params = [resolved(temperature=1.0, top_p=0.7)]
    seen = {sample_tokens(logits, params, [create_generator(s)])[0] for s in range(300)}
    assert seen == {0, 1}  # 0.5 < 0.7 so token 1 is needed; 0.8 >= 0.7 so token 2 is not
    params = [resolved(temperature=1.0, top_p=1.0)]
    seen = {sample_tokens(logits, params, [create_generator(s)])[0] for s in range(300)}
    assert seen == {0, 1, 2, 3}


def test_top_k_restricts_and_frequencies_follow_probabilities(kind):
    logits = as_kind(torch.tensor([[0.6, 0.3, 0.1]]).log(), kind)
    params = [resolved(temperature=1.0, top_k=2)]
    draws = [sample_tokens(logits, params, [create_generator(s)])[0] for s in range(600)]
    assert set(draws) == {0, 1}
    share = draws.count(0) / len(draws)
    assert abs(share - 0.6 / 0.9) < 0.08


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(temperature=float("nan")),
                                dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5),
                                dict(max_tokens=0), dict(stop=[""]), dict(stop=["x"] * 17)])
def test_invalid_params_raise(kw):
    with pytest.raises(InvalidSamplingParams):
        SamplingParams(**kw)


def test_resolve_uses_model_defaults_only_for_unset_fields():
    defaults = GenerationDefaults(temperature=0.6, top_k=20, top_p=0.95, max_tokens=50)
    p = SamplingParams(temperature=0.0).resolve(defaults, 100)
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.0, 20, 0.95, 50)
    p = SamplingParams().resolve(defaults, 30)
    assert p.max_tokens == 30  # clamped to the room left
    p = SamplingParams().resolve(None, 30)
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (1.0, 0, 1.0, 30)


def test_plain_temperature_sampling_follows_softmax(kind):
    logits = as_kind(torch.tensor([[0.6, 0.3, 0.1]]).log(), kind)
    params = [resolved(temperature=1.0)]
    draws = [sample_tokens(logits, params, [create_generator(s)])[0] for s in range(900)]
    shares = [draws.count(t) / len(draws) for t in range(3)]
    assert all(abs(a - b) < 0.06 for a, b in zip(shares, [0.6, 0.3, 0.1]))
    hot = [resolved(temperature=100.0)]  # flattens towards uniform
    draws = [sample_tokens(logits, hot, [create_generator(s)])[0] for s in range(900)]
    assert min(draws.count(t) for t in range(3)) > 200


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (50, 1.0), (50, 0.8), (3000, 0.999),
                                         (0, 0.9999), (0, 1.0)])
def test_cpu_and_gpu_implementations_pick_the_same_tokens(kind, top_k, top_p):
    """Given the same uniform draws both implementations select the same token; the flat
    rows make the nucleus reach past the first candidates the CPU path looks at."""
    if kind == "torch":
        pytest.skip("compares the two implementations once")
    from freetoken.engine.sampling import sample_row
    from freetoken.engine.sampling_torch import sample_rows

    gen = torch.Generator().manual_seed(top_k)
    logits = torch.cat([torch.randn(2, 5000, generator=gen) * 3,
                        torch.randn(2, 5000, generator=gen) * 0.05])
    params = [resolved(temperature=0.8, top_k=top_k, top_p=top_p)] * 4
    agree = total = 0
    for step in range(60):
        uniforms = [(step * 0.6180339 + row * 0.25) % 1.0 for row in range(4)]
        gpu = sample_rows(logits, params, uniforms).tolist()
        cpu = [sample_row(logits[r].numpy(), params[r], uniforms[r]) for r in range(4)]
        agree += sum(a == b for a, b in zip(gpu, cpu))
        total += 4
    assert agree >= 0.98 * total   # float32 vs float64 may split a draw on a CDF boundary
