"""Sandbox side of the REPL sandbox: the script that starts the zygote (fork server), which forks the
REPL processes.

This file runs as a script in its own interpreter (``python -I -B _child.py ARGS``), started by
``workers/sandbox/zygote_client.py`` (inside bubblewrap where available, else inside namespaces it sets
up itself). Every other underscore module of this folder is one of the zygote's (bubblewrap's root
shows them beside the script, see ``isolation.py``): the script imports them all from its own folder
before entering any namespace, then takes that folder off ``sys.path`` so the REPLs' code cannot
import from it. They use the standard library only and do nothing on import, so the host imports
the wire format (``_wire.py``), the reserved names (``_repl_namespace.py``) and the seccomp filter's
description (``_seccomp.py``) as modules of ``workers.sandbox``.

    _child.py           this script: its arguments, the no-bubblewrap namespaces, then the zygote
    _zygote.py          the fork server: probes, spawn / kill / release, exit notices
    _repl_process.py    a forked child becoming a REPL: session, fds, rlimits, uid, seccomp
    _repl_runtime.py    the REPL: its namespace and helpers, the request loop, sub-calls
    _repl_output.py     a block's captured output and the traceback of its user frames
    _repl_namespace.py  the reserved names and the pristine copies of contexts
    _linux.py           prctl, namespaces, mounts through ctypes; the "rlimits" mode's minimal root
    _seccomp.py         the REPL's seccomp filter
    _wire.py            the frames on every socket

Processes (inside the sandbox's pid namespace):

    zygote (pid 1: root with a few capabilities, or the only uid of a user namespace)
      +-- REPL slot 0   (own session, own uid where available, rlimits, scratch dir as cwd)
      |     +-- whatever the REPL's code forks (same uid, same limits)
      +-- REPL slot 1 ...
"""

import json
import os
import signal
import sys

# Type checkers treat a name TYPE_CHECKING as true, so they read only the package imports below (the
# zygote's copies are the same modules); a constant, not typing's, keeps the zygote's imports minimal.
TYPE_CHECKING = False

if TYPE_CHECKING or __package__:
    from workers.sandbox._linux import PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, _enter_namespaces, prctl
    from workers.sandbox._zygote import _Zygote
else:  # run as a script (the zygote): its modules lie beside this file; keep them off the REPL's path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _linux import PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, _enter_namespaces, prctl
    from _zygote import _Zygote

    del sys.path[0]


def main() -> None:
    args = json.loads(sys.argv[1])
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the host (or bwrap) is our parent
    except OSError:
        pass
    report = {"mode": args["mode"]}
    if args["mode"] == "rlimits":
        _enter_namespaces(args, report)
    try:
        prctl(PR_SET_CHILD_SUBREAPER, 1)
    except OSError:
        pass
    args["report"] = report
    zygote = _Zygote(args)
    zygote.setup()
    zygote.loop()


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:
        sys.stderr.write(f"sandbox zygote failed: {type(exc).__name__}: {exc}\n")
        sys.exit(1)
