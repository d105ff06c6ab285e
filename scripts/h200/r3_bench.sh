#!/usr/bin/env bash
# Routing replay on the H200 (docs/benchmarks/r3.md), after setup.sh (carry .whl .trl .tokonly):
#   bash scripts/h200/r3_bench.sh tiny moe dense
# tiny: the tiny Qwen3-MoE in bf16 (a 30 s sanity run of the whole path); moe: a random-weight MoE
# of Qwen3-30B-A3B's layer shape (8 layers, 128 experts, top-8; ~5 B parameters), 32 rollouts of 128
# tokens from the embedded engine, scored by the fsdp backend without routing / measuring / replaying
# (~4 min, most of it building and loading the model); dense: r3 enabled vs disabled on a
# random-weight Qwen3-0.6B training step (~1 min). Each writes $OUT/r3-h200-<variant>.json and .log.
set -u
source scripts/h200/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for variant in "$@"; do
  case $variant in
    tiny) args=(--preset tiny-moe --rollouts 16 --max-new-tokens 64 --repeats 3) ;;
    moe) args=(--preset qwen3-30b-a3b-8l --rollouts 32 --max-new-tokens 128 --repeats 5) ;;
    dense) args=(--preset qwen3-0.6b-dense --repeats 7) ;;
    *) echo "unknown variant $variant (tiny, moe, dense)"; exit 2 ;;
  esac
  start=$SECONDS
  # python -m: works whether or not the device's workspace wheels carry miles-r3's entry points
  timeout 540 python3 -m miles_r3.bench --device cuda --dtype bfloat16 --work-dir /tmp/r3 "${args[@]}" \
    --output "$OUT/r3-h200-$variant.json" >"$OUT/r3-$variant.log" 2>&1
  echo "$variant: exit $? in $((SECONDS - start)) s"
  python3 - "$OUT/r3-h200-$variant.json" <<'PY' || tail -20 "$OUT/r3-$variant.log"
import json, sys
d = json.load(open(sys.argv[1]))
if "variants" in d:
    for name, v in d["variants"].items():
        print(f"  {name:8s} |lp diff| {v['train_rollout_logprob_abs_diff']:.5f} (max {v['train_rollout_logprob_abs_diff_max']:.3f})"
              f"  agreement {v.get('routing_agreement', float('nan')):.4f} tokens {v.get('token_agreement', float('nan')):.4f}"
              f"  {v['median_s']:.3f} s" + (f" x{v['time_ratio_vs_off']:.3f}" if "time_ratio_vs_off" in v else ""))
else:
    print(f"  dense step: r3 enabled / disabled = {d['time_ratio_enabled_vs_disabled']:.4f} (min {d['time_ratio_enabled_vs_disabled_min']:.4f});"
          f" run_forward us/call {d['run_forward_us_per_call']}")
PY
done
