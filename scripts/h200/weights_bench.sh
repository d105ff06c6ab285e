#!/usr/bin/env bash
# `miles bench weights` on the device (docs/benchmarks/weights.md), after setup.sh, with the
# `.benchcfg` folder carried (SmolLM2's config and tokenizer: the machine is offline).
#   bash scripts/h200/weights_bench.sh 1b 1b-onebucket 8b
# Run on the `nvidia-h200-x2` kind: broadcast (NCCL) needs the engine on a second GPU and is
# reported as skipped on one. 1b: ~2.5 min; 8b: ~7.5 min (building the random model and loading
# it into two engines is most of it), so give 8b a call of its own.
set -u
source scripts/h200/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for variant in "$@"; do
  case $variant in
    1b) args=(--random-model 1b) ;;
    1b-onebucket) args=(--random-model 1b --transports shared_memory,broadcast --bucket-mb 4096) ;;
    8b) args=(--random-model 8b --transports shared_memory,broadcast) ;;
    *) echo "unknown variant $variant"; exit 2 ;;
  esac
  start=$SECONDS
  miles bench weights --model .benchcfg --devices cuda --repeats 3 --work-dir "/tmp/bw-$variant" "${args[@]}" \
    --out "$OUT/weights-h200x2-$variant.json" >"$OUT/weights-$variant.log" 2>&1
  echo "$variant: exit $? in $((SECONDS - start)) s"
  grep -E '"(p2p_copy|device_copy|gbps_best|seconds_median|error|skipped)"|": \{$' "$OUT/weights-$variant.log"
done
