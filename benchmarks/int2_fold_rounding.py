"""Where the folded INT2 decode's error comes from, on the CPU: the roundings of the folded
splits (the Triton one in ``decode_attention.py`` and the Gluon one in
``decode_int2_gluon.py`` make the same ones) emulated in float32 torch, one at a time,
against the float32 reference on the same quantized pools::

    python benchmarks/int2_fold_rounding.py            # ~1 min on 2 cores

The folded splits round three things to fp16: ``q * ks`` (the page's key scale folded into
the query: the key dot's operand), ``p`` and ``p * vs`` (the value dot's operand). With the
query scaled up, attention sharpens until one token takes nearly all the weight, and the
``q * ks`` rounding (relative 2**-11 per channel) dominates: session 18 measured 1.27e-3 on
the H200 for the Gluon split at 16x, which this reproduces to four digits.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))
from mixed_batch import build_mixed_batch  # noqa: E402

from agentkv.kernels import decode_attention_ref  # noqa: E402
from agentkv.kernels.packing import unpack_int2  # noqa: E402


def emulate(mb, round_qks: bool = True, round_p: bool = True, round_pvs: bool = True):
    """The folded INT2 attention of every (request, query head) [B, Hq, D] in float32, with
    the chosen operands rounded to fp16 as the kernels round them (one softmax over all
    positions: the splits' merge is exact up to float32)."""
    p2 = mb.pools.int2
    codes_k = unpack_int2(p2.k).float()  # [P, Hkv, 32, D]
    codes_v = unpack_int2(p2.v).float()
    b_, hq, d = mb.q.shape
    hkv = p2.k.shape[1]
    group = hq // hkv
    out = torch.zeros(b_, hq, d)
    for b in range(b_):
        slots = mb.slot_map[b, : int(mb.seq_lens[b])].long()
        j = slots[slots != 0] - mb.pools.int2_base
        page, row = j // 32, j % 32
        for h in range(hkv):
            ck, cv = codes_k[page, h, row], codes_v[page, h, row]  # [T, D]
            ks, kz = p2.k_scale[page, h].float(), p2.k_zero[page, h].float()  # [T, D]
            vs, vz = p2.v_scale[page, h, row].float(), p2.v_zero[page, h, row].float()  # [T, D/32]
            for i in range(group):
                q = mb.q[b, h * group + i].float()
                qks = q[None, :] * ks
                if round_qks:
                    qks = qks.half().float()
                s = (
                    ((ck * qks).sum(1) + (q[None, :] * kz).sum(1))
                    / math.sqrt(d)
                    * math.log2(math.e)
                )
                p = torch.exp2(s - s.max())
                denom = p.sum()
                if round_p:
                    p = p.half().float()
                pv = p[:, None] * vs
                if round_pvs:
                    pv = pv.half().float()
                o = (cv * pv.repeat_interleave(32, 1)).sum(0)
                o = o + (p[:, None] * vz).sum(0).repeat_interleave(32)
                out[b, h * group + i] = o / denom
    return out


def main() -> None:
    print(
        "query scale | all roundings | without q*ks | q*ks only | none  (rel. L2 vs reference, fp16 output)"
    )
    for scale in (0.05, 1.0, 4.0, 16.0):
        mb = build_mixed_batch(
            [(40, 0, 0), (23, 0, 0)], hq=8, hkv=2, d=128, dead_fraction=0.2, seed=3
        )
        mb.q = (mb.q.float() * scale).to(torch.float16)
        ref = decode_attention_ref(mb.q, mb.pools, mb.slot_map, mb.seq_lens).float()

        def rel(x: torch.Tensor, ref: torch.Tensor = ref) -> float:
            return float((x.half().float() - ref).norm() / ref.norm())

        row = [
            rel(emulate(mb)),
            rel(emulate(mb, round_qks=False)),
            rel(emulate(mb, round_p=False, round_pvs=False)),
            rel(emulate(mb, False, False, False)),
        ]
        print(f"{scale:11.2f} | " + " | ".join(f"{x:.3e}" for x in row), flush=True)


if __name__ == "__main__":
    main()
