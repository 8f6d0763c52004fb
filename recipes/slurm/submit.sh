#!/usr/bin/env bash
# Submit a hyflow recipe to a RUNNING Ray cluster with `ray job submit`, stream its logs, exit with its status
# (0 succeeded, 1 failed). Works against any Ray cluster whose dashboard (job server) you can reach;
# recipes/slurm/hyflow.sbatch calls it once it has started one.
#
#   HYFLOW_DASHBOARD=http://HEAD:8265 recipes/slurm/submit.sh grpo \
#       model.path=/shared/models/qwen trainer.nnodes=2 trainer.n_gpus_per_node=8 \
#       trainer.default_local_dir=/shared/runs/grpo1
#
# Variables (all optional):
#   HYFLOW_DASHBOARD      dashboard address of the cluster (default: $RAY_API_SERVER_ADDRESS, else
#                         http://127.0.0.1:8265)
#   HYFLOW_REPO           repository root (default: the one holding this script)
#   HYFLOW_CODE           upload (default): zip the repo and ship it as the job's working_dir (no shared file
#                         system needed); shared: the repo sits at HYFLOW_REPO on every node, nothing is uploaded
#   HYFLOW_JOB_ENV        space-separated KEY=VALUE env vars for the job (driver and every worker), e.g.
#                         "NCCL_DEBUG=WARN OMP_NUM_THREADS=8"
#   HYFLOW_SUBMISSION_ID  the job's id (default: Ray picks one); `ray job logs|status|stop ID` use it
#   HYFLOW_PYTHON         python for the small helper run here (default: python3)
#   HYFLOW_JOB_PYTHON     python that runs the recipe on the head node (default: python)
#   RAY_AUTH_MODE, RAY_AUTH_TOKEN   the cluster's token when it uses token authentication (Ray >= 2.5x)
# Paths in the overrides (model.path, data.*_files, trainer.default_local_dir) must exist on the nodes: with
# HYFLOW_CODE=upload the job runs in a per-node copy of the repo, so give absolute paths on shared storage.
set -euo pipefail

recipe=${1:?usage: submit.sh RECIPE [key.sub=value ...]   (RECIPE: grpo, ppo, quickstart, rlm)}
shift
repo=${HYFLOW_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
dashboard=${HYFLOW_DASHBOARD:-${RAY_API_SERVER_ADDRESS:-http://127.0.0.1:8265}}
mode=${HYFLOW_CODE:-upload}
py=${HYFLOW_PYTHON:-python3}
job_py=${HYFLOW_JOB_PYTHON:-python}

if [ ! -f "$repo/recipes/$recipe.py" ]; then
  echo "submit.sh: no recipe '$recipe' ($repo/recipes/$recipe.py does not exist)" >&2
  exit 2
fi

env_args=()
for kv in ${HYFLOW_JOB_ENV:-}; do env_args+=(--env "$kv"); done
runtime_env=$(PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$py" -m recipes.launch runtime-env \
  --mode "$mode" --repo "$repo" ${env_args[@]+"${env_args[@]}"})

submit=(ray job submit --address "$dashboard" --runtime-env-json "$runtime_env")
if [ -n "${HYFLOW_SUBMISSION_ID:-}" ]; then submit+=(--submission-id "$HYFLOW_SUBMISSION_ID"); fi

if [ "$mode" = shared ]; then
  # no working_dir: start in the shared repo so relative paths (runs/...) resolve as they do locally
  entry=(bash -c 'cd "$0" && exec "$1" -m "recipes.$2" "${@:3}"' "$repo" "$job_py" "$recipe" "$@")
else
  entry=("$job_py" -m "recipes.$recipe" "$@")
fi

echo "submit.sh: ray job submit to $dashboard (code: $mode) -- recipes.$recipe $*"
# `ray job submit` waits for the job, tails its logs and exits 1 if it failed.
exec "${submit[@]}" -- "${entry[@]}"
