#!/usr/bin/env bash
# Issue 30's end-to-end row: the long-tail agentic workload (`miles bench async`'s sync runs: 4
# prompts x 4 samples of 3-turn `long_tail` sessions per step), with the engine's radix prefix cache
# and the fsdp prefix tree both on, against both off. The arms alternate, REPEATS runs each
# (default 3), one `miles bench async --modes sync` per run; the router's `metrics` middleware is on
# in both arms, so each run's metrics show the prefix cache's hit rate.
#   bash scripts/prefix/longtail_e2e.sh OUT_DIR [extra --set overrides...]
# TREE=auto: the "on" arm lets the fsdp cost model choose tree or flat per micro-batch (default: on,
# a tree wherever rows share a prefix).
# Then: uv run python scripts/prefix/longtail_e2e_summary.py OUT_DIR
set -eu
out=${1:?usage: longtail_e2e.sh OUT_DIR [KEY=VALUE ...]}; shift
mkdir -p "$out"
extra=(--set "router.middlewares=[metrics]")
for kv in "$@"; do extra+=(--set "$kv"); done
on=(--set engine.disable_radix_cache=false --set "fsdp.prefix_tree=${TREE:-on}")
off=(--set engine.disable_radix_cache=true --set fsdp.prefix_tree=off)
for r in $(seq 1 "${REPEATS:-3}"); do
  for arm in off on; do
    [ "$arm" = on ] && settings=("${on[@]}") || settings=("${off[@]}")
    [ -f "$out/$arm-$r.json" ] && continue
    uv run miles bench async --model "${MODEL:-tiny}" --modes sync --steps "${STEPS:-6}" --repeats 1 \
      "${extra[@]}" "${settings[@]}" --runs-dir "$out/runs-$arm-$r" --json "$out/$arm-$r.json" >"$out/$arm-$r.log" 2>&1
    echo "$arm repeat $r: exit $?"
  done
done
