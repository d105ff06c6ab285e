#!/usr/bin/env bash
# First device call (carry .whl, plus .trl for the learning test and .tokonly for tiny_model()):
# third-party + workspace wheels into /tmp/site, the tokenizer-only model home into /tmp/mh.
# See README.md in this folder.
set -e
shopt -s nullglob
wheels=(.whl/*.whl .trl/*.whl)
[ ${#wheels[@]} -gt 0 ] || { echo "no wheels here: carry .whl (bash scripts/h200/prepare.sh whl)"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}" >/tmp/site.log 2>&1 || { tail -20 /tmp/site.log; exit 1; }
if [ -d .tokonly/models ]; then
  rm -rf /tmp/mh && cp -r .tokonly /tmp/mh
else
  echo "no .tokonly carried: tiny_model() (the GPU tests) cannot get its tokenizer offline"
fi
source scripts/h200/env.sh
python3 -c "import torch, transformers, miles, miles_fsdp; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
