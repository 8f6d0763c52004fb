"""Hostile code in the REPL sandbox, in each isolation mode this machine offers ("bwrap" where
bubblewrap is installed and works; "rlimits": the zygote's own namespaces and rlimits).

Every case must end as an observation (an error string or a contained result), never crash or hang the
test process, never touch the host, and leave the REPL usable (a fresh one where it had to be killed).
Python-level escapes (``__subclasses__``, ``__globals__``) are *not* prevented -- the REPL has full
builtins -- they are contained by the process boundary: whatever they reach runs as the REPL's own
unprivileged uid, inside its namespaces and limits.
"""

import asyncio
import errno
import json
import os
import signal
import socket
import tempfile
import time

import pytest

from tests.skips import skip_or_fail
from workers.sandbox import ReplSandbox, SandboxConfig, SandboxError, bwrap_path
from workers.sandbox._seccomp import CLONE_NAMESPACES, syscall_numbers
from workers.sandbox.sandbox import SANDBOX_ENV

pytestmark = pytest.mark.timeout(60)

LIMITS = dict(timeout_s=1.0, memory_mb=256, cpu_s=30, max_procs=16, max_file_mb=8, max_output_chars=2000)


def _open(mode: str, **overrides) -> ReplSandbox:
    if mode == "bwrap" and bwrap_path() is None:
        skip_or_fail("bubblewrap (bwrap) is not installed")
    try:
        return ReplSandbox(SandboxConfig(isolation=mode, **{**LIMITS, **overrides}))
    except SandboxError as exc:
        skip_or_fail(f"{mode} isolation is not available here: {exc}")


@pytest.fixture(scope="module", params=["bwrap", "rlimits"])
def sandbox(request):
    sb = _open(request.param)
    yield sb
    sb.close()


@pytest.fixture
def repl(sandbox):
    r = sandbox.create(context="secret context")
    yield r
    r.close()


def uid_separated(sandbox) -> bool:
    return sandbox.isolation_report()["uid_separation"].startswith("each REPL")


def require(sandbox, feature: str) -> None:
    """Skip (naming what is missing) where this machine does not give the sandbox ``feature``; the
    isolation report says so too. On the CI machine (root, bubblewrap) nothing is skipped."""
    report = sandbox.isolation_report()
    ns = report["namespaces"]
    have = {
        "net": ns.get("net"),
        "fs": report["filesystem"].startswith("minimal root"),
        "seccomp": report["seccomp"].startswith("seccomp-bpf"),
        "procs": "NOT enforced" not in report["limits"]["processes"],
        "signals": ns.get("pid") or uid_separated(sandbox),
    }[feature]
    if not have:
        brief = {k: report[k] for k in ("namespaces", "filesystem", "uid_separation", "seccomp")} | {
            "procs": report["limits"]["processes"]
        }
        skip_or_fail(f"{sandbox.mode} isolation here lacks {feature!r} containment: {brief}")


def assert_fresh_and_usable(repl):
    res = repl.execute("print(context, 'x' in globals())")
    assert res.error is None
    assert res.stdout == "secret context False\n"


def descendants(root: int) -> int:
    """How many processes descend from ``root`` (the sandbox's process on the host)."""
    children: dict[int, list[int]] = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(p))
    todo, seen = [root], 0
    while todo:
        for c in children.get(todo.pop(), []):
            seen += 1
            todo.append(c)
    return seen


LOOPS = {
    "plain": "while True:\n    pass",
    "catch-everything": "while True:\n    try:\n        while True:\n            pass\n    except BaseException:\n        pass",
    "signal-handlers": (
        "import signal\n"
        "for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGALRM, signal.SIGXCPU):\n"
        "    signal.signal(s, signal.SIG_IGN)\n"
        "signal.alarm(1)\n"
        "while True:\n    try:\n        while True:\n            pass\n    finally:\n        continue\n"
    ),
    "blocking-sleep": "import time\ntime.sleep(1000)",
}


@pytest.mark.parametrize("code", LOOPS.values(), ids=LOOPS.keys())
def test_infinite_loops_are_killed_from_outside(repl, code):
    repl.execute("x = 1\nopen('kept.txt', 'w').write('file')")
    t0 = time.perf_counter()
    res = repl.execute(code)
    assert time.perf_counter() - t0 < 4
    assert res.timed_out and res.killed and res.restarted
    assert res.error.startswith("TimeoutError: the code block exceeded the 1 s wall-clock limit")
    assert "variables from earlier steps are lost" in res.error
    assert_fresh_and_usable(repl)
    assert repl.execute("print(open('kept.txt').read())").stdout == "file\n"  # scratch files survive


def test_timeout_in_one_repl_leaves_a_concurrent_one_alone(sandbox):
    async def main():
        a, b = await sandbox.acreate(), await sandbox.acreate()
        try:
            await b.aexecute("state = 'mine'")
            loop_res, calm_res = await asyncio.gather(
                a.aexecute("while True:\n    pass"),
                # its own generous limit: on two busy cores b's reply may come past a's 1 s
                b.aexecute("import time\ntime.sleep(0.3)\nprint(state)", timeout_s=30),
            )
            return loop_res, calm_res
        finally:
            await a.aclose()
            await b.aclose()

    loop_res, calm_res = asyncio.run(main())
    assert loop_res.timed_out
    assert calm_res.stdout == "mine\n" and not calm_res.restarted


def test_memory_bombs_raise_memoryerror_and_keep_the_repl(repl):
    repl.execute("x = 1")
    res = repl.execute("big = bytearray(10 * 1024**3)")
    assert res.error.endswith("MemoryError") and not res.killed
    # A generous per-block timeout: filling 256 MB must end in MemoryError, also on a loaded machine.
    res = repl.execute("hoard = []\nwhile True:\n    hoard.append(bytearray(10**7))", timeout_s=10)
    assert "MemoryError" in res.error and not res.killed
    res = repl.execute("n = len(hoard)\ndel hoard\nprint(n < 26, x)")
    assert res.stdout == "True 1\n"  # limited to 256 MB; state kept


def test_fork_bomb_is_contained(sandbox, repl):
    require(sandbox, "procs")
    res = repl.execute(
        "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
        "            time.sleep(60)\n            os._exit(0)\n        n += 1\n"
        "except OSError as e:\n    print(n, e.errno)",
        timeout_s=10,
    )
    n, err = res.stdout.split()
    assert int(n) < LIMITS["max_procs"] and err == "11"  # EAGAIN from RLIMIT_NPROC

    async def bomb():
        r = await sandbox.acreate(context="secret context")
        root = sandbox._zygote.proc.pid
        baseline = descendants(root)
        task = asyncio.ensure_future(
            r.aexecute(
                "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
            )
        )
        peak = baseline
        while not task.done():
            peak = max(peak, descendants(root))
            await asyncio.sleep(0.02)
        return r, task.result(), peak - baseline

    r, res, growth = asyncio.run(bomb())
    try:
        assert res.timed_out and res.killed
        assert 4 <= growth <= LIMITS["max_procs"] + 4  # the bomb ran, and never past its limit
        assert_fresh_and_usable(r)
        if uid_separated(sandbox):
            count = (
                "import os\nme = os.getuid()\nn = 0\nfor p in os.listdir('/proc'):\n    if p.isdigit():\n"
                "        try:\n            uid = int(open(f'/proc/{p}/status').read().split('Uid:')[1].split()[0])\n"
                "        except OSError:\n            continue\n        n += uid == me\nprint(n)"
            )
            assert r.execute(count).stdout == "1\n"  # every process of the bomb is gone
    finally:
        r.close()


def test_huge_outputs_are_truncated(repl):
    res = repl.execute("print('x' * 10**8)")
    assert res.stdout == "x" * 2000 + f"\n... [truncated {10**8 + 1 - 2000} chars]"
    res = repl.execute("for i in range(300000):\n    print(i)")
    assert res.stdout.startswith("0\n1\n2\n") and "[truncated" in res.stdout and not res.timed_out
    res = repl.execute("import os\nos.system('yes | head -c 20000000')")  # fd-level, past RLIMIT_FSIZE
    assert res.stdout.startswith("y\ny\n") and len(res.stdout) < 2100 and "[truncated" in res.stdout
    assert repl.execute("print('small')").stdout == "small\n"


def test_host_files_outside_scratch_are_unreadable(sandbox, repl, tmp_path):
    require(sandbox, "fs")
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET")
    secret.chmod(0o600)
    public = tmp_path / "public.txt"
    public.write_text("PUBLIC-DATA")
    public.chmod(0o644)
    os.chmod(tmp_path, 0o755)
    # World-readable host files outside the sandbox's root are absent in both modes (this test file,
    # /etc/passwd), not merely unreadable.
    paths = [str(secret), str(public), "/etc/shadow", "/etc/passwd", os.path.abspath(__file__)]
    for path in paths:
        res = repl.execute(f"print(open({path!r}).read())")
        assert res.error is not None, path
        assert "FileNotFoundError" in res.error or "PermissionError" in res.error
        assert "SECRET" not in res.stdout and "PUBLIC" not in res.stdout
    if uid_separated(sandbox):
        other = sandbox.create()
        try:
            other.execute("open('mine.txt', 'w').write('private')")
            res = repl.execute(f"print(open({other.scratch_dir + '/mine.txt'!r}).read())")
            assert "PermissionError" in res.error  # another REPL's scratch dir
        finally:
            other.close()


def test_writes_outside_scratch_fail(sandbox, repl, tmp_path):
    require(sandbox, "fs")
    drop = tmp_path / "drop"
    drop.mkdir()
    drop.chmod(0o777)  # world-writable on the host
    targets = [str(drop / "x"), "/tmp/x", "/var/tmp/x", "/dev/shm/x", "/x", "/etc/x", "/usr/x", "/opt/x"]
    code = (
        "import os\nok = []\n"
        f"for p in {targets!r}:\n"
        "    try:\n        open(p, 'w').write('pwned')\n        ok.append(p)\n    except OSError:\n        pass\n"
        "open('inside.txt', 'w').write('fine')\n"
        "print(ok, os.path.exists('inside.txt'))"
    )
    res = repl.execute(code)
    assert res.stdout == "[] True\n"
    assert list(drop.iterdir()) == []


def test_host_environment_does_not_leak(repl):
    # Once dumpable again, a process may read its own original environment block: the zygote's,
    # which is SANDBOX_ENV only (bubblewrap adds PWD=/), not the host's (PYTEST_CURRENT_TEST, HOME, ...).
    code = (
        "import ctypes\nctypes.CDLL(None).prctl(4, 1, 0, 0, 0)\n"  # PR_SET_DUMPABLE
        "raw = open('/proc/self/environ', 'rb').read().decode()\n"
        "import json\nprint(json.dumps(dict(kv.split('=', 1) for kv in raw.split('\\0') if kv)))"
    )
    res = repl.execute(code)
    assert res.error is None, res.error
    env = json.loads(res.stdout)
    assert env.pop("PWD", "/") == "/"
    assert env == SANDBOX_ENV


def test_host_unix_sockets_are_unreachable(sandbox, repl):
    require(sandbox, "fs")
    require(sandbox, "seccomp")
    # Outside /tmp on purpose (the old rlimits mode covered /tmp but left the rest of the host tree
    # visible): a socket any user may connect to, beside this test file.
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(__file__)), prefix=".sock-") as d:
        os.chmod(d, 0o755)
        path = os.path.join(d, "host.sock")
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(path)
        os.chmod(path, 0o777)
        listener.listen()
        listener.setblocking(False)
        try:
            code = (
                "import os, socket, asyncio\n"
                f"print(os.path.exists({path!r}))\n"
                "a, b = socket.socketpair()\n"  # unconnected pairs (asyncio's self-pipe) still work
                "asyncio.run(asyncio.sleep(0))\n"
                "s = socket.socket(socket.AF_UNIX)\n"
                f"s.connect({path!r})"
            )
            res = repl.execute(code)
            assert res.stdout == "False\n"
            assert res.error.endswith("PermissionError: [Errno 1] Operation not permitted"), res.error
            with pytest.raises(BlockingIOError):
                listener.accept()  # nothing ever connected
        finally:
            listener.close()


def test_seccomp_denies_what_a_repl_never_needs(sandbox, repl):
    require(sandbox, "seccomp")
    nr = syscall_numbers()
    # Each call with harmless arguments; without the filter they succeed or fail with another errno
    # (nested user + mount namespaces and ptrace of its own child succeed).
    calls = {
        "unshare_user_mount": (nr["unshare"], 0x10000000 | 0x00020000),
        "unshare_net": (nr["unshare"], 0x40000000),
        "clone_newuser": (nr["clone"], 0x10000000 | 17),  # | SIGCHLD
        "clone_newns": (nr["clone"], 0x00020000 | 17),
        "setns": (nr["setns"], 0, 0),
        "mount": (nr["mount"], 0, 0, 0, 0, 0),
        "keyctl": (nr["keyctl"], 0, 0),
        "bpf": (nr["bpf"], 0, 0, 0),
        "perf_event_open": (nr["perf_event_open"], 0, 0, -1, -1, 0),
        "io_uring_setup": (nr["io_uring_setup"], 1, 0),
        "init_module": (nr["init_module"], 0, 0, 0),
        "open_by_handle_at": (nr["open_by_handle_at"], 0, 0, 0),
    }
    assert CLONE_NAMESPACES & 0x10000000 and CLONE_NAMESPACES & 0x00020000
    code = (
        "import ctypes, json, os, signal, subprocess, threading\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def call(nr, *args):\n"
        "    ctypes.set_errno(0)\n"
        "    rc = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])\n"
        "    if rc == 0 and os.getpid() != me:\n"
        "        os._exit(0)\n"  # a clone that went through: the child leaves at once
        "    return ctypes.get_errno() if rc == -1 else 0\n"
        "me = os.getpid()\n"
        f"out = {{k: call(*v) for k, v in {calls!r}.items()}}\n"
        "pid = os.fork()\n"
        "if pid == 0:\n    import time\n    time.sleep(30)\n    os._exit(0)\n"
        f"out['ptrace_attach_own_child'] = call({nr['ptrace']}, 16, pid, 0, 0)\n"
        "os.kill(pid, signal.SIGKILL)\nos.waitpid(pid, 0)\n"
        f"out['clone3'] = call({nr['clone3']}, 0, 0)\n"
        "out['seccomp_mode'] = open('/proc/self/status').read().split('Seccomp:')[1].split()[0]\n"
        "t = threading.Thread(target=lambda: None)\nt.start()\nt.join()\n"  # threads and
        "out['subprocess'] = subprocess.run(['echo', 'ok'], capture_output=True, text=True).stdout\n"  # forks work
        "print(json.dumps(out))"
    )
    res = repl.execute(code)
    assert res.error is None, res.error
    out = json.loads(res.stdout)
    assert out.pop("seccomp_mode") == "2" and out.pop("subprocess") == "ok\n"
    assert out.pop("clone3") == errno.ENOSYS  # so the C library falls back to clone, which is checked
    assert out == {k: errno.EPERM for k in out}


def test_file_size_limit(repl):
    res = repl.execute("open('big.bin', 'wb').write(b'0' * (9 * 1024**2))")
    assert "File too large" in res.error and not res.killed
    assert repl.execute("print(1)").stdout == "1\n"


def test_no_network(sandbox, repl):
    require(sandbox, "net")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        for host in ("127.0.0.1", "1.1.1.1"):
            res = repl.execute(f"import socket\nsocket.create_connection(({host!r}, {port}), timeout=1)")
            assert res.error is not None and ("Error" in res.error or "timed out" in res.error)
        res = repl.execute("import socket\nsocket.getaddrinfo('example.com', 80)")
        assert "gaierror" in res.error
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever connected
    finally:
        listener.close()


def test_killing_the_parent_or_everything_touches_no_one_else(sandbox, repl):
    require(sandbox, "signals")
    bystander = sandbox.create()
    try:
        bystander.execute("v = 'still here'")
        for code in (
            "import os\nos.kill(os.getppid(), 9)",
            "import os\nos.kill(1, 9)",
            f"import os\nos.kill({os.getpid()}, 9)",
        ):
            res = repl.execute(code)
            assert not res.killed
            assert res.error is None or "PermissionError" in res.error or "ProcessLookupError" in res.error
        res = repl.execute("import os\nos.kill(-1, 9)\nprint('alive')")  # only its own processes
        assert res.stdout == "alive\n" or "ProcessLookupError" in res.error
        for sig in ("SIGKILL", "SIGTERM"):  # its own process group, itself included
            res = repl.execute(f"import os, signal\nos.killpg(0, signal.{sig})")
            assert res.killed and res.restarted
            # The real signal and cause, not a guess at a limit.
            assert f"killed by {sig}, sent from inside the sandbox by its own code" in res.error, res.error
            assert "not a limit" in res.error and "CPU hard limit" not in res.error
            assert_fresh_and_usable(repl)
        assert bystander.execute("print(v)").stdout == "still here\n"
    finally:
        bystander.close()


def test_escapes_via_subclasses_and_globals_stay_inside(sandbox, repl, tmp_path):
    require(sandbox, "fs")
    drop = tmp_path / "escape"
    drop.mkdir()
    drop.chmod(0o777)
    a, b = drop / "via_subclasses", drop / "via_globals"
    code = (
        "cw = [c for c in ().__class__.__base__.__subclasses__() if c.__name__ == 'catch_warnings'][0]\n"
        "os_ = cw()._module.__builtins__['__import__']('os')\n"
        f"rc1 = os_.system('touch {a}')\n"
        "g = FINAL.__globals__\n"  # the REPL runtime's module globals
        f"rc2 = g['os'].system('touch {b}')\n"
        "import stat\n"
        "socks = [fd for fd in range(3, 256) if os_.path.exists(f'/proc/self/fd/{fd}')\n"
        "         and stat.S_ISSOCK(os_.fstat(fd).st_mode)]\n"
        "print(rc1 != 0, rc2 != 0, os_.getuid(), len(socks))"
    )
    res = repl.execute(code)
    assert res.error is None, res.error
    failed1, failed2, uid, n_socks = res.stdout.split()
    assert failed1 == failed2 == "True"
    assert not a.exists() and not b.exists()
    assert n_socks == "1"  # only its own channel to the host: no handle on the zygote
    if uid_separated(sandbox):
        assert int(uid) != 0


def test_process_death_and_protocol_abuse_become_observations(repl):
    res = repl.execute("x = 1\nimport os\nos._exit(3)")
    assert res.killed and res.restarted and "exited with code 3" in res.error
    assert_fresh_and_usable(repl)
    res = repl.execute("x = 1\nimport ctypes\nctypes.string_at(0)")  # segfault
    assert res.killed and res.restarted and "SIGSEGV" in res.error
    assert_fresh_and_usable(repl)
    garbage = (
        "import os, stat\n"
        "fd = [f for f in range(3, 64) if os.path.exists(f'/proc/self/fd/{f}') and stat.S_ISSOCK(os.fstat(f).st_mode)][0]\n"
        "os.write(fd, b'\\xff\\xff\\xff\\xff')\n"
        "import time\ntime.sleep(0.5)"
    )
    res = repl.execute(garbage)
    assert res.killed and res.restarted and "ProtocolError" in res.error
    assert_fresh_and_usable(repl)


def test_a_process_killed_at_its_cpu_hard_limit_is_told_so_while_another_process_is_oom_killed():
    """The machine's OOM kill count is global: a concurrent test's OOM kill raised it while a REPL ran into
    its CPU hard limit, and that REPL was told the OOM killer ended it (CI at afe6519)."""
    from workers.sandbox.protocol import _describe_exit

    at_cpu_limit = {"signal": signal.SIGKILL, "cpu_s": 2.02, "oom_kills": 1}
    assert "CPU hard limit of 2 s exceeded" in _describe_exit(at_cpu_limit, cpu_s=1)
    oom_killed = {"signal": signal.SIGKILL, "cpu_s": 0.3, "oom_kills": 1}
    assert "out-of-memory killer" in _describe_exit(oom_killed, cpu_s=1)


@pytest.mark.parametrize("mode", ["bwrap", "rlimits"])
def test_cpu_limit_kills_a_spinning_background_thread(mode):
    sb = _open(mode, cpu_s=1, timeout_s=10)
    try:
        with sb.create(context="secret context") as r:
            res = r.execute(
                "import threading\ndef spin():\n    while True:\n        pass\nthreading.Thread(target=spin).start()"
            )
            assert res.ok  # the block itself returns at once; the thread keeps burning CPU
            deadline = time.monotonic() + 10
            while r.alive and time.monotonic() < deadline:
                time.sleep(0.05)
            res = r.execute("print(context)")
            assert res.restarted and "CPU time limit of 1 s exceeded" in res.stderr
            assert res.stdout == "secret context\n"
            # A REPL that ignores SIGXCPU is SIGKILLed at the hard limit, and that is what it is told.
            res = r.execute(
                "import signal, threading\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\n"
                "def spin():\n    while True:\n        pass\nthreading.Thread(target=spin).start()"
            )
            deadline = time.monotonic() + 25  # 2 s of CPU time: longer in wall time on a loaded machine
            while r.alive and time.monotonic() < deadline:
                time.sleep(0.05)
            res = r.execute("print(context)")
            assert res.restarted and "killed by SIGKILL: CPU hard limit of 2 s exceeded" in res.stderr
    finally:
        sb.close()


def test_sandbox_survives_its_zygote_dying(sandbox):
    with sandbox.create(context="secret context") as r:
        r.execute("x = 1")
        zygote = sandbox._zygote
        zygote.proc.kill()  # simulate a crash of the fork server (and with it its whole pid namespace)
        deadline = time.monotonic() + 10
        while zygote.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not zygote.alive
        res = r.execute("print(context)")
        assert res.restarted and res.stdout == "secret context\n"
        with sandbox.create() as other:
            assert other.execute("print(2)").stdout == "2\n"


def test_a_forked_child_running_off_the_block_cannot_answer_for_the_repl(repl):
    res = repl.execute("import os\npid = os.fork()\nprint('hello from', 'child' if pid == 0 else 'parent')")
    assert res.stdout.count("hello from parent") == 1
    for i in range(3):  # no stray result from the child is taken for a later block
        assert repl.execute(f"print({i})").stdout == f"{i}\n"
    res = repl.execute("print('\\ud800 lone surrogate')")
    assert res.stdout == "? lone surrogate\n"


def test_hostile_objects_cannot_break_the_runtime(sandbox):
    with sandbox.create(context=["a", "b"]) as r:
        code = (
            "class Evil:\n"
            "    def __eq__(self, other):\n        raise RuntimeError('eq')\n"
            "    @property\n    def __class__(self):\n        raise RuntimeError('class')\n"
            "    def __str__(self):\n        raise RuntimeError('str')\n"
            "context.append(Evil())\n"
            "evil = Evil()\n"
        )
        res = r.execute(code)
        assert res.error is None and ("evil", "Evil") in res.variables
        assert r.execute("print(context)").stdout == "['a', 'b']\n"
        res = r.execute("FINAL_VAR('evil')")
        assert "RuntimeError: str" in res.error and res.final_answer is None
        assert not res.killed
