#!/usr/bin/env bash
# Peak GPU memory and step time with and without resources.release_engine_memory, on one H200
# (docs/benchmarks/engine-memory.md), after setup.sh and `sglang_parts.sh prepare` (random weights
# of SmolLM2-135M's shape in /tmp/sgmodel; MODEL=/tmp/smol after model.sh for the real model):
#   bash scripts/h200/memory_bench.sh                       # none, kv_cache, all; 3 repeats of 10 steps
#   bash scripts/h200/memory_bench.sh --settings none all --repeats 5 -- rollout.prompts_per_step=64
# What it measures and how: scripts/h200/memory_bench.py. Exit 3: runs are left for another call
# (the same command again, on the warm machine, continues); the JSON is $OUT/memory-h200.json.
set -u
source scripts/h200/env.sh
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader
python3 -c "import pynvml" 2>/dev/null && echo "sampling with pynvml" || echo "sampling with nvidia-smi (no pynvml)"
exec python3 scripts/h200/memory_bench.py "$@"
