#!/usr/bin/env bash
# `miles bench train --tree` on the H200 (docs/benchmarks/prefix-tree.md), after setup.sh:
#   bash scripts/h200/tree_bench.sh            # Qwen3-0.6B shape, 8 GRPO groups per step, 3 runs
# MODEL (default qwen3-0.6b), NGROUPS (default 8), REPEATS (processes, default 3), STEPS (timed steps
# per arm, default 4), ATTENTION (default sdpa,flex_attention). The budget is one group's flat size
# (18,432 tokens) in every arm: flat rows run a group per micro-batch, the prefix planner fits the
# groups' trees. Each run is its own process (compile included) and writes tree-<tag>-rN.json.
set -u
source scripts/h200/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MODEL=${MODEL:-qwen3-0.6b}; NGROUPS=${NGROUPS:-8}; REPEATS=${REPEATS:-3}; STEPS=${STEPS:-4}
ATTENTION=${ATTENTION:-sdpa,flex_attention}
tag="$MODEL-g$NGROUPS"
for r in $(seq 1 "$REPEATS"); do
  start=$SECONDS
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 300 miles bench train --tree --model "$MODEL" \
    --tree-workloads grpo --tree-groups "$NGROUPS" --tree-attention "$ATTENTION" --warmup 2 --steps "$STEPS" \
    --output "$OUT/tree-$tag-r$r.json" >"$OUT/tree-$tag-r$r.log" 2>&1
  echo "run $r: exit $? in $((SECONDS - start)) s"
  python3 - "$OUT/tree-$tag-r$r.json" <<'PY'
import json, sys
try:
    grpo = json.load(open(sys.argv[1]))["workloads"]["grpo"]
except (OSError, KeyError):
    sys.exit(0)
for arm, row in grpo.items():
    if isinstance(row, dict) and "step_s_median" in row:
        print(f"  {arm}: {row['computed_tokens']} tokens in {row['micro_batches']} passes, step {row['step_s_median']:.3f} s "
              f"({row['step_s_min']:.3f}-{row['step_s_max']:.3f}), speedup {row.get('step_speedup', 1):.2f}x, "
              f"loss {row['first_step_loss']:.6f}, peak {row['peak_memory_gb']:.1f} GB")
PY
done
