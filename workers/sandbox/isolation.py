"""The host's plan of the sandbox's isolation: the root filesystem the sandbox shows (the same plan for
bubblewrap's argv and for the zygote's own mounts in the "rlimits" mode), bubblewrap's command line,
the zygote's environment, and the block of host uids that gives each REPL a uid of its own.
"""

import contextlib
import fcntl
import os
import random
import shutil
import subprocess
import sys
import tempfile

from workers.sandbox.config import SandboxError

CHILD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_child.py")
# The zygote's modules, which the script imports from its own folder (see _child.py) and the sandbox's
# root shows beside it: every other underscore module of this folder.
ZYGOTE_MODULES = tuple(
    sorted(
        name
        for name in os.listdir(os.path.dirname(CHILD_SCRIPT))
        if name.startswith("_") and name.endswith(".py") and name not in ("__init__.py", "_child.py")
    )
)
SANDBOX_SCRIPT = "/opt/hyflow-sandbox/child.py"  # where the sandbox's root shows the script
SANDBOX_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}  # the zygote's whole environment
BWRAP_SCRATCH = "/scratch"
BWRAP_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_KILL")
BWRAP_ETC = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/alternatives",
)
UID_BASE = 1_500_000_000  # slot uids: UID_BASE + block * 4096 + slot, block claimed by a lock file
UID_BLOCKS = 1 << 17


def _python_paths() -> list[str]:
    """Directories the interpreter needs inside the sandbox (prefixes, site-packages)."""
    cands = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    cands.append(os.path.dirname(os.path.realpath(sys.executable)))
    cands += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    out: list[str] = []
    for p in sorted({os.path.abspath(c) for c in cands if c and os.path.isdir(c)}, key=len):
        if not any(p == q or p.startswith(q + "/") for q in out) and not p.startswith("/usr/"):
            out.append(p)
    return out


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def _bwrap_version(path: str) -> str:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or out.stderr.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"


def _root_plan() -> list[tuple[str, ...]]:
    """The sandbox's root filesystem, the same in both modes (bubblewrap builds it from its argv, the
    zygote of the "rlimits" mode with mount(2)): ("dir", path), ("symlink", target, path),
    ("ro-bind", src, dst), ("ro-bind-try", src, dst). Every other host path is absent."""
    plan: list[tuple[str, ...]] = []
    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            plan.append(("symlink", os.readlink(top), top))
        elif os.path.isdir(top):
            plan.append(("ro-bind", top, top))
    # Parents of mount points are made traversable (bwrap would create them with mode 0700).
    made: set[str] = set()
    for p in _python_paths() + ["/etc/", os.path.dirname(SANDBOX_SCRIPT) + "/"]:
        parts = p.split("/")
        for i in range(2, len(parts)):
            anc = "/".join(parts[:i])
            if anc not in made:
                made.add(anc)
                plan.append(("dir", anc))
    plan += [("ro-bind", p, p) for p in _python_paths()]
    plan += [("ro-bind-try", p, p) for p in BWRAP_ETC]
    plan.append(("ro-bind", CHILD_SCRIPT, SANDBOX_SCRIPT))
    here, there = os.path.dirname(CHILD_SCRIPT), os.path.dirname(SANDBOX_SCRIPT)
    plan += [("ro-bind", os.path.join(here, m), os.path.join(there, m)) for m in ZYGOTE_MODULES]
    return plan


def _bwrap_argv(bwrap: str, scratch_mb: int, root: bool) -> list[str]:
    argv = [bwrap, "--die-with-parent", "--as-pid-1", "--new-session"]
    argv += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if not root:
        argv.append("--unshare-user")
    for kind, *paths in _root_plan():
        argv += (["--perms", "0755", "--dir"] if kind == "dir" else [f"--{kind}"]) + paths
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--perms", "0711", "--size", str(int(scratch_mb) << 20), "--tmpfs", BWRAP_SCRATCH]
    argv += ["--remount-ro", "/", "--chdir", "/", "--clearenv"]
    for key, value in SANDBOX_ENV.items():
        argv += ["--setenv", key, value]
    if root:
        argv += ["--cap-drop", "ALL"]
        for cap in BWRAP_CAPS:
            argv += ["--cap-add", cap]
    return argv


class _UidBlock:
    """A block of 4096 host uids held by this sandbox for as long as it lives (a flock on a file in
    the temp dir), so two sandboxes on one machine never share slot uids."""

    def __init__(self):
        d = os.path.join(tempfile.gettempdir(), "hyflow-sandbox-uids")
        os.makedirs(d, exist_ok=True)
        rng = random.SystemRandom()
        for _ in range(64):
            block = rng.randrange(UID_BLOCKS)
            path = os.path.join(d, f"{block}.lock")
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.stat(path).st_ino != os.fstat(fd).st_ino:  # unlinked by its last holder meanwhile
                    raise OSError("stale lock file")
            except OSError:
                os.close(fd)
                continue
            self.fd, self.path, self.base = fd, path, UID_BASE + block * 4096
            return
        raise SandboxError("could not claim a block of sandbox uids")

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)  # while still locked, so no one else holds this inode
        with contextlib.suppress(OSError):
            os.close(self.fd)
