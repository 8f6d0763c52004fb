"""The master port a group's rank 0 binds for torch.distributed: drawn where the OS does not hand out
ports by itself, and a group of one that finds its port taken takes another instead of failing (CI once
failed on EADDRINUSE: a port picked with ``bind(0)`` was taken before the TCPStore bound it)."""

import socket
import subprocess
import sys
from pathlib import Path

from controller.worker import free_port
from tests.skips import skip_or_fail

REPO = Path(__file__).resolve().parents[2]


def _ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_the_port_is_outside_the_ephemeral_range_and_free():
    if _ephemeral_low() < 21000:  # a kernel setting: CI's machines have the default 32768
        skip_or_fail(
            f"this kernel's ephemeral port range starts at {_ephemeral_low()}, leaving no room below it"
        )
    ports = [free_port() for _ in range(20)]
    assert all(20000 <= p < min(_ephemeral_low(), 30000) for p in ports), ports
    assert len(set(ports)) > 1, "drawn at random, so that two groups starting together differ"
    with socket.socket() as s:
        s.bind(("", ports[0]))  # nothing holds it


JOIN = """
import os, sys
import torch.distributed as dist
from controller import Worker
w = Worker()
w.init_distributed(timeout_s=20)
print("joined", dist.get_rank(), dist.get_world_size(), w.master_port, os.environ["MASTER_PORT"])
"""


def _join(rank: int, world: int, port: int) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "RANK": str(rank), "WORLD_SIZE": str(world)}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return subprocess.run(
        [sys.executable, "-c", JOIN], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_a_group_of_one_whose_port_is_taken_joins_on_another():
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        out = _join(0, 1, taken)
    assert out.returncode == 0, out.stderr[-2000:]
    _, rank, world, port, env_port = out.stdout.split()
    assert (rank, world) == ("0", "1")
    assert int(port) != taken and port == env_port


def test_rank_0_of_a_larger_group_still_fails_loudly_on_a_taken_port():
    # Its peers were told the port: moving elsewhere would leave them waiting, so the error stands.
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        out = _join(0, 2, squatter.getsockname()[1])
    assert out.returncode != 0
    assert "EADDRINUSE" in out.stderr or "address already in use" in out.stderr
