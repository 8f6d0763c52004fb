"""A throwaway Slurm cluster on this machine for tests: munged, slurmctld and two slurmd (nodes ``<id>-1``,
``<id>-2``, each on its own port of 127.0.0.1; Debian's slurm-wlm allows several slurmd per host), all started
from a generated config under one temp dir, as root, in the foreground, each in its own session.

The config suits a container. Process tracking: ``proctrack/cgroup`` in the cgroup v1 freezer hierarchy where
that is mounted writable (it is on the CI-class machine these tests were written on; the ``slurm_<node>``
cgroups are removed at teardown; node names are unique per cluster, so two test sessions' clusters never share
one), else ``proctrack/linuxproc`` (by process tree: no cgroup enforcement). No CPU or memory constraint
through cgroups (``cgroup.conf``): the machine's cpuset and memory hierarchies stay untouched; CPU binding by
``task/affinity``; no accounting database. Node sizes come from the config (``SlurmdParameters=
config_overrides``), not the hardware, so two 2-CPU nodes fit on a 2-core machine. Every process the cluster
starts (daemons, slurmstepd, job steps and what they spawn) inherits ``SLURM_CONF=<temp dir>/slurm.conf`` in
its environment: teardown cancels all jobs, stops the daemons by pid and then finds any leftover by that
variable.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "scancel")
TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
}


def unavailable() -> str | None:
    """Why a cluster cannot be started here (None: it can)."""
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        return f"Slurm/munge not on PATH (missing {', '.join(missing)}: apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "the Slurm daemons of the test cluster must run as root (slurmd starts jobs as their user)"
    return None


FREEZER = Path("/sys/fs/cgroup/freezer")  # cgroup v1, as mounted here; cgroup v2 hosts are not tried


def cgroup_tracking() -> bool:
    """Whether jobs can be tracked in cgroups here (a writable cgroup v1 freezer hierarchy)."""
    return FREEZER.is_dir() and os.access(FREEZER, os.W_OK)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _conf(d: Path, ctld_port: int, nodes: list[str], node_ports: list[int]) -> str:
    host = socket.gethostname().split(".")[0]  # slurmctld only runs on the host SlurmctldHost names
    lines = "\n".join(
        f"NodeName={n} NodeAddr=127.0.0.1 Port={p} CPUs=2 RealMemory=4000 State=UNKNOWN"
        for n, p in zip(nodes, node_ports)
    )
    return f"""\
ClusterName=hyflowtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={node_ports[0]}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/ctld
SlurmdSpoolDir={d}/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/%n/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/%n/slurmd.log
ProctrackType={"proctrack/cgroup" if cgroup_tracking() else "proctrack/linuxproc"}
TaskPlugin=task/affinity
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=15
MinJobAge=600
{lines}
PartitionName=test Nodes={",".join(nodes)} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="hysl", dir="/tmp"))  # short: munge's socket path
        self.conf = self.dir / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.nodes = [f"n{self.dir.name[4:]}-{i}" for i in (1, 2)]  # unique: the temp dir's random suffix

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf), **extra}

    def _daemon(self, name: str, cmd: list[str]) -> None:
        with open(self.dir / f"{name}.out", "wb") as out:
            self.procs.append(
                subprocess.Popen(
                    cmd, env=self.env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            )

    def start(self, timeout: float = 60) -> None:
        d = self.dir
        (d / "munge").mkdir(mode=0o755)
        key = d / "munge" / "key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for sub in ("ctld", *self.nodes):
            (d / sub).mkdir()
        ctld_port, *node_ports = _free_ports(1 + len(self.nodes))
        self.conf.write_text(_conf(d, ctld_port, self.nodes, node_ports))
        (d / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nConstrainCores=no\nConstrainRAMSpace=no\n")
        m = d / "munge"
        self._daemon(
            "munged",
            ["munged", "-F", "--force", f"--socket={m}/sock", f"--key-file={key}", f"--pid-file={m}/pid",
             f"--log-file={m}/log", f"--seed-file={m}/seed"],
        )  # fmt: skip
        self._wait(lambda: (m / "sock").exists(), timeout, "munged did not create its socket")
        self._daemon("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        for n in self.nodes:
            self._daemon(f"slurmd-{n}", ["slurmd", "-D", "-N", n, "-f", str(self.conf)])
        self._wait(
            lambda: self.node_states() == {n: "idle" for n in self.nodes},
            timeout,
            "the nodes did not become idle",
        )

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"{what} (exited: {dead}):\n{self.logs()}")
            time.sleep(0.5)

    def run(self, *cmd: str, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=kw.pop("env", self.env()), capture_output=True, text=True,
                              timeout=timeout, **kw)  # fmt: skip

    def node_states(self) -> dict[str, str]:
        res = self.run("sinfo", "--noheader", "--Node", "--format=%N %T")
        return dict(line.split() for line in res.stdout.splitlines()) if res.returncode == 0 else {}

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, StdOut, ...)."""
        out = self.run("scontrol", "--oneliner", "show", "job", job_id).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait_job(self, job_id: str, timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while (info := self.job(job_id)).get("JobState") not in TERMINAL:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout:g}s")
            time.sleep(1)
        return info

    def leftovers(self) -> list[str]:
        """Processes that carry this cluster's SLURM_CONF other than the daemons and their helpers (slurmctld's
        slurmscriptd): job steps, their processes, slurmstepd."""
        daemons = {p.pid for p in self.procs}
        marker = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in daemons or int(entry.name) == os.getpid():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid not in daemons and marker in (entry / "environ").read_bytes().split(b"\0"):
                    cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    found.append(f"{entry.name}: {cmd[:160]}")
            except OSError:
                continue
        return found

    def logs(self) -> str:
        files = [*self.dir.glob("*.out"), *self.dir.glob("*.log"), *self.dir.glob("n*/slurmd.log")]
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in files)

    def stop(self) -> list[str]:
        """Cancel every job, stop the daemons (SIGTERM by pid, SIGKILL after 20 s); returns what was still
        running after the jobs had 30 s to end (then killed)."""
        if all(p.poll() is None for p in self.procs):
            self.run("scancel", "--full", "--user=root")
        deadline = time.monotonic() + 30
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.5)
        for line in left:
            try:
                os.kill(int(line.split(":")[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in reversed(self.procs):  # slurmd, slurmctld, then munged
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        try:
            for n in self.nodes:  # slurmd leaves its node's (empty) cgroup behind
                for cg in sorted((FREEZER / f"slurm_{n}").glob("**/"), reverse=True):
                    cg.rmdir()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
        return left
