"""CI-sized soak of the real server (the full one is ``benchmarks/soak.py``): concurrent
multi-turn sessions with mixed policies, streamed turns, abandoned streams, ended and
left-over sessions, then the admin flush: no errors, every slot back, store invariants."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_soak_small(server, engine):
    from agentkv.bench.soak import SoakConfig, run_soak

    cfg = SoakConfig(sessions=8, concurrency=4, turns=2, max_tokens=2, abandon_every=3)
    report = run_soak(server.base_url.removesuffix("/v1"), cfg)
    assert report.errors == [], report.errors[:5]
    assert report.abandoned == 3 and report.requests >= 13  # sessions 0, 3, 6
    assert report.sessions_ended == 6  # keep_every=7: sessions 0 and 7 are left to the flush
    assert report.ok and report.flush["free_slots"] == engine.store.stats().capacity
    stats = engine.store.stats()
    assert stats.num_requests == 0 and stats.prefix_cache_nodes == 0
    engine.store.check_invariants()
