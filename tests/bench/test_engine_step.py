"""benchmarks/engine_step.py on the CPU at a tiny shape with random weights: every path and
mode decodes and is reported (the figures are the GPU's, docs/benchmarks.md §3 sessions 32-34)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import engine_step  # noqa: E402


@pytest.mark.slow
def test_each_path_and_mode_decodes_and_is_reported(tmp_path: Path) -> None:
    args = argparse.Namespace(
        shape="2,4,2,32,128,256",
        model_dir=None,
        prompt=300,
        steps=3,
        paths="reference,dense",
        modes="bf16,int4,kvzap",
        fusions="all",
        overlap="on",
        temperature=0.0,
        top_p=1.0,
        profile="int4",
        kernel_profile=None,
        device="cpu",
        out=tmp_path / "engine_step.json",
    )
    rows = engine_step.run(args)
    assert [(r["path"], r["mode"]) for r in rows] == [
        ("reference", "bf16"),
        ("reference", "int4"),
        ("reference", "kvzap"),
        ("dense", "bf16"),
        ("dense", "int4"),
        ("dense", "kvzap"),
    ]
    for r in rows:
        assert r["ms_per_step"] > 0 and r["prompt_tokens"] > 128 and r["steps"] == 3
        assert 0 < r["median_step_ms"] <= r["max_step_ms"]
    bf16, int4 = rows[0]["resident_kv_mib"], rows[1]["resident_kv_mib"]
    assert int4 < 0.7 * bf16  # all but the last 128 positions at INT4
    # KVzap's random surrogate (threshold 0) pruned about half of what left its window
    kvzap = rows[2]
    assert kvzap["evicted_entries"] > 0 and kvzap["live_kv_tokens"] < rows[0]["live_kv_tokens"]
    assert {r["fusions"] for r in rows} == {"all"}
    assert (tmp_path / rows[1]["profile"]).read_text().count("engine") > 0
    json.dumps(rows)
    with pytest.raises(SystemExit, match=r"--fusions: unknown \['rope'\]"):
        engine_step.run(argparse.Namespace(**{**vars(args), "fusions": "all,norms+rope"}))
    with pytest.raises(SystemExit, match="--shape"):
        engine_step.build_model(Path("."), "1,2,3", "cpu", None, 16)
