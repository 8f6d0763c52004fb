#!/usr/bin/env bash
# `make sglang-cpu`: a CPU SGLang engine in the project's .venv, for tests and CI on machines without a GPU.
#   sglang==0.5.20 (the last release pinned to torch 2.13.0, as is .venv) with --no-deps, then its
#   pure-Python requirements (cpu_requirements.txt) under a constraint that keeps torch, transformers and
#   tokenizers at the versions .venv already has. Idempotent: a stamp in .venv records what was installed;
#   pip's own cache (~/.cache/pip) makes a repeat install fast. sgl_kernel and torchvision have no CPU
#   build on the registries: cpu_shim/ stands in for them at run time (see cpu_shim/hyflow_cpu_shim.py).
# On a GPU machine install the real thing instead: pip install "sglang==0.5.20" (pulls CUDA torch).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here/../../.."
PY="${PY:-.venv/bin/python}"
SGLANG_VERSION=0.5.20
stamp=.venv/.sglang-cpu
want="sglang==$SGLANG_VERSION $(sha256sum "$here/cpu_requirements.txt" | cut -c1-16)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
  && "$PY" -c "import importlib.metadata as m; assert m.version('sglang') == '$SGLANG_VERSION'" 2>/dev/null; then
  echo "sglang-cpu: up to date ($want)"
  exit 0
fi

constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
"$PY" -m pip list --format=freeze 2>/dev/null | grep -iE '^(torch|transformers|tokenizers)==' >"$constraints"
grep -qi '^torch==' "$constraints" || { echo "sglang-cpu: no torch in $PY's environment; run make first" >&2; exit 1; }

"$PY" -m pip install -q --no-deps "sglang==$SGLANG_VERSION"
"$PY" -m pip install -q -c "$constraints" -r "$here/cpu_requirements.txt"
echo "$want" >"$stamp"
echo "sglang-cpu: installed $want (held: $(tr '\n' ' ' <"$constraints"))"
