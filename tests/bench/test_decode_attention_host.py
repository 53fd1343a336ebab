"""benchmarks/decode_attention.py's ``python_us`` stubs every kernel ``decode_attention``
launches (a Gluon split launched but not stubbed counted as Python time before session 21).
Runs on the CPU: the launch sites are read from the kernels' source, and a stubbed call runs
the real ``decode_attention`` up to its launches."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import decode_attention as bench  # noqa: E402

from agentkv.kernels import KVPools, SegmentMaxLens, decode_attention  # noqa: E402


def test_every_launch_site_is_stubbed() -> None:
    src = (ROOT / "kernels" / "decode_attention.py").read_text()
    launched = set(re.findall(r"^\s*(\w+)\[[^\]]*\]\(", src, flags=re.M))
    assert launched == set(bench.LAUNCHED_KERNELS)


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
