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
#   last:        bash benchmarks/sglang_plugin.sh stop
#
# `start` installs the bundle and this checkout into /tmp/site, then starts two servers on
# the one GPU with the same memory budget: stock (port 30000, --attention-backend triton) and
# plugin (port 30001, SGLANG_PLUGINS=agentkv, --attention-backend agentkv
# --radix-cache-backend agentkv --page-size 1). Both: Qwen3 shape with dummy weights
# (SGL_MODEL=8b default, or tiny), same seed, --enable-cache-report, CUDA graphs on
# (DISABLE_CUDA_GRAPH=1 turns them off for both), MEM_FRACTION (0.38 each).
# Logs and results land in $OUT (check.json, replay.json, stock.log, plugin.log).
set -uo pipefail
cd "$(dirname "$0")/.."
cmd=${1:?usage: sglang_plugin.sh prepare|start|check|replay|stop [args]}
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
  for name in stock plugin; do
    if [ -f "$RUN/$name.pid" ]; then
      pid=$(cat "$RUN/$name.pid"); kill -TERM -- "-$pid" 2>/dev/null; sleep 2; kill -KILL -- "-$pid" 2>/dev/null
      rm -f "$RUN/$name.pid"
    fi
  done
}

case "$cmd" in
prepare)
  mkdir -p .carry_sgl
  grep -qxF /.carry_sgl/ .git/info/exclude 2>/dev/null || echo /.carry_sgl/ >> .git/info/exclude
  cp ../shared/data/qwen3-tokenizer/tokenizer.json ../shared/data/qwen3-tokenizer/tokenizer_config.json .carry_sgl/
  cp ../shared/data/tau-bench/gpt-4o-airline.json .carry_sgl/
  du -sh .carry_sgl
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
  cd "$RUN"  # keep the checkout off sys.path[0]: agentkv comes from /tmp/site
  python3 -c 'import os, sys; os.setsid(); os.execvp(sys.argv[1], sys.argv[1:])' \
    python3 -m sglang.launch_server "${COMMON[@]}" --port 30000 --attention-backend triton \
    > "$RUN/stock.log" 2>&1 &
  echo $! > "$RUN/stock.pid"
  SGLANG_PLUGINS=agentkv python3 -c 'import os, sys; os.setsid(); os.execvp(sys.argv[1], sys.argv[1:])' \
    python3 -m sglang.launch_server "${COMMON[@]}" --port 30001 --attention-backend agentkv \
    --radix-cache-backend agentkv --page-size 1 ${SGL_PLUGIN_ARGS:-} \
    > "$RUN/plugin.log" 2>&1 &
  echo $! > "$RUN/plugin.pid"
  cd - >/dev/null
  for i in $(seq 1 150); do
    health 30000 && health 30001 && break
    for name in stock plugin; do
      kill -0 "$(cat "$RUN/$name.pid")" 2>/dev/null || { echo "$name server died"; tail -80 "$RUN/$name.log"; cp "$RUN"/*.log "$OUT"/; exit 5; }
    done
    sleep 2
  done
  health 30000 && health 30001 || { echo "servers not healthy after 300 s"; tail -40 "$RUN"/*.log; cp "$RUN"/*.log "$OUT"/; exit 6; }
  echo "both servers up"; grep -h -i -E "agentkv|max_total_num_tokens|KV Cache is allocated" "$RUN"/plugin.log | head -20
  grep -h -E "max_total_num_tokens|KV Cache is allocated" "$RUN"/stock.log | head -5
  ;;
check)
  python3 -P benchmarks/sglang_plugin.py check --stock http://127.0.0.1:30000 --plugin http://127.0.0.1:30001 \
    --plugin-log "$RUN/plugin.log" --out "$OUT" "$@"
  rc=$?; cp "$RUN"/*.log "$OUT"/ 2>/dev/null; exit $rc
  ;;
replay)
  python3 -P benchmarks/sglang_plugin.py replay --stock http://127.0.0.1:30000 --plugin http://127.0.0.1:30001 \
    --stock-log "$RUN/stock.log" --plugin-log "$RUN/plugin.log" --out "$OUT" "$@"
  rc=$?; cp "$RUN"/*.log "$OUT"/ 2>/dev/null; exit $rc
  ;;
stop)
  stop_servers
  ;;
*)
  echo "unknown command $cmd"; exit 2 ;;
esac
