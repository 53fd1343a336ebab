#!/usr/bin/env bash
# Issue 16 on the GPU machine: train IntentKV's residual head with one labelling, then replay
# the learned mode (alpha_max 1) beside the rule at 256/512/1024 (s17b.args) with that head.
#   here, once: bash benchmarks/replay_device.sh prepare; mkdir -p .carry_tau .carry_bfcl
#               gzip -9c .carry_data/gpt-4o-airline.json > .carry_tau/gpt-4o-airline.json.gz
#               agentkv bench export --source bfcl:multi_turn_miss_param --limit 16 --out p.jsonl
#               agentkv bench export --source bfcl:multi_turn_miss_func --limit 16 --out f.jsonl
#               cat p.jsonl f.jsonl | gzip -9 > .carry_bfcl/bfcl_mix32.jsonl.gz
#   GPU calls 1-3: bash benchmarks/replay_device.sh stage       (carry .carry_model/gguf.part00,
#               then part01, then part02: one 36 MB part per call beside the ~20 MB tree)
#   GPU call 4: bash benchmarks/intentkv_head_device.sh LABEL [TRAIN_SECONDS] [REPLAY_SECONDS]
#               carry: .carry_model/gguf.sha256 .carry_model/llm_init.py .whl .carry_tau .carry_bfcl
#               (tau-bench gzipped: the call's 64 MiB limit)
# Writes $OUT/heads/LABEL (head.safetensors, metrics.json, curves.png) and $OUT/replay_LABEL.
# Knobs (environment): MAX_TOKENS (training sessions' cut, 4096), BUDGET (256), CAL_TRACES (8),
# CAL_BUDGETS / CAL_CUTS (calibration grid, default: BUDGET / MAX_TOKENS), ALPHA_GRID
# (0,0.25,0.5,1,2); REPLAY_SECONDS 0 skips the replay.
set -euo pipefail
cd "$(dirname "$0")/.."
label=${1:?usage: intentkv_head_device.sh arguments|attention|both [train_s] [replay_s]}
train_s=${2:-360}
replay_s=${3:-150}
out=${OUT:-/tmp/out}
max_tokens=${MAX_TOKENS:-4096}
budget=${BUDGET:-256}
cal="--calibrate-traces ${CAL_TRACES:-8} --calibrate-budgets ${CAL_BUDGETS:-$budget}"
cal="$cal --calibrate-max-tokens ${CAL_CUTS:-$max_tokens} --alpha-grid ${ALPHA_GRID:-0,0.25,0.5,1,2}"
args=$(tr '\n' ' ' < docs/benchmarks/replay_h100_pieces/s17b.args)  # one line: it goes into bash -c
bash benchmarks/replay_device.sh exec bash -c "
set -euo pipefail
if [ -f .carry_tau/gpt-4o-airline.json.gz ]; then
  gunzip -c .carry_tau/gpt-4o-airline.json.gz > /tmp/akv/tau.json
  export AGENTKV_TAU_BENCH=/tmp/akv/tau.json
fi
gunzip -c .carry_bfcl/bfcl_mix32.jsonl.gz > /tmp/akv/bfcl_mix32.jsonl
timeout $train_s python3 -P -m agentkv.engine.cli train-intentkv --device cuda \
  --out $out/heads/$label --tau-sessions 24 --bfcl-sessions 0 \
  --traces /tmp/akv/bfcl_mix32.jsonl --max-tokens $max_tokens --budget $budget --label $label $cal \
  > $out/train_$label.log 2>&1 || { tail -c 4000 $out/train_$label.log; exit 1; }
tail -c 3000 $out/train_$label.log
mv $out/heads/$label/rows.pt /tmp/akv/rows_$label.pt  # tens of MB: not sent back
[ $replay_s -gt 0 ] || exit 0
AGENTKV_INTENTKV_HEADS=$out/heads python3 -P -m agentkv.engine.cli bench replay --device cuda \
  --out $out/replay_$label $args --max-seconds $replay_s > $out/replay_$label.log 2>&1 \
  || { tail -c 4000 $out/replay_$label.log; exit 1; }
tail -c 2500 $out/replay_$label.log
"
