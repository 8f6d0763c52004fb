"""The seccomp filter of a REPL process: a classic-BPF program installed with prctl(2) through ctypes.

A hand-written program rather than libseccomp: it needs nothing installed (libseccomp's Python
bindings are not on PyPI as wheels; Debian's ``python3-seccomp`` is built for the system Python and
lives outside the project's venv; ``pyseccomp`` from PyPI wraps ``libseccomp.so``, which would have to
exist inside the sandbox's root), and the rules are few enough to read in full here.

Denied with EPERM (a REPL never needs them): tracing other processes, mounts and namespaces, keys,
eBPF, perf, kernel modules and kexec, io_uring (its operations bypass seccomp), clocks and host
names, memfd files and SysV / POSIX-message-queue IPC (memory outside RLIMIT_AS, channels between
trajectories), and ``socket()`` of every family but IP and netlink. Path-based rules are not
expressible in seccomp (it sees pointers, not paths), so AF_UNIX socket creation is refused outright: a
REPL's channel to the host is an inherited socket and ``socketpair`` (asyncio's self-pipe) still works. ``clone`` with a namespace
flag fails with EPERM; ``clone3`` (whose flags sit behind a pointer) fails with ENOSYS, so the C
library falls back to ``clone`` for threads and forks. A system call of another ABI (i386 or x32 on
x86_64) kills the process.

Standard library only: the sandbox's zygote imports this file beside ``_child.py``.
"""

import ctypes
import ctypes.util
import errno
import functools
import platform
import socket

DENIED = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "unshare",
    "setns",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "open_by_handle_at",
    "name_to_handle_at",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "syslog",
    "settimeofday",
    "clock_settime",
    "adjtimex",
    "clock_adjtime",
    "sethostname",
    "setdomainname",
    "fanotify_init",
    "iopl",
    "ioperm",
    "uselib",
    # Memory that RLIMIT_AS does not count (memfd files, SysV segments that outlive the REPL) and IPC
    # objects another trajectory could read: SysV shared memory, message queues and semaphores, POSIX
    # message queues.
    "memfd_create",
    "memfd_secret",
    "shmget",
    "shmat",
    "shmctl",
    "shmdt",
    "msgget",
    "msgsnd",
    "msgrcv",
    "msgctl",
    "semget",
    "semop",
    "semtimedop",
    "semctl",
    "mq_open",
    "mq_unlink",
    "mq_timedsend",
    "mq_timedreceive",
    "mq_notify",
    "mq_getsetattr",
)

# From the kernel's uapi headers (asm/unistd_64.h and asm-generic/unistd.h); x86_64-only calls are
# absent from the aarch64 table.
_X86_64 = dict(
    ptrace=101, process_vm_readv=310, process_vm_writev=311, pidfd_getfd=438, mount=165, umount2=166,
    pivot_root=155, chroot=161, move_mount=429, open_tree=428, fsopen=430, fsconfig=431, fsmount=432,
    fspick=433, mount_setattr=442, unshare=272, setns=308, keyctl=250, add_key=248, request_key=249,
    bpf=321, perf_event_open=298, userfaultfd=323, kexec_load=246, kexec_file_load=320, init_module=175,
    finit_module=313, delete_module=176, reboot=169, swapon=167, swapoff=168, acct=163, quotactl=179,
    open_by_handle_at=304, name_to_handle_at=303, io_uring_setup=425, io_uring_enter=426,
    io_uring_register=427, syslog=103, settimeofday=164, clock_settime=227, adjtimex=159,
    clock_adjtime=305, sethostname=170, setdomainname=171, fanotify_init=300, iopl=172, ioperm=173,
    uselib=134, memfd_create=319, memfd_secret=447, shmget=29, shmat=30, shmctl=31, shmdt=67, msgget=68,
    msgsnd=69, msgrcv=70, msgctl=71, semget=64, semop=65, semtimedop=220, semctl=66, mq_open=240,
    mq_unlink=241, mq_timedsend=242, mq_timedreceive=243, mq_notify=244, mq_getsetattr=245, clone=56,
    clone3=435, socket=41,
)  # fmt: skip
_AARCH64 = dict(
    ptrace=117, process_vm_readv=270, process_vm_writev=271, pidfd_getfd=438, mount=40, umount2=39,
    pivot_root=41, chroot=51, move_mount=429, open_tree=428, fsopen=430, fsconfig=431, fsmount=432,
    fspick=433, mount_setattr=442, unshare=97, setns=268, keyctl=219, add_key=217, request_key=218,
    bpf=280, perf_event_open=241, userfaultfd=282, kexec_load=104, kexec_file_load=294, init_module=105,
    finit_module=273, delete_module=106, reboot=142, swapon=224, swapoff=225, acct=89, quotactl=60,
    open_by_handle_at=265, name_to_handle_at=264, io_uring_setup=425, io_uring_enter=426,
    io_uring_register=427, syslog=116, settimeofday=170, clock_settime=112, adjtimex=171,
    clock_adjtime=266, sethostname=161, setdomainname=162, fanotify_init=262, memfd_create=279,
    memfd_secret=447, shmget=194, shmat=196, shmctl=195, shmdt=197, msgget=186, msgsnd=189, msgrcv=188,
    msgctl=187, semget=190, semop=193, semtimedop=192, semctl=191, mq_open=180, mq_unlink=181,
    mq_timedsend=182, mq_timedreceive=183, mq_notify=184, mq_getsetattr=185, clone=220, clone3=435,
    socket=198,
)  # fmt: skip
# machine -> (AUDIT_ARCH_* value, syscall numbers, first number of a foreign ABI sharing the arch)
_ARCHES = {"x86_64": (0xC000003E, _X86_64, 0x40000000), "aarch64": (0xC00000B7, _AARCH64, None)}

CLONE_NAMESPACES = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
# The only socket families a REPL may create: IP (inside its own network namespace) and netlink (the C
# library's address lookups). AF_UNIX is absent (seccomp cannot see paths; socketpair still works), and so
# are vsock (the hypervisor's host), packet, alg and the rest of the kernel's families.
SOCKET_FAMILIES = (socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK)

# Classic BPF opcodes and seccomp return values (linux/filter.h, linux/seccomp.h).
_LD_ABS_W, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _ERRNO, _KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in struct seccomp_data (arg0's low 32 bits on little-endian)
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2


def syscall_numbers() -> dict[str, int]:
    """This machine's numbers of the calls the filter names ({} where the filter is not available)."""
    return dict(_ARCHES.get(platform.machine(), (0, {}, None))[1])


def program() -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions for this machine's architecture."""
    machine = platform.machine()
    if machine not in _ARCHES:
        raise OSError(errno.ENOSYS, f"no seccomp filter for the {machine} architecture")
    arch, nrs, foreign = _ARCHES[machine]
    eperm, enosys = _ERRNO | errno.EPERM, _ERRNO | errno.ENOSYS
    prog = [(_LD_ABS_W, 0, 0, _ARCH), (_JEQ, 1, 0, arch), (_RET, 0, 0, _KILL_PROCESS), (_LD_ABS_W, 0, 0, _NR)]
    if foreign is not None:
        prog += [(_JGE, 0, 1, foreign), (_RET, 0, 0, _KILL_PROCESS)]
    for name in DENIED:
        if name in nrs:
            prog += [(_JEQ, 0, 1, nrs[name]), (_RET, 0, 0, eperm)]
    prog += [(_JEQ, 0, 1, nrs["clone3"]), (_RET, 0, 0, enosys)]
    # clone: deny namespace flags in arg 0.
    prog += [(_JEQ, 0, 4, nrs["clone"]), (_LD_ABS_W, 0, 0, _ARG0), (_JSET, 0, 1, CLONE_NAMESPACES)]
    prog += [(_RET, 0, 0, eperm), (_RET, 0, 0, _ALLOW)]
    # socket: allow the families of SOCKET_FAMILIES in arg 0, deny every other.
    n = len(SOCKET_FAMILIES)
    prog += [(_JEQ, 0, n + 2, nrs["socket"]), (_LD_ABS_W, 0, 0, _ARG0)]
    prog += [(_JEQ, n - i, 0, int(family)) for i, family in enumerate(SOCKET_FAMILIES)]
    prog += [(_RET, 0, 0, eperm)]
    prog.append((_RET, 0, 0, _ALLOW))
    return prog


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


@functools.cache
def prepare() -> tuple:
    """The compiled filter and libc, built once (the zygote calls this, so that a forked REPL only
    makes the prctl call: find_library runs ldconfig). Raises OSError on an unsupported machine."""
    prog = program()
    insns = (_SockFilter * len(prog))(*[_SockFilter(*i) for i in prog])
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return libc, _SockFprog(len(prog), insns), insns


def install() -> None:
    """Install the filter on the calling thread (and what it forks); needs PR_SET_NO_NEW_PRIVS set
    first unless the caller holds CAP_SYS_ADMIN. Raises OSError when it cannot be installed."""
    libc, fprog, _ = prepare()
    rc = libc.prctl(PR_SET_SECCOMP, ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(fprog), 0, 0)
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp filter: {errno.errorcode.get(err, err)}")


def describe() -> str:
    """One line for the isolation report."""
    return (
        f"seccomp-bpf filter on every REPL process: EPERM for {', '.join(n for n in DENIED if n in syscall_numbers())}, "
        "clone with namespace flags and socket() of any family but AF_INET, AF_INET6 and AF_NETLINK "
        "(socketpair allowed); ENOSYS for clone3; "
        "calls of another ABI kill the process"
    )
