#!/usr/bin/env bash
# GPU check, one call on a bare CUDA machine: set up what hyflow needs on top of the machine's CUDA torch, run
# the GPU-marked tests (FSDP2/NCCL pools, the native engine on CUDA, SGLang with CUDA and the recipes on it) and
# the GPU benchmarks (native decode tokens/s against the HBM bandwidth bound, training MFU on a Qwen2.5-0.5B-shaped
# random-init Qwen2, the quickstart on SGLang vs native, resharding over NCCL when there are >= 4 GPUs), and write
# everything under $OUT (default outputs/gpu_check): summary.json (each step's command, exit code, seconds,
# skip reason), gpu_check.log, pytest_gpu.xml and the benchmarks' JSON. CI never runs it.
#
#   bash benchmarks/gpu_check.sh                      # on the GPU machine
#   bash benchmarks/gpu_check.sh --download DIR       # on a machine with PyPI: fill a wheelhouse for an offline one
#   WHEELS=DIR bash benchmarks/gpu_check.sh           # offline: install only from that wheelhouse
# (--download measured: 81 MB for CPython 3.12, of which ray's wheel is 79 MB, without SGLANG_SPEC.)
#
# Setup installs into the machine's own python3 environment (a GPU machine lent for a check is thrown away after)
# only what it lacks (ray, omegaconf, ...; none of them depends on torch, so the machine's CUDA torch stays).
# A venv is not used: an image whose python3 is itself a venv would hide its torch from a nested one. SGLang with
# CUDA is installed only when SGLANG_SPEC is set (e.g. SGLANG_SPEC="sglang==0.5.20"): SGLang pins its own torch
# (0.5.19-0.5.21: torch 2.13.0), which then replaces the machine's. Without it the SGLang tests skip with their
# reason and the summary says so.
# Status: written against the repository's benchmarks and pytest markers; not yet run on a GPU (none was lent to
# the task that wrote it).
set -uo pipefail
cd "$(dirname "$0")/.."
PKGS=("ray==2.60.0" "omegaconf>=2.3" "pytest-timeout>=2.3")

if [ "${1:-}" = "--download" ]; then
  dir=${2:?usage: gpu_check.sh --download DIR}
  # CPython 3.12, manylinux x86_64: the GPU image's python3; add SGLANG_SPEC to fetch SGLang's CUDA wheels too
  bin=(python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$dir")
  "${bin[@]}" "ray==2.60.0" "pytest-timeout>=2.3" ${SGLANG_SPEC:-} || exit 1
  # omegaconf's parser runtime exists only as an sdist (pure Python; built offline with the image's setuptools)
  "${bin[@]}" --no-deps "omegaconf==2.3.0" || exit 1
  exec python3 -m pip download --no-deps --no-binary=:all: -d "$dir" "antlr4-python3-runtime==4.9.3"
fi

OUT=${OUT:-outputs/gpu_check}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: >"$LOG"
STEPS="$OUT/.steps.jsonl"
: >"$STEPS"

# step NAME SKIP_REASON CMD...: run CMD (or record why it was skipped), log its output, note rc and seconds
step() {
  local name=$1 skip=$2
  shift 2
  if [ -n "$skip" ]; then
    echo "== $name: skipped ($skip)" | tee -a "$LOG"
    python3 -c 'import json,sys; print(json.dumps({"step": sys.argv[1], "skipped": sys.argv[2]}))' \
      "$name" "$skip" >>"$STEPS"
    return
  fi
  echo "== $name: $*" | tee -a "$LOG"
  local t0=$SECONDS
  "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
  python3 -c 'import json,sys; print(json.dumps({"step": sys.argv[1], "cmd": sys.argv[4:], "rc": int(sys.argv[2]), "seconds": int(sys.argv[3])}))' \
    "$name" "$rc" "$((SECONDS - t0))" "$@" >>"$STEPS"
}

nvidia-smi >>"$LOG" 2>&1 || { echo "no nvidia-smi: this script is for a CUDA machine" | tee -a "$LOG"; exit 1; }

# setup: what the machine's python3 lacks (its CUDA torch stays)
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install -q --no-cache-dir)
[ -n "${WHEELS:-}" ] && PIP+=(--no-index --find-links "$WHEELS" --no-build-isolation)
step install-hyflow-deps "" "${PIP[@]}" "${PKGS[@]}"
[ -n "${SGLANG_SPEC:-}" ] && step install-sglang "" "${PIP[@]}" "$SGLANG_SPEC"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
"$PY" -c 'import sglang' >/dev/null 2>&1 && NO_SGLANG="" || NO_SGLANG="sglang not importable (set SGLANG_SPEC)"

# tests: every GPU- or SGLang-marked test (on CUDA the SGLang tests use device="cuda")
step pytest-gpu "" "$PY" -m pytest -q -m "gpu or sglang" tests -p no:cacheprovider --junitxml="$OUT/pytest_gpu.xml"

# benchmarks
step bench-rollout "" "$PY" -m benchmarks.bench_rollout --device cuda --out "$OUT/bench_rollout.json"
step bench-train "" "$PY" -m benchmarks.bench_train
cp outputs/bench_train.json "$OUT/" 2>/dev/null
step bench-sglang-vs-native "$NO_SGLANG" "$PY" -m benchmarks.bench_sglang_vs_native \
  trainer.total_training_steps=20 trainer.progress_bar=false
cp outputs/bench_sglang_vs_native.json "$OUT/" 2>/dev/null
[ "$NGPU" -ge 4 ] && NO_NCCL="" || NO_NCCL="$NGPU GPU(s): bench_reshard's smallest layout needs 4"
step bench-reshard-nccl "$NO_NCCL" "$PY" -m benchmarks.bench_reshard --world 4 --dtype bfloat16

"$PY" - "$STEPS" "$OUT/summary.json" <<'EOF'
import json, sys, torch
steps = [json.loads(line) for line in open(sys.argv[1])]
info = {"torch": torch.__version__, "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
json.dump({"machine": info, "steps": steps}, open(sys.argv[2], "w"), indent=2)
failed = [s["step"] for s in steps if s.get("rc")]
print(f"summary: {sys.argv[2]}; failed steps: {failed or 'none'}")
EOF
rm -f "$STEPS"
