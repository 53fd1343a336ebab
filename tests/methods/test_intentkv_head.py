"""IntentKV Phase-2 residual head: exact rule score at initialisation, the alpha clip, a live
gradient path, checkpoints, and the error for a model without a head."""

from __future__ import annotations

import pytest
import torch

from agentkv.methods.base import ModelShape
from agentkv.methods.intentkv_head import (
    HEAD_FILE,
    HEADS_ENV,
    HeadConfig,
    HeadNotFound,
    ResidualHead,
    head_for,
    rule_logit,
)

SHAPE = ModelShape(num_layers=3, num_q_heads=4, num_kv_heads=2, head_dim=16)


def inputs(n: int = 40, m: int = 7, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rule = torch.softmax(torch.randn(n, generator=g) * 2, dim=0)
    keys = torch.randn(n, 16, generator=g) * 8
    memory = torch.nn.functional.normalize(torch.randn(16, generator=g), dim=0)
    q_keys = torch.randn(m, 16, generator=g) * 8
    return rule, keys, memory, q_keys


def test_rule_logit_is_monotone_and_centred():
    rule, *_ = inputs()
    z = rule_logit(rule)
    assert torch.equal(torch.argsort(z), torch.argsort(rule))
    torch.testing.assert_close(rule_logit(torch.full((10,), 0.1)), torch.zeros(10))


def test_initial_head_is_the_rule_exactly():
    head = ResidualHead(HeadConfig.for_shape(SHAPE))
    rule, keys, memory, q_keys = inputs()
    z = rule_logit(rule)
    assert torch.equal(head(z, keys, memory, q_keys), z)
    assert torch.equal(head(z, keys, memory, q_keys[:0]), z)  # no live query keys
    assert float(head.alpha.detach()) == 1.0
    # the gradient still reaches the zero-initialised output layer (alpha > 0)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(
        head(z, keys, memory, q_keys), (rule > rule.median()).float()
    )
    loss.backward()
    assert float(head.mlp[2].weight.grad.abs().sum()) > 0
    assert float(head.mlp[2].bias.grad.abs()) > 0


def test_alpha_is_clipped_at_inference():
    head = ResidualHead(HeadConfig.for_shape(SHAPE))
    torch.nn.init.normal_(head.mlp[2].weight)
    with torch.no_grad():
        head.alpha.fill_(3.0)
    rule, keys, memory, q_keys = inputs()
    z = rule_logit(rule)
    r = head.residual(keys, memory, q_keys)
    torch.testing.assert_close(head(z, keys, memory, q_keys, alpha_max=1.0), z + r)
    torch.testing.assert_close(head(z, keys, memory, q_keys), z + 3.0 * r)
    assert torch.equal(head(z, keys, memory, q_keys, alpha_max=0.0), z)  # the rule floor
    with torch.no_grad():
        head.alpha.fill_(-2.0)
    assert torch.equal(head(z, keys, memory, q_keys, alpha_max=1.0), z)


def test_checkpoint_round_trip_and_lookup(tmp_path, monkeypatch):
    head = ResidualHead(HeadConfig.for_shape(SHAPE, model="toy"))
    torch.nn.init.normal_(head.mlp[2].weight)
    head.save(tmp_path / "toy" / HEAD_FILE)
    monkeypatch.setenv(HEADS_ENV, str(tmp_path))
    back = head_for(SHAPE)
    assert back.config == head.config
    rule, keys, memory, q_keys = inputs()
    z = rule_logit(rule)
    with torch.no_grad():
        torch.testing.assert_close(back(z, keys, memory, q_keys), head(z, keys, memory, q_keys))
    other = ModelShape(num_layers=5, num_q_heads=4, num_kv_heads=2, head_dim=16)
    with pytest.raises(HeadNotFound, match="agentkv train-intentkv") as e:
        head_for(other)
    assert "policy.mode" in str(e.value) and HEADS_ENV in str(e.value)


def test_the_default_model_ships_a_head(monkeypatch):
    """SmolLM2-135M-Instruct's head is in the package and found by its model shape."""
    import json

    from agentkv.engine.model_loader import resolve_model_dir

    monkeypatch.delenv(HEADS_ENV, raising=False)
    try:
        cfg = json.loads((resolve_model_dir(None) / "config.json").read_text())
    except Exception as e:  # pragma: no cover - depends on the local install
        pytest.skip(f"default model not available: {e}")
    heads = cfg["num_attention_heads"]
    shape = ModelShape(
        num_layers=cfg["num_hidden_layers"],
        num_q_heads=heads,
        num_kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
    )
    head = head_for(shape)
    assert head.config.model == "SmolLM2-135M-Instruct" and head.config.matches(shape)
    assert float(head.alpha.detach()) > 0.0 and not bool((head.mlp[2].weight == 0).all())
