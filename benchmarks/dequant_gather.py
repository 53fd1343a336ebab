"""Prefill over a quantized cached prefix: ``dequant_gather`` bandwidth on the GPU.

Before a prefill chunk attends to a cached prefix held in the mixed-precision pools, the
engine gathers and dequantizes the prefix's K/V rows into a dense bf16 buffer
(:func:`agentkv.kernels.dequant_gather`, per-(layer, head) slot maps as the store keeps
them). This times it for one layer of N tokens (Hkv=8, D=128) with every cell in one
precision (bf16 / INT4 / INT2) or mixed (75% INT2 pages, 25% INT4), with cells laid out
``contiguous`` (a column's cells in allocation order, as a fresh demotion writes them) or
``scattered`` (a random permutation), and 0% or 50% DEAD.

Effective bandwidth = (bytes read + bytes written) / time, where bytes read are the live
cells' codes, scales and zeros (useful bytes, not the sectors touched) and the slot map, and bytes written the dense bf16
K and V (DEAD rows are written as zeros). The anchor is a plain device-to-device copy of the
output's size (``copy_tbps``), the best this kernel could do, and a write-only fill of it
(``write_tbps``). Not a test; never gates CI::

    python benchmarks/dequant_gather.py --out docs/benchmarks/dequant_gather.json

Next to the original kernel (``variant="base"``, ``GATHER_BASE`` swept over ``--block-t`` x
``--warps``) it sweeps the launch / memory variants of ``VARIANTS`` (``GatherConfig`` objects;
``--variants``, each at ``--variant-configs`` block_t:warps pairs) at 0% DEAD, and at 50% DEAD the best
``--dead-top`` base and variant configs of 0% DEAD. Every row carries its knobs; ``best``
holds, per (tokens, layout, impl, dead), the fastest config whose output equals the torch
reference exactly, with the base kernel's best time beside it. Past ``--budget-s`` only the
variant configs that were among the best of an earlier shape still run (~100 s expected on
an H100 with the defaults).
``--sass`` needs no GPU: registers and SASS instructions of each config compiled for sm_90
(written next to ``--out`` as ``*_sass.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import platform
import sys
import time
from pathlib import Path

import torch

try:  # installed package, or a checkout (kernels/ is mapped to agentkv.kernels)
    from agentkv.kernels import (
        GATHER_BASE,
        GatherConfig,
        KVPools,
        dequant_gather,
        write_int2_pages,
        write_int4,
    )
except ImportError:  # pragma: no cover - checkout without install
    import importlib.util
    import sys

    _root = Path(__file__).resolve().parents[1] / "kernels"
    _spec = importlib.util.spec_from_file_location(
        "agentkv.kernels", _root / "__init__.py", submodule_search_locations=[str(_root)]
    )
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules["agentkv.kernels"] = _mod
    _spec.loader.exec_module(_mod)
    from agentkv.kernels import (
        GATHER_BASE,
        GatherConfig,
        KVPools,
        dequant_gather,
        write_int2_pages,
        write_int4,
    )

HKV, D = 8, 128


def _bench_us(fn, rep_ms: int = 100, timer: str = "graph") -> float:
    """Microseconds per call: with ``timer="graph"`` the kernels alone (a CUDA graph of
    flush + call pairs minus the flushes, as ``decode_attention.py``'s ``kernel_us``: no
    host time, which at 32k tokens is longer than the gather itself), else ``do_bench``'s
    median (host launch included when it is the longer)."""
    import triton

    if not torch.cuda.is_available():  # CPU smoke test (TRITON_INTERPRET=1): one timed call
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    if timer == "graph":
        from decode_attention import _kernel_us

        us = _kernel_us(fn)
        if us is not None:
            return us
    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")) * 1e3


def build(n: int, layout: str, dev: torch.device, seed: int = 0, int4_head_major: bool = False):
    """Pools holding the same random K/V ``[n, Hkv, D]`` in every precision, and per-head
    unified slot ids ``[n, Hkv]`` for each precision (``int4_head_major``: the INT4 pool's
    rows head-major, as the store's)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    k = torch.randn(n, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(n, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    pools = KVPools.allocate(n + 1, n, n // 32, HKV, D, device=dev, int4_head_major=int4_head_major)

    def order(m: int) -> torch.Tensor:
        if layout == "contiguous":
            return torch.arange(m, device=dev)
        return torch.randperm(m, device=dev, generator=g)

    full_ids = order(n) + 1
    int4_ids = order(n)
    pages = order(n // 32)
    pools.full.k[full_ids] = k
    pools.full.v[full_ids] = v
    write_int4(pools.int4, int4_ids, k, v)
    write_int2_pages(pools.int2, pages, k, v)
    heads = torch.ones(1, HKV, dtype=torch.int64, device=dev)
    slots = {
        "bf16": full_ids[:, None] * heads,
        "int4": (int4_ids + pools.int4_base)[:, None] * heads,
        "int2": pools.int2_slot_ids(pages).reshape(n)[:, None] * heads,
    }
    n2 = (3 * n // 4) // 32 * 32
    slots["mixed"] = torch.cat([slots["int2"][:n2], slots["int4"][n2:]])
    return pools, {name: s.to(torch.int32).contiguous() for name, s in slots.items()}, n2


def bytes_moved(impl: str, n: int, live: torch.Tensor, n2: int) -> tuple[int, int]:
    """(read, written) bytes of one gather of ``n`` positions (``live`` bool ``[n, Hkv]``)."""
    ng = D // 32
    written = 2 * n * HKV * D * 2
    read = n * HKV * 4  # the slot map
    is2 = torch.zeros(n, dtype=torch.bool, device=live.device)
    if impl == "int2":
        is2[:] = True
    elif impl == "mixed":
        is2[:n2] = True
    cells2 = int((live & is2[:, None]).sum())
    cells_other = int(live.sum()) - cells2
    if impl == "bf16":
        return read + cells_other * 2 * D * 2, written
    read += cells_other * 2 * (D // 2 + 2 * ng * 2)  # INT4 K, V: codes + scales + zeros
    # INT2: K and V codes, V scales + zeros per cell, K scale + zero once per page and head
    pages = -(-int(is2.sum()) // 32)
    read += cells2 * (2 * (D // 4) + 2 * ng * 2) + pages * HKV * 2 * D * 2
    return read, written


# Launch / memory variants swept next to the original kernel (``base`` = GATHER_BASE): name ->
# GatherConfig (see its docstring); each runs at the --variant-configs (block_t, warps), which
# replace the config's own. The default GatherConfig() is h8_skip_tile_o32_cs_rows at 32:8
# (heads_per_program None = Hkv = 8), also sweepable as "default".
_O32 = dataclasses.replace(GATHER_BASE, skip_absent=True, int2_tile=True, offsets32=True)
_V = dataclasses.replace
VARIANTS: dict[str, GatherConfig] = {
    "hf": _V(GATHER_BASE, heads_fastest=True),
    "skip": _V(GATHER_BASE, skip_absent=True),
    "skip_tile": _V(GATHER_BASE, skip_absent=True, int2_tile=True),
    "skip_tile_o32": _O32,
    "hf_skip_tile_o32": _V(_O32, heads_fastest=True),
    "hf_skip_tile_o32_cs": _V(_O32, heads_fastest=True, store_cache=".cs"),
    "hf2_skip_tile_o32_cs": _V(_O32, heads_fastest=True, heads_per_program=2, store_cache=".cs"),
    "h8_skip_tile_o32_cs": _V(_O32, heads_fastest=True, heads_per_program=8, store_cache=".cs"),
    "hf_skip_tile_o32_cs_rows": _V(_O32, heads_fastest=True, store_cache=".cs", slot_rows=True),
    "h8_skip_tile_o32_cs_rows": _V(
        _O32, heads_fastest=True, heads_per_program=8, store_cache=".cs", slot_rows=True
    ),
    "default": GatherConfig(),
}
# swept by default (the others on request, --variants NAME,...): skip_absent alone, then
# one knob added at a time, and whole output rows per program
DEFAULT_VARIANTS = [
    "skip",
    "skip_tile_o32",
    "hf_skip_tile_o32",
    "hf_skip_tile_o32_cs",
    "hf_skip_tile_o32_cs_rows",
    "h8_skip_tile_o32_cs",
    "h8_skip_tile_o32_cs_rows",
]


def knobs(cfg: GatherConfig) -> dict:
    """The launch / memory knobs of ``cfg`` as a JSON row's fields (all but block_t and
    num_warps, in GatherConfig's order; heads_per_program resolved for Hkv=8)."""
    d = dataclasses.asdict(cfg)
    del d["block_t"], d["num_warps"]
    d["heads_per_program"] = cfg.heads(HKV)
    return d


KNOB_DEFAULTS = knobs(GATHER_BASE)  # the original kernel's knobs


_SASS_PTRS = dict(
    slots_ptr="*i32",
    fk_ptr="*bf16",
    fv_ptr="*bf16",
    q4k_ptr="*u8",
    q4v_ptr="*u8",
    q4c_ptr="*fp32",
    q2k_ptr="*u8",
    q2v_ptr="*u8",
    ok_ptr="*bf16",
    ov_ptr="*bf16",
)
_SASS_DIV16 = {"row_stride", "stride_fs", "stride_fh", "stride_ot", "stride_oh", "H"}


def sass_table(
    base_pairs: list[tuple[int, int]], variant_pairs: list[tuple[int, int]], names: list[str]
) -> list[dict]:
    """Compile the kernel for sm_90 (``triton.compile``, GPUTarget("cuda", 90, 32); no GPU
    needed, only Triton's bundled ptxas / cuobjdump) for the base kernel and each variant:
    registers and SASS instructions per (token, KV head) in warp-instructions (whole kernel
    / warps / tokens per program). ``all``: every pool present (what runs when the
    precisions are not skipped); ``int4`` / ``int2``: compiled with only that quantized pool,
    what a skip_absent block of one precision executes (plus the skipped full load)."""
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from agentkv.kernels import dequant_gather as dg_mod

    fn = sys.modules[dg_mod.__module__]._dequant_gather_kernel
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    knob_const = dict(
        heads_per_program="HEADS",
        heads_fastest="HEADS_FASTEST",
        skip_absent="SKIP",
        store_cache="STORE_CACHE",
        int2_tile="INT2_TILE",
        int4_words="WORDS",
        offsets32="OFF32",
        slot_rows="SLOT_ROWS",
    )
    out = []
    for name in ["base", *names]:
        kn = knobs(VARIANTS.get(name, GATHER_BASE))
        for bt, w in base_pairs if name == "base" else variant_pairs:
            row = dict(variant=name, block_t=bt, num_warps=w)
            for path, (has4, has2) in dict(
                all=(True, True), int4=(True, False), int2=(False, True)
            ).items():
                consts = dict(
                    D=D, BLOCK_T=bt, HAS_INT4=has4, HAS_INT2=has2, PER_HEAD=True, HAS_KCS=False
                )
                for k, c in knob_const.items():
                    v = kn[k]
                    consts[c] = v
                sig = {
                    a: "constexpr"
                    if a in consts
                    else _SASS_PTRS.get(a, "*fp16" if a.endswith("_ptr") else "i32")
                    for a in fn.arg_names
                }
                attrs = {
                    (i,): [["tt.divisibility", 16]]
                    for i, a in enumerate(fn.arg_names)
                    if sig[a].startswith("*") or a in _SASS_DIV16
                }
                src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
                kern = triton.compile(
                    src, target=GPUTarget("cuda", 90, 32), options={"num_warps": w}
                )
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(kern.asm["cubin"])
                    f.flush()
                    sass = subprocess.run(
                        [tool, "-sass", f.name], capture_output=True, text=True
                    ).stdout
                    res = subprocess.run(
                        [tool, "-res-usage", f.name], capture_output=True, text=True
                    ).stdout
                n_ins = sum(
                    bool(re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+\S", line))
                    for line in sass.splitlines()
                )
                per = n_ins * w / (bt * kn["heads_per_program"])
                regs = int(m.group(1)) if (m := re.search(r"REG:(\d+)", res)) else -1
                row[f"{path}_regs"] = regs
                row[f"{path}_warp_instr_per_token_head"] = round(per, 1)
                row[f"{path}_bar_sync"] = sass.count("BAR.SYNC")
            out.append(row)
            print(
                f"{name:20} block_t={bt:3} warps={w}  "
                + "  ".join(
                    f"{p}: {row[p + '_regs']} regs {row[p + '_warp_instr_per_token_head']:6.1f}"
                    f" instr {row[p + '_bar_sync']:2} bar"
                    for p in ("all", "int4", "int2")
                ),
                flush=True,
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/dequant_gather.json"))
    ap.add_argument("--tokens", default="32768,262144")
    ap.add_argument("--block-t", default="16,32,64", help="block_t of the base kernel's sweep")
    ap.add_argument("--warps", default="4,8", help="warps of the base kernel's sweep")
    ap.add_argument(
        "--base-words",
        default="1",
        help="int4_words of the base sweep for INT4 / mixed ('1,0': both, as before)",
    )
    ap.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help="launch / memory variants to sweep next to the base kernel ('' = none); names: "
        + ", ".join(VARIANTS),
    )
    ap.add_argument(
        "--variant-configs",
        default="16:4,32:4,32:8",
        help="block_t:warps pairs each variant runs at",
    )
    ap.add_argument(
        "--dead-top",
        type=int,
        default=2,
        help="at 50%% DEAD, only the best N base and best N variant configs of 0%% DEAD",
    )
    ap.add_argument("--rep-ms", type=int, default=40, help="do_bench rep (ms) per config")
    ap.add_argument(
        "--int4-head-major",
        action="store_true",
        help="the INT4 pool's rows head-major (the engine store's layout)",
    )
    ap.add_argument(
        "--timer",
        choices=("graph", "do_bench"),
        default="graph",
        help="graph: kernel time alone (CUDA graph); do_bench: host launch included",
    )
    ap.add_argument("--device", default="cuda", help="cpu + TRITON_INTERPRET=1: a smoke test")
    ap.add_argument(
        "--budget-s", type=float, default=100.0, help="stop sweeping variants after this long"
    )
    ap.add_argument(
        "--sass",
        action="store_true",
        help="no GPU: compile for sm_90 and print registers / instructions per config",
    )
    args = ap.parse_args()
    base_pairs = [
        (int(bt), int(w)) for bt in args.block_t.split(",") for w in args.warps.split(",")
    ]
    variant_pairs = [tuple(int(x) for x in c.split(":")) for c in args.variant_configs.split(",")]
    if args.sass:
        names = [x for x in args.variants.split(",") if x]
        table = sass_table(base_pairs, variant_pairs, names)
        sass_out = args.out.with_name(args.out.stem + "_sass.json")  # never the timings file
        sass_out.parent.mkdir(parents=True, exist_ok=True)
        sass_out.write_text(json.dumps({"sass_sm90": table}, indent=1))
        print(f"wrote {sass_out}")
        return
    dev = torch.device(args.device)
    t_start = time.perf_counter()
    names = [x for x in args.variants.split(",") if x]
    unknown = set(names) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; known: {list(VARIANTS)}")
    rows, best_rows = [], []
    winners: set[tuple[str, int, int]] = set()  # top variant configs of each shape so far
    for n in (int(x) for x in args.tokens.split(",")):
        out = torch.empty(2, n, HKV, D, dtype=torch.bfloat16, device=dev)
        src = torch.randn_like(out)
        copy_us = _bench_us(lambda out=out, src=src: out.copy_(src), args.rep_ms, args.timer)
        copy_tbps = 2 * out.numel() * 2 / copy_us / 1e6
        fill_us = _bench_us(lambda out=out: out.fill_(1.0), args.rep_ms, args.timer)
        write_tbps = out.numel() * 2 / fill_us / 1e6  # write-only anchor (the output's bytes)
        print(f"N={n}: copy {copy_tbps:.2f} TB/s, write-only fill {write_tbps:.2f} TB/s")
        del out, src
        for layout in ("contiguous", "scattered"):
            pools, slots, n2 = build(n, layout, dev, int4_head_major=args.int4_head_major)
            g = torch.Generator(device=dev).manual_seed(1)
            dead = torch.rand(n, HKV, device=dev, generator=g) < 0.5
            for impl, s in slots.items():
                # 0% DEAD configs (inexact, us, order, name, block_t, warps, config): base / variants
                base_top: list[tuple] = []
                top: list[tuple] = []
                for dead_frac in (0.0, 0.5):
                    sm = torch.where(dead, torch.zeros_like(s), s) if dead_frac else s
                    live = sm != 0
                    rd, wr = bytes_moved(impl, n, live, n2)
                    ref_k, ref_v = dequant_gather(pools, sm.long(), per_head=True, backend="torch")
                    words = [bool(int(x)) for x in args.base_words.split(",")]
                    if dead_frac == 0.0:
                        configs = [
                            ("base", bt, w, dataclasses.replace(GATHER_BASE, int4_words=wd))
                            for bt in (int(x) for x in args.block_t.split(","))
                            for w in (int(x) for x in args.warps.split(","))
                            for wd in (words if impl in ("int4", "mixed") else (True,))
                        ]
                        configs += [
                            (name, bt, w, VARIANTS[name])
                            for name in names
                            for bt, w in variant_pairs
                        ]
                    else:  # the best configs of 0% DEAD only
                        configs = [
                            (name, bt, w, cfg)
                            for *_, name, bt, w, cfg in sorted(base_top)[: args.dead_top]
                        ]
                        configs += [
                            (name, bt, w, cfg)
                            for *_, name, bt, w, cfg in sorted(top)[: args.dead_top]
                        ]
                    best = base_best = best_any = None
                    for name, bt, w, cfg in configs:
                        cfg = dataclasses.replace(cfg, block_t=bt, num_warps=w)
                        over = time.perf_counter() - t_start > args.budget_s
                        if name != "base" and over and winners and (name, bt, w) not in winners:
                            continue  # over budget: the variant configs that won so far only

                        def fn(sm=sm, pools=pools, cfg=cfg):
                            return dequant_gather(pools, sm, per_head=True, config=cfg)

                        k, v = fn()
                        err = max(
                            float((k.float() - ref_k).abs().max()),
                            float((v.float() - ref_v).abs().max()),
                        )
                        us = _bench_us(fn, args.rep_ms, args.timer)
                        row = dict(
                            tokens=n,
                            layout=layout,
                            impl=impl,
                            dead=dead_frac,
                            variant=name,
                            block_t=bt,
                            num_warps=w,
                            **knobs(cfg),
                            us=round(us, 2),
                            read_bytes=rd,
                            written_bytes=wr,
                            effective_tbps=round((rd + wr) / us / 1e6, 3),
                            copy_tbps=round(copy_tbps, 3),
                            write_tbps=round(write_tbps, 3),
                            max_abs_err_vs_torch=err,
                        )
                        rows.append(row)
                        if dead_frac == 0.0:  # exact ones first
                            (base_top if name == "base" else top).append(
                                (err != 0.0, us, len(top) + len(base_top), name, bt, w, cfg)
                            )
                        if err == 0.0 and (best is None or us < best["us"]):
                            best = row
                        if best_any is None or us < best_any["us"]:
                            best_any = row
                        exact_base = name == "base" and err == 0.0
                        if exact_base and (base_best is None or us < base_best["us"]):
                            base_best = row
                    winners.update((c[3], c[4], c[5]) for c in sorted(top)[: args.dead_top])
                    if best_any is None:
                        continue
                    exact = best is not None
                    if not exact:
                        print(f"N={n} {layout} {impl} dead={dead_frac}: no exact config!")
                        best = best_any
                    summary = dict(
                        tokens=n,
                        layout=layout,
                        impl=impl,
                        dead=dead_frac,
                        exact=exact,
                        best=best,
                        base_us=base_best["us"] if base_best else None,
                        base_tbps=base_best["effective_tbps"] if base_best else None,
                        speedup_vs_base=round(base_best["us"] / best["us"], 3)
                        if base_best
                        else None,
                    )
                    best_rows.append(summary)
                    knob_txt = " ".join(
                        f"{k}={best[k]}" for k in KNOB_DEFAULTS if best[k] != KNOB_DEFAULTS[k]
                    )
                    print(
                        f"N={n:>6} {layout:10} {impl:5} dead={dead_frac:.1f} best "
                        f"{best['us']:8.1f} us  {best['effective_tbps']:.2f} TB/s "
                        f"(base {summary['base_tbps']}, copy {copy_tbps:.2f}, "
                        f"write {write_tbps:.2f})  {best['variant']} block_t={best['block_t']} "
                        f"warps={best['num_warps']} {knob_txt}  "
                        f"[{time.perf_counter() - t_start:.0f} s]",
                        flush=True,
                    )
            del pools, slots
            torch.cuda.empty_cache()
    meta = dict(
        gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev),
        date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        torch=torch.__version__,
        machine=platform.platform(),
        command="python benchmarks/dequant_gather.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        wall_s=round(time.perf_counter() - t_start, 1),
        variants={  # each variant's knobs that differ from the base kernel's
            name: {k: v for k, v in knobs(VARIANTS[name]).items() if v != KNOB_DEFAULTS[k]}
            for name in names
        },
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows, "best": best_rows}, indent=1))
    print(f"wrote {args.out} ({meta['wall_s']} s)")


if __name__ == "__main__":
    main()
