#!/usr/bin/env bash
# Issue 16 on the GPU machine: the Phase-2 ablations (s18_ablate.args: rule / learned / learned
# without memory, without cross-attention, head only, at 256/512/1024, 4k cut) and the long
# sessions (s18_long.args: 8k cut, budgets 1024/2048, IntentKV rule + learned vs SnapKV / H2O),
# with the head shipped in the package.
#   here, once: bash benchmarks/replay_device.sh prepare; mkdir -p .carry_tau
#               gzip -9c .carry_data/gpt-4o-airline.json > .carry_tau/gpt-4o-airline.json.gz
#   GPU calls 1-3: bash benchmarks/replay_device.sh stage       (carry .carry_model/gguf.part00,
#               then part01, then part02: one 36 MB part per call beside the ~20 MB tree)
#   GPU call 4: bash benchmarks/intentkv_ablations_device.sh [ABLATE_SECONDS] [LONG_SECONDS]
#               carry: .carry_model/gguf.sha256 .carry_model/llm_init.py .whl .carry_tau
# Writes $OUT/ablate and $OUT/long (results.json, summary.md, fidelity_vs_memory.png); compare
# here with `agentkv bench compare`.
set -euo pipefail
cd "$(dirname "$0")/.."
ablate_s=${1:-280}
long_s=${2:-200}
out=${OUT:-/tmp/out}
pieces=docs/benchmarks/replay_h100_pieces
ablate=$(tr '\n' ' ' < $pieces/s18_ablate.args)  # one line each: they go into bash -c
long=$(tr '\n' ' ' < $pieces/s18_long.args)
bash benchmarks/replay_device.sh exec bash -c "
set -uo pipefail
gunzip -c .carry_tau/gpt-4o-airline.json.gz > /tmp/akv/tau.json
export AGENTKV_TAU_BENCH=/tmp/akv/tau.json
for run in 'ablate $ablate_s $ablate' 'long $long_s $long'; do
  set -- \$run
  name=\$1 secs=\$2; shift 2
  python3 -P -m agentkv.engine.cli bench replay --device cuda --out $out/\$name \"\$@\" \
    --max-seconds \$secs > $out/\$name.log 2>&1 || echo \"\$name failed (exit \$?)\"
  grep -v '%|' $out/\$name.log | tail -n 30
done
"
