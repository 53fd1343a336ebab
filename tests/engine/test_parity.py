"""FullCache through the KV store and the agentkv attention == plain transformers.

Same weights, float32, CPU: greedy tokens identical and logits within 1e-3 of HF's SDPA path,
for a short prompt, a prompt longer than the prefill chunk, a second turn that reuses the
prefix cache, and teacher-forced ``Engine.score``. Sampled decoding is reproducible by seed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from agentkv.engine.engine import GenerationConfig
from agentkv.policies import FullCache
from agentkv.wire import KVPayload

from .chats import tau_messages

pytestmark = pytest.mark.slow

ATOL = 1e-3


def hf_logits(hf_model: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()


def hf_greedy(hf_model: Any, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def chat_recording_logits(engine, monkeypatch, messages, payload, max_tokens):
    """``engine.chat`` (greedy), recording the logits each decode step sampled from."""
    seen: list[torch.Tensor] = []
    sample = engine._sample

    def spy(logits, gen, generator):
        seen.append(logits.detach().float().cpu().clone())
        return sample(logits, gen, generator)

    monkeypatch.setattr(engine, "_sample", spy)
    result = engine.chat(messages, payload=payload, gen=GenerationConfig(max_tokens=max_tokens))
    monkeypatch.undo()
    return result, torch.stack(seen)


def check_against_hf(engine, hf_model, monkeypatch, messages, sid, max_tokens=6):
    """Chat through the engine; compare every sampled step with HF; returns (result, ids, diff)."""
    prompt = engine.renderer.encode(messages).token_ids
    payload = KVPayload(session_id=sid, policy=FullCache())
    result, steps = chat_recording_logits(engine, monkeypatch, messages, payload, max_tokens)
    assert result.usage.prompt_tokens == len(prompt)
    ref = hf_logits(hf_model, prompt + result.token_ids)
    n = len(prompt)
    ref_steps = ref[n - 1 : n - 1 + steps.shape[0]]
    diff = float((steps - ref_steps).abs().max())
    assert diff < ATOL, f"max |logit diff| {diff}"
    # the same greedy continuation as transformers' own generate
    expected = hf_greedy(hf_model, prompt, len(result.token_ids))
    assert result.token_ids == expected
    # every sampled token is the argmax of HF's logits at that step (ties aside)
    assert result.token_ids == ref_steps.argmax(-1).tolist()[: len(result.token_ids)]
    return result, prompt, diff


def test_short_prompt_matches_hf(engine, hf_model, monkeypatch, sid):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Name three colors."},
    ]
    result, prompt, _ = check_against_hf(engine, hf_model, monkeypatch, messages, sid)
    assert len(result.token_ids) == 6 and result.finish_reason == "length"
    assert result.text == engine.tokenizer.decode(result.token_ids, skip_special_tokens=True)


def test_chunked_prefill_matches_hf(engine, hf_model, monkeypatch, sid):
    messages, _ = tau_messages(system_chars=1400)
    prompt = engine.renderer.encode(messages).token_ids
    assert engine.chunk_size < len(prompt) < 2 * engine.chunk_size + 100, len(prompt)
    result, _, _ = check_against_hf(engine, hf_model, monkeypatch, messages, sid, max_tokens=4)
    assert result.usage.prefix_hit_tokens < engine.chunk_size  # the prefill really chunked


def test_second_turn_from_prefix_cache_matches_hf(engine, hf_model, monkeypatch, sid):
    messages = [
        {"role": "system", "content": f"You are assistant {sid}."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    first, prompt1, _ = check_against_hf(engine, hf_model, monkeypatch, messages, sid)
    assert first.usage.prefix_hit_tokens < len(prompt1) // 2  # a new conversation
    messages = [
        *messages,
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": "And of Italy?"},
    ]
    second, prompt2, _ = check_against_hf(engine, hf_model, monkeypatch, messages, sid)
    assert second.usage.prefix_hit_tokens >= len(prompt1) - 1
    assert second.usage.prefix_hit_tokens < len(prompt2)


def test_score_matches_one_hf_forward(engine, hf_model, sid):
    messages = [
        {"role": "system", "content": f"Session {sid}."},
        {"role": "user", "content": "Say hello to Bob."},
    ]
    target = {"role": "assistant", "content": "Hello Bob, nice to meet you!"}
    payload = KVPayload(session_id=sid, policy=FullCache())
    prompt = engine.renderer.encode(messages).token_ids
    full = engine.renderer.encode([*messages, target], add_generation_prompt=False).token_ids
    assert full[: len(prompt)] == prompt
    ref = hf_logits(hf_model, full)
    n = len(prompt)
    for turn in range(2):  # the second time the prompt comes from the prefix cache
        res = engine.score(messages, target, payload=payload)
        assert res.target_ids.tolist() == full[n:]
        assert res.logits.shape == (len(full) - n, ref.shape[-1])
        diff = float((res.logits - ref[n - 1 : len(full) - 1]).abs().max())
        assert diff < ATOL, f"turn {turn}: max |logit diff| {diff}"
        assert (res.usage.prefix_hit_tokens >= n - 1) == (turn == 1)
    # usage counts the teacher-forced target as the completion
    assert res.usage.completion_tokens == len(full) - n


def sample_tokens(engine, sid: str, seed: int | None, temperature: float = 1.0) -> list[int]:
    gen = GenerationConfig(max_tokens=8, temperature=temperature, top_p=0.95, seed=seed)
    messages = [{"role": "user", "content": "Tell me a story."}]
    payload = KVPayload(session_id=sid, policy=FullCache())
    return engine.chat(messages, payload=payload, gen=gen).token_ids


def test_sampling_reproducible_by_seed(engine, sid):
    a = sample_tokens(engine, sid, seed=1234)
    b = sample_tokens(engine, sid + "-b", seed=1234)
    assert a == b and len(a) > 0
    others = {tuple(sample_tokens(engine, sid, seed=s)) for s in (1, 2, 3)}
    others.add(tuple(a))
    assert len(others) >= 2, "different seeds gave the same tokens every time"


def test_sampling_without_seed_leaves_global_rng_alone(engine, sid):
    before = torch.initial_seed()
    state = torch.get_rng_state()
    sample_tokens(engine, sid, seed=None)
    assert torch.initial_seed() == before
    assert torch.equal(torch.get_rng_state(), state)
