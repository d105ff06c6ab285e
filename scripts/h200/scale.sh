#!/usr/bin/env bash
# Scale-out on 2 GPUs (docs/benchmarks/scale.md), on the nvidia-h200-x2 kind, after setup.sh and model.sh:
#   bash scripts/h200/scale.sh one-gpu disagg disagg-async coloc2
# The learning config (scripts/learning/arithmetic_h200.yaml), STEPS steps, no evaluation, no export:
#   one-gpu       the baseline: trainer rank and engine share GPU 0 (resources.gpus_per_node=1)
#   disagg        1 trainer GPU + 1 engine GPU, weights by NCCL broadcast
#   disagg-async  the same with run.mode=one_step_off (the next rollout overlaps training)
#   coloc2        FSDP on 2 GPUs (2 rank processes, NCCL) + an engine on each GPU, weights by CUDA IPC
# Each part writes <part>.log, <part>.metrics.jsonl, <part>.services.json, <part>.summary.json and its
# processes' logs to /tmp/scale, which outlives a call while the machine stays warm, so the parts may
# be split over calls; then scale.json compares every part run so far with one-gpu
# (scale_compare.py), and everything is copied to $OUT (default /tmp/out).
set -u
source scripts/h200/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WORK=/tmp/scale; mkdir -p "$WORK"
STEPS=${STEPS:-20}  # EXTRA="key=value ..." adds overrides to every part
# MODEL: /tmp/smol (model.sh: the real SmolLM2) or any folder of that shape, e.g. the random-weight
# /tmp/sgmodel of sglang_parts.sh prepare: step times do not depend on what the weights learned
MODEL=${MODEL:-/tmp/smol}
CFG=scripts/learning/arithmetic_h200.yaml
run_part() {  # name, overrides...
  local name=$1; shift
  local start=$SECONDS
  rm -rf /tmp/runs/$name
  timeout 480 miles train $CFG model.name=$MODEL run.output_dir=/tmp/runs run.name=$name run.steps=$STEPS \
    eval.every=0 run.export_hf=false "$@" ${EXTRA:-} >"$WORK/$name.log" 2>&1
  local code=$?
  echo "$name: exit $code in $((SECONDS - start)) s"
  [ $code -eq 0 ] || tail -30 "$WORK/$name.log"
  cp /tmp/runs/$name/metrics.jsonl "$WORK/$name.metrics.jsonl" 2>/dev/null
  cp /tmp/runs/$name/services.json "$WORK/$name.services.json" 2>/dev/null
  mkdir -p "$WORK/$name.logs" && cp /tmp/runs/$name/logs/*.log "$WORK/$name.logs/" 2>/dev/null
  python3 scripts/learning/summarize.py "$WORK/$name.metrics.jsonl" > "$WORK/$name.summary.json" 2>/dev/null \
    && python3 -c "import json,sys; s=json.load(open(sys.argv[1])); print(' ', {k: s[k] for k in ('steps', 'step_s_median', 'phase_s_median')})" "$WORK/$name.summary.json"
}
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
for part in "$@"; do
  case $part in
    one-gpu) run_part one-gpu resources.gpus_per_node=1 ;;
    disagg) run_part disagg resources.trainer_ranks=1 resources.engines=1 resources.colocate=false weights.transport=broadcast ;;
    disagg-async) run_part disagg-async resources.trainer_ranks=1 resources.engines=1 resources.colocate=false \
                    weights.transport=broadcast run.mode=one_step_off algorithm.correction=tis ;;
    coloc2) run_part coloc2 resources.trainer_ranks=2 resources.engines=2 ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
python3 scripts/h200/scale_compare.py "$WORK" --baseline one-gpu > "$WORK/scale.json" && cat "$WORK/scale.json"
cp -r "$WORK"/. "$OUT"/
