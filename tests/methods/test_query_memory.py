"""IntentKV's QueryMemory and its prefill observer, on real query-sized tensors (no model).

Post-RoPE query rows of SmolLM2 have norms ~4-19; the memory must mix *directions* so that
``beta`` is the old memory's share and ``m`` carries intent across turns.
"""

from __future__ import annotations

import torch

from agentkv.methods.base import ModelShape, ObserveRequest
from agentkv.methods.intentkv import QueryMean
from agentkv.methods.query_memory import QueryMemoryStore, normalize

L, HQ, HKV, D = 3, 4, 2, 16


def q_rows(seed: int, norm: float = 12.8) -> torch.Tensor:
    """A ``q_bar``-like ``[L, Hq, D]`` with the measured median norm."""
    g = torch.Generator().manual_seed(seed)
    return normalize(torch.randn(L, HQ, D, generator=g)) * norm


def cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (normalize(a) * normalize(b)).sum(-1)


def test_memory_mixes_directions_so_it_remembers():
    store = QueryMemoryStore()
    q1, q2 = q_rows(1), q_rows(2)
    m1 = store.update("s", q1, 0.5)
    torch.testing.assert_close(m1, normalize(q1))
    m2 = store.update("s", q2, 0.5)
    torch.testing.assert_close(m2.norm(dim=-1), torch.ones(L, HQ))
    # beta = 0.5 bisects the old memory and the new query, whatever q_bar's norm
    torch.testing.assert_close(cos(m2, m1), cos(m2, q2))
    # a raw q_bar of norm 12.8 would leave m2 ~ q2 (cos > 0.99); the memory keeps turn 1
    assert float(cos(m2, q2).max()) < 0.95
    assert float(cos(m2, m1).min()) > 0.5
    # the result does not depend on q_bar's scale
    other = QueryMemoryStore()
    other.update("s", q1 * 0.3, 0.5)
    torch.testing.assert_close(other.update("s", q2 * 5.0, 0.5), m2)


def test_memory_carries_intent_across_turns():
    """Turn 1's intent decays geometrically (beta per event), not at once."""
    beta = 0.7
    store = QueryMemoryStore()
    store.update("s", q_rows(10), beta)
    first = normalize(q_rows(10))
    sims = []
    for t in range(1, 5):
        m = store.update("s", q_rows(10 + t), beta)
        sims.append(float(cos(m, first).mean()))
    # still clearly pointing at turn 1's intent after 4 unrelated turns, and fading
    assert sims[0] > 0.8 and sims[-1] > 0.2
    assert sims == sorted(sims, reverse=True)
    # beta = 0 forgets: the memory is the newest query
    store.update("t", q_rows(10), 0.0)
    torch.testing.assert_close(store.update("t", q_rows(11), 0.0), normalize(q_rows(11)))


def test_request_local_sessions_are_never_stored():
    store = QueryMemoryStore(capacity=2)
    m = store.update("req:abc", q_rows(1), 0.5)
    torch.testing.assert_close(m, normalize(q_rows(1)))
    assert "req:abc" not in store and len(store) == 0
    for sid in ("a", "b", "c"):
        store.update(sid, q_rows(2), 0.5)
    assert "a" not in store and len(store) == 2  # LRU


def _feed(obs: QueryMean, q_all: torch.Tensor, first: int, chunk: int) -> None:
    """Prefill positions ``first..T-1`` of ``q_all [L, Hq, T, D]`` in chunks, as the engine does."""
    T = q_all.shape[2]
    k = torch.zeros(HKV, T, D)
    for c0 in range(first, T, chunk):
        c1 = min(c0 + chunk, T)
        for layer in range(L):
            obs.observe(layer, q_all[layer][:, c0:c1], torch.arange(c0, c1), k, None, None)


def test_observer_means_the_actionable_span():
    shape = ModelShape(L, HQ, HKV, D)
    T = 50
    q_all = torch.randn(L, HQ, T, D, generator=torch.Generator().manual_seed(0))
    actionable = torch.zeros(T, dtype=torch.bool)
    actionable[30:41] = True
    obs = QueryMean(ObserveRequest(T, 20, actionable, shape), window=8)
    _feed(obs, q_all, 20, chunk=7)
    torch.testing.assert_close(obs.result(), q_all[:, :, 30:41].mean(dim=2))


def test_observer_fallback_is_a_bounded_tail_window():
    """No actionable token: the mean of the last ``window`` computed queries, not the last one."""
    shape = ModelShape(L, HQ, HKV, D)
    T, window = 50, 8
    q_all = torch.randn(L, HQ, T, D, generator=torch.Generator().manual_seed(1))
    none = torch.zeros(T, dtype=torch.bool)
    obs = QueryMean(ObserveRequest(T, 0, none, shape), window=window)
    _feed(obs, q_all, 0, chunk=5)  # the window straddles chunks
    q_bar = obs.result()
    torch.testing.assert_close(q_bar, q_all[:, :, T - window :].mean(dim=2))
    assert not torch.allclose(q_bar, q_all[:, :, -1])
    # only computed positions count: a prefix-cache hit shortens the window
    obs = QueryMean(ObserveRequest(T, T - 3, none, shape), window=window)
    _feed(obs, q_all, T - 3, chunk=5)
    torch.testing.assert_close(obs.result(), q_all[:, :, T - 3 :].mean(dim=2))
