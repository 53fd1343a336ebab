"""The engine's token sampler (:meth:`Engine._next_token`): greedy is the argmax, a sampled
token follows softmax(logits / T) renormalised over the top-p set, never outside it, and a
broken distribution yields a token instead of an error (on a GPU, multinomial's device-side
assert would end the process's CUDA context)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from agentkv.engine.engine import Engine, GenerationConfig  # noqa: E402

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def _draws(gen: GenerationConfig, n: int = 20000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(LOGITS.numel())
    for _ in range(n):
        tok = Engine._next_token(LOGITS, gen, g)
        assert tok.shape == (1,) and tok.dtype == torch.int64
        counts[int(tok)] += 1
    return counts / n


def test_greedy_is_the_argmax():
    assert int(Engine._next_token(LOGITS, GenerationConfig(), None)) == 0


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
def test_sampled_tokens_follow_the_top_p_distribution(temperature, top_p):
    p = torch.softmax(LOGITS / temperature, -1)
    sp, idx = p.sort(descending=True)
    keep = sp.cumsum(0) - sp <= top_p
    want = torch.zeros_like(p).scatter_(0, idx, sp * keep)
    want /= want.sum()
    got = _draws(GenerationConfig(temperature=temperature, top_p=top_p))
    assert torch.allclose(got, want, atol=0.015), (got, want)  # (20k draws: ~4 sigma)
    assert bool((got[want == 0] == 0).all())  # (outside the top-p set: never)


def test_a_seed_repeats_its_draws_and_a_broken_distribution_still_gives_a_token():
    gen = GenerationConfig(temperature=1.0, top_p=0.9)
    a = [int(Engine._next_token(LOGITS, gen, torch.Generator().manual_seed(5))) for _ in range(3)]
    assert len(set(a)) == 1
    bad = torch.tensor([float("nan"), 1.0, float("inf"), 0.0])
    tok = Engine._next_token(bad, gen, torch.Generator().manual_seed(0))
    assert 0 <= int(tok) < 4
