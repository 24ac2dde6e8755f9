"""The greedy path of sample_tokens (a vectorized argmax on CPU) against torch.argmax."""

import torch

from freetoken.engine.request import SamplingParams
from freetoken.engine.sampling import create_generator, greedy_tokens, sample_tokens


def resolved(**kw) -> SamplingParams:
    return SamplingParams(**kw).resolve(None, 100)


def test_greedy_ties_take_the_first_index_like_torch():
    logits = torch.zeros(3, 50)
    logits[0, [7, 30]] = 2.0          # a tie: the lower index wins
    logits[1, :] = -1.0               # all equal: index 0
    logits[2, [49, 3]] = 5.0
    params = [resolved(temperature=0)] * 3
    tokens = sample_tokens(logits, params, [create_generator(i) for i in range(3)])
    assert tokens == logits.argmax(-1).tolist() == [7, 0, 3]


def test_greedy_matches_torch_on_a_large_vocabulary():
    logits = torch.randn(5, 49152, generator=torch.Generator().manual_seed(3))
    assert greedy_tokens(logits) == logits.argmax(-1).tolist()
    assert greedy_tokens(logits.double()) == logits.argmax(-1).tolist()   # the torch path


def test_mixed_batch_keeps_greedy_rows_greedy():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)) * 3
    params = [resolved(temperature=0), resolved(temperature=1.0, top_k=1),
              resolved(temperature=0), resolved(temperature=2.0, top_k=1)]
    tokens = sample_tokens(logits, params, [create_generator(i) for i in range(4)])
    assert tokens == logits.argmax(-1).tolist()
