"""Cluster launch for real on this machine: a Ray head (`ray start --head` on loopback) plus a second
`ray start` node with its own resources, a recipe submitted with `ray job submit` (recipes/slurm/submit.sh), and
the Slurm batch script (recipes/slurm/hyflow.sbatch) submitted with `sbatch` to a real two-node Slurm cluster
started on this machine (tests/recipes/slurm_testlib.py).

The Ray clusters are separate from the test session's own Ray (tests/conftest.py): their own ports, temp dir,
token and environment (no RAY_* variables of this process leak in); each `ray start --block` is stopped with
SIGTERM (by our finalizer, or by the Slurm job's teardown), after which no process of its temp dir may remain.
The recipe runs with trainer.nnodes=2 on Ray nodes of 1 CPU each, so its pool needs a placement group on both
nodes: a success means both Ray nodes ran workers.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from ray.util import get_node_ip_address

from recipes.launch import runtime_env
from tests.skips import skip_or_fail

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RAY = shutil.which("ray", path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
if RAY is None:
    skip_or_fail("the ray CLI is not installed (pip install 'ray[default]')", allow_module_level=True)

JOB = [  # one GRPO step of the nano model on 2 nodes x 1 CPU bundle (no warm start: launching is tested)
    "model.tiny_size=nano",
    "sft.enable=false",
    "task.n_train=16",
    "task.n_val=4",
    "data.train_batch_size=2",
    "data.max_prompt_length=32",
    "data.max_response_length=8",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=2",
    "trainer.total_training_steps=1",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.resume_mode=disable",
    "trainer.progress_bar=false",
    "trainer.plot=false",
    "trainer.logger=[console]",
    "trainer.nnodes=2",
    "trainer.n_gpus_per_node=1",
]


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _node_ports(ports: list[int], worker_range: int) -> list[str]:
    """Per-node ports, so two nodes (and the test session's Ray) can share one machine."""
    agent, agent_grpc, runtime_env_agent, metrics, node_manager, object_manager = ports
    return [
        f"--dashboard-agent-listen-port={agent}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--runtime-env-agent-port={runtime_env_agent}",
        f"--metrics-export-port={metrics}",
        f"--node-manager-port={node_manager}",
        f"--object-manager-port={object_manager}",
        f"--min-worker-port={worker_range}",
        f"--max-worker-port={worker_range + 999}",
        "--object-store-memory=150000000",
    ]


def _clean_env(token: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=token,
        OMP_NUM_THREADS="1",
        HYFLOW_PYTHON=sys.executable,
        HYFLOW_JOB_PYTHON=sys.executable,
    )
    env.update(extra)
    env.pop("PYTHONPATH", None)  # the job must find the code through its runtime env, not ours
    return env


def _ours(tmp: str) -> list[int]:
    """Pids of processes whose command line names our temp dir (the Ray processes this test started)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if tmp in cmd and int(entry.name) != os.getpid():
            pids.append(int(entry.name))
    return pids


def _cmdlines(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160])
        except OSError:
            pass
    return out


def _stop(procs: list[subprocess.Popen], tmp: str) -> list[int]:
    """SIGTERM each `ray start --block` we started (it stops its node's Ray processes); returns the pids of
    any process of ours still alive after 30 s (then killed)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
    while (left := _ours(tmp)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def _run(
    cmd: list[str], env: dict[str, str], timeout: float, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """Run to completion; output through files, not pipes (a daemon it leaves behind would hold a pipe open)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=out, stderr=err, timeout=timeout)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(
            cmd, proc.returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace")
        )


class LocalCluster:
    """A head and a worker node started with `ray start --block` on loopback, each in its own session."""

    def __init__(self, tmp: str):
        self.tmp = tmp
        self.token = secrets.token_hex(32)
        ports = _free_ports(15)
        self.gcs_port, self.dash_port, self.client_port = ports[:3]
        self.head_ports, self.worker_ports = ports[3:9], ports[9:15]
        self.dashboard = f"http://127.0.0.1:{self.dash_port}"
        self.procs: list[subprocess.Popen] = []

    def env(self, **extra: str) -> dict[str, str]:
        return _clean_env(self.token, **extra)

    def _start_node(self, args: list[str], log: str) -> None:
        with open(Path(self.tmp) / log, "wb") as out:
            self.procs.append(
                subprocess.Popen(
                    [RAY, "start", "--block", f"--temp-dir={self.tmp}", *args],
                    env=self.env(),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

    def wait_nodes(self, n: int) -> str:
        cmd = [sys.executable, "-m", "recipes.launch", "wait-nodes", "--address", self.dashboard]
        res = _run([*cmd, "--nodes", str(n), "--timeout", "60"], self.env(PYTHONPATH=str(REPO)), 90)
        assert res.returncode == 0, f"cluster did not come up:\n{res.stderr}\n{self.logs()}"
        return res.stdout

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in Path(self.tmp).glob("*.log"))

    def start(self) -> None:
        head = [
            "--head",
            "--node-ip-address=127.0.0.1",
            f"--port={self.gcs_port}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dash_port}",
            "--include-dashboard=true",
            f"--ray-client-server-port={self.client_port}",
            "--num-cpus=1",
        ]
        self._start_node([*head, *_node_ports(self.head_ports, 22000)], "head.log")
        self.wait_nodes(1)
        worker = [
            f"--address=127.0.0.1:{self.gcs_port}",
            "--node-ip-address=127.0.0.1",
            "--num-cpus=1",
            '--resources={"hyflow_worker_node": 1}',
        ]
        self._start_node([*worker, *_node_ports(self.worker_ports, 23000)], "worker.log")


@pytest.fixture
def local_cluster():  # one test uses it: stopped before the Slurm tests start their own Ray
    tmp = tempfile.mkdtemp(prefix="hyfc", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
    cluster = LocalCluster(tmp)
    try:
        cluster.start()
        yield cluster
    finally:
        left = _stop(cluster.procs, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        assert not left, f"Ray processes survived SIGTERM of `ray start --block`: {left}"


def test_runtime_env_modes_and_errors():
    up = runtime_env("upload", "/repo", {"NCCL_DEBUG": "WARN"})
    assert (
        up["working_dir"] == "/repo"
        and "runs/" in up["excludes"]
        and up["env_vars"] == {"NCCL_DEBUG": "WARN"}
    )
    assert runtime_env("shared", "/repo") == {"env_vars": {"PYTHONPATH": "/repo"}}
    with pytest.raises(ValueError, match="upload or shared"):
        runtime_env("rsync", "/repo")


def test_job_env_vars_leave_the_jobs_own_values_alone():
    from recipes.trainer.run import job_env_vars

    wanted = {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "2"}
    assert job_env_vars(wanted, {"TOKENIZERS_PARALLELISM": "true"}) == {"OMP_NUM_THREADS": "2"}
    assert job_env_vars(wanted, {}) == wanted


def test_wait_nodes_times_out_naming_the_cluster_and_the_error():
    port = _free_ports(1)[0]  # nothing listens there
    res = _run(
        [sys.executable, "-m", "recipes.launch", "wait-nodes", "--address", f"http://127.0.0.1:{port}"]
        + ["--nodes", "2", "--timeout", "1"],
        _clean_env("0" * 64, PYTHONPATH=str(REPO)),
        60,
    )
    assert res.returncode == 1
    assert f"the Ray cluster at http://127.0.0.1:{port} has 0 of 2 node(s) ready" in res.stderr
    assert "last error:" in res.stderr


def test_ray_job_submit_runs_a_recipe_on_two_nodes(local_cluster, tmp_path):
    nodes = local_cluster.wait_nodes(2)
    assert nodes.count("node ") == 2 and "(head)" in nodes
    run_dir = tmp_path / "run"
    env = local_cluster.env(
        HYFLOW_DASHBOARD=local_cluster.dashboard,
        HYFLOW_SUBMISSION_ID="hyflow-test-grpo",
        # also set by the recipe's ray.init: the driver must leave the job's value alone or Ray refuses to merge
        HYFLOW_JOB_ENV="TOKENIZERS_PARALLELISM=false",
    )
    res = _run(
        ["bash", str(REPO / "recipes/slurm/submit.sh"), "grpo", *JOB, f"trainer.default_local_dir={run_dir}"],
        env,
        240,
        cwd=tmp_path,  # submit.sh finds the repo from its own path
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"job failed:\n{out[-6000:]}\n{local_cluster.logs()}"
    assert "Job 'hyflow-test-grpo' succeeded" in out
    assert "[grpo] step 1/1" in out  # the job's own log lines were streamed
    # the job's outputs: resolved config and one metrics row of the step
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    assert rows[0]["perf/total_num_tokens"] > 0 and "timing_s/update_weights" in rows[0]
    assert "nnodes: 2" in (run_dir / "config.yaml").read_text()
    # the job server kept its status and logs
    status = _run([RAY, "job", "status", "--address", local_cluster.dashboard, "hyflow-test-grpo"], env, 60)
    assert "Job 'hyflow-test-grpo' succeeded" in status.stdout + status.stderr
    logs = _run([RAY, "job", "logs", "--address", local_cluster.dashboard, "hyflow-test-grpo"], env, 60)
    assert "[grpo] step 1/1" in logs.stdout


def test_submit_refuses_an_unknown_recipe():
    bad = _run(["bash", str(REPO / "recipes/slurm/submit.sh"), "nosuch"], _clean_env("0" * 64), 30)
    assert bad.returncode == 2 and "no recipe 'nosuch'" in bad.stderr


# ---------------------------------------------------------------------------------------------------------------
# The Slurm batch script on a real Slurm: munged, slurmctld and two slurmd on this machine (tests/recipes/
# slurm_testlib.py); sbatch, srun, scontrol and scancel are Slurm's own. Only the hosts are not real: both
# nodes are this machine, so each node's Ray gets its own ports.
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slurm(needs):
    from slurm_testlib import SlurmCluster, unavailable

    if reason := unavailable():
        needs(reason)
    cluster = SlurmCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        left = cluster.stop()
        assert not left, f"processes outlived their Slurm jobs: {left}"


def _sbatch(
    slurm, tmp_path: Path, name: str, sbatch_args: list[str], overrides: list[str]
) -> tuple[str, str]:
    """Submit hyflow.sbatch from the repository root as a user would (CPU nodes: no GPUs, 2 CPUs per task of
    which Ray offers 1, so a 2-node recipe needs both nodes); returns (job id, Ray temp dir)."""
    ray_tmp = tempfile.mkdtemp(prefix="hysr", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
    gcs, dash, client, *ports = _free_ports(15)
    env = _clean_env(
        "",
        SLURM_CONF=str(slurm.conf),
        HYFLOW_CPUS_PER_NODE="1",
        HYFLOW_RAY_PORT=str(gcs),
        HYFLOW_DASHBOARD_PORT=str(dash),
        HYFLOW_RAY_TMPDIR=ray_tmp,
        HYFLOW_WAIT_TIMEOUT="90",
        HYFLOW_RAY_HEAD_ARGS=" ".join([f"--ray-client-server-port={client}", *_node_ports(ports[:6], 26000)]),
        HYFLOW_RAY_WORKER_ARGS=" ".join(_node_ports(ports[6:12], 27000)),
    )
    del env["RAY_AUTH_TOKEN"], env["RAY_AUTH_MODE"]  # the script makes its own per-job token
    res = slurm.run(
        "sbatch", "--parsable", "--gpus-per-task=0", "--cpus-per-task=2", f"--output={tmp_path}/{name}-%j.out",
        *sbatch_args, "recipes/slurm/hyflow.sbatch", "grpo", *overrides, env=env, cwd=REPO,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().split(";")[0], ray_tmp


def _finish(slurm, job_id: str, ray_tmp: str, timeout: float) -> tuple[dict, str]:
    """Wait for the job to end; returns (its scontrol record, its output file) after checking that no Ray
    process of the job (by its temp dir) and no job-step process is left."""
    try:
        info = slurm.wait_job(job_id, timeout)
        deadline = time.monotonic() + 10  # slurmstepd reaps the step's processes after the job's state is set
        while (left := _ours(ray_tmp) + slurm.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.5)
        # read after the processes are gone: a cancelled job's state is set before its script's teardown
        # trap has written its last lines (seen once under load: the teardown lines were missing)
        out = Path(info["StdOut"]).read_text(errors="replace")
        assert not left, (
            f"left behind by job {job_id}: {_cmdlines(_ours(ray_tmp))} {slurm.leftovers()}\n{out}"
        )
        return info, out
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _slurm_out(tmp_path: Path, name: str) -> str:
    return "\n".join(p.read_text(errors="replace") for p in tmp_path.glob(f"{name}-*.out"))


def test_sbatch_on_real_slurm_cancel_then_resume_on_two_nodes(slurm, tmp_path):
    """A 2-node GRPO job cancelled with `scancel` after its first checkpoint: the job ends CANCELLED, the
    script's teardown ran, no Ray or step process is left, and the checkpoint it wrote is intact -- a second
    job resumes from it with trainer.resume_mode=auto, runs two more steps and ends COMPLETED."""
    run_dir = tmp_path / "run"
    job = [x for x in JOB if not x.startswith(("trainer.total_training_steps", "trainer.save_freq",
                                               "trainer.resume_mode"))]  # fmt: skip
    first, ray_tmp = _sbatch(
        slurm, tmp_path, "cancel", ["--nodes=2"],
        [*job, f"trainer.default_local_dir={run_dir}", "trainer.total_training_steps=100", "trainer.save_freq=1"],
    )  # fmt: skip
    latest = run_dir / "checkpoints" / "latest_step"
    deadline = time.monotonic() + 240
    while not (latest.exists() and "[grpo] step 1/100" in _slurm_out(tmp_path, "cancel")):  # logs stream in
        state = slurm.job(first).get("JobState")
        assert state in ("PENDING", "RUNNING") and time.monotonic() < deadline, (
            f"job {first} is {state} without a checkpoint:\n{_slurm_out(tmp_path, 'cancel')[-4000:]}\n{slurm.logs()}"
        )
        time.sleep(0.5)
    assert slurm.run("scancel", first).returncode == 0
    info, out = _finish(slurm, first, ray_tmp, 60)
    assert info["JobState"] == "CANCELLED", out
    # the teardown ran to its end (SIGTERM: exit 143), and Slurm had to SIGKILL no step after KillWait
    assert (
        "stopping Ray on 2 node(s)" in out and "Ray stopped; exit 143" in out and "task 0: Killed" not in out
    ), out
    saved = int(latest.read_text())
    assert saved >= 1 and (run_dir / "checkpoints" / "actor" / f"step_{saved}").is_dir()

    second, ray_tmp = _sbatch(
        slurm, tmp_path, "resume", ["--nodes=2"],
        [*job, f"trainer.default_local_dir={run_dir}", f"trainer.total_training_steps={saved + 2}",
         "trainer.save_freq=-1", "trainer.resume_mode=auto"],
    )  # fmt: skip
    info, out = _finish(slurm, second, ray_tmp, 240)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out
    assert f"Ray worker on {slurm.nodes[1]}" in out and "Ray stopped; exit 0" in out
    # the head's address is the one Ray picks (this machine's outward interface where it has one), not a
    # loopback address from /etc/hosts that other hosts could not reach
    assert f"Ray head on {slurm.nodes[0]} ({get_node_ip_address()}:" in out
    assert f"[grpo] resumed at step {saved} from" in out
    assert f"[grpo] step {saved + 2}/{saved + 2}" in out
    assert f"Job 'hyflow-{second}-grpo' succeeded" in out
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps[-2:] == [saved + 1, saved + 2]


def test_sbatch_on_real_slurm_failing_recipe_ends_failed(slurm, tmp_path):
    """One node; the recipe fails on the cluster (a misspelt config key): the job ends FAILED with exit code 1
    and the recipe's error in its output, and Ray is torn down."""
    job_id, ray_tmp = _sbatch(
        slurm, tmp_path, "fail", ["--nodes=1"],
        [*JOB[:-2], f"trainer.default_local_dir={tmp_path / 'run'}", "rollout.nn=3"],
    )  # fmt: skip
    info, out = _finish(slurm, job_id, ray_tmp, 180)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0", out
    assert f"Job 'hyflow-{job_id}-grpo' failed" in out
    assert "unknown config key 'rollout.nn'" in out
    assert "stopping Ray on 1 node(s)" in out and "Ray stopped; exit 1" in out


def test_sbatch_refuses_a_bad_allocation_before_starting_anything(slurm, tmp_path):
    """The script's own checks, in real jobs: more Ray nodes asked than allocated, or submitted from outside
    the repository: the job ends FAILED (exit 2) with the reason, before any Ray step. Outside Slurm at all
    (plain bash, no SLURM_* variables) it stops at once."""
    env = _clean_env("0" * 64, SLURM_CONF=str(slurm.conf))
    script = str(REPO / "recipes/slurm/hyflow.sbatch")
    outside = _run(["bash", script, "grpo"], env, 30)  # from the repository root
    assert outside.returncode != 0 and "not inside a Slurm allocation" in outside.stderr
    sbatch = ["sbatch", "--parsable", "--gpus-per-task=0", "--cpus-per-task=1", "--nodes=1"]
    short = slurm.run(*sbatch, f"--output={tmp_path}/short-%j.out", script, "grpo", env=env | {"HYFLOW_NNODES": "3"},
                      cwd=REPO)  # fmt: skip
    elsewhere = slurm.run(
        *sbatch, f"--output={tmp_path}/elsewhere-%j.out", script, "grpo", env=env, cwd=tmp_path
    )
    for job, reason in (
        (short, f"HYFLOW_NNODES=3 but the allocation has 1 node(s): {slurm.nodes[0]}"),
        (elsewhere, f"{tmp_path} is not the hyflow repository"),
    ):
        info = slurm.wait_job(job.stdout.strip(), 60)
        out = Path(info["StdOut"]).read_text()
        assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0") and reason in out, out
        assert "Ray head" not in out
