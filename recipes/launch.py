"""Helpers for launching recipes on a running Ray cluster (used by ``recipes/slurm/*.sh``).

    python -m recipes.launch runtime-env --mode upload --repo .            # JSON for ray job submit
    python -m recipes.launch wait-nodes --address http://HEAD:8265 --nodes 4 --gpus-per-node 8 --timeout 300

``runtime-env`` builds the job's runtime environment:

* ``upload`` (works against any cluster): the repository is zipped and shipped as the job's ``working_dir``
  (files ignored by .gitignore are skipped, and so are run outputs); every worker process gets it on its
  ``sys.path``. Outputs must go to an absolute ``trainer.default_local_dir`` on storage the nodes share,
  since the working dir is a per-node copy under Ray's temp dir.
* ``shared``: the repository already sits at the same path on every node (a shared file system, as on most
  Slurm clusters): nothing is uploaded, ``PYTHONPATH`` points at it and the entry point starts there.

``wait-nodes`` polls the cluster's dashboard until ``--nodes`` nodes are alive (and, with
``--gpus-per-node``, each of them has that many GPUs), then prints them; on timeout it exits 1 saying what
is missing. The Ray token (``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN``) is read from the environment.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

# Never shipped in the working dir: run outputs and local environments (Ray also honours .gitignore).
UPLOAD_EXCLUDES = ["runs/", "outputs/", ".venv/", ".git/", "*.pt", "*.safetensors"]


def runtime_env(mode: str, repo: str, env: dict[str, str] | None = None) -> dict:
    """The runtime env of a recipe job (``mode`` upload | shared, see the module doc)."""
    env = dict(
        env or {}
    )  # may repeat what the recipe's ray.init sets: the job's value wins (run.job_env_vars)
    if mode == "upload":
        return {"working_dir": repo, "excludes": list(UPLOAD_EXCLUDES), "env_vars": env}
    if mode == "shared":
        return {"env_vars": {"PYTHONPATH": repo, **env}}
    raise ValueError(f"runtime env mode must be upload or shared, got {mode!r}")


def alive_nodes(address: str) -> list[dict]:
    """Alive nodes of the cluster whose dashboard is at ``address`` (``http://host:port``)."""
    from ray.util.state import list_nodes

    nodes = list_nodes(address=address, filters=[("state", "=", "ALIVE")], raise_on_missing_output=False)
    return [
        {
            "node_id": n.node_id,
            "ip": n.node_ip,
            "head": bool(n.is_head_node),
            "CPU": float(n.resources_total.get("CPU", 0)),
            "GPU": float(n.resources_total.get("GPU", 0)),
        }
        for n in nodes
    ]


def wait_for_nodes(
    address: str, nodes: int, gpus_per_node: float = 0.0, timeout_s: float = 300.0, poll_s: float = 2.0
) -> list[dict]:
    """Block until ``nodes`` nodes are alive (each with ``gpus_per_node`` GPUs); TimeoutError says what is
    missing (including why the dashboard could not be reached, if it could not)."""
    deadline = time.monotonic() + timeout_s
    seen: list[dict] = []
    last_error = ""
    while True:
        try:
            seen = alive_nodes(address)
            last_error = ""
        except Exception as err:  # dashboard not up yet, connection refused, auth
            last_error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        ready = [n for n in seen if n["GPU"] >= gpus_per_node]
        if len(ready) >= nodes:
            return seen
        if time.monotonic() >= deadline:
            short = [f"{n['ip']} has {n['GPU']:g} GPUs" for n in seen if n["GPU"] < gpus_per_node]
            raise TimeoutError(
                f"after {timeout_s:g}s the Ray cluster at {address} has {len(ready)} of {nodes} node(s) ready"
                + (f" (each needs {gpus_per_node:g} GPUs; {', '.join(short)})" if short else "")
                + (f"; last error: {last_error}" if last_error else "")
            )
        time.sleep(poll_s)


def _parse_env(items: list[str]) -> dict[str, str]:
    bad = [i for i in items if "=" not in i or i.startswith("=")]
    if bad:
        raise SystemExit(f"--env takes KEY=VALUE, got {bad}")
    return dict(i.split("=", 1) for i in items)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m recipes.launch", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("runtime-env", help="print the job's runtime env as JSON")
    r.add_argument("--mode", choices=["upload", "shared"], default="upload")
    r.add_argument("--repo", required=True, help="the repository root (absolute for shared mode)")
    r.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="env var for the job")
    w = sub.add_parser("wait-nodes", help="wait until the cluster has its nodes")
    w.add_argument("--address", required=True, help="dashboard address, http://host:port")
    w.add_argument("--nodes", type=int, required=True)
    w.add_argument("--gpus-per-node", type=float, default=0.0)
    w.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    if args.cmd == "runtime-env":
        try:
            print(json.dumps(runtime_env(args.mode, args.repo, _parse_env(args.env))))
        except ValueError as err:
            print(f"runtime-env: {err}", file=sys.stderr)
            return 2
        return 0
    try:
        nodes = wait_for_nodes(args.address, args.nodes, args.gpus_per_node, args.timeout)
    except TimeoutError as err:
        print(f"wait-nodes: {err}", file=sys.stderr)
        return 1
    for n in nodes:
        print(f"node {n['ip']} {'(head) ' if n['head'] else ''}CPU={n['CPU']:g} GPU={n['GPU']:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
