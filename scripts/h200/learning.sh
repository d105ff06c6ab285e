#!/usr/bin/env bash
# The learning test on the H200 (docs/benchmarks/learning.md), after setup.sh and model.sh:
#   bash scripts/h200/learning.sh miles-sync miles-async trl eval
# Each part writes its results under $OUT (default /tmp/out). Parts: miles-sync (40 steps, sync),
# miles-async (40 steps, run.mode=one_step_off), the same two with fsdp.compile=true (miles-sync-compile,
# miles-async-compile), profile (12 sync steps under py-spy, all processes),
# trl (TRL's GRPOTrainer, 40 steps), eval (held-out greedy accuracy of base, Miles and TRL models),
# miles-lora (40 sync steps with train.lora rank 32, alpha 64 and lr LORA_LR, default 5e-5: 10x the
# full fine-tune's 5e-6; issue 32; eval then covers its merged export too), miles-sync-top (40 sync steps
# with rollout.true_on_policy: issue 31's learning run; its summary counts steps with a non-zero diff).
# MODEL (default /tmp/smol) and EXTRA (more overrides, space-separated) let a part start on CPU:
#   MODEL=<tiny model> STEPS=2 EXTRA="model.device=cpu weights.transport=disk ..." uv run bash scripts/h200/learning.sh miles-lora
set -u
source scripts/h200/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-40}
MODEL=${MODEL:-/tmp/smol}
LORA_LR=${LORA_LR:-5e-5}
read -r -a EXTRA <<< "${EXTRA:-}"
CFG=scripts/learning/arithmetic_h200.yaml
miles_run() {  # name, extra overrides...
  local name=$1; shift
  local start=$SECONDS
  miles train $CFG model.name=$MODEL run.output_dir=/tmp/runs run.name=$name run.steps=$STEPS "$@" ${EXTRA[@]+"${EXTRA[@]}"} \
    >"$OUT/$name.log" 2>&1
  echo "$name: exit $? in $((SECONDS - start)) s"
  cp /tmp/runs/$name/metrics.jsonl "$OUT/$name.metrics.jsonl" 2>/dev/null
  python3 scripts/learning/summarize.py "$OUT/$name.metrics.jsonl" > "$OUT/$name.summary.json" && cat "$OUT/$name.summary.json"
}
for part in "$@"; do
  case $part in
    miles-sync) miles_run miles-sync ;;
    miles-async) miles_run miles-async run.mode=one_step_off algorithm.correction=tis ;;
    miles-sync-top) miles_run miles-sync-top rollout.true_on_policy=true ;;
    miles-lora) miles_run miles-lora "train.lora={rank: 32, alpha: 64}" train.lr=$LORA_LR ;;
    miles-sync-compile) miles_run miles-sync-compile fsdp.compile=true ;;
    miles-async-compile) miles_run miles-async-compile run.mode=one_step_off algorithm.correction=tis fsdp.compile=true ;;
    profile)
      py-spy record --subprocesses --nonblocking --rate 50 --format raw -o "$OUT/profile.txt" -- \
        miles train $CFG model.name=/tmp/smol run.output_dir=/tmp/runs run.name=profile run.steps=12 eval.every=0 \
        >"$OUT/profile.log" 2>&1; echo "profile: exit $?"
      python3 scripts/learning/summarize.py /tmp/runs/profile/metrics.jsonl > "$OUT/profile.summary.json" ;;
    trl)
      start=$SECONDS
      python3 scripts/learning/trl_grpo.py --model /tmp/smol --steps $STEPS --out /tmp/trl >"$OUT/trl.log" 2>&1
      echo "trl: exit $? in $((SECONDS - start)) s"; cp /tmp/trl/trl.json "$OUT/trl.json" 2>/dev/null ;;
    eval)
      models=(--model /tmp/smol)
      for m in /tmp/runs/miles-sync/hf /tmp/runs/miles-async/hf /tmp/runs/miles-lora/hf /tmp/runs/miles-sync-top/hf /tmp/trl/final; do [ -d "$m" ] && models+=(--model "$m"); done
      python3 scripts/learning/eval_heldout.py "${models[@]}" --n 256 --out "$OUT/heldout.json" >"$OUT/eval.log" 2>&1
      echo "eval: exit $?"; cat "$OUT/heldout.json" ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
