#!/usr/bin/env bash
# Issue 10's decode-attention run in one go on the lent GPU machine (docs/benchmarks.md §3,
# session 36's commands): the 9-shape grid on the store's rows, the default grid (slot-major
# rows scattered at random) with SGLang 0.5.17's Triton kernel on the same bf16 pool, the
# prefill gather, the read-only probe and the clocks under back-to-back calls. SGLang comes
# from ../shared/sglang-gpu's bundle, two parts of ~27 MB, one per call, in calls that follow
# each other closely (the machine keeps /tmp for ~30 s between calls).
#
#   here, once:     bash benchmarks/decode_grid_device.sh prepare
#   here:           bash .sglang-gpu/select_parts.sh 0 0
#   GPU call 1:     bash benchmarks/decode_grid_device.sh store    (~6 min)
#                   carry: [".whl", ".carry", ".sglang-gpu"]
#   here, at once:  bash .sglang-gpu/select_parts.sh 1 1
#   GPU call 2:     bash benchmarks/decode_grid_device.sh sglang   (~4 min)
#                   carry: the same
#   here:           python benchmarks/decode_table.py --kernel --json DIR/grid_store.json
#
# Each call leaves one tarball in $OUT (a device call returns only a few files) and prints
# the grid's time table.
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=${1:?usage: decode_grid_device.sh prepare|store|sglang}
out=${OUT:-/tmp/out}

install_agentkv() {
    # this checkout's code and the small wheels it needs beside the machine's torch / triton
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/pyd .whl/*.whl
    python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-compile --target /tmp/akv .
    export PYTHONPATH=/tmp/akv:/tmp/pyd${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
}

step() {  # one benchmark, its output in $out/$1.log; a failure is reported, the rest still run
    local name=$1
    shift
    local t0=$SECONDS rc=0
    "$@" > "$out/$name.log" 2>&1 || rc=$?
    echo "$name: exit $rc, $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || tail -n 5 "$out/$name.log"
}

pack() {  # everything written under $out/$1 into $out/$1.tgz
    tar czf "/tmp/$1.tgz" -C "$out" "$1" && rm -rf "${out:?}/$1" && mv "/tmp/$1.tgz" "$out/"
    ls -la "$out"
}

case "$cmd" in
prepare)
    [ -d .sglang-gpu ] || cp -r ../shared/sglang-gpu .sglang-gpu
    exclude=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file
    for p in /.sglang-gpu/ /.carry/ /.whl/; do
        grep -qxF "$p" "$exclude" || echo "$p" >> "$exclude"
    done
    [ -f .carry/part01 ] || [ -f /tmp/carry_all/part01 ] || bash .sglang-gpu/build_bundle.sh
    bash benchmarks/device_wheels.sh
    ls -la .whl .carry /tmp/carry_all 2>/dev/null || true
    ;;
store)
    bash .sglang-gpu/stage.sh 2>&1 | tail -n 1
    install_agentkv
    mkdir -p "$out/store"
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader \
        > "$out/store/gpu.txt" || true
    step store/grid_store python3 benchmarks/decode_attention.py --no-sglang \
        --slots sorted-live/head --out "$out/store/grid_store.json"
    python3 benchmarks/decode_table.py --kernel --json "$out/store/grid_store.json" \
        > "$out/store/grid_store_table.md" || true
    sed -n '/^### Time/,/^### Effective/p' "$out/store/grid_store_table.md" | head -n 14
    step store/gather python3 benchmarks/dequant_gather.py --tokens 262144 --variants '' \
        --block-t 32 --warps 4 --int4-head-major --out "$out/store/gather.json"
    step store/probe python3 benchmarks/gather_roofline.py --shapes '8,32768;1,32768;32,4096' \
        --layouts 'int4 head-major;int2 pages;bf16 pool' --out "$out/store/probe.json"
    step store/clocks python3 benchmarks/decode_clocks.py --shapes '8,32768;32,4096' \
        --out "$out/store/clocks.json"
    tail -n 14 "$out/store/clocks.log"
    pack store
    ;;
sglang)
    bash .sglang-gpu/stage.sh 2>&1 | tail -n 1
    INSTALL_ONLY=1 bash .sglang-gpu/run.sh > /tmp/sglang_install.log 2>&1 \
        || { tail -n 20 /tmp/sglang_install.log; exit 4; }
    # SGLang's site after agentkv's: only its decode kernel is imported (its own transformers
    # would shadow the machine's otherwise)
    install_agentkv
    export PYTHONPATH=$PYTHONPATH:/tmp/site
    mkdir -p "$out/random"
    step random/grid_random python3 benchmarks/decode_attention.py \
        --out "$out/random/grid_random.json"
    python3 benchmarks/decode_table.py --kernel --json "$out/random/grid_random.json" \
        > "$out/random/grid_random_table.md" || true
    sed -n '/^### Time/,/^### Effective/p' "$out/random/grid_random_table.md" | head -n 14
    pack random
    ;;
*)
    echo "unknown command $cmd (prepare, store or sglang)" >&2
    exit 2
    ;;
esac
