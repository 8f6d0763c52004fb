"""The zygote's Linux-level isolation, through ctypes where the standard library lacks a call (prctl,
unshare, mount, capset): those calls and their constants, a REPL's dropped capabilities and user
namespace of its own, and, where bubblewrap is not used (the "rlimits" mode), the zygote's own
namespaces and the same minimal root as bubblewrap's, built with mount(2) and entered with pivot_root(2).

Standard library only; a module of the zygote (see ``_child.py``).
"""

import ctypes
import ctypes.util
import os
import signal

# Type checkers treat a name TYPE_CHECKING as true, so they read only the package imports below (the
# zygote's copies are the same modules); a constant, not typing's, keeps the zygote's imports minimal.
TYPE_CHECKING = False

if TYPE_CHECKING or __package__:
    from workers.sandbox import _seccomp
else:  # in the zygote, which imports its modules from its own folder (see _child.py)
    import _seccomp

# Linux constants (x86_64 / aarch64 agree on these).
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_MOVE, MS_REC = 32, 1024, 2048, 4096, 8192, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38

_libc = None


def _lib():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def prctl(option: int, arg: int) -> None:
    _check(_lib().prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl({option})")


def unshare(flags: int) -> None:
    _check(_lib().unshare(flags), "unshare")


def mount(source, target, fstype, flags: int, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    rc = _lib().mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))
    _check(rc, f"mount {target}")


def umount(target: str, flags: int = 0) -> None:
    _check(_lib().umount2(target.encode(), flags), f"umount {target}")


def _drop_capabilities() -> None:
    """capset(2) with empty effective, permitted and inheritable sets."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [
            ("effective", ctypes.c_uint32),
            ("permitted", ctypes.c_uint32),
            ("inheritable", ctypes.c_uint32),
        ]

    header = Header(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (Data * 2)()
    try:
        _lib().capset(ctypes.byref(header), data)
    except (AttributeError, OSError):
        pass


def _enter_userns() -> None:
    uid, gid = os.getuid(), os.getgid()
    try:
        unshare(CLONE_NEWUSER)
    except OSError:
        return
    for path, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        try:
            with open(f"/proc/self/{path}", "w") as f:
                f.write(text)
        except OSError:
            pass


# ---------------------------------------------------------------------------------------------
# Namespaces for the no-bubblewrap mode
# ---------------------------------------------------------------------------------------------


def _enter_namespaces(args: dict, report: dict) -> None:
    """Without bubblewrap: new user (when not root), mount, pid, net, ipc and uts namespaces and the
    same minimal root filesystem as bubblewrap's.
    Returns in the inner process (pid 1 of the new pid namespace); the outer process waits for it and
    exits with its status. Whatever cannot be set up is reported, not fatal."""
    ns = report.setdefault("namespaces", {})
    euid, egid = os.geteuid(), os.getegid()
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    if euid != 0:
        flags |= CLONE_NEWUSER
    try:
        unshare(flags)
        entered = flags
    except OSError as exc:
        report.setdefault("notes", []).append(f"unshare of all namespaces failed ({exc}); trying net only")
        entered = 0
        for one in ((CLONE_NEWUSER | CLONE_NEWNET) if euid != 0 else CLONE_NEWNET,):
            try:
                unshare(one)
                entered = one
            except OSError as exc2:
                report.setdefault("notes", []).append(f"unshare(net) failed: {exc2}")
    if entered & CLONE_NEWUSER:
        for path, text in (
            ("setgroups", "deny"),
            ("uid_map", f"0 {euid} 1"),
            ("gid_map", f"0 {egid} 1"),
        ):
            with open(f"/proc/self/{path}", "w") as f:
                f.write(text)
    for name, flag in (
        ("user", CLONE_NEWUSER),
        ("mount", CLONE_NEWNS),
        ("pid", CLONE_NEWPID),
        ("net", CLONE_NEWNET),
        ("ipc", CLONE_NEWIPC),
        ("uts", CLONE_NEWUTS),
    ):
        ns[name] = bool(entered & flag)
    if entered & CLONE_NEWPID:
        pid = os.fork()
        if pid != 0:  # outer: keep nothing open, wait for the inner zygote, exit like it
            os.close(int(args["ctrl_fd"]))
            try:
                prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            except OSError:
                pass
            while True:
                try:
                    _, status = os.waitpid(pid, 0)
                    break
                except InterruptedError:
                    continue
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
        try:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass
    if entered & CLONE_NEWNS:
        try:
            _setup_mounts(args, report)
        except (OSError, KeyError) as exc:  # KeyError: no pivot_root number for this machine
            os.makedirs(args["scratch_root"], exist_ok=True)
            report["filesystem"] = f"host filesystem as is (building the minimal root failed: {exc})"
    else:
        os.makedirs(args["scratch_root"], exist_ok=True)
        report["filesystem"] = "host filesystem as is (no mount namespace); scratch on the host disk"


def _mountinfo() -> list[tuple[str, int]]:
    out = []
    flag_of = {
        "nosuid": MS_NOSUID,
        "nodev": MS_NODEV,
        "noexec": MS_NOEXEC,
        "noatime": MS_NOATIME,
        "nodiratime": MS_NODIRATIME,
        "relatime": MS_RELATIME,
        "strictatime": MS_STRICTATIME,
    }
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            target = parts[4].encode().decode("unicode_escape")
            flags = 0
            for opt in parts[5].split(","):
                flags |= flag_of.get(opt, 0)
            out.append((target, flags))
    return out


def _setup_mounts(args: dict, report: dict) -> None:
    """Build the sandbox's root as bubblewrap does, from the host's plan (read-only binds of /usr, the
    Python installation and a few /etc files), add a fresh /proc, a minimal /dev and the scratch tmpfs,
    and pivot into it: every other host path, unix sockets included, is then gone from this view."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    # The new root's tmpfs goes on the host's (empty) scratch dir; inside the new root the scratch
    # tmpfs sits at the same path, so the REPLs' scratch paths are what the host expects.
    scratch = new = args["scratch_root"]
    os.makedirs(new, exist_ok=True)
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m")
    os.umask(0o022)
    for kind, *rest in args["root_plan"]:
        if kind == "dir":
            os.makedirs(new + rest[0], exist_ok=True)
        elif kind == "symlink":
            os.symlink(rest[0], new + rest[1])
        elif kind == "ro-bind" or os.path.exists(rest[0]):  # "ro-bind-try" skips what is missing
            _bind(rest[0], new + rest[1])
    dev = new + "/dev"
    os.makedirs(dev)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=64k")
    for name in ("null", "zero", "full", "random", "urandom", "tty"):
        if os.path.exists(f"/dev/{name}"):
            _bind(f"/dev/{name}", f"{dev}/{name}")
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"{dev}/{name}")
    os.symlink("/proc/self/fd", f"{dev}/fd")
    os.mkdir(f"{dev}/shm")
    os.makedirs(new + "/proc")
    if report.get("namespaces", {}).get("pid"):
        mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    else:
        mount("/proc", new + "/proc", None, MS_BIND | MS_REC)
    os.makedirs(new + scratch)
    size = int(args.get("scratch_mb", 1024)) << 20
    mount("tmpfs", new + scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=711,size={size}")
    for target, flags in _mountinfo():  # all read-only but /proc and the scratch tmpfs
        inside = target == new or target.startswith(new + "/")
        if inside and not any(
            target == w or target.startswith(w + "/") for w in (new + "/proc", new + scratch)
        ):
            mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
    os.chdir(new)
    _check(_lib().syscall(ctypes.c_long(_seccomp.syscall_numbers()["pivot_root"]), b".", b"."), "pivot_root")
    umount(".", MNT_DETACH)  # the old root, stacked on "." by pivot_root
    os.chdir("/")
    report["filesystem"] = "minimal root"


def _bind(src: str, target: str) -> None:
    if os.path.isdir(src):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    mount(src, target, None, MS_BIND | MS_REC)
