"""benchmarks/decode_attention.py's ``python_us`` stubs every kernel ``decode_attention``
launches (a Gluon split launched but not stubbed counted as Python time before session 21).
Runs on the CPU: the launch sites are read from the kernels' source, and a stubbed call runs
the real ``decode_attention`` up to its launches."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import decode_attention as bench  # noqa: E402

from agentkv.kernels import KVPools, SegmentMaxLens, decode_attention  # noqa: E402


def test_every_launch_site_is_stubbed() -> None:
    """Each kernel a plan launches (``self.<site>_launch(<kernel>, ...)``) is stubbed."""
    src = (ROOT / "kernels" / "decode_attention.py").read_text()
    launched = set(re.findall(r"self\.\w+_launch\(\s*(\w+),", src))
    assert launched == set(bench.LAUNCHED_KERNELS)
    assert not re.findall(r"^\s*(\w+)\[[^\]]*\]\(", src, flags=re.M)  # (no other launch)


def test_without_launches_stubs_and_restores(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the Triton backend on a CPU
    mod = sys.modules[decode_attention.__module__]
    before = {name: getattr(mod, name) for name in bench.LAUNCHED_KERNELS}
    hq, hkv, d, b, n = 8, 2, 64, 2, 64
    pools = KVPools.allocate(b * n + 1, b * n, 4, hkv, d, device="cpu")
    q = torch.randn(b, hq, d, dtype=torch.float16)
    seq = torch.full((b,), n, dtype=torch.int32)
    slots = (torch.arange(b * n, dtype=torch.int32) + 1).view(b, n)
    seen = []

    def call():
        seen.append({name: getattr(mod, name) for name in bench.LAUNCHED_KERNELS})
        return decode_attention(
            q, pools, slots, seq, int4_lens=seq, max_lens=SegmentMaxLens(0, n, 0),
            backend="triton",
        )  # fmt: skip

    out = bench.without_launches(mod, call)()
    assert out.shape == (b, hq, d)
    assert all(isinstance(k, bench._NoLaunch) for k in seen[0].values())
    assert {name: getattr(mod, name) for name in bench.LAUNCHED_KERNELS} == before


def test_tiered_layout_is_mixed_with_a_bf16_window() -> None:
    """``--impls tiered`` (decode_splits.py): the mixed layout's INT2 segment, then INT4, then
    the last ``full_tail`` positions on the full bf16 pool; its segment bounds cover every
    position, and its byte count is the mixed one with the window's INT4 rows (codes and
    scales) read as bf16 rows instead."""
    s = bench.Shape(2, 1024)
    w, n2, n = s.full_tail, s.n2_mixed, s.n
    assert w == 128 and n2 == 768
    kw = s.inputs("tiered", False)
    ml = kw["max_lens"]
    assert (ml.int2, ml.int4, ml.full) == (n2, n - n2 - w, w)
    assert torch.equal(kw["int2_lens"] + kw["int4_lens"] + w, kw["seq_lens"])
    sm = kw["slot_map"]
    assert torch.equal(sm[:, :n2], s.slots_int2[:, :n2])
    assert torch.equal(sm[:, n2 : n - w], s.slots_int4[:, n2 : n - w])
    assert torch.equal(sm[:, n - w :], s.slots_full[:, n - w :])
    int4_row = bench.D // 2 + 2 * (bench.D // 32) * 2  # codes + fp16 scale and zero per group
    per_token = 2 * bench.HKV * (bench.D * 2 - int4_row)  # K and V, every KV head
    assert s.bytes_read("tiered", False) - s.bytes_read("mixed", False) == s.b * w * per_token
    # the window's output is exact: the reference over it alone is SDPA's over the bf16 K/V
    window = bench.decode_attention_ref(
        s.q.float(), s.pools, sm[:, n - w :].contiguous(), torch.full_like(kw["seq_lens"], w)
    )
    k, v = (t[:, :, n - w :].float() for t in (s.k, s.v))
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        s.q[:, :, None].float(), k, v, enable_gqa=True
    )
    torch.testing.assert_close(window, sdpa[:, :, 0], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="unknown impl"):
        s.inputs("int3", False)


def test_decode_splits_summary_takes_medians_against_the_first_variant() -> None:
    """decode_splits.py's closing table: per (B, N, impl), each variant's median kernel time
    over its rounds, its spread, its ratio to the first variant and to SDPA (whose time each
    row carries as ``kernel_us * vs_sdpa``); a variant that only failed shows its error."""
    import decode_splits

    def row(variant, us, rnd, sdpa=100.0, **kw):
        return {"B": 1, "N": 4096, "impl": "mixed", "variant": variant, "round": rnd,
                "kernel_us": us, "vs_sdpa": sdpa / us, **kw}  # fmt: skip

    rows = [row("a", 20.0, 0), row("b", 30.0, 0), row("a", 22.0, 1), row("b", 33.0, 1)]
    rows += [row("a", 21.0, 2), row("b", 27.0, 2)]
    rows.append({"B": 1, "N": 4096, "impl": "mixed", "variant": "c", "round": 0,
                 "error": "ValueError: int2_gluon"})  # fmt: skip
    lines = decode_splits.summary(rows).strip().splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [c[3] for c in cells] == ["a", "b", "c"]
    assert cells[0][4:9] == ["21.0", "20.0-22.0", "+0.0%", "4.76x", "3"]
    assert cells[1][4:9] == ["30.0", "27.0-33.0", "+42.9%", "3.33x", "3"]
    assert cells[2][4] == "ValueError: int2_gluon"


def test_slot_orders_place_every_token_on_its_own_row() -> None:
    """``--slots`` (decode_attention.slot_order): every layout is a permutation of the pool's
    rows; ``runs:E`` keeps E consecutive rows together, ``churn`` is the real allocator's
    order handing out every row after a churn (in whole runs), ``live`` the live requests'
    rows after it (thinned by per-token eviction: fewer consecutive neighbours); a Shape
    built on them, also with ``sorted-`` requests over a head-major INT4 pool, holds the same
    values (the reference output does not move)."""
    import int4_slot_runs

    g = torch.Generator().manual_seed(0)
    tokens = 4096
    orders = {lay: bench.slot_order(lay, tokens, g) for lay in
              ("random", "sequential", "runs:32", "churn", "live")}  # fmt: skip
    for lay, o in orders.items():
        assert o.dtype == torch.int32 and torch.equal(o.sort().values, torch.arange(tokens)), lay
    assert torch.equal(orders["sequential"], torch.arange(tokens, dtype=torch.int32))
    runs = orders["runs:32"].view(-1, 32)
    assert bool((runs[:, 1:] - runs[:, :-1] == 1).all()) and bool((runs[:, 0] % 32 == 0).all())
    assert int4_slot_runs.run_adjacency(orders["random"]) < 0.01
    assert int4_slot_runs.run_adjacency(orders["churn"]) > 0.95
    assert 0.2 < int4_slot_runs.run_adjacency(orders["live"]) < 0.9
    for bad in ("runs:0", "runs:33", "churn:32", "heap"):
        with pytest.raises(ValueError, match="unknown slot layout"):
            bench.slot_order(bad, tokens, g)
    with pytest.raises(ValueError, match="unknown INT4 row order"):
        bench.Shape(2, 512, slots="live/slot")
    shapes = [bench.Shape(2, 512, slots=lay) for lay in ("random", "churn", "sorted-live/head")]
    assert not torch.equal(shapes[0].slots_int4, shapes[1].slots_int4)
    assert shapes[2].pools.int4.head_major and not shapes[0].pools.int4.head_major
    rows = shapes[2].slots_int4 - shapes[2].pools.int4_base
    assert bool((rows[:, 1:] > rows[:, :-1]).all())  # each request's cells in row order
    for s in shapes:
        kw = s.inputs("int4", False)
        s.out = bench.decode_attention_ref(s.q.float(), s.pools, kw["slot_map"], kw["seq_lens"])
    for s in shapes[1:]:
        torch.testing.assert_close(shapes[0].out, s.out)


@pytest.mark.parametrize("gluon", [False, True])
def test_host_overhead_script_times_each_path(gluon: bool) -> None:
    """benchmarks/decode_host_overhead.py times ``decode_attention``'s Python part, with
    Triton's dispatch per launch, and (``--gluon``: the sm_90 path, the Gluon splits'
    launches stubbed, INT2 too) with direct launches, per impl on the CPU, one line each;
    a direct launch's path is the shortest."""
    import subprocess

    if gluon and sys.modules[decode_attention.__module__].mixed_split_gluon_kernel is None:
        pytest.skip("this Triton has no Gluon")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "decode_host_overhead.py")]
    cmd += ["--batch", "2", "--length", "256", "--calls", "3", "--loops", "1"]
    out = subprocess.run(
        cmd + (["--gluon"] if gluon else []), capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = re.findall(r"^(\w+)_us (\w+) +median +([\d.]+)", out.stdout, flags=re.M)
    impls = ["bf16", "int4", "mixed"] + (["int2"] if gluon else [])
    modes = ["python", "dispatch"] + (["direct"] if gluon else [])
    assert [(k, i) for k, i, _ in rows] == [(k, i) for k in modes for i in impls]
    assert all(float(t) > 0 for _, _, t in rows)
    assert ("sm_90 path" in out.stdout) is gluon
