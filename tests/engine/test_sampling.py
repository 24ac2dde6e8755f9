import pytest
import torch

from freetoken.engine.request import InvalidSamplingParams, SamplingParams
from freetoken.engine.sampling import create_generator, sample_tokens
from freetoken.models.config import GenerationDefaults


def resolved(**kw) -> SamplingParams:
    return SamplingParams(**kw).resolve(None, 100)


def random_logits(rows=4, vocab=1000, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = random_logits()
    params = [resolved(temperature=0)] * 4
    tokens = sample_tokens(logits, params, [create_generator(i) for i in range(4)])
    assert tokens == logits.argmax(-1).tolist()


def test_top_k_one_is_argmax_at_any_temperature():
    logits = random_logits()
    params = [resolved(temperature=5.0, top_k=1)] * 4
    for seed in range(5):
        tokens = sample_tokens(logits, params, [create_generator(seed + i) for i in range(4)])
        assert tokens == logits.argmax(-1).tolist()


def test_seed_is_reproducible_and_independent_of_batch_mates():
    logits = random_logits(rows=3)
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
    with_greedy = [sample_tokens(logits[[1, 0]], mixed, gens)[1] for _ in range(20)]
    assert with_greedy == [row[0] for row in alone]
    assert len({row[0] for row in first}) > 1  # it really samples


def test_top_p_restricts_to_the_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    params = [resolved(temperature=1.0, top_p=0.7)]
    seen = {sample_tokens(logits, params, [create_generator(s)])[0] for s in range(300)}
    assert seen == {0, 1}  # 0.5 < 0.7 so token 1 is needed; 0.8 >= 0.7 so token 2 is not
    params = [resolved(temperature=1.0, top_p=1.0)]
    seen = {sample_tokens(logits, params, [create_generator(s)])[0] for s in range(300)}
    assert seen == {0, 1, 2, 3}


def test_top_k_restricts_and_frequencies_follow_probabilities():
    probs = torch.tensor([[0.6, 0.3, 0.1]])
    params = [resolved(temperature=1.0, top_k=2)]
    draws = [sample_tokens(probs.log(), params, [create_generator(s)])[0] for s in range(600)]
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


def test_plain_temperature_sampling_follows_softmax():
    probs = torch.tensor([[0.6, 0.3, 0.1]])
    params = [resolved(temperature=1.0)]
    draws = [sample_tokens(probs.log(), params, [create_generator(s)])[0] for s in range(900)]
    shares = [draws.count(t) / len(draws) for t in range(3)]
    assert all(abs(a - b) < 0.06 for a, b in zip(shares, [0.6, 0.3, 0.1]))
    hot = [resolved(temperature=100.0)]  # flattens towards uniform
    draws = [sample_tokens(probs.log(), hot, [create_generator(s)])[0] for s in range(900)]
    assert min(draws.count(t) for t in range(3)) > 200
