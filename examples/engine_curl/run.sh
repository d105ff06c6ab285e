#!/usr/bin/env bash
# Every endpoint of the embedded engine, once, against a running server:
#   export MILES_AUTH_TOKEN=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')
#   miles serve engine --model smollm2-135m-instruct --port 30000 &   then   bash examples/engine_curl/run.sh
set -euo pipefail
ENGINE=${ENGINE:-http://127.0.0.1:30000}
: "${MILES_AUTH_TOKEN:?set MILES_AUTH_TOKEN to the token the engine was started with}"
# every route but /health needs the token; bodies are JSON
call() { echo "== $1 $2"; shift 2; curl -sS -H "Authorization: Bearer $MILES_AUTH_TOKEN" -H 'Content-Type: application/json' "$@"; echo; }

call GET /health "$ENGINE/health"
call GET /model_info "$ENGINE/model_info"
call POST /generate "$ENGINE/generate" -d '{"text": "The capital of France is", "return_logprob": true,
  "sampling_params": {"max_new_tokens": 16, "temperature": 0}}'
call POST /generate "$ENGINE/generate" -d '{"input_ids": [1, 504, 3458, 282], "rid": "demo-1",
  "sampling_params": {"max_new_tokens": 32, "temperature": 0.8, "top_p": 0.95, "sampling_seed": 7, "stop": ["\n\n"]}}'
call POST "/generate (bad: typo)" "$ENGINE/generate" -d '{"text": "hi", "sampling_params": {"temprature": 0.5}}'
call POST "/generate (bad: prompt too long)" "$ENGINE/generate" -d "{\"input_ids\": [$(seq -s, 1 9000)]}"

# A long request, aborted while it runs.
curl -sS -H "Authorization: Bearer $MILES_AUTH_TOKEN" -H 'Content-Type: application/json' "$ENGINE/generate" -d '{"text": "Count to a thousand:", "rid": "long-1",
  "sampling_params": {"max_new_tokens": 4000, "ignore_eos": true}}' > /tmp/miles-engine-long.json &
sleep 1
call POST /abort_request "$ENGINE/abort_request" -d '{"rid": "long-1"}'
wait
echo "== the aborted request answered:"; head -c 300 /tmp/miles-engine-long.json; echo

call POST /pause_generation "$ENGINE/pause_generation" -d '{"mode": "in_place"}'
call POST /continue_generation "$ENGINE/continue_generation" -X POST
call POST /flush_cache "$ENGINE/flush_cache" -X POST
call POST /update_weight_version "$ENGINE/update_weight_version" -d '{"new_version": "7"}'
call GET /health_generate "$ENGINE/health_generate"
call GET /server_info "$ENGINE/server_info"
call POST "/weights_checker (snapshot)" "$ENGINE/weights_checker" -d '{"action": "snapshot"}'
call GET "/weights_checksum (first 200 chars)" "$ENGINE/weights_checksum" -o /tmp/miles-engine-sums.json
head -c 200 /tmp/miles-engine-sums.json; echo
