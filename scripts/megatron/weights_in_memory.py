"""Peak host memory of building the megatron backend (one rank, CPU): weights streamed in by layer
against the whole checkpoint converted in one call (what the backend did before, and still does
for a bridge whose ``to_megatron`` has no ``partial``). Each measurement is a fresh process (peak
RSS is per process); prints JSON with the medians, spreads and their ratio.

    uv run python scripts/megatron/weights_in_memory.py [--model smollm2-135m-instruct] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = """
import json, resource, sys, time
import torch
torch.set_num_threads(1)
from miles.context import context_for
from miles_contracts import Process
from miles_megatron import loading
from miles_megatron.backend import MegatronBackend
from miles_megatron.testing import config_for
model, mode = sys.argv[1], sys.argv[2]
if mode == "whole":
    loading.takes_partial = lambda method: False
path = context_for().kernel.resolve_model(model)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
start = time.perf_counter()
backend = MegatronBackend(context_for(config_for(path), Process.trainer_rank(0)))
print(json.dumps({"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "imports_gb": before,
                  "seconds": time.perf_counter() - start}))
"""


def measure(model: str, mode: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, model, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"streamed": [], "whole": []}
    for mode in runs:  # warm-up: the page cache holds the checkpoint for every measured run
        measure(args.model, mode)
    for _ in range(args.repeats):
        for mode in runs:
            runs[mode].append(measure(args.model, mode))
    summary = {}
    for mode, rows in runs.items():
        peaks = [r["peak_rss_gb"] for r in rows]
        summary[mode] = {"peak_rss_gb_median": statistics.median(peaks), "peak_rss_gb_spread": max(peaks) - min(peaks),
                         "seconds_median": statistics.median(r["seconds"] for r in rows), "runs": rows}
    print(json.dumps({"model": args.model, "repeats": args.repeats, **summary,
                      "peak_ratio_streamed_over_whole": summary["streamed"]["peak_rss_gb_median"]
                      / summary["whole"]["peak_rss_gb_median"]}, indent=2))


if __name__ == "__main__":
    main()
