"""``AttentionColumnSums``: the window observer's masked path (no host read, used off the CPU)
gives what the selection of the window's queries gives."""

from __future__ import annotations

import pytest
import torch

from agentkv.methods.attention_probe import AttentionColumnSums
from agentkv.methods.base import ModelShape, ObserveRequest

SHAPE = ModelShape(num_layers=3, num_q_heads=4, num_kv_heads=2, head_dim=8)


def feed(obs, chunks, T, masked, seed=0, holes=False, heads=False, fresh=False):
    """Prefill ``T`` positions chunk by chunk (ascending, as every caller does), each layer's
    queries seeing the keys of every position so far (some DEAD with ``holes``); ``fresh``:
    new position and mask tensors at every layer (the observer cannot tell that a chunk's
    layers share them, and records each layer on its own)."""
    g = torch.Generator().manual_seed(seed)
    q_all = torch.randn(SHAPE.num_layers, SHAPE.num_q_heads, T, SHAPE.head_dim, generator=g)
    k_all = torch.randn(SHAPE.num_layers, SHAPE.num_kv_heads, T, SHAPE.head_dim, generator=g)
    live = torch.rand(T, generator=g) > 0.3 if holes else torch.ones(T, dtype=torch.bool)
    hm_all = torch.rand(SHAPE.num_kv_heads, T, generator=g) > 0.2
    start = 0
    for n in chunks:
        end = start + n
        q_pos = torch.arange(start, end)
        k_pos = torch.nonzero(live[:end]).reshape(-1)
        hm = hm_all[:, k_pos] if heads else None
        for layer in range(SHAPE.num_layers):
            q = q_all[layer, :, start:end]
            k = k_all[layer][:, k_pos]
            args = (q_pos, k, k_pos, hm)
            if fresh:
                args = tuple(None if a is None else a.clone() for a in args)
            qp, kk, kp, h = args
            if masked:
                obs._observe_window(layer, q, qp, kk, kp, h)
            else:
                obs.observe(layer, q, qp, kk, kp, h)
        start = end
    assert start == T
    return obs.result()


@pytest.mark.parametrize(
    "chunks",
    [[40], [20, 20], [35, 5], [30, 2, 8], [10, 10, 10, 10], [33, 7], [31, 9], [1] * 40],
)
@pytest.mark.parametrize("holes,heads", [(False, False), (True, False), (True, True)])
def test_masked_window_equals_selected_window(chunks, holes, heads):
    T, window = 40, 8
    req = ObserveRequest(T, 0, torch.zeros(T, dtype=torch.bool), SHAPE)
    selected = feed(AttentionColumnSums(req, T - window), chunks, T, False, 3, holes, heads)
    masked = feed(AttentionColumnSums(req, T - window), chunks, T, True, 3, holes, heads)
    torch.testing.assert_close(masked.sums, selected.sums, rtol=1e-6, atol=1e-7)
    assert torch.equal(masked.counts, selected.counts)
    assert torch.equal(masked.seen, selected.seen)
    assert torch.equal(masked.head_live, selected.head_live)
    # the window saw something, and chunks before the window left no trace
    assert selected.seen.any() and selected.sums.abs().sum() > 0


def test_a_chunk_before_the_window_leaves_no_trace():
    T, window = 40, 8
    req = ObserveRequest(T, 0, torch.zeros(T, dtype=torch.bool), SHAPE)
    obs = AttentionColumnSums(req, T - window)
    q = torch.randn(SHAPE.num_q_heads, 20, SHAPE.head_dim)
    k = torch.randn(SHAPE.num_kv_heads, 20, SHAPE.head_dim)
    obs._observe_window(0, q, torch.arange(20), k, torch.arange(20), None)
    obs = obs.result()
    assert not obs.seen.any() and not obs.head_live.any()
    assert not obs.sums.any() and not obs.counts.any()


@pytest.mark.parametrize("masked", [False, True], ids=["selected", "masked"])
@pytest.mark.parametrize("chunks", [[40], [20, 20], [33, 7], [1] * 40])
@pytest.mark.parametrize("holes,heads", [(False, False), (True, True)])
def test_a_chunks_layers_are_recorded_at_once_as_one_by_one(masked, chunks, holes, heads):
    """The layers of a chunk share its positions and head mask: the observer writes their
    counts, seen flags and held heads once for the run of layers (what a batched server
    passes), and gets exactly what it gets recording each layer on its own."""
    T, window = 40, 8
    req = ObserveRequest(T, 0, torch.zeros(T, dtype=torch.bool), SHAPE)
    for first_query in (0, T - window):
        shared = feed(AttentionColumnSums(req, first_query), chunks, T, masked, 4, holes, heads)
        alone = feed(
            AttentionColumnSums(req, first_query), chunks, T, masked, 4, holes, heads, True
        )
        assert torch.equal(shared.sums, alone.sums)
        assert torch.equal(shared.counts, alone.counts)
        assert torch.equal(shared.seen, alone.seen)
        assert torch.equal(shared.head_live, alone.head_live)
        assert shared.seen.any()
