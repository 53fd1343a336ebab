"""IntentKV's alpha_max calibration over budgets x length cuts: the selection rule on hand-made
tables, ``agentkv calibrate-intentkv`` end to end on the real default model (a head
recalibrated without retraining: same weights, the calibration's pick in its metadata), and
clear errors for bad option values."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from agentkv.methods.base import ModelShape  # noqa: E402
from agentkv.methods.intentkv_head import HEAD_FILE, HeadConfig, ResidualHead  # noqa: E402
from agentkv.train.intentkv_fit import alpha_summary, choose_alpha_max  # noqa: E402

#: SmolLM2-135M-Instruct, the default model
SMOLLM2 = ModelShape(num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64)


def setting(budget, cut, rows):
    """A calibration setting from ``(alpha_max, top1, kl, ci_lo, ci_hi)`` rows; the rule
    (alpha_max 0) first, the paired difference is ``top1 - rule top1``."""
    rule_top1 = rows[0][1]
    table = []
    for a, top1, kl, lo, hi in rows:
        row = {"alpha_max": a, "top1_agreement": top1, "mean_kl": kl, "top1_ci95": [0, 1]}
        if a > 0:
            row["vs_rule"] = {"difference": top1 - rule_top1, "ci95": [lo, hi]}
        table.append(row)
    return {"budget": budget, "max_tokens": cut, "table": table}


def test_a_significant_loss_in_one_setting_excludes_an_alpha():
    """1.0 has the best mean top-1 but loses at budget 1024 / 8k (upper bound < 0): 0.5,
    admissible everywhere, is picked."""
    settings = [
        setting(256, 4096, [(0, 0.80, 0.4, 0, 0), (0.5, 0.81, 0.4, -0.01, 0.03), (1, 0.84, 0.3, 0.01, 0.07)]),
        setting(1024, 8192, [(0, 0.90, 0.1, 0, 0), (0.5, 0.90, 0.1, -0.01, 0.01), (1, 0.88, 0.2, -0.03, -0.004)]),
    ]  # fmt: skip
    summary = {r["alpha_max"]: r for r in alpha_summary(settings)}
    assert summary[1.0]["losses"] == ["budget 1024, 8192 tokens"]
    assert not summary[1.0]["admissible"] and summary[1.0]["mean_difference"] > 0
    assert summary[0.5]["admissible"] and summary[0.0]["admissible"]
    assert summary[1.0]["mean_top1_agreement"] > summary[0.5]["mean_top1_agreement"]
    assert choose_alpha_max(settings) == 0.5
    # without the loss (its interval reaches 0), 1.0 wins on mean top-1
    settings[1]["table"][2]["vs_rule"]["ci95"] = [-0.03, 0.0]
    assert choose_alpha_max(settings) == 1.0


def test_none_admissible_gives_the_rule():
    """A negative mean difference is not admissible even without a significant loss; a loss
    anywhere excludes; with nothing admissible the pick is 0."""
    settings = [
        setting(256, 4096, [(0, 0.80, 0.4, 0, 0), (0.5, 0.79, 0.3, -0.02, 0.01), (2, 0.86, 0.3, 0.02, 0.1)]),
        setting(1024, 4096, [(0, 0.90, 0.1, 0, 0), (0.5, 0.90, 0.1, -0.01, 0.01), (2, 0.85, 0.3, -0.09, -0.01)]),
    ]  # fmt: skip
    summary = {r["alpha_max"]: r for r in alpha_summary(settings)}
    assert summary[0.5]["losses"] == [] and summary[0.5]["mean_difference"] < 0
    assert not summary[0.5]["admissible"] and not summary[2.0]["admissible"]
    assert choose_alpha_max(settings) == 0.0


def test_ties_go_to_the_lower_kl_then_to_the_smaller_alpha():
    tie = [(0, 0.80, 0.40, 0, 0), (0.5, 0.82, 0.35, -0.01, 0.05), (1, 0.82, 0.30, -0.01, 0.05)]
    assert choose_alpha_max([setting(256, 4096, tie)]) == 1.0  # equal top-1: lower KL
    full = [(0, 0.80, 0.40, 0, 0), (0.5, 0.82, 0.30, -0.01, 0.05), (1, 0.82, 0.30, -0.01, 0.05)]
    assert choose_alpha_max([setting(256, 4096, full)]) == 0.5  # full tie: the smaller
    # equal to the rule on top-1 (difference 0, admissible): KL decides, a full tie is the rule
    same = [(0, 0.80, 0.40, 0, 0), (1, 0.80, 0.38, 0.0, 0.0)]
    assert choose_alpha_max([setting(256, 4096, same)]) == 1.0
    same = [(0, 0.80, 0.40, 0, 0), (1, 0.80, 0.40, 0.0, 0.0)]
    assert choose_alpha_max([setting(256, 4096, same)]) == 0.0


def test_the_tables_must_share_a_grid_with_the_rule_in_it():
    a = setting(256, 4096, [(0, 0.8, 0.4, 0, 0), (1, 0.8, 0.4, 0, 0)])
    b = setting(512, 4096, [(0, 0.8, 0.4, 0, 0), (2, 0.8, 0.4, 0, 0)])
    with pytest.raises(ValueError, match="grid"):
        choose_alpha_max([a, b])
    no_rule = {"budget": 256, "max_tokens": 4096, "table": a["table"][1:]}
    with pytest.raises(ValueError, match="grid"):
        choose_alpha_max([no_rule])


def small_head(tmp_path, name="h"):
    head = ResidualHead(HeadConfig(head_dim=16, hidden=8))
    head.save(tmp_path / name / HEAD_FILE)
    return tmp_path / name


def test_cli_rejects_bad_option_values(tmp_path):
    from typer.testing import CliRunner

    from agentkv.engine.cli import app
    from agentkv.methods.intentkv_head import SHIPPED_DIR

    run = CliRunner().invoke
    head = small_head(tmp_path)
    base = ["calibrate-intentkv", "--head", str(head), "--out", str(tmp_path / "o")]
    for option, value in [
        ("--budgets", "256,big"),
        ("--budgets", "0,256"),
        ("--budgets", ","),
        ("--max-tokens", "4096;8192"),
        ("--max-tokens", "-1"),
        ("--alpha-grid", "0,-1"),
        ("--alpha-grid", "0,nan"),
        ("--traces", "0"),
    ]:
        res = run(app, [*base, option, value])
        assert res.exit_code == 2 and option in res.output, (option, value, res.output)
    res = run(app, ["calibrate-intentkv", "--head", str(tmp_path / "none")])
    assert res.exit_code == 2 and "--head" in res.output
    # the packaged head is not overwritten unless --out names it
    shipped = next(p for p in sorted(SHIPPED_DIR.glob("*")) if (p / HEAD_FILE).is_file())
    before = (shipped / HEAD_FILE).stat().st_mtime_ns
    res = run(app, ["calibrate-intentkv", "--head", str(shipped)])
    assert res.exit_code == 2 and "--out" in res.output and "shipped" in res.output
    assert (shipped / HEAD_FILE).stat().st_mtime_ns == before
    train = ["train-intentkv", "--out", str(tmp_path / "t")]
    for option, value in [("--calibrate-budgets", "256,x"), ("--calibrate-max-tokens", "")]:
        res = run(app, [*train, option, value])
        assert res.exit_code == 2 and option in res.output, (option, value, res.output)
    assert not (tmp_path / "o").exists() and not (tmp_path / "t").exists()  # no work done


@pytest.mark.slow
def test_calibrate_intentkv_cli_recalibrates_without_retraining(tmp_path):
    """One held-out session (system prompt cut, its tools only), two budgets x two cuts, grid
    {0, 1}, a head whose residual is not zero: the written head has the input's weights and
    the calibration's pick as its alpha_max."""
    from typer.testing import CliRunner

    from agentkv.bench.traces import tau_bench_path
    from agentkv.engine.cli import app

    try:
        tau_bench_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    torch.manual_seed(0)
    head = ResidualHead(HeadConfig.for_shape(SMOLLM2, model="test"))
    torch.nn.init.normal_(head.mlp[2].weight, std=2.0)
    head.calibrated_alpha_max = 2.0
    head.save(tmp_path / "in" / HEAD_FILE, {"training_traces": json.dumps([])})
    out = tmp_path / "out"
    args = ["calibrate-intentkv", "--head", str(tmp_path / "in"), "--device", "cpu"]
    args += ["--traces", "1", "--budgets", "128,64", "--max-tokens", "500,600"]
    args += ["--alpha-grid", "1", "--system-chars", "300", "--called-tools-only"]
    res = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert res.exit_code == 0, res.output
    c = json.loads((out / "calibration.json").read_text())
    assert c["grid"] == [0.0, 1.0] and len(c["traces"]) == 1 and c["alpha_max_before"] == 2.0
    settings = [(s["budget"], s["max_tokens"]) for s in c["settings"]]
    assert settings == [(64, 500), (128, 500), (64, 600), (128, 600)]
    turns = {s["max_tokens"]: s["turns"] for s in c["settings"]}
    assert 0 < turns[500] < turns[600]  # the longer cut replays one more turn
    for s in c["settings"]:
        rule, one = s["table"]
        d = one["top1_agreement"] - rule["top1_agreement"]
        assert one["vs_rule"]["difference"] == pytest.approx(d, abs=1e-9)
    assert c["alpha_max"] == choose_alpha_max(c["settings"])
    assert f"chose alpha_max {c['alpha_max']:g}" in res.output
    back = ResidualHead.load(out / HEAD_FILE)
    assert back.calibrated_alpha_max == c["alpha_max"]
    assert back.inference_alpha_max(None) == c["alpha_max"]
    original = ResidualHead.load(tmp_path / "in" / HEAD_FILE)
    assert original.calibrated_alpha_max == 2.0  # the input is left alone
    for (k, v), (k2, v2) in zip(
        original.state_dict().items(), back.state_dict().items(), strict=True
    ):
        assert k == k2 and torch.equal(v, v2)
    assert (out / "calibration.png").stat().st_size > 0
