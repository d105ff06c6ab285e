#!/usr/bin/env bash
# Transformer Engine on the device machine, for the megatron backend (issue 14; first run there
# 2026-12-01: the extension built in 102 s, megatron's TE layers trained at once; numbers in
# docs/benchmarks/train.md). Its core wheel (264 MiB) is over one call's 64 MiB carry, so it
# travels in parts like SGLang does; its PyTorch extension is source only (C++, no nvcc needed)
# and is built there against the device's torch (../../../.library/device/KINDS.md).
#
# Here, once:  bash scripts/h200/prepare.sh te        # .te/1 ... .te/5 (wheel parts), .te/build
# Device, calls back to back (what /tmp holds is lost 30 s after a call ends):
#   carry [".te/1"]: bash scripts/h200/te.sh stage 1   (the same for 2 ... 5; seconds each)
#   carry [".whl", ".tokonly", ".te/build"]:
#     bash scripts/h200/setup.sh >/dev/null && bash scripts/h200/te.sh install && bash scripts/h200/megatron_bench.sh ...
#     install joins and checks the wheel, installs it and cuDNN frontend into /tmp/site, places the
#     metapackage's dist-info, builds the extension (or unpacks the build carried in
#     .te/build/te-torch.tar.xz: 1.2 MB, for torch 2.11+cu130 / Python 3.12) into the core wheel's
#     wheel_lib, imports transformer_engine.pytorch, and writes a fresh build to $OUT/te-torch.tar.xz
#     (put it into .te/build/ to skip the build next time). megatron's transformer_impl: auto then
#     takes Transformer Engine (the bench JSON says "transformer_engine": true).
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
  if [ ! -d /tmp/site/transformer_engine/wheel_lib ]; then
    cat "$STAGE"/core.part.* > "$STAGE/$wheel"
    got=$(sha256sum "$STAGE/$wheel" | cut -d' ' -f1)
    [ "$want" = "$got" ] || { echo "wheel parts incomplete or corrupt: $(ls "$STAGE")"; return 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$STAGE/$wheel" \
      .te/build/nvidia_cudnn_frontend-*.whl
  fi
  # TE's import checks that the transformer-engine metapackage is installed at the core's version:
  # its Python files are the core wheel's, so only its dist-info is placed
  python3 - .te/build/transformer_engine-*-py3-none-any.whl <<'PY'
import sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
wheel.extractall("/tmp/site", [n for n in wheel.namelist() if ".dist-info/" in n])
PY
  source scripts/h200/env.sh
  local lib=/tmp/site/transformer_engine/wheel_lib
  if ls "$lib"/transformer_engine_torch*.so >/dev/null 2>&1; then
    echo "extension already in place"
  elif [ -f .te/build/te-torch.tar.xz ]; then
    tar -xJf .te/build/te-torch.tar.xz -C "$lib"
  else
    build "$lib" || return 1
  fi
  python3 -c "import transformer_engine, transformer_engine.pytorch as te; print('transformer engine', transformer_engine.__version__, te.Linear)"
}

# The torch extension is C++ only (a CppExtension: no nvcc), compiled against this machine's torch.
# Built in place with ninja under /tmp/tebuild, so a build cut short by TE_BUILD_S resumes where it
# stopped when `install` runs again within 30 s (the machine still warm). Only the .so is placed,
# in the core wheel's wheel_lib, where TE's loader looks: a transformer_engine_torch dist-info
# would only add one more version check.
build() {
  local lib=$1 src
  [ -d /tmp/tebuild ] || { mkdir -p /tmp/tebuild && tar -xzf .te/build/transformer_engine_torch-*.tar.gz -C /tmp/tebuild; }
  src=$(ls -d /tmp/tebuild/transformer_engine_torch-*)
  # cudnn.h, nccl.h, cublasLt.h: from the CUDA toolkit or the nvidia-* wheels, wherever they are
  CPATH=$(python3 -c "import glob, nvidia; print(':'.join(d for r in nvidia.__path__ for d in glob.glob(r + '/*/include') + glob.glob(r + '/*/*/include')))")
  export CPATH NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS=90 MAX_JOBS=$(nproc)
  local start=$SECONDS rc=0
  (cd "$src" && timeout "${TE_BUILD_S:-480}" python3 setup.py build_ext --inplace) > "$OUT/te-build.log" 2>&1 || rc=$?
  echo "build: exit $rc after $((SECONDS - start)) s"
  if [ $rc -ne 0 ]; then
    grep -m5 -iE "error|fatal" "$OUT/te-build.log"; tail -15 "$OUT/te-build.log"
    [ $rc -eq 124 ] && echo "cut short: run te.sh install again within 30 s to resume"
    return 1
  fi
  cp "$src"/transformer_engine_torch*.so "$lib/"
  (cd "$lib" && tar -cJf "$OUT/te-torch.tar.xz" transformer_engine_torch*.so && ls -l "$OUT/te-torch.tar.xz")
}

case ${1:-} in
  stage) stage "${2:?which part: 1 ... 5}" ;;
  install) install ;;
  *) echo "usage: te.sh stage N | te.sh install"; exit 2 ;;
esac
