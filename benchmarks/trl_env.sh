#!/usr/bin/env bash
# Creates the TRL baseline environment for benchmarks/bench_vs_trl.py in its own virtualenv
# (default .venv-trl at the repository root). TRL is a baseline to measure against, never a
# dependency of hyflow: nothing in hyflow's .venv imports it.
#   bash benchmarks/trl_env.sh [VENV_DIR]
# Idempotent: a finished environment (stamp file present) is left as it is.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-trl}"
PY="${PY:-$(command -v python3.11 || command -v python3)}"
STAMP="$VENV/.trl-installed"
[ -f "$STAMP" ] && exit 0
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# torch first, pinned to the local CPU wheel, so nothing pulls a multi-GB CUDA build; then TRL and
# the versions pip resolved for it when this benchmark was written (pinned so runs stay comparable).
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q trl==1.16.0 transformers==5.24.0 accelerate==1.15.0 datasets==5.2.0 tokenizers==0.23.3
touch "$STAMP"
