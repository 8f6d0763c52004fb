"""The zygote: the sandbox's fork server. It probes what isolation works here (a uid per REPL, the
seccomp filter), then serves the host's control socket: it forks a REPL per "spawn" (with the socket
the host passed along), SIGKILLs every process of a slot on "kill" and "release", and reports each
REPL's exit (with what the host needs to name the cause).

Standard library only; a module of the zygote (see ``_child.py``).
"""

import itertools
import os
import select
import signal
import socket
import sys
import time

# Type checkers treat a name TYPE_CHECKING as true, so they read only the package imports below (the
# zygote's copies are the same modules); a constant, not typing's, keeps the zygote's imports minimal.
TYPE_CHECKING = False

if TYPE_CHECKING or __package__:
    from workers.sandbox import _seccomp
    from workers.sandbox._linux import CLONE_NEWUSER, PR_SET_NO_NEW_PRIVS, _lib, prctl
    from workers.sandbox._repl_process import _repl_child
    from workers.sandbox._wire import recv_frame, send_frame
else:  # in the zygote, which imports its modules from its own folder (see _child.py)
    import _seccomp
    from _linux import CLONE_NEWUSER, PR_SET_NO_NEW_PRIVS, _lib, prctl
    from _repl_process import _repl_child
    from _wire import recv_frame, send_frame


RM = "/bin/rm" if os.path.exists("/bin/rm") else "/usr/bin/rm"
CGROUP_FAILED = 72  # exit code of a REPL that could not enter its memory cgroup
KILLER_SLOT = 4095  # the uid block's uid that kill helpers run as (see _kill_uid)
HELPER_DEADLINE_S = 1.0  # a kill helper still running after this is stuck (or stopped): killed


class _Zygote:
    def __init__(self, args: dict):
        self.args = args
        self.ctrl = socket.socket(fileno=int(args["ctrl_fd"]))
        self.ctrl.setblocking(True)
        self.uid_base: int | None = args.get("uid_base")
        self.uid_sep = False
        self.seccomp = False
        self.scratch_root = args["scratch_root"]
        self.children: dict[int, tuple[int, int, int]] = {}  # pid -> (slot, gen, OOM kills at spawn)
        self.slot_pid: dict[int, int] = {}
        self.report: dict = dict(args.get("report") or {})
        self.wake_r, self.wake_w = os.pipe()
        self.stuck_helpers = 0
        self.removers: dict[int, tuple[object, str]] = {}  # pid of an `rm -rf` -> (request id, path)
        self.hooks: dict = {}  # set by tests only ("test_hooks"): e.g. widen the kill helper's window

    # -- setup ----------------------------------------------------------------------------------

    def setup(self) -> None:
        for name in self.args.get("preimport", []):
            try:
                __import__(name)
            except Exception:
                pass
        self.report["uid_separation"] = self._probe_uid()
        self.uid_sep = self.report["uid_separation"] == "ok"
        self.report["seccomp"] = self._probe_seccomp()
        self.seccomp = self.report["seccomp"] == "ok"
        os.makedirs(self.scratch_root, exist_ok=True)
        os.chmod(self.scratch_root, 0o711)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: os._exit(0))

    def _probe_uid(self) -> str:
        """Can a forked child switch to the slot uids and still read the Python installation?"""
        if self.uid_base is None:
            return "not attempted (not root)"
        uid = int(self.uid_base)
        paths = [os.path.dirname(os.__file__)] + [p for p in self.args.get("python_paths", []) if p]
        paths = [p for p in paths if os.path.isdir(p)]  # as seen by the zygote
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
            except OSError:
                code = 2
            if code == 0 and not all(os.access(p, os.R_OK | os.X_OK) for p in paths):
                code = 3
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        return {0: "ok", 2: "setresuid failed", 3: "python installation not readable by the slot uid"}.get(
            code, f"probe failed ({code})"
        )

    def _probe_seccomp(self) -> str:
        """Does the REPL's seccomp filter install here, and does it refuse a nested user namespace?"""
        try:
            _seccomp.prepare()
        except OSError as exc:
            return f"not available: {exc.strerror}"
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                prctl(PR_SET_NO_NEW_PRIVS, 1)
                _seccomp.install()
            except OSError:
                code = 2
            if code == 0 and _lib().unshare(CLONE_NEWUSER) == 0:
                code = 3
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        return {0: "ok", 2: "the kernel refused the filter", 3: "installed but not enforced"}.get(
            code, f"probe failed ({code})"
        )

    # -- main loop ------------------------------------------------------------------------------

    def loop(self) -> None:
        send_frame(self.ctrl, {"op": "ready", "report": self.report, "pid": os.getpid()})
        watched: list[socket.socket | int] = [self.ctrl, self.wake_r]
        while True:
            try:
                ready, _, _ = select.select(watched, [], [])
            except InterruptedError:
                ready = []
            if self.wake_r in ready:
                try:
                    os.read(self.wake_r, 4096)
                except BlockingIOError:
                    pass
            self._reap()
            if self.ctrl in ready:
                fds: list[int] = []
                try:
                    msg = recv_frame(self.ctrl, fds)
                except (EOFError, OSError, ValueError):
                    self._shutdown()
                    return
                try:
                    reply = self._handle(msg, fds)
                except Exception as exc:
                    for fd in fds:
                        _close(fd)
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                if reply is not None:  # None: answered later (a release, once its scratch dir is gone)
                    self._reply(msg.get("rid"), reply)
                if msg.get("op") == "shutdown":
                    self._shutdown()
                    return

    def _reply(self, rid, reply: dict) -> None:
        reply["rid"] = rid
        reply["op"] = "reply"
        send_frame(self.ctrl, reply)

    def _handle(self, msg: dict, fds: list) -> dict | None:
        op = msg.get("op")
        if op == "spawn":
            scratch = self._scratch(int(msg["slot"]), int(msg["trajectory"]))
            cgroup_fd = fds[1] if len(fds) > 1 else None  # the slot's memory cgroup, where the host has one
            return self._spawn(
                int(msg["slot"]), int(msg["gen"]), fds[0], cgroup_fd, scratch, msg.get("limits") or {}
            )
        if op == "kill":
            return self._kill(int(msg["slot"]))
        if op == "release":
            out = self._kill(int(msg["slot"]))
            if not out["ok"]:
                return out
            self._remove(self._scratch(int(msg["slot"]), int(msg["trajectory"])), msg.get("rid"))
            return None
        if op == "shutdown":
            return {"ok": True}
        if op == "test_hooks":
            self.hooks.update(msg)
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def _scratch(self, slot: int, trajectory: int) -> str:
        """A trajectory's own scratch dir: a name no later trajectory of the slot (same uid) uses, so a
        dir whose removal failed is never handed on."""
        return os.path.join(self.scratch_root, f"repl-{slot}.{trajectory}")

    def _remove(self, path: str, rid) -> None:
        """Remove a released REPL's scratch dir (its processes are dead) in a child running
        ``rm -rf``, which handles any depth, count, names and permissions without recursion limits and
        keeps this loop free while it works; the release is answered when it exits (``_reap``). The
        dir is first made root's, so even a failed removal leaves nothing the slot's uid can enter."""
        if not os.path.lexists(path):
            self._reply(rid, {"ok": True, "cleanup": "ok"})
            return
        try:
            os.chown(path, 0, 0, follow_symlinks=False)
            os.chmod(path, 0o700)
        except OSError:
            pass
        if not self.hooks.get("fail_next_cleanup") and _remove_flat(path):
            self._reply(rid, {"ok": True, "cleanup": "ok"})
            return
        argv = [RM, "-rf", "--one-file-system", "--", path]
        if self.hooks.pop("fail_next_cleanup", False):  # tests: a removal that fails
            argv = [RM, "--no-such-option"]
        pid = os.fork()
        if pid == 0:
            try:
                os.closerange(3, os.sysconf("SC_OPEN_MAX"))
                os.execv(RM, argv)
            finally:
                os._exit(127)
        self.removers[pid] = (rid, path)

    def _uid(self, slot: int) -> int | None:
        if not self.uid_sep:
            return None
        assert self.uid_base is not None  # uid_sep: the probe ran with a uid_base
        return int(self.uid_base) + slot

    def _spawn(self, slot: int, gen: int, sock_fd: int, cgroup_fd, scratch: str, limits: dict) -> dict:
        uid = self._uid(slot)
        if not os.path.isdir(scratch):  # a restart after a kill keeps the trajectory's files
            os.makedirs(scratch)
        if uid is not None:
            os.chown(scratch, uid, uid)
        os.chmod(scratch, 0o700)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:
            code = 70
            try:
                if cgroup_fd is not None:  # into the slot's memory cgroup before anything else
                    code = CGROUP_FAILED
                    os.write(cgroup_fd, b"0")
                    os.close(cgroup_fd)
                    code = 70
                _repl_child(self.ctrl, self.seccomp, sock_fd, scratch, uid, limits)
                code = 0
            except BaseException:  # noqa: B036
                code = 71 if code == 70 else code
            finally:
                os._exit(code)
        _close(sock_fd)
        if cgroup_fd is not None:
            _close(cgroup_fd)
        self.children[pid] = (slot, gen, _oom_kills())
        self.slot_pid[slot] = pid
        return {"ok": True, "pid": pid, "scratch": scratch, "uid": uid}

    def _reap(self) -> None:
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.removers:
                self._removed(pid, status)
                continue
            owner = self.children.pop(pid, None)
            if owner is None:
                continue
            slot, gen, oom_at_start = owner
            if self.slot_pid.get(slot) == pid:
                del self.slot_pid[slot]
            info = {"op": "exited", "slot": slot, "gen": gen}
            if os.WIFSIGNALED(status):
                # What the host needs to name the cause: the process's own CPU time (RLIMIT_CPU) and
                # whether the kernel's OOM killer ran meanwhile; anything else came from inside.
                info["signal"] = os.WTERMSIG(status)
                info["cpu_s"] = round(usage.ru_utime + usage.ru_stime, 3)
                info["oom_kills"] = _oom_kills() - oom_at_start
                info["uid_separation"] = self.uid_sep
            else:
                info["code"] = os.waitstatus_to_exitcode(status)
            try:
                send_frame(self.ctrl, info)
            except OSError:
                pass

    def _removed(self, pid: int, status: int) -> None:
        rid, path = self.removers.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if not os.path.lexists(path):
            self._reply(rid, {"ok": True, "cleanup": "ok"})
            return
        self._reply(
            rid,
            {
                "ok": True,
                "cleanup": f"failed: rm -rf exited with {code}; {path} is left, owned by root, never reused",
            },
        )

    def _kill(self, slot: int) -> dict:
        """SIGKILL every process of the slot: all processes of its uid (one kill(-1) as that uid is
        atomic against fork bombs), or its process group where there is no uid separation."""
        uid = self._uid(slot)
        main = self.slot_pid.get(slot)
        deadline = time.monotonic() + 5.0
        remaining = True
        while time.monotonic() < deadline:
            if uid is not None:
                self._kill_uid(uid)
                self._reap()
                remaining = _uid_has_processes(uid)
            else:
                remaining = False
                if main is not None:
                    for target in (lambda: os.killpg(main, signal.SIGKILL), lambda: os.kill(main, 9)):
                        try:
                            target()
                            remaining = True
                        except OSError:
                            pass
            self._reap()
            if not remaining and slot not in self.slot_pid:
                return {"ok": True, "stuck_helpers": self.stuck_helpers}
            time.sleep(0.002)
        return {"ok": False, "error": "processes of the slot survived SIGKILL for 5 s"}

    def _kill_uid(self, uid: int) -> None:
        """kill(-1, SIGKILL) from a helper whose effective uid is ``uid``: it reaches exactly the
        processes of that uid in this pid namespace, all at once (a fork in progress cannot outrun it).

        The helper's real and saved uid are the block's killer uid, which no REPL runs as: a process
        may signal another only if its uid matches the target's real or saved uid, so the REPL's
        processes can see the helper but never stop or kill it, and kill(-1) reaches no one else.
        A helper that does not finish within HELPER_DEADLINE_S is killed (it is root's child) and
        counted; the caller tries again."""
        pause = self.hooks.pop("kill_helper_pause_s", 0)  # tests: the next helper waits before it acts
        pid = os.fork()
        if pid == 0:
            try:
                killer = self._killer_uid()
                os.setgroups([])
                os.setresgid(killer, uid, killer)
                os.setresuid(killer, uid, killer)
                time.sleep(pause)
                os.kill(-1, signal.SIGKILL)
            except BaseException:  # noqa: B036
                pass
            os._exit(0)
        deadline = time.monotonic() + HELPER_DEADLINE_S
        while True:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                return
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                self.stuck_helpers += 1
                return
            time.sleep(0.001)

    def _killer_uid(self) -> int:
        """The uid block's last uid: never a slot's (``SandboxConfig.max_repls`` stays below it)."""
        assert self.uid_base is not None  # only called with uid_sep (a slot uid to kill)
        return int(self.uid_base) + KILLER_SLOT

    def _shutdown(self) -> None:
        for slot in list(self.slot_pid):
            try:
                self._kill(slot)
            except Exception:
                pass


def _remove_flat(path: str, most: int = 64) -> bool:
    """Remove a dir of at most ``most`` entries and no subdirectories here and now (the common case,
    without a process to start); False, having perhaps removed some, for anything else."""
    try:
        with os.scandir(path) as it:
            entries = list(itertools.islice(it, most + 1))
        if len(entries) > most or any(e.is_dir(follow_symlinks=False) for e in entries):
            return False
        for e in entries:
            os.unlink(e.path)
        os.rmdir(path)
        return True
    except OSError:
        return False


def _oom_kills() -> int:
    """The kernel's count of out-of-memory kills since boot (0 where /proc/vmstat lacks it)."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _uid_has_processes(uid: int) -> bool:
    """Is any process (zombies included) of real uid ``uid`` visible in /proc?"""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            return True
                        break
        except (OSError, ValueError, IndexError):
            continue
    return False


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
