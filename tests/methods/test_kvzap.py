"""KVzap: surrogate files, the prefill plan against scores computed outside the engine,
decode-time pruning, session score reuse and the compression ratio in telemetry."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from agentkv import KVzap, build_payload  # noqa: E402
from agentkv.methods import ModelShape  # noqa: E402
from agentkv.methods.kvzap_surrogate import (  # noqa: E402
    ROOT_ENV,
    Surrogate,
    SurrogateMeta,
    SurrogateNotFound,
    shipped_surrogate,
    surrogate_from_path,
)

SMOL = ModelShape(num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64)
OTHER = ModelShape(num_layers=4, num_q_heads=8, num_kv_heads=2, head_dim=16)
MESSAGES = [
    {"role": "system", "content": "You are KVzap's test assistant for the orbital ferry desk."},
    {
        "role": "user",
        "content": "The ferry Aldebaran leaves dock 7 at 04:40 and reaches the Lagrange "
        "station at 11:15; the ferry Vega leaves dock 2 at 06:05 and arrives at 12:50. "
        "Tickets cost 340 credits, luggage over 20 kg is 15 credits per kg. Which ferry "
        "arrives first, and what do I pay with 26 kg of luggage?",
    },
]


def tiny_surrogate(shape: ModelShape, kind: str, hidden: int = 32) -> Surrogate:
    g = torch.Generator().manual_seed(0)
    meta = SurrogateMeta("tiny", kind, shape.num_layers, shape.num_q_heads,
                         shape.num_kv_heads, shape.head_dim, hidden)  # fmt: skip
    L, H = shape.num_layers, shape.num_kv_heads
    if kind == "linear":
        return Surrogate(meta, torch.randn(L, H, hidden, generator=g), torch.randn(L, H))
    w1, b1 = torch.randn(L, 4, hidden, generator=g), torch.randn(L, 4)
    return Surrogate(meta, w1, b1, torch.randn(L, H, 4, generator=g), torch.randn(L, H))


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_surrogate_file_round_trip(tmp_path, kind):
    sur = tiny_surrogate(OTHER, kind)
    sur.save(tmp_path / f"{kind}.safetensors")
    back = surrogate_from_path(str(tmp_path), kind, OTHER)
    assert back.kind == kind and back.meta == sur.meta
    h = torch.randn(5, 32)
    torch.testing.assert_close(back.score(2, h), sur.score(2, h), atol=2e-2, rtol=2e-2)
    assert back.score(2, h).shape == (5, OTHER.num_kv_heads)


def test_surrogate_path_errors(tmp_path, monkeypatch):
    with pytest.raises(SurrogateNotFound, match="agentkv train-kvzap") as e:
        surrogate_from_path(str(tmp_path), "mlp", OTHER)
    assert e.value.field == "payload.policy.surrogate_path"
    tiny_surrogate(OTHER, "mlp").save(tmp_path / "mlp.safetensors")
    with pytest.raises(SurrogateNotFound, match="not this model"):
        surrogate_from_path(str(tmp_path), "mlp", SMOL)
    (tmp_path / "linear.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(SurrogateNotFound, match="no readable"):
        surrogate_from_path(str(tmp_path), "linear", OTHER)
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "allowed"))
    with pytest.raises(SurrogateNotFound, match=ROOT_ENV):
        surrogate_from_path(str(tmp_path), "mlp", OTHER)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_shipped_surrogates(kind):
    sur = shipped_surrogate(kind, SMOL)
    assert sur.kind == kind and sur.meta.model == "SmolLM2-135M-Instruct"
    assert sur.meta.hidden_size == 576
    with pytest.raises(SurrogateNotFound, match="agentkv train-kvzap") as e:
        shipped_surrogate(kind, OTHER)
    assert e.value.field == "payload.policy.surrogate"


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_score_all_equals_per_layer_scores(kind):
    sur = tiny_surrogate(OTHER, kind)
    h = torch.randn(OTHER.num_layers, 7, 32)
    per_layer = torch.stack([sur.score(i, h[i]) for i in range(OTHER.num_layers)])
    torch.testing.assert_close(sur.score_all(h), per_layer, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_deferred_decode_scores_equal_immediate_scores(kind):
    """Small passes (decode steps) are scored later, every layer at once; a prefill chunk at
    once; a pass some layers missed falls back to per-layer scoring. All read the same."""
    from agentkv.methods.base import ObserveRequest
    from agentkv.methods.kvzap import DEFER_MAX_ROWS, KVzapScores

    sur = tiny_surrogate(OTHER, kind)
    L = OTHER.num_layers
    T0 = DEFER_MAX_ROWS + 6
    obs = KVzapScores(sur, ObserveRequest(T0, 0, torch.zeros(T0, dtype=torch.bool), OTHER))
    hidden = torch.randn(L, T0 + 9, 32)
    pos = torch.arange(T0)
    for layer in range(L):  # prefill: scored as it arrives
        obs.observe_hidden(layer, hidden[layer, :T0], pos)
    assert not obs._pending
    for t in range(T0, T0 + 8):  # decode steps: deferred (one positions object per pass)
        step = torch.tensor([t])
        for layer in range(L):
            obs.observe_hidden(layer, hidden[layer, t : t + 1], step)
    assert len(obs._pending) == 8 * L
    last = torch.tensor([T0 + 8])  # a pass seen by layer 0 only: per-layer fallback
    obs.observe_hidden(0, hidden[0, T0 + 8 :], last)
    got = obs.window_scores(0, T0 + 9)
    assert not obs._pending
    want = torch.stack([sur.score(i, hidden[i]).T for i in range(L)])  # [L, Hkv, T]
    torch.testing.assert_close(got[:, :, : T0 + 8], want[:, :, : T0 + 8], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[0, :, T0 + 8], want[0, :, T0 + 8], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_replayed_decode_steps_are_scored_from_the_ring(kind):
    """A decode step captured in a CUDA graph copies each layer's input into the ring (what
    every replay of it then does, no Python running); collected every ``collect_every`` steps
    and when scores are read, beside eager steps' deferred rows, every position reads what
    scoring it at once gives. The ring goes with the decode."""
    from agentkv.methods.base import ObserveRequest
    from agentkv.methods.kvzap import RING_ROWS, KVzapScores

    sur = tiny_surrogate(OTHER, kind)
    L, T0, n = OTHER.num_layers, 20, 2 * RING_ROWS + 7
    obs = KVzapScores(sur, ObserveRequest(T0, 0, torch.zeros(T0, dtype=torch.bool), OTHER))
    hidden = torch.randn(L, T0 + n, 32)
    for layer in range(L):
        obs.observe_hidden(layer, hidden[layer, :T0], torch.arange(T0))
    with pytest.raises(RuntimeError, match="before_capture"):
        obs._record(0, hidden[0, T0 : T0 + 1], torch.tensor([T0]))
    obs.before_capture(torch.device("cpu"), torch.float32)
    assert obs.collect_every == RING_ROWS
    for i, t in enumerate(range(T0, T0 + n)):
        step = torch.tensor([t])
        for layer in range(L):
            if i % 10 == 3:  # an epoch's first step runs eagerly: deferred as before
                obs.observe_hidden(layer, hidden[layer, t : t + 1], step)
            else:  # (what the captured step's replay writes)
                obs._record(layer, hidden[layer, t : t + 1], step)
        if (i + 1) % obs.collect_every == 0:
            obs.collect()
    got = obs.window_scores(0, T0 + n)
    want = torch.stack([sur.score(i, hidden[i]).T for i in range(L)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    obs.end_decode()
    assert obs._ring is None and not obs._pending


# ----------------------------------------------------------------- on the real engine


@pytest.fixture(scope="module")
def reference_hidden(engine):
    """Layer inputs of MESSAGES computed by plain transformers (no agentkv attention)."""
    from agentkv.train.kvzap_fit import load_eager_model

    model, _, _ = load_eager_model(None, "cpu")
    tags = engine.renderer.encode(MESSAGES, None, build_payload(MESSAGES, KVzap(), "x").messages)
    with torch.no_grad():
        out = model.model(input_ids=torch.tensor([tags.token_ids]), output_hidden_states=True)
    return tags, [h[0] for h in out.hidden_states[:-1]]


def expected_scores(kind: str, hidden: list[torch.Tensor]) -> torch.Tensor:
    sur = shipped_surrogate(kind, SMOL)
    return torch.stack([sur.score(i, h).T for i, h in enumerate(hidden)])  # [L, Hkv, T]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_prefill_plan_is_threshold_or_window(engine, reference_hidden, kind):
    tags, hidden = reference_hidden
    T = len(tags)
    want = expected_scores(kind, hidden)
    window = 16
    tau = float(want[:, :, : T - window].median())  # about half the entries go
    policy = KVzap(threshold=tau, window=window, surrogate=kind, decode_interval=0)
    payload = build_payload(MESSAGES, policy, f"x:kvzap-prefill-{kind}")
    with engine._lock:
        req, _, info = engine._prefill_and_plan(tags, payload)
        try:
            assert req.num_cached == 0
            keep = req.slot_map.keep_mask.clone()
            engine.store.check_invariants()
        finally:
            engine.store.finish_request(req, cache=False)
    assert info["note"] == f"kvzap: {T}/{T} positions scored"
    expect = want >= tau
    expect[:, :, T - window :] = True
    close = (want - tau).abs() < 1e-3  # float noise between two attention implementations
    assert bool((keep == expect)[~close].all())
    frac = float((~keep[:, :, : T - window]).float().mean())
    assert 0.4 < frac < 0.6
    assert info["evicted_entries"] == int((~keep).sum())
    engine.end_session(payload.session_id)


@pytest.mark.slow
def test_decode_prunes_positions_leaving_the_window(engine):
    from agentkv.engine.engine import GenerationConfig

    policy = KVzap(threshold=-5.5, window=8, decode_interval=4)
    payload = build_payload(MESSAGES, policy, "x:kvzap-decode")
    tags = engine.renderer.encode(MESSAGES, None, payload.messages)
    T = len(tags)
    gen = GenerationConfig(max_tokens=24)
    with engine._lock:
        req, logits, info = engine._prefill_and_plan(tags, payload)
        try:
            prefill_evicted = info["evicted_entries"]
            pruning = info["decode_pruning"]
            assert pruning is not None and pruning.interval == 4
            out, _, _ = engine._decode(req, logits, gen, None, info)
            n = req.seq_len
            assert n == T + len(out) - 1 and len(out) >= 12
            keep = req.slot_map.keep_mask
            scores = pruning.observer.window_scores(0, n)
            assert bool(torch.isfinite(scores).all())  # every decoded position was scored
            assert bool(keep[:, :, n - policy.window :].all())  # the window slides
            pruned = pruning.observer.pruned_until
            assert n - policy.window - pruning.interval < pruned <= n - policy.window
            # below the pruned line: exactly the threshold rule
            assert bool((keep[:, :, :pruned] == (scores[:, :, :pruned] >= policy.threshold)).all())
            assert info["evicted_entries"] > prefill_evicted  # decoded positions were pruned
            engine.store.check_invariants()
        finally:
            engine.store.finish_request(req, cache=True)
    engine.end_session(payload.session_id)
    engine.store.check_invariants()


@pytest.mark.slow
def test_session_scores_and_compression_ratio(engine):
    from agentkv.engine.engine import GenerationConfig

    policy = KVzap(threshold=-5.5, window=8, decode_interval=4)
    sid = "x:kvzap-session"
    r1 = engine.chat(
        MESSAGES, payload=build_payload(MESSAGES, policy, sid), gen=GenerationConfig(max_tokens=6)
    )
    u1 = r1.usage
    assert u1.method == "kvzap" and u1.evicted_entries > 0
    n1 = u1.prompt_tokens + u1.completion_tokens - 1
    assert u1.compression_ratio == pytest.approx(1 - u1.live_kv_tokens / n1, abs=1e-3)
    assert 0 < u1.compression_ratio < 1
    turn2 = MESSAGES + [
        {"role": "assistant", "content": r1.content or "The Aldebaran."},
        {"role": "user", "content": "And the Vega's ticket with no luggage?"},
    ]
    r2 = engine.chat(
        turn2, payload=build_payload(turn2, policy, sid), gen=GenerationConfig(max_tokens=2)
    )
    u2 = r2.usage
    # the session's own prefix comes from the cache, with its scores: every position scored
    assert u2.prefix_hit_tokens >= u1.prompt_tokens
    assert u2.plan_note == f"kvzap: {u2.prompt_tokens}/{u2.prompt_tokens} positions scored"
    engine.end_session(sid)
    engine.store.check_invariants()
