"""IntentKV Phase-2 training: future-action labels on a real rendered trajectory, the loss,
and a fit that learns what the rule misses (no model needed: rows are built directly)."""

from __future__ import annotations

import json

import pytest
import torch

from agentkv.methods.base import ModelShape
from agentkv.methods.intentkv_head import HeadConfig, ResidualHead, rule_logit
from agentkv.tags import Role, TagCode
from agentkv.train.intentkv_data import (
    Row,
    argument_values,
    char_labels,
    future_arguments,
    token_labels,
)
from agentkv.train.intentkv_fit import FitConfig, LossConfig, fit, ranking_metrics, row_loss

SHAPE = ModelShape(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16)


def call(name, args):
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def test_argument_values_and_horizon():
    assert argument_values(
        '{"user_id": "mia_li_3668", "n": 2, "ok": true, "xs": ["JFK", "SE"]}'
    ) == [
        "mia_li_3668",
        "JFK",
    ]
    msgs = [{"role": "user", "content": "hi"}] + [
        {"role": "assistant", "content": None, "tool_calls": [call("f", {"a": f"value{k}"})]}
        for k in range(7)
    ]
    assert future_arguments(msgs, 1, horizon=5) == [f"value{k}" for k in range(5)]
    assert future_arguments(msgs, 3, horizon=2) == ["value2", "value3"]


def test_token_labels_on_a_real_rendering():
    """Positive tokens are candidates whose text lies in a future argument's occurrence."""
    from transformers import AutoTokenizer

    from agentkv.engine.chat_template import ChatRenderer
    from agentkv.engine.model_loader import resolve_model_dir

    try:
        tok = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    except Exception as e:  # pragma: no cover - depends on the local install
        pytest.skip(f"default model not available: {e}")
    msgs = [
        {"role": "system", "content": "You are an airline agent."},
        {"role": "user", "content": "My user id is mia_li_3668 and I fly to SEA."},
        {"role": "assistant", "content": "Let me look."},
        {"role": "user", "content": "Thanks."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call("get_user", {"id": "mia_li_3668"})],
        },
    ]
    tags = ChatRenderer(tok).encode(msgs[:4], None)
    enc = tok(tags.text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = [tuple(o) for o in enc["offset_mapping"]]
    chars = char_labels(tags.text, future_arguments(msgs, 4))
    candidates = ~torch.tensor(tags.forced(False))
    codes = torch.tensor(tags.codes)
    labels = token_labels(tags.text, offsets, chars, candidates, codes)
    pos = [t for t in range(len(labels)) if labels[t] == 1]
    assert pos and tok.decode([tags.token_ids[t] for t in pos]).strip() == "mia_li_3668"
    for t in range(len(labels)):
        if not bool(candidates[t]) or TagCode.role_of(tags.codes[t]) is Role.DELIM:
            assert labels[t] == -1
    assert int((labels == 0).sum()) > 10


def synthetic_rows(n_rows: int, seed: int) -> list[Row]:
    """Rows where positives are keys aligned with a hidden direction the rule cannot see."""
    g = torch.Generator().manual_seed(seed)
    direction = torch.nn.functional.normalize(torch.ones(16), dim=0)
    rows = []
    for r in range(n_rows):
        n = 60
        keys = torch.randn(n, 16, generator=g)
        labels = torch.zeros(n, dtype=torch.int8)
        labels[:6] = 1
        keys[:6] += 3 * direction
        labels[-3:] = -1
        rule = torch.softmax(torch.randn(n, generator=g), dim=0)
        rows.append(
            Row(
                rule=rule,
                keys=keys,
                memory=torch.nn.functional.normalize(torch.randn(16, generator=g), dim=0),
                q_keys=torch.randn(4, 16, generator=g),
                labels=labels,
                memory_norm=torch.ones(2, 4),
                session=f"s{r % 4}",
            )
        )
    return rows


def test_loss_parts():
    row = synthetic_rows(1, 0)[0]
    head = ResidualHead(HeadConfig.for_shape(SHAPE))
    loss, parts = row_loss(head, row, LossConfig())
    assert torch.isfinite(loss) and parts["bce"] > 0 and parts["rank"] > 0
    assert 0 < parts["keep"] < 1
    # excluded tokens do not count: flipping their label changes nothing
    flipped = Row(**{**row.__dict__, "labels": row.labels.clone()})
    flipped.labels[-3:] = -1
    again = row_loss(head, flipped, LossConfig())[0]
    assert float(again.detach()) == pytest.approx(float(loss.detach()))


def test_fit_learns_what_the_rule_misses():
    train, val = synthetic_rows(24, 1), synthetic_rows(8, 2)
    rule = ranking_metrics(None, val)
    head, result = fit(train, val, HeadConfig.for_shape(SHAPE), FitConfig(epochs=8), progress=False)
    learned = ranking_metrics(head, val)
    assert learned["auc"] > rule["auc"] + 0.2
    h = result["history"]
    assert h["val_loss"][result["best_epoch"]] == min(h["val_loss"])
    z = rule_logit(val[0].rule)
    assert not torch.equal(head(z, val[0].keys, val[0].memory, val[0].q_keys), z)


def test_cli_rejects_a_bad_label_or_grid(tmp_path):
    from typer.testing import CliRunner

    from agentkv.engine.cli import app

    base = ["train-intentkv", "--out", str(tmp_path / "h")]
    res = CliRunner().invoke(app, [*base, "--label", "future"])
    assert res.exit_code != 0 and "--label" in res.output
    res = CliRunner().invoke(app, [*base, "--alpha-grid", "0,big"])
    assert res.exit_code != 0 and "--alpha-grid" in res.output
    assert not (tmp_path / "h").exists()  # rejected before any work
