"""Static cost of the decode kernel's variants on sm_90, without a GPU.

Compiles ``agentkv.kernels.decode_attention``'s split kernel ahead of time for an H100
(``triton.compile`` with ``GPUTarget("cuda", 90, 32)``; needs only a Triton wheel with its
bundled ptxas / cuobjdump) and reports, per variant, the registers, the local-memory spill
stack, and the SASS instructions of the inner loop per (token, KV head): warp instructions
of one loop iteration x warps x 32 lanes / tokens per iteration. Use the same Triton as
the GPU (3.6 on the H100 machine) for numbers that match what runs there; the variants'
*ranking* is what this is for, not a time (times only come from
``benchmarks/decode_attention.py`` on the GPU)::

    python benchmarks/decode_sass.py                      # the INT4 variants at Hq/Hkv=4, D=128
    python benchmarks/decode_sass.py --segments int2      # the INT2 splits (Triton, Gluon)
    python benchmarks/decode_sass.py --segments int4      # the INT4 splits (Triton, Gluon)
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

PTRS = {
    "q_ptr": "*bf16",
    "slot_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "int2_lens_ptr": "*i32",
    "int4_lens_ptr": "*i32",
    "hm_ptr": "*u8",
    "fk_ptr": "*bf16",
    "fv_ptr": "*bf16",
    "q4k_ptr": "*u8",
    "q4v_ptr": "*u8",
    "q4ks_ptr": "*fp16",
    "q4kz_ptr": "*fp16",
    "q4vs_ptr": "*fp16",
    "q4vz_ptr": "*fp16",
    "q4c_ptr": "*fp32",
    "q2k_ptr": "*u8",
    "q2v_ptr": "*u8",
    "q2ks_ptr": "*fp16",
    "q2kz_ptr": "*fp16",
    "q2vs_ptr": "*fp16",
    "q2vz_ptr": "*fp16",
    "po_ptr": "*fp32",
    "plse_ptr": "*fp32",
    "qk_scale": "fp32",
}
# integer arguments the JIT would specialise as multiples of 16 in the benchmark's shapes
DIV16 = {"stride_qb", "stride_qh", "stride_sb", "stride_fs", "stride_fh"}
DIV16 |= {"split_len2", "split_len4", "split_lenf"}


def _stacked(bn: int, warps: int, *knobs: str) -> dict:
    """A stacked-path variant: ``bn`` positions per iteration, ``warps``, the named knobs on."""
    return dict(STACKED=True, BN_INT4=bn, warps=warps, **dict.fromkeys(knobs, True))


#: the five stacked-path knobs (``DecodeConfig``'s ``int4_imma`` ... ``int4_offsets32``)
KNOBS = ("KEY_IMMA", "LAZY_RESCALE", "V_SUBNORMAL", "V_DOTS8", "OFFS32")

VARIANTS = {
    "int4 stacked bn32 w1, knobs off (the default before session 10)": _stacked(32, 1),
    "int4 stacked lazy bn32 w1": _stacked(32, 1, "LAZY_RESCALE"),
    "int4 imma bn32 w1": _stacked(32, 1, "KEY_IMMA"),
    "int4 imma lazy bn32 w1": _stacked(32, 1, *KNOBS[:2]),
    "int4 stacked subnormal-V bn32 w1": _stacked(32, 1, "V_SUBNORMAL"),
    "int4 imma lazy subnormal-V bn32 w1": _stacked(32, 1, *KNOBS[:3]),
    "int4 stacked dots8-V bn32 w1": _stacked(32, 1, "V_DOTS8"),
    "int4 imma lazy subnormal-V dots8-V bn32 w1": _stacked(32, 1, *KNOBS[:4]),
    "int4 all five knobs bn32 w1 (session 10's default)": _stacked(32, 1, *KNOBS),
    "int4 five knobs + live from scales, 3 stages (session 11's default)": dict(
        _stacked(32, 1, *KNOBS), INT4_LIVE_FROM_SCALES=True, stages=3
    ),
    "int4 default with centred V (int4_v_centred: magic-number codes, no subnormals)": dict(
        _stacked(32, 1, "KEY_IMMA", "LAZY_RESCALE", "V_DOTS8", "OFFS32"),
        INT4_LIVE_FROM_SCALES=True,
        V_CENTRED=True,
        stages=3,
    ),
    "int4 separate scale tensors (value scales by dot, live from scales, 3 stages)": dict(
        _stacked(32, 1, *KNOBS), INT4_LIVE_FROM_SCALES=True, INT4_V_SCALES_BY_DOT=True, stages=3
    ),
    "int4 default, interleaved scales read as one row tile (session 13's default)": dict(
        _stacked(32, 1, *KNOBS),
        INT4_V_SCALES_BY_DOT=True,
        INT4_SCALE_STRIDE=16,
        INT4_SCALE_TILE=True,
        stages=3,
    ),
    "int4 default, chunked programs (INT4_CHUNKS: launches that chunk, session 16)": dict(
        _stacked(32, 1, *KNOBS),
        INT4_V_SCALES_BY_DOT=True,
        INT4_SCALE_STRIDE=16,
        INT4_SCALE_TILE=True,
        INT4_CHUNKS=True,
        stages=3,
    ),
    "int4 session 10 default, maxnreg 168": dict(_stacked(32, 1, *KNOBS), maxnreg=168),
    "int4 session 10 default, maxnreg 128": dict(_stacked(32, 1, *KNOBS), maxnreg=128),
    "int4 imma lazy subnormal-V dots8-V bn64 w2": _stacked(64, 2, *KNOBS[:4]),
    "int4 imma lazy subnormal-V bn64 w2": _stacked(64, 2, *KNOBS[:3]),
    "int4 imma lazy bn64 w2": _stacked(64, 2, *KNOBS[:2]),
    "int4 stacked bn64 w2": _stacked(64, 2),
    "int4 stacked bn32 w4": _stacked(32, 4),
    "int4 per-group folded V bn64 w2": dict(STACKED=False, V_FOLD=True, BN_INT4=64, warps=2),
    "int4 per-group fp16 V bn64 w2": dict(STACKED=False, V_FOLD=False, BN_INT4=64, warps=2),
    "int4 per-group fp16 V bn32 w2": dict(STACKED=False, V_FOLD=False, BN_INT4=32, warps=2),
    "int4 legacy bn32 w2": dict(INT4_LEGACY=True, BN_INT4=32, warps=2),
}


def compile_split(group: int, head_dim: int, segments: set[str], **knobs):
    """The split kernel compiled for sm_90 with the given constexpr knobs."""
    mod = importlib.import_module("agentkv.kernels.decode_attention")
    fn = mod._decode_split_kernel
    warps = knobs.pop("warps", 2)
    stages = knobs.pop("stages", 2)
    maxnreg = knobs.pop("maxnreg", None)
    consts = dict(
        G=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_HQ=triton.next_power_of_2(group),
        D=head_dim,
        BN_FULL=64,
        BN_INT4=64,
        HAS_FULL="full" in segments,
        HAS_INT4="int4" in segments,
        HAS_INT2="int2" in segments,
        HAS_HEAD_MASK=False,
        HAS_KCS=False,
        IEEE_F32=False,
        USE_ASM=True,
        PREFETCH=True,
        V_FOLD=True,
        INT4_LEGACY=False,
        STACKED=True,
        INT2_FOLD=False,
        INT2_V_WORDS=False,
        INT4_LIVE_FROM_SCALES=False,
        HEADS_FASTEST=True,
        V_CENTRED=False,
        INT4_V_SCALES_BY_DOT=False,
        INT4_SCALE_STRIDE=head_dim // 32,  # separate scale tensors; 4x: interleaved
        INT4_SCALE_TILE=False,
        INT2_PIPELINED=False,
        INT2_LAZY_RESCALE=False,
        INT4_CHUNKS=False,
        q4_head_rows=1,  # a slot-major INT4 pool's head stride, specialized at launch
        **dict.fromkeys(KNOBS, False),
    )
    consts.update(knobs)
    sig = {n: "constexpr" if n in consts else PTRS.get(n, "i32") for n in fn.arg_names}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(fn.arg_names)
        if sig[n].startswith("*") or n in DIV16
    }
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    options = {"num_warps": warps, "num_stages": stages}
    if maxnreg:
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _compile_gluon(fn, consts: dict, unaligned: tuple[str, ...] = ()):
    """A Gluon decode split compiled for sm_90 with the launch's constexprs and options
    (``consts``: the module's ``*_consts`` dict, launch options included); every pointer
    is 16-byte aligned as the launch's are, except those named in ``unaligned``."""
    from triton.experimental.gluon._runtime import GluonASTSource

    consts = dict(consts)
    options = {k: consts.pop(k) for k in ("num_warps", "maxnreg") if k in consts}
    pools = ("", "2", "4")  # the mixed kernel's k2_ptr ... and k4_ptr ...
    ptrs = {
        "q_ptr": "*bf16",
        **dict.fromkeys(("slot_ptr", "lens_ptr", "lens2_ptr", "lens4_ptr"), "*i32"),
        "hm_ptr": "*u8",
        **{f"{t}{p}_ptr": "*u8" for t in ("k", "v") for p in pools},
        **{f"{t}{p}_ptr": "*fp16" for t in ("ks", "kz", "vs", "vz") for p in pools},
        **dict.fromkeys(("kcs_ptr", "po_ptr", "plse_ptr"), "*fp32"),
        "qk_scale": "fp32",
    }
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in fn.arg_names}
    aligned = {"stride_qb", "stride_qh", "stride_sb", "split_len", "split_len2", "split_len4"}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(fn.arg_names)
        if (sig[n].startswith("*") and n not in unaligned) or n in aligned
    }
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_gluon_int2(group: int, head_dim: int = 128, **knobs):
    """The Gluon INT2 split (``agentkv.kernels.decode_int2_gluon``) compiled for sm_90 with
    the launch's constexprs and options (``knobs`` override them, e.g. ``maxnreg``)."""
    mod = importlib.import_module("agentkv.kernels.decode_int2_gluon")
    consts = mod.int2_split_gluon_consts(group, head_dim, has_head_mask=False)
    return _compile_gluon(mod.int2_split_gluon_kernel, {**consts, **knobs})


def compile_gluon_int4(group: int, head_dim: int = 128, interleaved: bool = True, **knobs):
    """The Gluon INT4 split (``agentkv.kernels.decode_int4_gluon``) compiled for sm_90 with
    the launch's constexprs and options (``interleaved``: the pool's one scale buffer, whose
    ``kz`` / ``vs`` / ``vz`` views start 8, 16, 24 bytes in; else four scale tensors;
    ``knobs`` override the constexprs, e.g. ``HAS_KCS``, and ``maxnreg``)."""
    mod = importlib.import_module("agentkv.kernels.decode_int4_gluon")
    consts = mod.int4_split_gluon_consts(
        group,
        head_dim,
        scale_stride=4 * head_dim // 32 if interleaved else head_dim // 32,
        interleaved=interleaved,
        has_int2=True,
        has_head_mask=False,
        has_key_channel_scale=False,
    )
    unaligned = ("kz_ptr", "vs_ptr", "vz_ptr") if interleaved else ()
    # a slot-major pool's head stride, 1 row, is specialized at launch as here
    consts = {**consts, "head_rows4": 1}
    return _compile_gluon(mod.int4_split_gluon_kernel, {**consts, **knobs}, unaligned)


def compile_gluon_mixed(group: int, head_dim: int = 128, **knobs):
    """The INT2 + INT4 split of one launch (``agentkv.kernels.decode_mixed_gluon``) compiled
    for sm_90 with the launch's constexprs and options (interleaved INT4 scales)."""
    mod = importlib.import_module("agentkv.kernels.decode_mixed_gluon")
    consts = mod.mixed_split_gluon_consts(
        group,
        head_dim,
        scale_stride=4 * head_dim // 32,
        interleaved=True,
        has_head_mask=False,
        has_key_channel_scale=False,
    )
    unaligned = ("kz4_ptr", "vs4_ptr", "vz4_ptr")
    consts = {**consts, "head_rows4": 1}  # a slot-major pool's, specialized at launch
    return _compile_gluon(mod.mixed_split_gluon_kernel, {**consts, **knobs}, unaligned)


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def sass_stats(kernel, tokens_per_iter: int, warps: int) -> dict:
    """Registers, spill stack and the largest loop's instruction count of a compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run(
            [_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True
        ).stdout
        res = subprocess.run(
            [_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True
        ).stdout
    ins = [
        (int(m.group(1), 16), m.group(2))
        for line in sass.splitlines()
        if (m := re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line))
    ]
    at = {a: i for i, (a, _) in enumerate(ins)}
    # backward branches close loops; the inner loop is the one holding the most MMAs (the
    # smallest such; with several segments compiled in, the quantized one when it has more
    # MMAs per iteration), which is also the largest loop when the body has no branch
    best, lo, hi = (-1, 0), 0, 0
    for i, (a, text) in enumerate(ins):
        if "BRA" in text and (m := re.search(r"0x([0-9a-f]+)", text.split("BRA")[1])):
            target = int(m.group(1), 16)
            body = ins[at[target] : i + 1] if target < a and target in at else []
            # a range holding an EXIT is a divergence fallback jumping back, not a loop
            if body and not any("EXIT" in t for _, t in body):
                n_mma = sum("MMA" in t for _, t in body)
                key = (n_mma, -(i + 1 - at[target]))
                if key > best:
                    best, lo, hi = key, at[target], i + 1
    loop = [t for _, t in ins[lo:hi]]
    # conditional forward branches inside the loop (e.g. a lazy rescale) skip a block on the
    # common path: count the loop without the skipped blocks too
    skipped = set()
    for i in range(lo, hi):
        text = ins[i][1]
        if text.startswith("@") and " BRA " in f" {text} " and "BRA.DIV" not in text:
            m = re.search(r"0x([0-9a-f]+)", text.split("BRA")[1])
            target = int(m.group(1), 16) if m else -1
            if ins[i][0] < target <= ins[hi - 1][0] and target in at:
                skipped.update(range(i + 1, at[target]))
    ops = collections.Counter(t.split()[1] if t.startswith("@") else t.split()[0] for t in loop)
    reg = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    return {
        "regs": int(reg.group(1)) if reg else None,
        "spill_stack_bytes": int(stack.group(1)) if stack else None,
        "loop_instructions": len(loop),
        "lane_instructions_per_token": len(loop) * warps * 32 / tokens_per_iter,
        "lane_instructions_per_token_skipping": (len(loop) - len(skipped))
        * warps
        * 32
        / tokens_per_iter,
        "top_ops": ops.most_common(8),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--segments", default="int4", help="int4 | int2 | full")
    args = ap.parse_args()
    if args.segments == "int4":
        runs = VARIANTS.items()
    elif args.segments == "int2":
        folded = dict(warps=1, INT2_FOLD=True, INT2_V_WORDS=True)
        pipelined = dict(folded, INT2_PIPELINED=True, stages=3)
        runs = [
            ("int2 dequantizing w2", dict(warps=2)),
            (
                "int2 folded v-words, hand prefetch, lazy (sessions 11-13)",
                dict(folded, PREFETCH=True, INT2_LAZY_RESCALE=True),
            ),
            ("int2 folded v-words, pipelined, eager (session 14's default)", pipelined),
            ("int2 folded v-words, pipelined, lazy", dict(pipelined, INT2_LAZY_RESCALE=True)),
            ("int2 folded v-words, pipelined, maxnreg 168", dict(pipelined, maxnreg=168)),
        ]
    else:
        runs = [(f"{args.segments} w2", dict(warps=2)), (f"{args.segments} w4", dict(warps=4))]
    print(f"triton {triton.__version__}, sm_90, G={args.group}, D={args.head_dim}")
    for name, knobs in runs:
        warps = knobs.get("warps", 2)
        tokens = {"int4": knobs.get("BN_INT4", 64), "int2": 32, "full": 64}[args.segments]
        k = compile_split(args.group, args.head_dim, {args.segments}, **dict(knobs))
        st = sass_stats(k, tokens, warps)
        print(
            f"{name:50s} regs {st['regs']:>3} spill {st['spill_stack_bytes']:>4} B  "
            f"loop {st['loop_instructions']:>5}  lane-instr/token "
            f"{st['lane_instructions_per_token']:7.0f}  skipping branches "
            f"{st['lane_instructions_per_token_skipping']:7.0f}  {st['top_ops'][:5]}",
            flush=True,
        )
    gluon = []
    if args.head_dim == 128 and args.group <= 8 and args.segments == "int2":
        gluon = [
            ("int2 Gluon split (session 18's default)", compile_gluon_int2, {}),
            ("int2 Gluon split, compiler's registers", compile_gluon_int2, dict(maxnreg=None)),
        ]
    elif args.head_dim == 128 and args.group <= 8 and args.segments == "int4":
        gluon = [
            ("int4 Gluon split (session 19's default)", compile_gluon_int4, {}),
            (
                "int4 Gluon split, separate scale tensors",
                compile_gluon_int4,
                dict(interleaved=False),
            ),
            ("int4 Gluon split, compiler's registers", compile_gluon_int4, dict(maxnreg=None)),
        ]
    for name, compile_fn, knobs in gluon:
        st = sass_stats(compile_fn(args.group, **knobs), 32, 1)
        print(
            f"{name:50s} regs {st['regs']:>3} spill {st['spill_stack_bytes']:>4} B  "
            f"loop {st['loop_instructions']:>5}  skipping branches "
            f"{st['lane_instructions_per_token_skipping']:7.0f}  {st['top_ops'][:5]}",
            flush=True,
        )


if __name__ == "__main__":
    main()
