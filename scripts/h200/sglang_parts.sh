#!/usr/bin/env bash
# Real SGLang under Miles on the device (issue 16), after setup.sh and SGLang's `stage install`
# (../shared/device/SGLANG.md): SGLang in /tmp/sg, Miles in /tmp/site, never in one process.
# The calls of scripts/h200/README.md, section F (same numbers):
#   bash scripts/h200/setup.sh && bash scripts/h200/sglang_parts.sh prepare        # call 1
#   (calls 2-4 stage SGLang: .peer/1, .peer/2, .peer/3 with `stage install`), then
#   bash scripts/h200/sglang_parts.sh contract sync-ipc                             # call 4, after the install
#   bash scripts/h200/sglang_parts.sh lora sync-lora                                # call 4 instead (issue 32)
#   STEPS=4 bash scripts/h200/sglang_parts.sh train                                 # call 5 (and sync-megatron)
#   bash scripts/h200/sglang_parts.sh bench                                         # call 6
#   bash scripts/h200/sglang_parts.sh sync-broadcast                                # nvidia-h200-x2 only
# Parts (each writes logs and results under $OUT, default /tmp/out, and prints a summary line):
#   prepare         random bf16 weights of SmolLM2-135M's shape (.benchcfg) saved to /tmp/sgmodel, so
#                   SGLang and the trainer load the same real checkpoint (~20 s)
#   contract        the engine contract suite against a live SGLang server started by miles_sglang
#                   (~2 min on a fresh machine: SGLang's first start builds its JIT kernels)
#   lora            LoRA adapters on a live SGLang server: three versions synced with the calls of
#                   miles_sglang.lora, each served against transformers with the adapter (~3 min)
#   sync-lora       `miles train` 3 steps with train.lora (rank 16) on SGLang: weights.transport=sglang_lora
#                   (adapters as PEFT folders loaded by name), weights.check=true; the router names each
#                   engine's adapter in its requests (issue 32; ~2.5 min)
#   sync-ipc        `miles train` 2 steps, rollout.engine=sglang, weights.transport=shared_memory
#                   (CUDA IPC, SGLang and FSDP on GPU 0), weights.check=true (~2 min)
#   sync-megatron   sync-ipc with train.backend=megatron (~2 min)
#   sync-broadcast  the same over NCCL broadcast, disaggregated: trainer and SGLang on a GPU each (needs 2 GPUs; ~2 min)
#   train           the learning config (docs/benchmarks/learning.md) with rollout.engine=sglang,
#                   STEPS steps (default 5), random weights (~3 min)
#   episodes        the compacting agent example, 2 steps through SGLang and through the embedded engine,
#                   then the train/rollout log-prob gap per branch kind (issue 26; EP_MODEL, ~6 min)
#   bench           `miles bench engine`: SGLang, the embedded engine and transformers `generate`, same GPU,
#                   model, prompts (also the embedded-vs-generate numbers of engine.md)
#                   (docs/benchmarks/engine.md; ~4 min)
#   sessions        `miles bench engine --sessions`: 50-turn sessions (80 + 80 tokens a turn), the embedded
#                   engine and SGLang each with their radix cache on and off, same sessions
#                   (docs/benchmarks/prefix-cache.md; ~5 min, two SGLang start-ups of it)
set -u
source scripts/h200/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MODEL=/tmp/sgmodel
STEPS=${STEPS:-5}
NVCC_HOME=$(command -v nvcc >/dev/null 2>&1 && dirname "$(dirname "$(command -v nvcc)")" || echo "")
# SGLang's environment (what ../shared/device/sglang.sh's sg_env sets), for its processes only
SG_ENV=(PYTHONPATH=/tmp/sg PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
        TVM_FFI_CACHE_DIR=/tmp/sgjit/tvm-ffi TRITON_CACHE_DIR=/tmp/sgjit/triton
        NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 SGLANG_DISABLE_REQUEST_LOGGING=1)
[ -n "$NVCC_HOME" ] && SG_ENV+=(CUDA_HOME=$NVCC_HOME)
mkdir -p /tmp/sgjit

need_sglang() { [ -d /tmp/sg/sglang ] || { echo "SGLang is not unpacked in /tmp/sg: run the three stage calls and install first"; exit 2; }; }
need_model() { [ -f $MODEL/config.json ] || { echo "$MODEL is missing: run the prepare part first"; exit 2; }; }

# A run config: the base YAML plus the sglang section with SGLang's environment (JSON is YAML).
run_config() {  # out_file base_yaml  (the GPUs come from placement: resources, CUDA_VISIBLE_DEVICES by the executor)
  python3 - "$1" "$2" "${SG_ENV[@]}" <<'PY'
import json, sys, yaml
out, base, *env = sys.argv[1:]
cfg = yaml.safe_load(open(base)) if base != "-" else {}
env = dict(kv.split("=", 1) for kv in env)
cfg.setdefault("rollout", {})["engine"] = "sglang"
cfg["sglang"] = {"python": "python3", "env": env, "mem_fraction_static": 0.4, "attention_backend": "fa3",
                 "sglang_args": ["--grammar-backend", "none"]}  # the trimmed SGLang has no xgrammar
cfg.pop("engine", None)  # the embedded engine's section: unused here
json.dump(cfg, open(out, "w"), indent=1)
PY
}

miles_train() {  # name config overrides...
  local name=$1 cfg=$2; shift 2
  local start=$SECONDS
  miles train "$cfg" model.name=$MODEL run.output_dir=/tmp/runs run.name=$name "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - start)) s"
  cp /tmp/runs/$name/metrics.jsonl "$OUT/$name.metrics.jsonl" 2>/dev/null
  cp -r /tmp/runs/$name/logs "$OUT/$name-logs" 2>/dev/null
  [ $rc -eq 0 ] || tail -30 "$OUT/$name.log"
  grep -hE '"(weights/version|perf/sync_gb_per_s|time/sync|reward/mean|train_rollout_logprob_abs_diff)"' \
    "$OUT/$name.metrics.jsonl" 2>/dev/null | tail -3 | cut -c1-400
}

live_check() {  # name script: a check script against a live SGLang server on GPU 0
  local name=$1 script=$2 start=$SECONDS
  CUDA_VISIBLE_DEVICES=0 python3 "$script" --model $MODEL --out "$OUT/$name" \
    --sglang-python python3 --sglang-env "${SG_ENV[@]}" >"$OUT/$name.log" 2>&1
  echo "$name: exit $? in $((SECONDS - start)) s"
  grep -E '"outcome"|checks passed|healthy after' "$OUT/$name.log" | cut -c1-300
}

for part in "$@"; do
  case $part in
    prepare)
      python3 - "$MODEL" <<'PY'
import shutil, sys, torch
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
out = Path(sys.argv[1])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(".benchcfg"), dtype=torch.bfloat16)
shutil.rmtree(out, ignore_errors=True)
model.save_pretrained(out)
AutoTokenizer.from_pretrained(".benchcfg").save_pretrained(out)
print("prepare:", out, sorted(p.name for p in out.iterdir()))
PY
      ;;
    contract)
      need_sglang; need_model
      live_check contract scripts/h200/sglang_contract.py
      # SGLang's JIT kernels, for a faster first start next time (put it into .peer/3/)
      tar -C /tmp/sgjit -cJf "$OUT/sgjit.tar.xz" . 2>/dev/null && echo "JIT cache -> \$OUT/sgjit.tar.xz" ;;
    lora)
      need_sglang; need_model
      live_check lora scripts/h200/sglang_lora.py ;;
    sync-ipc)
      need_sglang; need_model
      run_config /tmp/sync.json -  # colocated (the default): trainer rank and engine on GPU 0
      miles_train sglang-sync-ipc /tmp/sync.json run.steps=2 data.source=arithmetic rollout.prompts_per_step=4 \
        rollout.samples_per_prompt=4 rollout.max_new_tokens=16 train.backend=fsdp fsdp.compile=false \
        weights.transport=shared_memory weights.check=true eval.every=0 ;;
    sync-lora)
      need_sglang; need_model
      run_config /tmp/sync.json -  # colocated: trainer rank and engine on GPU 0, sharing /tmp/runs
      miles_train sglang-sync-lora /tmp/sync.json run.steps=3 data.source=arithmetic rollout.prompts_per_step=4 \
        rollout.samples_per_prompt=4 rollout.max_new_tokens=16 train.backend=fsdp fsdp.compile=false \
        "train.lora={rank: 16, alpha: 32}" train.lr=1e-4 weights.transport=sglang_lora weights.check=true \
        eval.every=0 run.export_hf=false
      # SGLang's own record of the adapter calls, and the versions the samples were served by
      grep -hoE '(load|unload)_lora_adapter[^,]{0,80}|lora_name[^,]{0,40}' "$OUT"/sglang-sync-lora-logs/engine-*.log 2>/dev/null | sort | uniq -c | head
      grep -hoE '"weights/(version|sync_bytes|check_passed)": [0-9.e+]+' "$OUT/sglang-sync-lora.metrics.jsonl" | sort | uniq -c ;;
    sync-megatron)
      need_sglang; need_model
      run_config /tmp/sync.json -  # as sync-ipc, trained by the megatron backend
      miles_train sglang-sync-megatron /tmp/sync.json run.steps=2 data.source=arithmetic rollout.prompts_per_step=4 \
        rollout.samples_per_prompt=4 rollout.max_new_tokens=16 train.backend=megatron \
        weights.transport=shared_memory weights.check=true eval.every=0 ;;
    sync-broadcast)
      need_sglang; need_model
      [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ] || {
        echo "sync-broadcast: needs 2 GPUs (NCCL refuses two ranks on one): run on the nvidia-h200-x2 kind"; continue; }
      run_config /tmp/sync.json -
      miles_train sglang-sync-broadcast /tmp/sync.json run.steps=2 data.source=arithmetic \
        rollout.prompts_per_step=4 rollout.samples_per_prompt=4 rollout.max_new_tokens=16 train.backend=fsdp \
        fsdp.compile=false resources.colocate=false weights.transport=broadcast weights.check=true eval.every=0 ;;
    train)
      need_sglang; need_model
      run_config /tmp/learning-sglang.json scripts/learning/arithmetic_h200.yaml
      miles_train sglang-learning /tmp/learning-sglang.json run.steps=$STEPS eval.every=0 run.export_hf=false ;;
    episodes)
      # issue 26: the compacting agent (examples/compacting_agent) trained through SGLang and through
      # the embedded engine, 2 steps, tokens dumped; then the train/rollout log-prob gap per branch
      # kind on step 1 (scripts/h200/branch_logprobs.py). EP_MODEL: /tmp/smol (SmolLM2-135M-Instruct,
      # model.sh) by default, else the random weights of `prepare`.
      need_sglang
      EP_MODEL=${EP_MODEL:-/tmp/smol}
      [ -f $EP_MODEL/config.json ] || { echo "$EP_MODEL is missing: run model.sh (or EP_MODEL=$MODEL after prepare)"; exit 2; }
      EP_ARGS=(run.steps=2 run.dump_tokens=true eval.every=0 run.export_hf=false rollout.prompts_per_step=8
               rollout.samples_per_prompt=4 rollout.max_new_tokens=64 train.backend=fsdp fsdp.compile=false)
      tag=$(basename $EP_MODEL)
      run_config /tmp/compact-sglang.json examples/compacting_agent/config.yaml
      miles_train compact-sglang-$tag /tmp/compact-sglang.json "${EP_ARGS[@]}" model.name=$EP_MODEL
      miles_train compact-embedded-$tag examples/compacting_agent/config.yaml "${EP_ARGS[@]}" model.name=$EP_MODEL
      for engine in sglang embedded; do
        python3 scripts/h200/branch_logprobs.py /tmp/runs/compact-$engine-$tag --model $EP_MODEL \
          --out "$OUT/branches-$engine-$tag.json" | tail -40
      done
      grep -hoE '"rollout/(forks_[a-z]+|episode_rows_mean|retried_branches)": [0-9.]+' "$OUT"/compact-*-$tag.metrics.jsonl | sort | uniq -c
      # a call returns at most 8 files: the engines' and ranks' logs in one archive
      tar -C "$OUT" -czf "$OUT/episodes-logs-$tag.tgz" $(cd "$OUT" && ls -d compact-*-logs 2>/dev/null) && rm -rf "$OUT"/compact-*-logs ;;
    bench)
      need_sglang
      start=$SECONDS
      CUDA_VISIBLE_DEVICES=0 miles bench engine --model .benchcfg --random-weights --device cuda \
        --systems embedded sglang generate --concurrency 1 32 128 --repeats 3 \
        --sglang-python python3 --sglang-env "${SG_ENV[@]}" --out "$OUT/engine-sglang-h200.json" >"$OUT/bench.log" 2>&1
      echo "bench: exit $? in $((SECONDS - start)) s"
      grep -E 'tok/s' "$OUT/bench.log" | tail -12
      python3 -c "import json; r = json.load(open('$OUT/engine-sglang-h200.json')); print(json.dumps(r['ratios']))" ;;
    sessions)
      need_sglang
      start=$SECONDS
      CUDA_VISIBLE_DEVICES=0 timeout 580 miles bench engine --model .benchcfg --random-weights --device cuda \
        --sessions --turns 50 --user-tokens 80 --answer-tokens 80 --repeats 3 --systems sglang \
        --sglang-python python3 --sglang-env "${SG_ENV[@]}" --out "$OUT/prefix-cache-h200.json" >"$OUT/sessions.log" 2>&1
      echo "sessions: exit $? in $((SECONDS - start)) s"
      python3 -c "import json; r = json.load(open('$OUT/prefix-cache-h200.json')); print(json.dumps({k: r.get(k) for k in ('last_turn', 'sglang_last_turn')}, indent=1))" ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
