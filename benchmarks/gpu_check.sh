#!/usr/bin/env bash
# The GPU check: one run on a lent CUDA machine (no package registry there) that installs what its image lacks
# from a carried wheelhouse and runs benchmarks/gpu_check.py (its steps and their order are described there).
#
#   bash benchmarks/gpu_check.sh --wheelhouse   # here, with PyPI: fill .gpu_wheels/ (ignored by git, 24 MB)
#   bash benchmarks/gpu_check.sh --rehearse     # here: the GPU image's Python and versions on the CPU, installed
#                                               # offline from .gpu_wheels/ as the GPU run does, then the check's
#                                               # steps at CPU sizes and the core tests
#   bash benchmarks/gpu_check.sh                # on the GPU machine (carry .gpu_wheels); results under $OUT
#
# The GPU image (see the device library's KINDS.md): Python 3.12 with torch 2.11.0+cu130, transformers 5.17.0,
# tokenizers 0.23.2, numpy 2.5, safetensors, pyarrow, pandas, peft, accelerate, pytest, pytest-timeout, pytest-xdist,
# aiohttp, grpcio, xxhash, ...; no Ray, OmegaConf or megatron-core. A run carries at most 64 MiB: Ray's wheel
# (79 MB) travels as ray-slim.tar.xz (21 MB at xz -9: its Java jars, RLlib, Serve, Tune, Train and LLM packages
# dropped, which hyflow never imports, and the native binaries stripped of their symbol tables), unpacked
# straight into a site folder; the rest are ordinary wheels installed --no-deps --no-index into the same folder.
# SGLang is not carried: its CUDA kernels are hundreds of MB.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu_wheels
RAY=ray==2.60.0
# a Python 3.12 that runs (pyenv's shim exists even where 3.12 is not the selected version)
PY312=${PY312:-$(for p in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
  "$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { command -v "$p"; break; }; done)}
# the image's versions (KINDS.md's pip list); torch: the same release (PyPI's build, which runs on the CPU)
IMAGE_PKGS=(torch==2.11.0 transformers==5.17.0 tokenizers==0.23.2 numpy==2.5.2 safetensors==0.8.0
  accelerate==1.15.0 peft pyarrow pandas pytest pytest-timeout pytest-xdist xxhash tensorboard matplotlib rich tqdm pyyaml
  click filelock msgpack protobuf requests packaging aiohttp grpcio attrs typing-extensions psutil)
REHEARSE_VENV=${REHEARSE_VENV:-$HOME/.cache/hyflow/gpu-rehearse-py312}

fetch() {  # fetch PKG...: CPython 3.12 manylinux x86_64 wheels, no dependencies (each need is named)
  "$PY312" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$WHEELS" "$@"
}

build_wheelhouse() {
  rm -rf "$WHEELS" && mkdir -p "$WHEELS" || return 1
  # Ray's own needs that the image lacks (jsonschema's chain), OmegaConf, megatron-core for the Megatron step
  fetch jsonschema jsonschema-specifications referencing rpds-py omegaconf==2.3.0 megatron-core==0.16.0 || return 1
  # antlr4's runtime (OmegaConf's parser) is only an sdist on PyPI: built here into a pure-Python wheel
  "$PY312" -m pip wheel -q --no-deps -w "$WHEELS" antlr4-python3-runtime==4.9.3 || return 1
  local tmp
  tmp=$(mktemp -d)
  (cd "$tmp" && "$PY312" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 "$RAY" && mkdir site && cd site && unzip -q ../ray-*.whl \
    && rm -rf ray/jars ray/rllib ray/serve ray/tune ray/train ray/llm \
    && strip ray/_raylet.so ray/core/src/ray/gcs/gcs_server ray/core/src/ray/raylet/raylet) || return 1
  XZ_OPT=-9 tar -C "$tmp/site" -cJf "$WHEELS/ray-slim.tar.xz" . || return 1
  rm -rf "$tmp"
  du -sh "$WHEELS"/* && du -sh "$WHEELS"
}

install_wheelhouse() {  # install_wheelhouse PYTHON SITE: what the image lacks, offline, into SITE
  local py=$1 site=$2
  [ -f "$WHEELS/ray-slim.tar.xz" ] || { echo "no $WHEELS/ray-slim.tar.xz: run bash benchmarks/gpu_check.sh --wheelhouse here first (and carry $WHEELS)"; return 1; }
  rm -rf "$site" && mkdir -p "$site" || return 1
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$WHEELS"/*.whl || return 1
  tar -C "$site" -xJf "$WHEELS/ray-slim.tar.xz" || return 1
  PYTHONPATH="$site:$PWD" "$py" -c 'import ray, omegaconf, megatron.core, recipes.grpo, workers.roles, benchmarks.gpu_check; print("imports ok: ray", ray.__version__)'
}

case "${1:-}" in
  --wheelhouse)
    build_wheelhouse
    exit $?
    ;;
  --rehearse)
    [ -d "$WHEELS" ] || build_wheelhouse || exit 1
    OUT=${OUT:-outputs/gpu_check_rehearsal}
    mkdir -p "$OUT"
    [ -x "$REHEARSE_VENV/bin/python" ] || "$PY312" -m venv "$REHEARSE_VENV" || exit 1
    "$REHEARSE_VENV/bin/pip" install -q "${IMAGE_PKGS[@]}" || exit 1  # seconds once they are there
    PY="$REHEARSE_VENV/bin/python"
    SITE=$(mktemp -d)/site
    install_wheelhouse "$PY" "$SITE" 2>&1 | tee "$OUT/setup.log" || exit 1
    export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
    "$PY" -m benchmarks.gpu_check --cpu --out "$OUT" --deadline-s "${DEADLINE_S:-900}"
    rc=$?
    # the core tests under the image's versions: engine, native rollout, weight sync, recipe configs
    "$PY" -m pytest -q -p no:cacheprovider -x tests/workers/engine/test_fsdp_engine.py \
      tests/workers/engine/test_packed_kernels.py tests/workers/rollout/test_native_interfaces.py tests/workers/rollout/test_native_graphs.py \
      tests/workers/weight_sync tests/recipes/test_config.py \
      2>&1 | tee "$OUT/pytest_core.log" | tail -5
    exit $(( rc || ${PIPESTATUS[0]} ))
    ;;
  "" | --run) ;;
  *)
    echo "usage: bash benchmarks/gpu_check.sh [--wheelhouse | --rehearse]" >&2
    exit 2
    ;;
esac

# On the GPU machine: set up from the carried wheelhouse, then the check; everything lands under $OUT.
OUT=${OUT:-outputs/gpu_check}
mkdir -p "$OUT"
nvidia-smi >"$OUT/setup.log" 2>&1 || { echo "no nvidia-smi: this is for a CUDA machine" | tee -a "$OUT/setup.log"; exit 1; }
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/hyflow-site}
t0=$SECONDS
install_wheelhouse "$PY" "$SITE" >>"$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
echo "setup: $((SECONDS - t0)) s" | tee -a "$OUT/setup.log"
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
exec "$PY" -m benchmarks.gpu_check --out "$OUT" --deadline-s "${DEADLINE_S:-480}" ${ONLY:+--only "$ONLY"}
