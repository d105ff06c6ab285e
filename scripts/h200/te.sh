#!/usr/bin/env bash
# Transformer Engine on the device machine, for the megatron backend (issue 14; written
# 2026-12-01, NOT YET RUN there: the first session that runs it should fix what breaks and say so
# in README.md G). Its core wheel (264 MiB) is over one call's 64 MiB carry, so it travels in
# parts like SGLang does; its PyTorch extension is source only and is built there, where nvcc,
# CMake, ninja, pybind11 and cuDNN are (../../../.library/device/KINDS.md).
#
# Here, once:  bash scripts/h200/prepare.sh te        # .te/1 ... .te/5 (wheel parts), .te/build
# Device, calls back to back (what /tmp holds is lost 30 s after a call ends):
#   carry [".te/1"]: bash scripts/h200/te.sh stage 1   (the same for 2 ... 5; seconds each)
#   carry [".whl", ".te/build"]: bash scripts/h200/setup.sh >/dev/null && bash scripts/h200/te.sh install
#     joins and checks the wheel, installs it and cuDNN frontend into /tmp/site, builds the
#     extension into /tmp/site (or unpacks a build carried in .te/build/te-torch.tar.xz), imports
#     transformer_engine.pytorch, and writes $OUT/te-torch.tar.xz: put it into .te/build/ to skip
#     the build next time. Then `megatron_bench.sh single` runs with Transformer Engine
#     (transformer_impl: auto takes it when it imports; the JSON says "transformer_engine": true).
set -euo pipefail
STAGE=/tmp/testage
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"

stage() {  # the parts carried in .te/N
  mkdir -p "$STAGE"
  cp ".te/$1"/core.part.* "$STAGE/"
  ls -l "$STAGE" | tail -n +2
}

install() {
  read -r want wheel < .te/build/core.sha256
  cat "$STAGE"/core.part.* > "$STAGE/$wheel"
  got=$(sha256sum "$STAGE/$wheel" | cut -d' ' -f1)
  [ "$want" = "$got" ] || { echo "wheel parts incomplete or corrupt: $(ls "$STAGE")"; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$STAGE/$wheel" \
    .te/build/nvidia_cudnn_frontend-*.whl
  source scripts/h200/env.sh
  if [ -f .te/build/te-torch.tar.xz ]; then
    tar -xJf .te/build/te-torch.tar.xz -C /tmp/site
  else
    rm -rf /tmp/tebuild && mkdir -p /tmp/tebuild
    tar -xzf .te/build/transformer_engine_torch-*.tar.gz -C /tmp/tebuild
    local start=$SECONDS
    # the extension compiles against the installed torch and the core library just installed
    (cd /tmp/tebuild/transformer_engine_torch-* && NVTE_FRAMEWORK=pytorch MAX_JOBS=$(nproc) \
      python3 -m pip install --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site .) \
      > "$OUT/te-build.log" 2>&1 || { tail -40 "$OUT/te-build.log"; return 1; }
    echo "extension built in $((SECONDS - start)) s"
    (cd /tmp/site && tar -cJf "$OUT/te-torch.tar.xz" transformer_engine_torch*)
  fi
  python3 -c "import transformer_engine, transformer_engine.pytorch as te; print('transformer engine', transformer_engine.__version__, te.Linear)"
}

case ${1:-} in
  stage) stage "${2:?which part: 1 ... 5}" ;;
  install) install ;;
  *) echo "usage: te.sh stage N | te.sh install"; exit 2 ;;
esac
