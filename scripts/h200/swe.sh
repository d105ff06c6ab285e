#!/usr/bin/env bash
# The SWE example on the H200 (docs/benchmarks/swe_agent.md), after setup.sh and model.sh (the real
# SmolLM2 at /tmp/smol), in the call that carries .swe (built by `prepare.sh whl`: mini-swe-agent, litellm
# and what they need that .whl lacks, plus Debian's bubblewrap .deb: the device has neither apt nor bwrap).
#   bash scripts/h200/swe.sh probe     # unpack bwrap, check it can make its namespaces here
#   bash scripts/h200/swe.sh train     # examples/swe_agent/config_h200.yaml under `timeout $SWE_TIMEOUT` (520 s:
#                                      # 19 of its 20 steps fit; SWE_OVERRIDES=run.steps=18 to end cleanly)
set -u
source scripts/h200/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ ! -x /tmp/bw/usr/bin/bwrap ]; then
  deb=$(ls .swe/bubblewrap_*.deb 2>/dev/null | head -1)
  [ -n "$deb" ] || { echo "no bubblewrap .deb carried (.swe)"; exit 1; }
  dpkg-deb -x "$deb" /tmp/bw || exit 1
fi
export PATH=/tmp/bw/usr/bin:$PATH
# a folder of their own: pip --target --upgrade replaces a target's bin/ (miles' entry point) wholesale
export PYTHONPATH=$PYTHONPATH:/tmp/swe-site
if ls .swe/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/swe-site .swe/*.whl \
    >/tmp/swe-site.log 2>&1 || { tail -20 /tmp/swe-site.log; exit 1; }
fi
for part in "$@"; do
  case $part in
    probe)
      bwrap --unshare-all --unshare-user --die-with-parent --ro-bind /usr /usr --symlink usr/bin /bin \
        --symlink usr/lib /lib --symlink usr/lib64 /lib64 --proc /proc --dev /dev --tmpfs /tmp \
        -- /usr/bin/python3 -c "import os, socket; print('in bwrap: uid', os.getuid(), 'net', socket.if_nameindex())"
      echo "bwrap probe: exit $?"
      python3 -c "import minisweagent, litellm; print('mini-swe-agent', minisweagent.__version__)" 2>&1 | tail -1 ;;
    train)
      start=$SECONDS
      timeout ${SWE_TIMEOUT:-520} miles train examples/swe_agent/config_h200.yaml model.name=/tmp/smol \
        run.output_dir=/tmp/runs ${SWE_OVERRIDES:-} >"$OUT/swe-h200.log" 2>&1
      echo "swe train: exit $? in $((SECONDS - start)) s"
      cp /tmp/runs/swe_agent_h200/metrics.jsonl "$OUT/swe-h200.metrics.jsonl" 2>/dev/null
      python3 - "$OUT/swe-h200.metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])] if len(sys.argv) > 1 else []
for row in rows:  # the step, its reward and tool-call counts, its time
    print({k: v for k, v in row.items() if k == "step" or any(w in k for w in ("reward", "tool_calls", "step_time"))})
PY
      tail -5 "$OUT/swe-h200.log" ;;
  esac
done
