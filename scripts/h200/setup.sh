#!/usr/bin/env bash
# First device call (carry .whl .trl .tokonly): third-party + workspace wheels into /tmp/site,
# the tokenizer-only model home into /tmp/mh. See README.md in this folder.
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .trl/*.whl >/tmp/site.log 2>&1 || { tail -20 /tmp/site.log; exit 1; }
rm -rf /tmp/mh && cp -r .tokonly /tmp/mh
source scripts/h200/env.sh
python3 -c "import torch, transformers, miles, miles_fsdp; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
