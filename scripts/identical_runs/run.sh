#!/usr/bin/env bash
# Six short deterministic CPU runs of one tree, for comparing two versions of Miles bit for bit
# (docs/design/plugin-kernel.md, "The 0.2 reshape changed no number"):
#
#   bash scripts/identical_runs/run.sh TREE OUT        # TREE: a checkout with its .venv (uv sync)
#   python scripts/identical_runs/compare.py OUT_A OUT_B
#
# sync / one_step_off (whitened advantages) / PPO with a critic on SmolLM2-135M, the calculator
# agent through the session server, routing replay on the tiny MoE model, megatron on the tiny
# dense one. Each ~1-3 min on 2 cores.
set -u
TREE=$1; OUT=$(realpath -m "$2")
mkdir -p "$OUT"
cd "$TREE"
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2
TINY=$(.venv/bin/python -c "from miles_models.testing import tiny_model; print(tiny_model('dense'))")
MOE=$(.venv/bin/python -c "from miles_models.testing import tiny_model; print(tiny_model('moe'))")
common="run.deterministic=true run.save_final=false run.output_dir=$OUT"
run() {
  local name=$1; shift
  local cfg=""; if [[ "${1:-}" == *.yaml ]]; then cfg=$1; shift; fi
  timeout 1200 .venv/bin/miles train $cfg $common run.name="$name" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $?"
}
run sync run.steps=3
run one_step_off run.mode=one_step_off algorithm.correction=tis run.steps=3 algorithm.normalize_advantages=true
run ppo run.steps=2 algorithm.advantage=ppo train.use_critic=true
run agentic examples/calculator_agent/config.yaml run.steps=2 rollout.prompts_per_step=2
run r3moe run.steps=2 model.name="$MOE" r3.enabled=true
run megatron run.steps=2 train.backend=megatron model.name="$TINY"
