"""KVzip+ targets against a brute-force implementation of the formula on a short input.

The brute force recomputes every layer from the weights (RMSNorm, q/k/v projections, RoPE,
causal softmax per query head) and evaluates

    s+_i = max over the GQA group's query heads h, max over repeated positions j,
           a^h_ji * ||W_O^h v_i|| / ||h_j||

with explicit Python loops over heads and positions; ``kvzip_plus_scores`` takes the
probabilities from the eager attention through hooks and reduces them vectorised.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow

CONTEXT = "Flight HAT083 leaves JFK at 3 PM."


@pytest.fixture(scope="module")
def eager_model():
    from agentkv.train.kvzap_fit import load_eager_model

    model, tokenizer, _ = load_eager_model(None, "cpu")
    return model, tokenizer


def brute_force(model, prompt) -> torch.Tensor:
    """float64 ``[L, n, Hkv]`` log s+ by the definition."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg = model.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // hq
    g = hq // hkv
    ids = prompt.input_ids[None]
    T = ids.shape[1]
    with torch.no_grad():
        out = model.model(input_ids=ids, output_hidden_states=True, use_cache=False)
        pos = torch.arange(T)[None]
        ctx = range(prompt.context.start, prompt.context.stop)
        rep = range(prompt.repeat.start, prompt.repeat.stop)
        result = torch.empty(len(model.model.layers), len(ctx), hkv, dtype=torch.float64)
        for li, layer in enumerate(model.model.layers):
            h = out.hidden_states[li][0]  # input of layer li
            x = layer.input_layernorm(h[None])
            at = layer.self_attn
            q = at.q_proj(x).view(1, T, hq, d).transpose(1, 2)
            k = at.k_proj(x).view(1, T, hkv, d).transpose(1, 2)
            v = at.v_proj(x).view(T, hkv, d)
            cos, sin = model.model.rotary_emb(x, pos)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            wo = at.o_proj.weight.double()  # [D_h, Hq * D]
            for kvh in range(hkv):
                for a, i in enumerate(ctx):
                    best = 0.0
                    for qh in range(kvh * g, (kvh + 1) * g):
                        logits = (q[0, qh].double() @ k[0, kvh].double().T) / math.sqrt(d)
                        wov = float((wo[:, qh * d : (qh + 1) * d] @ v[i, kvh].double()).norm())
                        for j in rep:
                            row = torch.softmax(logits[j, : j + 1], dim=-1)  # causal
                            s = float(row[i]) * wov / float(h[j].double().norm())
                            best = max(best, s)
                    result[li, a, kvh] = math.log(best)
    return result


def test_repeat_prompt_spans(eager_model):
    from agentkv.train.kvzip_targets import repeat_prompt

    _, tok = eager_model
    p = repeat_prompt(tok, CONTEXT)
    original = tok.decode(p.input_ids[p.context])
    repeated = tok.decode(p.input_ids[p.repeat])
    assert original.strip() == repeated.strip() == CONTEXT
    assert p.context.stop < p.repeat.start


def test_scores_match_brute_force(eager_model):
    from agentkv.train.kvzip_targets import kvzip_plus_scores, repeat_prompt

    model, tok = eager_model
    prompt = repeat_prompt(tok, CONTEXT)
    got = kvzip_plus_scores(model, prompt)
    want = brute_force(model, prompt)
    n = prompt.context.stop - prompt.context.start
    cfg = model.config
    assert got.log_scores.shape == (cfg.num_hidden_layers, n, cfg.num_key_value_heads)
    assert got.hidden.shape == (cfg.num_hidden_layers, n, cfg.hidden_size)
    torch.testing.assert_close(got.log_scores.double(), want, atol=2e-4, rtol=1e-4)
    # scores vary across heads and positions: the max is not degenerate
    assert float(want.std()) > 0.5
