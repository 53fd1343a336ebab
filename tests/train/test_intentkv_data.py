"""Phase-2 training rows from the real engine: a short tau-bench session replayed under
IntentKV, every compression event recorded and labelled by the next tool calls or by what the
next reply attends to; and alpha_max calibrated on the replay of a held-out session."""

from __future__ import annotations

import pytest
import torch

from agentkv import IntentKV

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def argument_rows(engine, short_session):
    """``(rows, stats)``: the session's rows with the default (future-argument) labels, collected
    once for the tests below (a deterministic replay: the union test compares against them)."""
    from agentkv.train.intentkv_data import collect_rows

    return collect_rows(
        engine, [short_session], IntentKV(budget=128, protect_system=False), progress=False
    )


def test_rows_from_a_replayed_session(engine, short_session, argument_rows):
    from agentkv.train.intentkv_data import argument_values

    rows, stats = argument_rows
    # three requests, each over budget; only the last has the id in its history (at the second
    # the id is the actionable query, forced and never a candidate): one row
    assert (stats.sessions, stats.requests, stats.events) == (1, 3, 3)
    assert stats.rows == len(rows) == 1 and stats.positives == rows[0].positives > 0
    assert rows[0].turn == 6
    user_id = argument_values(short_session.messages[-1]["tool_calls"][0]["function"]["arguments"])
    assert user_id == ["mia_li_3668"]
    for row in rows:
        n = row.labels.numel()
        assert row.rule.shape == (n,) and row.keys.shape == (n, engine.shape.head_dim)
        assert row.memory.shape == (engine.shape.head_dim,) and row.q_keys.shape[0] > 0
        assert float(row.rule.sum()) == pytest.approx(1.0, rel=1e-4)
        torch.testing.assert_close(row.memory_norm, torch.ones_like(row.memory_norm))
        assert 0 < row.positives < n
    assert not engine.methods.for_policy(IntentKV()).recorder  # the hook is removed


@pytest.fixture(scope="module")
def labeler():
    from agentkv.train.intentkv_attention import AttentionLabeler

    return AttentionLabeler.load(None, "cpu")


def test_attention_and_union_rows(engine, short_session, labeler, argument_rows, monkeypatch):
    import agentkv.train.intentkv_data as data
    from agentkv.train.intentkv_data import collect_rows

    kept = []
    real = data.kept_by_policy

    def recording(n_live, n_candidates, budget, scope):
        k = real(n_live, n_candidates, budget, scope)
        kept.append((n_live - n_candidates, k))
        return k

    monkeypatch.setattr(data, "kept_by_policy", recording)
    policy = IntentKV(budget=128, protect_system=False)
    att, stats = collect_rows(
        engine, [short_session], policy, progress=False, label="attention", labeler=labeler
    )
    # every event of this session keeps some history, so each is a row (no argument needed)
    assert stats.events == 3 and len(kept) == 3 and len(att) == sum(k > 0 for _, k in kept)
    assert [r.turn for r in att] == [2, 4, 6][-len(att) :]
    for row, (forced, k) in zip(att, [x for x in kept if x[1] > 0], strict=True):
        # the default: as many positives as the policy keeps (the total budget reading)
        assert row.positives == k == 128 - forced
        assert bool((row.labels >= 0).all())  # no exclusions: every candidate labelled
    args, _ = argument_rows  # the same policy, default labels
    both, _ = collect_rows(
        engine, [short_session], policy, progress=False, label="both", labeler=labeler
    )
    assert [r.turn for r in both] == [r.turn for r in att]
    by_turn = {r.turn: r for r in both}
    for a in att:  # the union holds the attention positives ...
        assert bool((by_turn[a.turn].labels[a.labels == 1] == 1).all())
    for a in args:  # ... and the argument positives (the same candidates: a deterministic replay)
        u = by_turn[a.turn]
        assert u.labels.numel() == a.labels.numel()
        assert bool((u.labels[a.labels == 1] == 1).all())
        assert u.positives >= max(a.positives, att[-1].positives)
    with pytest.raises(ValueError, match="label"):
        collect_rows(engine, [short_session], policy, progress=False, label="attention")


def test_alpha_max_calibration_writes_the_choice(engine, short_session, tmp_path):
    """A tiny calibration: one short session, two grid points, a head whose residual is not
    zero; the better grid point is chosen, written into the checkpoint and used by default."""
    from agentkv.bench.traces import Trace
    from agentkv.methods.intentkv_head import HEAD_FILE, HeadConfig, ResidualHead
    from agentkv.train.intentkv_fit import calibrate_alpha_max, plot_calibration

    torch.manual_seed(0)
    head = ResidualHead(HeadConfig.for_shape(engine.shape, model="test"))
    torch.nn.init.normal_(head.mlp[2].weight, std=2.0)
    # its first two turns (the third, the tool call, has the longest prompt)
    held_out = Trace(short_session.id, short_session.source, short_session.messages[:5], None)
    assert [m["role"] for m in held_out.messages][-1] == "assistant"
    c = calibrate_alpha_max(engine, head, [held_out], budgets=(128,), grid=(1.0,), progress=False)
    (setting,) = c["settings"]
    table = setting["table"]
    assert [r["alpha_max"] for r in table] == [0.0, 1.0] and c["traces"] == [held_out.id]
    assert (setting["budget"], setting["max_tokens"]) == (128, 4096)
    assert all(r["tokens"] > 0 and 0 <= r["top1_agreement"] <= 1 for r in table)
    diff = table[1]["top1_agreement"] - table[0]["top1_agreement"]
    assert table[1]["vs_rule"]["difference"] == pytest.approx(diff, abs=1e-9)
    # one trajectory: the interval is the point estimate, any drop is a loss
    assert table[1]["vs_rule"]["ci95"] == pytest.approx([diff, diff], abs=1e-9)
    wins = diff > 0 or (diff == 0 and table[1]["mean_kl"] < table[0]["mean_kl"])
    assert c["alpha_max"] == (1.0 if wins else 0.0)
    # the engine's head is given back: learned mode looks the model's head up again
    assert engine.methods.for_policy(IntentKV())._head is None
    head.calibrated_alpha_max = c["alpha_max"]
    head.save(tmp_path / "test" / HEAD_FILE)
    back = ResidualHead.load(tmp_path / "test" / HEAD_FILE)
    assert back.calibrated_alpha_max == c["alpha_max"]
    assert back.inference_alpha_max(None) == c["alpha_max"]  # IntentKV(mode="learned")
    assert back.inference_alpha_max(0.5) == 0.5  # an explicit policy value wins
    plot_calibration(c, tmp_path / "calibration.png")
    assert (tmp_path / "calibration.png").stat().st_size > 0
