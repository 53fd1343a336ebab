"""Shared real-data fixtures for the core tests (tau-bench trajectories, BFCL traces)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TAU_BENCH = Path(
    os.environ.get("AGENTKV_TAU_BENCH")
    or REPO.parent / "shared" / "data" / "tau-bench" / "gpt-4o-airline.json"
)


@pytest.fixture(scope="session")
def tau_items() -> list[dict]:
    """The 200 raw GPT-4o airline trajectories (``traj``: OpenAI-format messages)."""
    if not TAU_BENCH.is_file():
        pytest.skip(f"tau-bench data not found at {TAU_BENCH}")
    with open(TAU_BENCH) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def tau_trajs(tau_items) -> list[list[dict]]:
    return [item["traj"] for item in tau_items]


@pytest.fixture(scope="session")
def bfcl_base():
    """All 200 BFCL multi_turn_base examples, executed on the simulators."""
    pytest.importorskip("bfcl_eval")
    from agentkv.bench.traces import load_bfcl

    return load_bfcl("multi_turn_base")


@pytest.fixture(scope="session")
def bfcl_miss_func():
    pytest.importorskip("bfcl_eval")
    from agentkv.bench.traces import load_bfcl

    return load_bfcl("multi_turn_miss_func", limit=40, seed=1)
