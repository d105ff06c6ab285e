#!/usr/bin/env bash
# The 100-injection `miles chaos` soak of issue 29 on the device machine's CPUs (16 cores): the
# tiny random model on CPU, like the CI test, so it is the same soak docs/benchmarks/chaos.md gives
# for a free 2-core machine, spread over RUNS concurrent runs (RUNS x PER injections, a seed each)
# so that it fits one call. Each run has its own folder, ports and process tree; a kill only ever
# targets the run that chose it.
#
#   carry [".whl", ".tokonly"]:  bash scripts/h200/setup.sh >/dev/null && bash scripts/h200/chaos_soak.sh
#   here (smaller):              RUNS=1 PER=2 STEPS=6 OUT=/tmp/soak uv run bash scripts/h200/chaos_soak.sh
#
# Ran 2026-12-02 on the device (453 s; docs/benchmarks/chaos.md) and here with RUNS=1 PER=2 STEPS=6.
#
# -> $OUT/chaos-soak-<seed>.json per run (miles chaos' own report), chaos-soak-logs.tgz (their
# logs) and $OUT/chaos-soak.json (the totals: injections by kind, recoveries, lost, duplicated, passed). Exits 1 unless every run passed.
set -u
RUNS=${RUNS:-4}
PER=${PER:-25}
SEED0=${SEED0:-7}
LIMIT=${LIMIT:-500}
STEPS=${STEPS:-30}   # a run that ends before its injections are done is extended (steps doubled)
OUT=${OUT:?set OUT}
[ -f scripts/h200/env.sh ] && [ -d /tmp/site ] && source scripts/h200/env.sh
export OMP_NUM_THREADS=2 MKL_NUM_THREADS=2
WORK=${WORK:-/tmp/chaos-soak}
mkdir -p "$OUT" "$WORK"
model=$(python3 -c "from miles_models.testing import tiny_model; print(tiny_model('dense'))") || exit 1
pids=()
for i in $(seq 0 $((RUNS - 1))); do
  seed=$((SEED0 + i))
  python3 -m miles.cli.main chaos model.name="$model" model.device=cpu \
    run.output_dir="$WORK" run.name="soak-$seed" data.source=arithmetic rollout.prompts_per_step=2 \
    rollout.samples_per_prompt=2 rollout.max_new_tokens=8 reward.name=math reward.timeout=5 \
    run.mode=fully_async algorithm.correction=tis run.steps="$STEPS" run.save_every=1 \
    --injections "$PER" --seed "$seed" --gap 1,3 --max-resumes 3 --timeout "$LIMIT" \
    --out "$OUT/chaos-soak-$seed.json" >"$OUT/chaos-soak-$seed.log" 2>&1 &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
# a call returns at most 8 files: the runs' logs travel as one archive
tar -C "$OUT" -czf "$OUT/chaos-soak-logs.tgz" $(cd "$OUT" && ls chaos-soak-*.log) && rm -f "$OUT"/chaos-soak-*.log
python3 - "$OUT" <<'EOF'
import json, sys
from collections import Counter
from pathlib import Path

out = Path(sys.argv[1])
runs = [json.loads(p.read_text()) for p in sorted(out.glob("chaos-soak-*.json"))]
kinds: Counter[str] = Counter()
recoveries: Counter[str] = Counter()
for run in runs:
    kinds.update(run["injections"]["by_kind"])
    recoveries.update(run["recoveries"])
summary = {
    "runs": len(runs),
    "injections_requested": sum(r["injections"]["requested"] for r in runs),
    "injections": sum(kinds.values()),
    "by_kind": dict(kinds),
    "recoveries": dict(recoveries),
    "lost": sum(r["ledger"].get("lost", 0) for r in runs),
    "duplicated": sum(r["ledger"].get("duplicated", 0) for r in runs),
    "passed": bool(runs) and all(r["passed"] for r in runs),
    "per_run": [{k: r[k] for k in ("seed", "passed", "failures", "seconds", "injections", "recoveries", "resumes", "ledger")}
                for r in runs],
}
(out / "chaos-soak.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps({k: v for k, v in summary.items() if k != "per_run"}))
EOF
exit $rc
