"""A memory cgroup per REPL slot, where this machine lets the host make them: the kernel then accounts
everything a REPL holds (its processes' pages, and the tmpfs files it writes in its scratch dir) against
``SandboxConfig.memory_mb``, which RLIMIT_AS alone cannot (it counts each process's address space, not
files in memory). Over the limit, the kernel's OOM killer kills inside the REPL's cgroup only.

The host creates ``<its own memory cgroup>/hyflow-sandbox-<pid>-<n>/slot-<i>`` (cgroup v1's memory
controller, or v2 where its own cgroup delegates the memory controller to children) and hands the REPL
the open ``cgroup.procs`` file with its spawn request; the freshly forked REPL process writes ``0``
(itself) to it while still root, so it and everything it forks are charged from their first page. Where
none of this is allowed (no cgroup file system, read-only, v2 without delegation) the sandbox runs
without it and ``isolation_report()["memory"]`` says why.
"""

import contextlib
import itertools
import os
import time

_COUNTER = itertools.count()


def _own_cgroup() -> tuple[str, str]:
    """(version, directory) of this process's memory cgroup, or raise OSError saying why there is none."""
    with open("/proc/self/cgroup") as f:
        lines = [line.rstrip("\n").split(":", 2) for line in f]
    mounts: dict[str, tuple[str, str]] = {}  # version -> (root of the hierarchy it shows, mount point)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.strip().partition(" - ")
            fstype, _, options = right.split(" ", 2)
            root, target = left.split()[3:5]
            if fstype == "cgroup" and "memory" in options.split(","):
                mounts["v1"] = (root, target)
            elif fstype == "cgroup2":
                mounts.setdefault("v2", (root, target))

    def directory(version: str, path: str) -> str:
        root, target = mounts[version]
        return target + (path[len(root) :] if root != "/" and path.startswith(root) else path)

    for _, controllers, path in lines:
        if "memory" in controllers.split(",") and "v1" in mounts:
            return "v1", directory("v1", path)
    for hierarchy, controllers, path in lines:
        if hierarchy == "0" and controllers == "" and "v2" in mounts:
            d = directory("v2", path)
            with open(os.path.join(d, "cgroup.subtree_control")) as f:
                if "memory" not in f.read().split():
                    raise OSError(f"cgroup v2 at {d} does not delegate the memory controller to its children")
            return "v2", d
    raise OSError("no memory cgroup controller is mounted")


class MemoryCgroups:
    """This sandbox's memory cgroups: one per slot, made on the slot's first spawn, removed on close."""

    def __init__(self):
        self.version, own = _own_cgroup()
        self.root = os.path.join(own, f"hyflow-sandbox-{os.getpid()}-{next(_COUNTER)}")
        os.mkdir(self.root, 0o755)  # OSError (read-only, no permission) means: not on this machine
        if self.version == "v1":
            with contextlib.suppress(OSError):  # children count in this cgroup's usage too
                _write(os.path.join(self.root, "memory.use_hierarchy"), "1")

    @classmethod
    def probe(cls) -> "tuple[MemoryCgroups | None, str]":
        """The sandbox's cgroups, or None and the reason they cannot be made here."""
        try:
            return cls(), ""
        except (OSError, ValueError) as exc:
            return None, str(exc)

    def procs_fd(self, slot: int, limit_bytes: int) -> int:
        """An open ``cgroup.procs`` of the slot's cgroup, its limit set to ``limit_bytes`` (swap
        included, so nothing is pushed out of the count); the caller hands it to the REPL and closes it."""
        d = os.path.join(self.root, f"slot-{slot}")
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o755)
        if self.version == "v1":
            _write(os.path.join(d, "memory.limit_in_bytes"), str(limit_bytes))
            with contextlib.suppress(OSError):  # memsw exists only with swap accounting
                _write(os.path.join(d, "memory.memsw.limit_in_bytes"), str(limit_bytes))
        else:
            _write(os.path.join(d, "memory.max"), str(limit_bytes))
            with contextlib.suppress(OSError):
                _write(os.path.join(d, "memory.swap.max"), "0")
        return os.open(os.path.join(d, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)

    def oom_kills(self, slot: int) -> int:
        """How many processes the OOM killer has killed in the slot's cgroup (0 before its first spawn):
        unlike the machine's count, no other process's OOM kill raises it."""
        d = os.path.join(self.root, f"slot-{slot}")
        name = "memory.oom_control" if self.version == "v1" else "memory.events"
        try:
            with open(os.path.join(d, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def close(self, wait_s: float = 2.0) -> None:
        """Remove the cgroups once the sandbox's processes are gone (an exiting process leaves its cgroup
        a moment after its SIGKILL: retried for up to ``wait_s``)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                for name in os.listdir(self.root):
                    if name.startswith("slot-"):
                        with contextlib.suppress(FileNotFoundError):
                            os.rmdir(os.path.join(self.root, name))
                os.rmdir(self.root)
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.02)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
