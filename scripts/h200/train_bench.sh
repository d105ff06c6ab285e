#!/usr/bin/env bash
# `miles bench train` variants on the H200 (docs/benchmarks/train.md), after setup.sh:
#   bash scripts/h200/train_bench.sh default cudnn compile
# default: eager, PyTorch's attention choice, with the plain-transformers baseline;
# cudnn: attention kernels preferred in the order cudnn, flash; compile: decoder layers and the
# log-prob head through torch.compile, cudnn first. 4K rows go 4 to a micro-batch (16K tokens).
set -u
source scripts/h200/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
common=(--micro-batch-tokens 16384 --warmup 2 --steps 4)
for variant in "$@"; do
  case $variant in
    default) args=(--no-compile) ;;
    cudnn) args=(--no-compile --no-baseline --sdpa-backends cudnn,flash) ;;
    compile-head) args=(--no-compile --no-baseline --sdpa-backends cudnn,flash --compile-head) ;;
    compile) args=(--no-baseline --sdpa-backends cudnn,flash --compile) ;;
    *) echo "unknown variant $variant"; exit 2 ;;
  esac
  start=$SECONDS
  timeout 400 miles bench train "${common[@]}" "${args[@]}" --output "$OUT/train-$variant.json" >"$OUT/train-$variant.log" 2>&1
  echo "$variant: exit $? in $((SECONDS - start)) s"
  python3 - "$OUT/train-$variant.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except OSError:
    sys.exit(0)
for r in d["results"]:
    base = r.get("baseline", {}).get("mfu")
    print(f"  L={r['seq_len']}: miles mfu {r['miles']['mfu']:.3f} ({r['miles']['tokens_per_s']:.0f} tok/s, "
          f"{r['miles']['peak_memory_gb']:.1f} GB)" + (f", baseline mfu {base:.3f}" if base else ""))
PY
done
