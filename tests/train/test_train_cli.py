"""``agentkv train-kvzap`` end to end on a tiny corpus: files, metrics, loadable surrogates,
and the training traces never overlap the replay's evaluation sample."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")


def test_training_traces_exclude_the_replay_sample():
    from agentkv.bench.traces import DEFAULT_TAU_BENCH, load_source
    from agentkv.train.kvzap_corpus import EVAL_SAMPLE, training_traces

    if not DEFAULT_TAU_BENCH.is_file():
        pytest.skip("tau-bench data not found")
    train = {t.id for t in training_traces()}
    evaluated = {t.id for t in load_source("tau-bench", limit=EVAL_SAMPLE)}
    assert len(evaluated) == EVAL_SAMPLE and not train & evaluated
    assert len(train) == len(load_source("tau-bench")) - EVAL_SAMPLE


@pytest.mark.slow
def test_train_kvzap_cli(tmp_path):
    from typer.testing import CliRunner

    from agentkv.engine.cli import app
    from agentkv.methods import ModelShape
    from agentkv.methods.kvzap_surrogate import surrogate_from_path

    out = tmp_path / "kvzap"
    args = ["train-kvzap", "--out", str(out), "--device", "cpu", "--wiki-texts", "3"]
    args += ["--trace-texts", "1", "--prompt-tokens", "40", "--tokens-per-text", "12"]
    res = CliRunner().invoke(app, [*args, "--epochs", "2"])
    assert res.exit_code == 0, res.output
    assert "R^2" in res.output
    m = json.loads((out / "metrics.json").read_text())
    assert m["texts"] == {"wiki": 3, "traces": 1, "validation": 1}
    assert len(m["linear_r2_per_layer"]) == len(m["mlp_r2_per_layer"]) == 30
    assert all(0.0 <= r <= 1.0 for r in m["linear_r2_per_layer"])
    assert len(m["mlp_train_mse"]) == 2
    shape = ModelShape(num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64)
    for kind in ("linear", "mlp"):
        sur = surrogate_from_path(str(out), kind, shape)
        assert sur.kind == kind and sur.meta.hidden_size == 576
        assert m["file_bytes"][kind] == (out / f"{kind}.safetensors").stat().st_size
    assert (out / "loss.png").stat().st_size > 0 and (out / "r2_per_head.png").stat().st_size > 0
