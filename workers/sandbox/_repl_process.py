"""A freshly forked child of the zygote becoming a REPL process: its own session, only the REPL socket
open, a clean environment, rlimits, its own uid (or no capabilities and a user namespace of its own),
no new privileges and the seccomp filter; then it serves the REPL.

Standard library only; a module of the zygote (see ``_child.py``).
"""

import os
import signal
import socket

# Type checkers treat a name TYPE_CHECKING as true, so they read only the package imports below (the
# zygote's copies are the same modules); a constant, not typing's, keeps the zygote's imports minimal.
TYPE_CHECKING = False

if TYPE_CHECKING or __package__:
    from workers.sandbox import _seccomp
    from workers.sandbox._linux import (
        PR_SET_NO_NEW_PRIVS,
        PR_SET_PDEATHSIG,
        _drop_capabilities,
        _enter_userns,
        prctl,
    )
    from workers.sandbox._repl_runtime import _Repl
else:  # in the zygote, which imports its modules from its own folder (see _child.py)
    import _seccomp
    from _linux import PR_SET_NO_NEW_PRIVS, PR_SET_PDEATHSIG, _drop_capabilities, _enter_userns, prctl
    from _repl_runtime import _Repl


def _repl_child(ctrl: socket.socket, seccomp: bool, sock_fd: int, scratch: str, uid, limits: dict) -> None:
    """In the freshly forked child: detach, limit, drop privileges, then serve the REPL. ``ctrl`` is the
    zygote's control socket, ``seccomp`` whether the zygote's probe installed the filter."""
    os.setsid()
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # Only the REPL socket survives: the zygote's control socket must not be reachable from here.
    ctrl.detach()
    keep = sorted({0, 1, 2, sock_fd})
    for lo, hi in zip(keep, keep[1:] + [os.sysconf("SC_OPEN_MAX")]):
        os.closerange(lo + 1, hi)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for fd in (1, 2):
        mfd = os.memfd_create(f"fd{fd}", 0)
        os.dup2(mfd, fd)
        os.close(mfd)
    os.chdir(scratch)
    os.environ.clear()
    os.environ.update(
        {"HOME": scratch, "TMPDIR": scratch, "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
    )
    import resource

    mb = 1 << 20
    cpu = int(limits.get("cpu_s", 300))
    wanted = [
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_CPU, cpu, cpu + 1),
        (resource.RLIMIT_AS, int(limits.get("memory_mb", 1024)) * mb, None),
        (resource.RLIMIT_FSIZE, int(limits.get("max_file_mb", 64)) * mb, None),
        (resource.RLIMIT_NOFILE, int(limits.get("max_open_files", 256)), None),
        (resource.RLIMIT_NPROC, int(limits.get("max_procs", 64)), None),
    ]
    for res, soft, hard in wanted:
        resource.setrlimit(res, (soft, soft if hard is None else hard))
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    else:
        # No uid of its own (not root): shed the capabilities the zygote holds in its user namespace,
        # then enter a user namespace of its own, so RLIMIT_NPROC counts this REPL's processes only
        # (the count is kept per user namespace), where that is permitted.
        _drop_capabilities()
        _enter_userns()
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    if seccomp:  # the zygote's probe installed it: from here on a failure is fatal
        _seccomp.install()
    import random

    random.seed()
    sock = socket.socket(fileno=sock_fd)
    sock.setblocking(True)
    _Repl(sock, limits).serve()
