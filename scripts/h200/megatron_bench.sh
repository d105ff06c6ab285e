#!/usr/bin/env bash
# `miles bench train --backend megatron` on the H200s (docs/benchmarks/train.md), after setup.sh
# (the .whl folder must keep the megatron_core wheel: 2.6 MB, pure Python but one small helper).
#   one GPU  (nvidia-h200):    bash scripts/h200/megatron_bench.sh fsdp single single-eager
#   two GPUs (nvidia-h200-x2): bash scripts/h200/megatron_bench.sh tp2 cp2
# fsdp:   the fsdp backend at its best settings (compile, cudnn), measured in the same call as the
#         baseline of `single`; single: megatron, one GPU, 4K and 16K rows (4K rows four to a
#         micro-batch, as fsdp's run), with megatron.compile (the CUDA default: the head and every
#         transformer layer through torch.compile); single-nolayers: layers eager (head and rotary
#         embedding compiled); single-eager: nothing compiled; single-local: the local layers even
#         where Transformer Engine imports (te.sh), to compare the two in one call;
#         fsdp-big / single-big / single-local-big: one 65536-token micro-batch per step (a quarter
#         of the layer calls: Transformer Engine's layers are host-bound at 4K rows);
#         fsdp-spread / single-spread: rows of varied length (uniform in [L/2, L], --length-spread
#         0.5), as RL responses are: fsdp pads them or packs with a dense mask, megatron packs;
#         fsdp-short / single-short / single-short-varlen: 512-token rows, 32 to a micro-batch, where
#         per-sequence attention calls are many and small (is varlen worth it there?); single-varlen:
#         one torch.nn.attention.varlen call per layer instead of SDPA per sequence; tp2 / cp2: megatron on
#         two GPUs, 32K-token rows, TP=2 with
#         sequence parallelism or CP=2. Megatron runs megatron-core's local layers with PyTorch
#         SDPA unless Transformer Engine imports (the JSON says which: "transformer_engine").
# STEPS (default 8) timed steps after 2 warm-up ones: with 4, fsdp's 4K MFU moved by 10% between calls.
set -u
source scripts/h200/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
common=(--warmup 2 --steps ${STEPS:-8} --no-baseline --work-dir /tmp/bench-models)
python3 -c "import megatron.core, sys; print('megatron-core', megatron.core.__version__)" || { echo "megatron-core missing from /tmp/site: keep its wheel in .whl"; exit 1; }
python3 -c "import transformer_engine.pytorch" 2>/dev/null && echo "transformer engine: yes" || echo "transformer engine: no (local layers + PyTorch SDPA)"
for variant in "$@"; do
  case $variant in
    fsdp) cmd=(miles bench train "${common[@]}" --micro-batch-tokens 16384 --sdpa-backends cudnn,flash --compile) ;;
    single) cmd=(miles bench train "${common[@]}" --backend megatron --micro-batch-tokens 16384) ;;
    fsdp-spread) cmd=(miles bench train "${common[@]}" --micro-batch-tokens 16384 --sdpa-backends cudnn,flash --compile --length-spread 0.5) ;;
    single-spread) cmd=(miles bench train "${common[@]}" --backend megatron --micro-batch-tokens 16384 --length-spread 0.5) ;;
    fsdp-big) cmd=(miles bench train "${common[@]}" --micro-batch-tokens 65536 --sdpa-backends cudnn,flash --compile) ;;
    single-big) cmd=(miles bench train "${common[@]}" --backend megatron --micro-batch-tokens 65536) ;;
    single-local-big) cmd=(miles bench train "${common[@]}" --backend megatron --micro-batch-tokens 65536 --option transformer_impl=local) ;;
    single-local) cmd=(miles bench train "${common[@]}" --backend megatron --micro-batch-tokens 16384 --option transformer_impl=local) ;;
    single-nolayers) cmd=(miles bench train "${common[@]}" --backend megatron --micro-batch-tokens 16384 --option compile_layers=false) ;;
    single-eager) cmd=(miles bench train "${common[@]}" --backend megatron --micro-batch-tokens 16384 --option compile=false) ;;
    fsdp-short) cmd=(miles bench train "${common[@]}" --seq-lens 512 --micro-batch-tokens 16384 --sdpa-backends cudnn,flash --compile) ;;
    single-short) cmd=(miles bench train "${common[@]}" --backend megatron --seq-lens 512 --micro-batch-tokens 16384) ;;
    single-short-varlen) cmd=(miles bench train "${common[@]}" --backend megatron --seq-lens 512 --micro-batch-tokens 16384 --option attention_kernel=varlen) ;;
    single-varlen) cmd=(miles bench train "${common[@]}" --backend megatron --micro-batch-tokens 16384 --option attention_kernel=varlen) ;;
    single-recompute) cmd=(miles bench train "${common[@]}" --backend megatron --micro-batch-tokens 16384 --option recompute=selective) ;;
    tp2) cmd=(torchrun --nproc_per_node=2 --master_port=29561 -m miles.cli.main bench train "${common[@]}" --backend megatron
              --seq-lens 32768 --tokens-per-step 65536 --micro-batch-tokens 32768 --option tensor_parallel=2) ;;
    cp2) cmd=(torchrun --nproc_per_node=2 --master_port=29562 -m miles.cli.main bench train "${common[@]}" --backend megatron
              --seq-lens 32768 --tokens-per-step 65536 --micro-batch-tokens 32768 --option context_parallel=2) ;;
    *) echo "unknown variant $variant"; exit 2 ;;
  esac
  start=$SECONDS
  # PROFILE=1: one more step per length under torch.profiler, op tables into $OUT/profiles.tgz at the end
  [ -n "${PROFILE:-}" ] && cmd+=(--profile "/tmp/profiles/$variant")
  timeout 420 "${cmd[@]}" --output "$OUT/megatron-$variant.json" >"$OUT/megatron-$variant.log" 2>&1
  echo "$variant: exit $? in $((SECONDS - start)) s"
  [ -s "$OUT/megatron-$variant.json" ] || { tail -25 "$OUT/megatron-$variant.log"; continue; }
  python3 - "$OUT/megatron-$variant.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["results"]:
    m = r["miles"]
    busy = f", kernels {m['kernel_share']:.0%} of a profiled step" if m.get("kernel_share") else ""
    print(f"  {d['backend']} L={r['seq_len']}: mfu {m['mfu']:.3f} ({m['tokens_per_s']:.0f} tok/s, {m['peak_memory_gb']:.1f} GB/GPU{busy})")
PY
done
if [ -d /tmp/profiles ]; then tar czf "$OUT/profiles.tgz" -C /tmp profiles && echo "profiles: $OUT/profiles.tgz"; fi
