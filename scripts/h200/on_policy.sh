#!/usr/bin/env bash
# True on-policy on the H200 (issue 31; docs/benchmarks/on-policy.md), after setup.sh, with
# `.tokonly` (the GPU tests' tiny model) and `.benchcfg` (SmolLM2-135M's shape) carried:
#   bash scripts/h200/on_policy.sh tests smol
#   bash scripts/h200/on_policy.sh engine train
# tests:  the GPU-marked tests of the Triton kernels, the whole tiny model and `miles train` (bf16).
# smol:   `miles train` on random weights of SmolLM2-135M's shape, bf16, CUDA-graph decode,
#         rollout.true_on_policy, 4 steps of 32 samples: every step's diff must be 0 (~2 min).
# engine: `miles bench engine`, the embedded engine with and without true_on_policy at 1 / 32 / 128
#         concurrent requests, 128 new tokens, warm-up + 3 timed runs each (~4 min).
# train:  `miles bench train --true-on-policy --repeats 3` at SmolLM2-135M's and Qwen3-0.6B's shapes: the
#         fsdp step with and without, the same rows, 3 alternating pairs in one process per shape (~5 min).
set -u
source scripts/h200/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for part in "$@"; do
  start=$SECONDS
  case $part in
    tests)
      timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu \
        packages/miles-engine/tests/test_invariant_triton.py packages/miles-engine/tests/test_invariant_ops.py \
        packages/miles-engine/tests/test_invariant_moe.py \
        tests/test_true_on_policy.py >"$OUT/on-policy-tests.log" 2>&1
      echo "tests: exit $? in $((SECONDS - start)) s"; tail -5 "$OUT/on-policy-tests.log" ;;
    smol)
      [ -f .benchcfg/config.json ] || { echo "carry .benchcfg"; exit 2; }
      rm -rf /tmp/opruns/smol
      python3 - <<'PY'
import shutil
import torch
from transformers import AutoConfig, AutoModelForCausalLM
torch.manual_seed(0)
config = AutoConfig.from_pretrained(".benchcfg")
AutoModelForCausalLM.from_config(config).save_pretrained("/tmp/smol-random-op")
for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
    shutil.copy(f".benchcfg/{name}", f"/tmp/smol-random-op/{name}")
PY
      # the tests' vowel-share reward (conftest.RewardGate): different within a group, so the weights move
      rm -f /tmp/reward_url
      python3 -c 'import sys, time; sys.path.insert(0, "."); from conftest import RewardGate; g = RewardGate(hold=0); open("/tmp/reward_url", "w").write(g.url); time.sleep(900)' &
      gate=$!
      for _ in $(seq 50); do [ -s /tmp/reward_url ] && break; sleep 0.2; done
      timeout 300 miles train model.name=/tmp/smol-random-op model.device=cuda run.output_dir=/tmp/opruns run.name=smol \
        run.steps=4 rollout.prompts_per_step=8 rollout.samples_per_prompt=4 rollout.max_new_tokens=64 \
        rollout.temperature=0.8 rollout.true_on_policy=true reward.name=remote "reward.remote_url=$(cat /tmp/reward_url)" \
        train.lr=1e-4 >"$OUT/on-policy-smol.log" 2>&1
      echo "smol: exit $? in $((SECONDS - start)) s"
      kill $gate
      cp /tmp/opruns/smol/metrics.jsonl "$OUT/on-policy-smol.metrics.jsonl" 2>/dev/null
      python3 - <<'PY'
import json
for line in open("/tmp/opruns/smol/metrics.jsonl"):
    m = json.loads(line)
    print({k: m.get(k) for k in ("step", "train/train_rollout_logprob_abs_diff", "train/train_rollout_logprob_abs_diff_max",
                                 "train/true_on_policy_checked_tokens", "train/true_on_policy_mismatched_tokens",
                                 "train/grad_norm", "rollout/reward_mean", "time/step")})
PY
      ;;
    engine)
      timeout 500 miles bench engine --model .benchcfg --random-weights --device cuda --repeats 3 \
        --systems embedded embedded_true_on_policy --concurrency 1 32 128 \
        --out "$OUT/on-policy-engine-h200.json" >"$OUT/on-policy-engine.log" 2>&1
      echo "engine: exit $? in $((SECONDS - start)) s"; tail -4 "$OUT/on-policy-engine.log" ;;
    train)
      # 3 pairs (default, true_on_policy) per shape, alternating, each after its own warm-up; SmolLM2's
      # last pair also under torch.profiler (op tables in $OUT/prof)
      for model in ${MODELS:-smollm2-135m qwen3-0.6b}; do
        prof=(); [ "$model" = smollm2-135m ] && prof=(--profile "$OUT/prof")
        timeout 400 miles bench train --model "$model" --seq-lens 2048 --tokens-per-step 16384 --micro-batch-tokens 4096 \
          --warmup 2 --steps 3 --no-compile --no-baseline --true-on-policy --repeats "${REPEATS:-3}" "${prof[@]}" \
          --output "$OUT/on-policy-train-h200-$model.json" >>"$OUT/on-policy-train.log" 2>&1
        echo "train $model: exit $? in $((SECONDS - start)) s"
        python3 -c "import json, sys; e = json.load(open(sys.argv[1]))['results'][0]; print(e['true_on_policy_step_slowdown'], e['true_on_policy_step_slowdown_spread'], [(round(p['default_step_s'], 3), round(p['true_on_policy_step_s'], 3)) for p in e['true_on_policy_repeats']])" "$OUT/on-policy-train-h200-$model.json"
      done ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
