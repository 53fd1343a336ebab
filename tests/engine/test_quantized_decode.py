"""Quantized decode through the engine's attention seam: the kernels' path (``KernelDecode``:
the fused decode over the pools through the per-head ``DecodeIndex``, here its torch
reference and the Triton kernel under the interpreter) against the dense path (the gathered,
dequantized ``LiveView`` + SDPA) on the same quantized, holey KV, with decode pages quantized
as they fill; resident bytes split by precision."""

from __future__ import annotations

import pytest

from agentkv import H2O, UniformQuant, build_payload

pytestmark = pytest.mark.slow

MESSAGES = [
    {"role": "system", "content": "You answer in one short sentence. " * 6},
    {"role": "user", "content": "Name three colors of the sea at dusk, and why they change."},
]


#: 30 tokens: under the interpreter a kernel call costs about linearly in the cells it reads
SHORT = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "Name three colors of the sea at dusk."},
]


def _decode(engine, policy, path: str, n: int, messages=MESSAGES):
    from agentkv.engine.engine import GenerationConfig

    engine.decode_attention = path
    try:
        res = engine.chat(
            messages,
            payload=build_payload(messages, policy, f"req:{path}"),
            gen=GenerationConfig(max_tokens=n, ignore_eos=True),
        )
    finally:
        engine.decode_attention = "dense"
    engine.store.check_invariants()
    return res


@pytest.mark.parametrize(
    ("policy", "steps"),
    [
        (UniformQuant(bits=2, residual=16), 40),
        (UniformQuant(bits=4, residual=16), 40),
        (H2O(budget=48, recent=8), 12),
    ],
    ids=["uniform_quant2", "uniform_quant4", "h2o48"],
)
def test_reference_decode_matches_dense_path(engine, policy, steps, monkeypatch):
    """UniformQuant, 40 decode steps: the residual window (16) fills and pages of 32 quantize
    during decode (INT4 and INT2 pages: the kernels' index follows them in place,
    ``DecodeIndex.advance``); H2O (holes from its prefill plan, nothing changes during
    decode), 12 steps over the holes. Both paths read the same dequantized values and pick
    the same tokens."""
    from agentkv.cache import DecodeIndex

    advanced = []
    follow = DecodeIndex.advance

    def spy(self, *args):
        advanced.append(follow(self, *args))
        return advanced[-1]

    monkeypatch.setattr(DecodeIndex, "advance", spy)
    dense = _decode(engine, policy, "dense", steps)
    ref = _decode(engine, policy, "reference", steps)
    assert ref.token_ids == dense.token_ids
    u = dense.usage
    if policy.quantizes:
        # prompt cells before the window, then one decode page per column, are quantized
        shape = engine.shape
        prompt_q = (u.prompt_tokens - 16) * shape.num_layers * shape.num_kv_heads
        assert u.quantized_entries > prompt_q
        assert u.resident_kv_bytes_by_precision[f"int{policy.bits}"] > 0
        assert u.resident_kv_bytes < 0.5 * u.live_kv_bytes
        assert advanced == [True]  # one page in 40 steps, followed in place
    else:
        assert u.resident_kv_bytes <= 1.1 * u.live_kv_bytes
        assert u.evicted_entries > 0


def test_triton_decode_kernel_matches_dense_path(engine):
    """The fused Triton decode kernel (CPU interpreter) over INT4 cells and the full-precision
    window, one decode step in every layer: the step's new cell is appended to the index and
    read in place (the Triton kernel itself: tests/kernels; many steps through the same
    ``KernelDecode``: the reference test above; index appends: tests/cache/test_decode_index)."""
    policy = UniformQuant(bits=4, residual=8)
    dense = _decode(engine, policy, "dense", 2, SHORT)
    kern = _decode(engine, policy, "kernels", 2, SHORT)
    assert len(dense.token_ids) == 2
    assert kern.token_ids == dense.token_ids
    u = kern.usage
    assert u.resident_kv_bytes_by_precision["int4"] > 0  # the kernel read INT4 cells
    shape = engine.shape  # every prompt cell before the window of 8 is INT4
    assert u.quantized_entries >= (u.prompt_tokens - 8) * shape.num_layers * shape.num_kv_heads


def test_second_turn_eviction_compacts_the_sessions_int4_cells(engine):
    """Turn 1 quantizes the context to INT4 and is cached in its session; turn 2 (H2O)
    evicts most of those cells. Before the kernels' decode the survivors move into fuller
    runs (with the session's tree node repointed), which changes no value: the reference
    decode picks the dense path's tokens, and only the kernels' path moves cells."""
    from agentkv.engine.engine import GenerationConfig

    system = {"role": "system", "content": "You are a helpful assistant for a shop. " * 12}
    turn1 = [system, {"role": "user", "content": "What colors does the blue mug come in?"}]
    runs = {}
    for path in ("dense", "reference"):
        session = f"compact:{path}"
        engine.decode_attention = path
        engine.store.int4_min_density = 0.75  # (Engine(int4_compaction=0.75))
        try:
            first = engine.chat(
                turn1,
                payload=build_payload(turn1, UniformQuant(bits=4, residual=16), session),
                gen=GenerationConfig(max_tokens=4, ignore_eos=True),
            )
            turn2 = [
                *turn1,
                {"role": "assistant", "content": first.text},
                {"role": "user", "content": "And how much does it cost?"},
            ]
            runs[path] = engine.chat(
                turn2,
                payload=build_payload(turn2, H2O(budget=96, recent=16), session),
                gen=GenerationConfig(max_tokens=6, ignore_eos=True),
            )
        finally:
            engine.decode_attention = "dense"
            engine.store.int4_min_density = 0.0
        engine.store.check_invariants()
    dense, ref = runs["dense"], runs["reference"]
    assert dense.usage.prefix_hit_tokens > 64 and dense.usage.evicted_entries > 0
    assert dense.usage.resident_kv_bytes_by_precision["int4"] > 0
    assert dense.usage.compacted_entries == 0
    assert ref.usage.compacted_entries > 0
    assert ref.token_ids == dense.token_ids
    assert ref.usage.resident_kv_bytes == dense.usage.resident_kv_bytes
