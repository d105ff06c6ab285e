#!/usr/bin/env bash
# `miles bench engine` on the H200 (docs/benchmarks/engine.md), after setup.sh, with `.benchcfg`
# carried (SmolLM2-135M's config and tokenizer: the machine cannot pull the model, so the bench
# builds random weights of the same shape, which decode at the same speed).
#   bash scripts/h200/engine_bench.sh main
# main: the embedded engine (CUDA-graph decode), the same engine eager (--disable-cuda-graph) and
#   transformers `generate`, bf16, 128 new tokens, at 1, 32 and 128 concurrent requests; each
#   system warms up at each concurrency, then 3 timed runs. ~4 min (the eager engine and `generate`
#   at ~70 ms a decode step are most of it).
# c8: the embedded engine and `generate` at 8 concurrent requests only (~1 min).
# sessions: `--sessions`, 50-turn sessions of 80 + 80 tokens (8,000 at turn 50, inside SmolLM2's
#   8192-token context), the embedded engine with and without its radix prefix cache
#   (docs/benchmarks/prefix-cache.md; ~2-3 min).
set -u
source scripts/h200/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -f .benchcfg/config.json ] || { echo "no .benchcfg/config.json: carry .benchcfg (bash scripts/h200/prepare.sh benchcfg)"; exit 2; }
for variant in "$@"; do
  case $variant in
    main) args=(--systems embedded embedded_eager generate --concurrency 1 32 128) ;;
    c8) args=(--systems embedded generate --concurrency 8) ;;
    sessions) args=(--sessions --turns 50 --user-tokens 80 --answer-tokens 80) ;;
    *) echo "unknown variant $variant"; exit 2 ;;
  esac
  start=$SECONDS
  # inside one 10-minute call together with setup.sh (~1 min); a run killed here writes no JSON
  timeout 480 miles bench engine --model .benchcfg --random-weights --device cuda --repeats 3 "${args[@]}" \
    --out "$OUT/engine-h200-$variant.json" >"$OUT/engine-$variant.log" 2>&1
  echo "$variant: exit $? in $((SECONDS - start)) s"
  python3 - "$OUT/engine-h200-$variant.json" <<'PY'
import json, sys
try:
    report = json.load(open(sys.argv[1]))
except OSError:
    sys.exit("  no JSON: see the log under $OUT")
if "last_turn" in report:  # --sessions
    print(json.dumps(report["last_turn"], indent=1))
    sys.exit(0)
for name, by_c in report["systems"].items():
    for c, s in by_c.items():
        runs = ", ".join(f"{r:.0f}" for r in s["tokens_per_s_runs"])
        print(f"  {name:15} c={c:>3}: median {s['tokens_per_s_median']:9.1f} tok/s (runs {runs}; spread "
              f"{s['spread_pct']}%; warm-up {s['warmup_tokens_per_s']:.0f})")
for ratio, by_c in report["ratios"].items():
    print(f"  {ratio}: " + ", ".join(f"c={c} {v:.2f}x" for c, v in by_c.items()))
PY
done
