"""Fidelity-aligned IntentKV labels on a real rendering with the real default model: the
hooked per-layer reduction equals a brute-force computation from every attention matrix."""

from __future__ import annotations

import pytest
import torch

from agentkv.train.intentkv_attention import (
    AttentionLabeler,
    attention_labels,
    kept_by_policy,
)

pytestmark = pytest.mark.slow


def test_kept_by_policy():
    assert kept_by_policy(n_live=300, n_candidates=200, budget=256, budget_scope="total") == 156
    assert kept_by_policy(300, 200, 64, "total") == 0  # the forced set fills the budget
    assert kept_by_policy(300, 200, 64, "history") == 64
    assert kept_by_policy(300, 20, 64, "history") == 20


def test_attention_labels_match_brute_force_on_a_real_rendering():
    from agentkv.engine.chat_template import ChatRenderer
    from agentkv.train.kvzap_fit import load_eager_model

    try:
        model, tok, _ = load_eager_model(None, "cpu")
    except Exception as e:  # pragma: no cover - depends on the local install
        pytest.skip(f"default model not available: {e}")
    msgs = [
        {"role": "system", "content": "You are an airline agent."},
        {"role": "user", "content": "My user id is mia_li_3668 and I fly to SEA tomorrow."},
        {"role": "assistant", "content": "Let me look that up."},
        {"role": "user", "content": "Thanks, please check reservation 4WQ150."},
        {"role": "assistant", "content": "Reservation 4WQ150 for mia_li_3668 is confirmed."},
    ]
    r = ChatRenderer(tok)
    prompt = r.encode(msgs[:4], None)
    full = r.encode(msgs, None, add_generation_prompt=False)
    n, T = len(prompt), len(full)
    assert list(full.token_ids[:n]) == list(prompt.token_ids) and n + 5 < T
    ids = torch.tensor(full.token_ids)

    mass = AttentionLabeler(model).continuation_mass(ids, n)

    # brute force: every layer's full [Hq, T, T] attention, the definition summed by loops
    with torch.no_grad():
        att = model(input_ids=ids[None], output_attentions=True).attentions
    L, Hq = len(att), att[0].shape[1]
    brute = torch.zeros(n, dtype=torch.float64)
    for layer in range(L):
        for h in range(Hq):
            for j in range(n - 1, T - 1):  # the queries whose logits score the reply
                brute += att[layer][0, h, j, :n].double()
    brute /= L * Hq
    torch.testing.assert_close(mass.double(), brute, rtol=1e-4, atol=1e-7)
    # the reply's queries spread one unit of mass per query over all T' <= T keys
    assert 0 < float(mass.sum()) <= (T - n) + 1e-3

    candidates = ~torch.tensor(prompt.forced(False))
    k = 7
    labels = attention_labels(mass, candidates, k)
    cand = [i for i in range(n) if candidates[i]]
    top = sorted(cand, key=lambda i: (-float(brute[i]), i))[:k]
    assert sorted(int(i) for i in torch.nonzero(labels == 1)) == sorted(top)
    assert all(labels[i] == -1 for i in range(n) if not candidates[i])
    assert int((labels == 0).sum()) == len(cand) - k
