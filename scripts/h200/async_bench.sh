#!/usr/bin/env bash
# `miles bench async` on the device (docs/benchmarks/async.md), after setup.sh, with `.benchcfg` carried
# (SmolLM2-135M's config and tokenizer: the long_tail agent and the repeated_tokens reward need no trained
# weights, so the model is built here with random weights, as for the throughput benchmarks).
# `.whl` must hold a wheel of miles-longtail (its entry point registers the agent, the reward and the
# command): rebuild the wheelhouse after merging it.
#   bash scripts/h200/async_bench.sh x2    # nvidia-h200-x2: trainer and engine on a GPU each, NCCL broadcast
#   bash scripts/h200/async_bench.sh x1    # nvidia-h200: engine and trainer share GPU 0, CUDA IPC
# STEPS (default 8) and REPEATS (default 1) per mode, MODES (default all three: sync one_step_off fully_async); each run is a `miles train` child process; ~4 min
# per repeat (3 runs, ~30 s of start-up each). One repeat per device call, TAG names its JSON:
#   TAG=-r1 bash scripts/h200/async_bench.sh x2; then TAG=-r2 ... in the next call (the machine is warm)
# and here: miles bench async --replot async-h200x2-r1.json async-h200x2-r2.json --json ... --png ...
# (no matplotlib on the device).
set -u
source scripts/h200/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-8}; REPEATS=${REPEATS:-1}
MODEL=/tmp/smol-random
kind=${1:-x2}

if [ ! -f "$MODEL/config.json" ]; then
  python3 - "$MODEL" <<'EOF' || exit 1
import sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
torch.manual_seed(0)
config = AutoConfig.from_pretrained(".benchcfg")
AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(sys.argv[1])
AutoTokenizer.from_pretrained(".benchcfg").save_pretrained(sys.argv[1])
print("random SmolLM2-135M in", sys.argv[1])
EOF
fi

case $kind in
  # Disaggregated (docs/design/process-model.md): the trainer rank on one GPU, the engine on the other.
  x2) placement=(--set resources.colocate=false --set weights.transport=broadcast) ;;
  x1) placement=(--set weights.transport=shared_memory) ;;
  *) echo "unknown kind $kind (x1 or x2)"; exit 2 ;;
esac

# EXTRA: more overrides for every mode, space-separated key=value (e.g. EXTRA="rollout.max_staleness=4":
# how much of fully_async's speed admission control's bound costs; docs/benchmarks/async.md)
# ASYNC_EXTRA: the same for the fully_async runs only (ASYNC_EXTRA="rollout.max_staleness=4": the bound
# is a fully_async key, refused in the other modes)
extra=()
for kv in ${EXTRA:-}; do extra+=(--set "$kv"); done
for kv in ${ASYNC_EXTRA:-}; do extra+=(--async-set "$kv"); done

start=$SECONDS
# 8 prompts x 4 samples per step, 64 trajectories in flight in fully_async, tool calls of 50 ms and up
# (the tail of 64 draws per sync step is ~5 s); eager FSDP (compiling costs each run a warm-up that 8
# steps would not pay back).
miles bench async --model "$MODEL" --steps "$STEPS" --repeats "$REPEATS" --modes ${MODES:-sync one_step_off fully_async} --runs-dir "/tmp/async-runs-$kind${TAG:-}" \
  --set model.device=cuda --set model.dtype=bfloat16 --set fsdp.compile=false "${placement[@]}" \
  --set rollout.prompts_per_step=8 --set rollout.samples_per_prompt=4 --set rollout.concurrency=64 \
  --set longtail.latency_scale=0.05 --set train.lr=1e-4 "${extra[@]}" --timeout 400 \
  --json "$OUT/async-h200$kind${TAG:-}.json" >"$OUT/async-$kind${TAG:-}.log" 2>&1
echo "async bench $kind: exit $? in $((SECONDS - start)) s"
grep -E "samples/s|failed|Error" "$OUT/async-$kind${TAG:-}.log"
python3 - "$OUT/async-h200$kind${TAG:-}.json" <<'EOF'
import json, sys
report = json.load(open(sys.argv[1]))
for mode, row in report["modes"].items():
    print(mode, {k: row[k] for k in ("time_to_steps_s", "samples_per_s", "speedup_vs_sync") if k in row})
EOF
