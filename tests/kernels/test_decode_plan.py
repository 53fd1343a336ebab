"""The decode call's host side: its plan, made once per distinct call and kept
(:class:`DecodePlan`), the pools' layout key it is kept under, and on a GPU the direct
launches (:class:`DirectLaunch`) against Triton's own dispatch."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from mixed_batch import DEVICE, build_mixed_batch

from agentkv.kernels import (
    DecodeConfig,
    KVPools,
    SegmentMaxLens,
    clear_decode_plans,
    decode_attention_ref,
)
from agentkv.kernels.decode_attention import DecodePlan

dattn = importlib.import_module("agentkv.kernels.decode_attention")

GPU = torch.cuda.is_available()
LENS = [(2, 96, 40), (1, 64, 8)]  # (INT2 pages, INT4 tokens, full tokens) per request


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-6))


def _ref(mb) -> torch.Tensor:
    return decode_attention_ref(mb.q, mb.pools, mb.slot_map, mb.seq_lens, mb.head_mask)


@pytest.fixture(autouse=True)
def _own_plans(monkeypatch):
    """Each test starts with no plans and leaves the others' alone."""
    monkeypatch.setattr(dattn, "_PLANS", {})


def test_a_repeated_call_reuses_its_plan() -> None:
    mb = build_mixed_batch(LENS, hq=8, hkv=2, d=128, seed=1)
    first = mb.decode()
    assert len(dattn._PLANS) == 1
    plan = next(iter(dattn._PLANS.values()))
    assert isinstance(plan, DecodePlan)
    again = mb.decode()
    assert len(dattn._PLANS) == 1 and next(iter(dattn._PLANS.values())) is plan
    assert torch.equal(first, again)
    assert _rel(again, _ref(mb)) < 3e-3


def _tensors_in(obj, seen: set) -> list:
    """Tensors reachable from ``obj`` through dicts, sequences and the attributes and slots
    of agentkv's objects (Triton's, the kernels and compiled launchers, hold none)."""
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors_in(v, seen)]
    if isinstance(obj, (list, tuple, set)):
        return [t for v in obj for t in _tensors_in(v, seen)]
    if not type(obj).__module__.startswith("agentkv"):
        return []
    fields = dict(getattr(obj, "__dict__", {}))
    for name in getattr(type(obj), "__slots__", ()):
        if hasattr(obj, name):
            fields[name] = getattr(obj, name)
    return [t for v in fields.values() for t in _tensors_in(v, seen)]


def test_a_plan_keeps_none_of_its_calls_tensors() -> None:
    """A kept plan would otherwise keep a layer's query, slot map or pools alive."""
    mb = build_mixed_batch(LENS, hq=8, hkv=2, d=128, seed=11, head_mask_fraction=0.2)
    mb.decode()
    (plan,) = dattn._PLANS.values()
    assert _tensors_in(plan, set()) == []


def test_layers_alike_share_a_plan_and_read_their_own_tensors() -> None:
    """Two layers (pools allocated alike, other contents, other queries) take one plan,
    and each call reads its own tensors: the plan keeps none of the first call's."""
    a = build_mixed_batch(LENS, hq=8, hkv=2, d=128, seed=2)
    b = build_mixed_batch(LENS, hq=8, hkv=2, d=128, seed=3)
    assert a.pools.layout_key() == b.pools.layout_key()
    out_a, out_b = a.decode(), b.decode()
    assert len(dattn._PLANS) == 1
    assert _rel(out_a, _ref(a)) < 3e-3 and _rel(out_b, _ref(b)) < 3e-3
    assert _rel(out_a, out_b) > 0.1


def test_calls_that_launch_differently_get_their_own_plans() -> None:
    mb = build_mixed_batch(LENS, hq=8, hkv=2, d=128, seed=4, head_mask_fraction=0.3)
    calls = [
        {},
        {"max_lens": SegmentMaxLens(64, 96, 40)},  # other host bounds: other grids
        {"config": DecodeConfig(min_split_len=64)},
        {"split_len": 64},
        {"sm_scale": 0.05},
    ]
    outs = [mb.decode(**kw) for kw in calls]
    no_mask = dataclasses.replace(mb, head_mask=None)
    outs.append(no_mask.decode())
    assert len(dattn._PLANS) == len(calls) + 1
    ref = _ref(mb)
    for out in outs[:4]:
        assert _rel(out, ref) < 3e-3
    assert _rel(outs[-1], _ref(no_mask)) < 3e-3
    # the same calls again: no new plans
    for kw in calls:
        mb.decode(**kw)
    assert len(dattn._PLANS) == len(calls) + 1


def test_a_config_equal_to_another_is_planned_for_itself() -> None:
    """Plans are kept per config object (held by the plan, so its id is not reused)."""
    mb = build_mixed_batch(LENS, hq=8, hkv=2, d=128, seed=5)
    one, other = DecodeConfig(), DecodeConfig()
    assert one == other
    mb.decode(config=one)
    mb.decode(config=other)
    first, second = dattn._PLANS.values()
    assert first.config is one and second.config is other


def test_clear_decode_plans() -> None:
    mb = build_mixed_batch(LENS, hq=8, hkv=2, d=128, seed=6)
    mb.decode()
    clear_decode_plans()
    assert not dattn._PLANS
    mb.decode()
    assert len(dattn._PLANS) == 1


def test_plans_are_bounded(monkeypatch) -> None:
    monkeypatch.setattr(dattn, "_MAX_PLANS", 3)
    mb = build_mixed_batch(LENS, hq=8, hkv=2, d=128, seed=7)
    for s in (0.05, 0.06, 0.07, 0.08, 0.09):
        mb.decode(sm_scale=s)
    assert len(dattn._PLANS) == 3
    kept = [p.qk_scale for p in dattn._PLANS.values()]  # the newest three
    assert kept == pytest.approx([s * dattn._LOG2E for s in (0.07, 0.08, 0.09)])


def test_layout_key_follows_the_tensors() -> None:
    pools = KVPools.allocate(9, 64, 2, 2, 128, torch.float16, device=DEVICE)
    same = KVPools.allocate(9, 64, 2, 2, 128, torch.float16, device=DEVICE)
    key = pools.layout_key()
    assert key == same.layout_key()
    assert pools.layout_key() is key  # remembered while the tensors are the same
    pools.int4.k = torch.zeros_like(pools.int4.k)  # another tensor, laid out alike
    assert pools.layout_key() == key
    pools.int4.k = pools.int4.k[1:]  # fewer slots
    assert pools.layout_key() != key
    bigger = KVPools.allocate(17, 64, 2, 2, 128, torch.float16, device=DEVICE)
    assert bigger.layout_key() != key
    no_int2 = KVPools(same.full, same.int4, None)
    no_int4 = KVPools(same.full, None, same.int2)
    assert len({no_int2.layout_key(), no_int4.layout_key(), key}) == 3
    # an INT4 pool without its per-channel key scale vs with one
    kcs = KVPools(
        same.full,
        dataclasses.replace(same.int4, k_channel=torch.ones(2, 128, device=DEVICE)),
        same.int2,
    )
    assert kcs.layout_key() != same.layout_key()


needs_gpu = pytest.mark.skipif(not GPU, reason="direct launches run compiled kernels (CUDA)")

CASES = {
    "int4": [(0, 300, 0), (0, 170, 0)],
    "int2": [(9, 0, 0), (4, 0, 0)],
    "mixed": [(6, 200, 0), (3, 90, 0)],
    "all": [(3, 96, 40), (2, 64, 100)],
    "full": [(0, 0, 300), (0, 0, 64)],
}


@needs_gpu
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("head_mask", [0.0, 0.3])
def test_direct_launches_match_tritons_dispatch(monkeypatch, case, head_mask) -> None:
    """The second call of a plan launches without Triton's ``JITFunction.run`` and gives
    the bits Triton's dispatch gives."""
    mb = build_mixed_batch(CASES[case], hq=32, hkv=8, d=128, seed=8, head_mask_fraction=head_mask)
    via_triton = mb.decode(config=DecodeConfig(direct_launch=False))
    first = mb.decode()  # records each launch's compiled kernel
    runs: list[str] = []
    for name in ("_decode_split_kernel", "_merge_splits_kernel", "int2_split_gluon_kernel",
                 "int4_split_gluon_kernel", "mixed_split_gluon_kernel"):  # fmt: skip
        kernel = getattr(dattn, name)
        if kernel is None:
            continue
        real = kernel.run

        def counted(*a, _real=real, _name=name, **kw):
            runs.append(_name)
            return _real(*a, **kw)

        monkeypatch.setattr(kernel, "run", counted)
    second = mb.decode()
    torch.cuda.synchronize()
    assert runs == []
    assert torch.equal(first, via_triton) and torch.equal(second, via_triton)
    assert _rel(second, _ref(mb)) < 3e-3


@needs_gpu
def test_a_call_off_a_16_byte_boundary_gets_its_own_plan() -> None:
    """Triton specializes on alignment, so the plan's key holds the call tensors': a length
    tensor off a 16-byte boundary takes its own plan (its launches compiled through Triton),
    the aligned one its own again, and both give the same bits."""
    mb = build_mixed_batch(CASES["all"], hq=32, hkv=8, d=128, seed=9)
    aligned = mb.decode()
    buf = torch.zeros(mb.seq_lens.numel() + 1, dtype=mb.seq_lens.dtype, device=DEVICE)
    off = buf[1:]
    off.copy_(mb.seq_lens)
    assert off.data_ptr() % 16 == 4
    shifted = dataclasses.replace(mb, seq_lens=off)
    outs = [shifted.decode(), mb.decode(), shifted.decode()]
    assert len(dattn._PLANS) == 2
    for out in outs:
        assert torch.equal(out, aligned)


def _merge_ref(po: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The merge kernel's math: base-2 log-sum-exp weights over the splits."""
    w = torch.exp2(lse - lse.max(-1, keepdim=True).values)
    return (w[..., None] * po).sum(-2) / w.sum(-1)[..., None]


@needs_gpu
def test_a_direct_launch_site_fingerprints_its_arguments() -> None:
    """A site that does not trust its owner (``one_specialization`` False) keeps one
    compiled kernel per specialization: pointers off a 16-byte boundary and ints equal to 1
    compile their own, and each launch reads the arguments it is given."""
    from agentkv.kernels.direct_launch import DirectLaunch

    kernel = dattn._merge_splits_kernel
    b, hq, d = 2, 4, 128
    site = DirectLaunch(kernel, dict(D=d, BLOCK_S=16, BLOCK_D=d, num_warps=4))
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for off, splits in ((0, 5), (1, 5), (0, 5), (0, 1), (1, 5)):
        n = b * hq * splits
        po = torch.randn(n * d + 1, device=DEVICE, generator=gen)[off : off + n * d]
        lse = torch.randn(n + 1, device=DEVICE, generator=gen)[off : off + n]
        out = torch.empty(b, hq, d, device=DEVICE)
        site(kernel, (b * hq, 1, 1), (po, lse, out, out.stride(0), out.stride(1), hq, splits))
        ref = _merge_ref(po.view(b, hq, splits, d), lse.view(b, hq, splits))
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert len(site._compiled) == 3  # aligned x 5, off x 5, aligned x 1 splits


@needs_gpu
def test_a_launch_hook_takes_tritons_path(monkeypatch) -> None:
    """With a launch hook set (a profiler's), every launch goes through Triton (which
    calls the hook)."""
    from triton import knobs

    mb = build_mixed_batch(CASES["int4"], hq=32, hkv=8, d=128, seed=10)
    out = mb.decode()
    seen: list = []

    def hook(*a) -> None:
        seen.append(a)

    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):  # (later Tritons: a chain of hooks)
        chain.add(hook)
        try:
            again = mb.decode()
        finally:
            chain.remove(hook)
    else:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
        again = mb.decode()
    torch.cuda.synchronize()
    assert len(seen) >= 2  # the split(s) and the merge
    assert torch.equal(out, again)
