"""Host (CPU) cost of one ``decode_attention`` call, measured without a GPU.

    python benchmarks/decode_host_overhead.py                       # this checkout's kernels/
    python benchmarks/decode_host_overhead.py --kernels /tmp/old/kernels --site /tmp/t36/site

Per impl it prints medians over repeated loops of back-to-back calls on CPU tensors:

* ``python_us``: ``decode_attention`` with every Triton launch stubbed out (argument checks,
  the plan's key and lookup, allocations, the launch arguments: the Python part);
* ``dispatch_us``: the same plus, per launch, what Triton's ``JITFunction.run`` does in
  Python before its C launcher (the generated binder with ``native_specialize_impl`` over
  every argument, ``compute_cache_key``, the global-values check), with a CUDA sm_90 backend
  and no driver (``DecodeConfig.direct_launch`` off: every launch through Triton);
* ``direct_us`` (``--gluon``): the same call with direct launches (the default from
  session 29: after a site's first launch, the compiled kernel's
  launcher, here a no-op).

``--gluon`` stands in for an sm_90 GPU as far as the host sees one (132 SMs, programmatic
dependent launches, the Gluon splits for every quantized segment, their residency given):
the path a Hopper runs, the Gluon kernels' launches stubbed and bound alike, plus ``int2``.

Not measured: the C launcher and ``cuLaunchKernel`` (a few µs per launch on a GPU host).
On a GPU, ``benchmarks/decode_attention.py`` measures the whole host cost per call
(``host_us``). ``--kernels`` times another copy of ``kernels/`` (e.g. ``git archive <rev>
kernels``), ``--site`` puts another Triton first on ``sys.path`` (e.g. the GPU's version).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", default=str(Path(__file__).resolve().parents[1] / "kernels"))
    ap.add_argument("--site", default="", help="site-packages with the Triton to use")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--loops", type=int, default=15)
    ap.add_argument(
        "--gluon", action="store_true", help="the sm_90 path: the Gluon splits' launches"
    )
    args = ap.parse_args()
    if args.site:
        sys.path.insert(0, args.site)
    # the kernels must import as JITFunctions (their binder is what is timed), even where the
    # caller runs under the interpreter (the test suite): it is switched on after the import
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

    kdir = Path(args.kernels).resolve()
    spec = importlib.util.spec_from_file_location(
        "agentkv.kernels", kdir / "__init__.py", submodule_search_locations=[str(kdir)]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["agentkv.kernels"] = mod
    spec.loader.exec_module(mod)
    da = sys.modules["agentkv.kernels.decode_attention"]
    os.environ["TRITON_INTERPRET"] = "1"  # after the import: the kernels stay JITFunctions
    backend = make_backend(GPUTarget("cuda", 90, 32))

    class Compiled:
        """A compiled kernel's launcher fields, its launcher a no-op (no driver here)."""

        function = packed_metadata = None

        def _init_handles(self) -> None:
            pass

        @staticmethod
        def run(*args) -> None:
            pass

    class Stub(JITFunction):
        """``kernel[grid](...)``: nothing, or Triton's Python launch work without a driver
        (``bind``), returning a stand-in compiled kernel (``compiled``: what a direct launch
        records, so the later launches of its site go direct; a ``JITFunction`` to
        ``DirectLaunch``, built without its constructor)."""

        def __init__(self, jit, bind: bool, compiled: bool = False) -> None:
            self.jit, self.bind, self.key_cache = jit, bind, {}
            self.params = jit.params if compiled else None  # (None: no direct launches)
            self.binder = create_function_from_signature(jit.signature, jit.params, backend)

        def __getitem__(self, grid):
            def run(*a, **kw):
                if self.bind:
                    kw["debug"] = False
                    kw["instrumentation_mode"] = ""
                    _, spec_, opts = self.binder(*a, **kw)
                    compute_cache_key(self.key_cache, spec_, opts)
                    missing = object()
                    for (name, _), (val, g) in self.jit.used_global_vals.items():
                        if g.get(name, missing) != val:
                            raise RuntimeError(name)
                return Compiled() if self.params is not None else None

            return run

    class Driver:
        """The two calls a direct launch makes of Triton's driver, without a GPU."""

        @staticmethod
        def get_current_device() -> int:
            return 0

        @staticmethod
        def get_current_stream(device: int) -> int:
            return 0

    hq, hkv, d, b, n = 32, 8, 128, args.batch, args.length
    tokens = b * n
    pools = mod.KVPools.allocate(tokens + 1, tokens, tokens // 32, hkv, d, device="cpu")
    q = torch.randn(b, hq, d, dtype=torch.bfloat16)
    seq = torch.full((b,), n, dtype=torch.int32)
    m = (3 * n // 4) // 32 * 32
    slots = (torch.arange(tokens, dtype=torch.int32) + 1).view(b, n)  # values do not matter
    cases = {
        "bf16": dict(max_lens=mod.SegmentMaxLens(0, 0, n)),
        "int4": dict(int4_lens=seq, max_lens=mod.SegmentMaxLens(0, n, 0)),
        "mixed": dict(
            int2_lens=torch.full((b,), m, dtype=torch.int32),
            int4_lens=torch.full((b,), n - m, dtype=torch.int32),
            max_lens=mod.SegmentMaxLens(m, n - m, 0),
        ),
    }
    names = ["_decode_split_kernel", "_merge_splits_kernel"]
    config = None
    if args.gluon:  # what the host sees of an sm_90 GPU (restored below)
        names += ["int2_split_gluon_kernel", "int4_split_gluon_kernel", "mixed_split_gluon_kernel"]
        if getattr(da, names[-1]) is None:
            raise SystemExit("--gluon needs a Triton with Gluon")
        hopper = {
            "_use_gluon_int2": lambda *a: True,
            "_use_gluon_int4": lambda *a: True,
            "_pdl_capable": lambda device: True,
            "_num_sms": lambda device: 132,
            "triton_interpreting": lambda: False,
        }
        saved = {k: getattr(da, k) for k in hopper}
        for k, v in hopper.items():
            setattr(da, k, v)
        # the residency a GPU measures once per variant (H200: 12 INT4, 16 INT2 programs)
        config = mod.DecodeConfig(resident_programs=12)
        cases["int2"] = dict(int2_lens=seq, max_lens=mod.SegmentMaxLens(n, 0, 0))
    kernels = {k: getattr(da, k) for k in names}
    print(
        f"triton {triton.__version__} torch {torch.__version__} kernels {kdir} B={b} N={n}"
        + (" (sm_90 path: Gluon splits)" if args.gluon else "")
    )
    # direct launches (DecodeConfig.direct_launch, from session 29): with --gluon, where
    # the host stands in for a GPU's (elsewhere the interpreter's flag keeps them off)
    dl = sys.modules.get("agentkv.kernels.direct_launch")
    direct = dl is not None and args.gluon
    dispatch = config
    if dl is not None:  # Triton's dispatch on every launch
        dispatch = dataclasses.replace(config or mod.DecodeConfig(), direct_launch=False)
        dl.driver = type("Active", (), {"active": Driver()})
    modes = [("python", False, False, config), ("dispatch", True, False, dispatch)]
    if direct:
        modes.append(("direct", True, True, config))
    for mode, bind, compiled, cfg in modes:
        for k, jit in kernels.items():
            setattr(da, k, Stub(jit, bind, compiled))
        if hasattr(da, "clear_decode_plans"):  # (plans hold their launch sites' kernels)
            da.clear_decode_plans()
        for impl, kw in cases.items():

            def fn(kw=kw, cfg=cfg):
                return da.decode_attention(q, pools, slots, seq, backend="triton", config=cfg, **kw)

            for _ in range(args.calls):
                fn()
            loops = []
            for _ in range(args.loops):
                t = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                loops.append((time.perf_counter() - t) / args.calls * 1e6)
            print(
                f"{mode}_us {impl:6s} median {statistics.median(loops):6.1f} min {min(loops):6.1f}",
                flush=True,
            )
    for k, jit in kernels.items():
        setattr(da, k, jit)
    if args.gluon:
        for k, v in saved.items():
            setattr(da, k, v)


if __name__ == "__main__":
    main()
