"""The second class of hostile REPL code (issue 57): memory held outside the address space, IPC between
trajectories, scratch directories built to resist removal, a racing of the timeout's kill path, replies
that would amplify in the host, and socket families a REPL never needs. Run in each isolation mode.

Each attack here is written by us (the held-out corpus stays held out); each failed on the sandbox before
the fixes it names.
"""

import asyncio
import errno
import json
import logging
import time
import tracemalloc

import pytest

from tests.workers.sandbox.test_hostile import _open, require

pytestmark = pytest.mark.timeout(90)

# A libc handle and the SysV / POSIX IPC calls, as REPL code would reach them with ctypes.
LIBC = (
    "import ctypes, errno, json, os\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "def err(rc):\n"
    "    return ctypes.get_errno() if rc == -1 else 0\n"
)


@pytest.fixture(scope="module", params=["bwrap", "rlimits"])
def sandbox(request):
    sb = _open(request.param, max_repls=4)
    yield sb
    sb.close()


def run(repl, code: str, **kw) -> dict:
    res = repl.execute(code, **kw)
    assert res.error is None, res.error
    return json.loads(res.stdout.strip().splitlines()[-1])


# -- memory outside the address-space limit -------------------------------------------------------------


def test_memory_outside_the_address_space_cannot_be_held(sandbox):
    """memfd files and SysV segments hold memory that RLIMIT_AS does not count (a SysV segment even
    outlives its REPL); both are refused, and POSIX shared memory has no writable /dev/shm."""
    require(sandbox, "seccomp")
    with sandbox.create() as repl:
        out = run(
            repl,
            LIBC + "out = {}\n"
            "try:\n"
            "    fd = os.memfd_create('hoard')\n"
            "    os.ftruncate(fd, 1 << 20)\n"
            "    out['memfd'] = 0\n"
            "except OSError as e:\n"
            "    out['memfd'] = e.errno\n"
            "IPC_PRIVATE, IPC_CREAT = 0, 0o1000\n"
            "out['shmget'] = err(libc.shmget(IPC_PRIVATE, ctypes.c_size_t(512 << 20), IPC_CREAT | 0o600))\n"
            "try:\n"
            "    open('/dev/shm/hoard', 'wb').write(b'x' * 4096)\n"
            "    out['dev_shm'] = 0\n"
            "except OSError as e:\n"
            "    out['dev_shm'] = e.errno\n"
            "print(json.dumps(out))",
        )
    assert out["memfd"] == errno.EPERM and out["shmget"] == errno.EPERM
    assert out["dev_shm"] in (errno.ENOENT, errno.EROFS, errno.EACCES)


HOARD_FILES = (
    "import os\n"
    "n = 0\n"
    "try:\n"
    "    while True:\n"
    "        open(f'hoard{n}', 'wb').write(b'x' * (8 << 20))\n"  # max_file_mb is 8
    "        n += 1\n"
    "except OSError as e:\n"
    "    print(n, e.errno)\n"
)


def test_files_in_memory_count_against_the_repls_memory(sandbox):
    """tmpfs files are memory RLIMIT_AS does not see. With a memory cgroup per REPL (opt-in, where the
    host may create one; the report says which) a REPL writing files dies by the OOM killer at
    memory_mb (256 MB), and a concurrent REPL keeps its state."""
    accounted = _open(sandbox.mode, memory_cgroup=True)
    try:
        memory = accounted.isolation_report()["memory"]
        if "a memory cgroup per REPL" not in memory:
            pytest.skip(f"no memory cgroups on this machine: {memory}")
        with accounted.create() as calm, accounted.create() as hoarder:
            calm.execute("state = 'mine'")
            res = hoarder.execute(HOARD_FILES, timeout_s=60)
            assert res.killed and "out-of-memory killer" in res.error, (res.stdout, res.error)
            kept = hoarder.execute("import os\nprint(sum(os.path.getsize(f) for f in os.listdir('.')) >> 20)")
            assert int(kept.stdout) < 256  # the files written before the kill (kept for the restarted REPL)
            assert calm.execute("print(state)").stdout == "mine\n"
            # The hoarder's OOM kill is its own cgroup's: the calm REPL, alive all along, killing itself
            # is told it was its own signal, not the OOM killer (the machine's count rose meanwhile).
            res = calm.execute("import os, signal\nos.killpg(0, signal.SIGKILL)")
            assert res.killed and "sent from inside the sandbox" in res.error, res.error
    finally:
        accounted.close()


def test_without_a_memory_cgroup_files_are_capped_by_the_scratch_tmpfs(sandbox):
    """The fallback where no cgroup can be made: the scratch tmpfs's size (scratch_mb) bounds what files
    hold (eight 8 MB files fill 64 MB), and a write past it fails with ENOSPC in the code."""
    capped = _open(sandbox.mode, memory_cgroup=False, scratch_mb=64)
    try:
        assert "no memory cgroup per REPL (not asked for" in capped.isolation_report()["memory"]
        with capped.create() as repl:
            res = repl.execute(HOARD_FILES, timeout_s=60)
        assert res.error is None and res.stdout.split() == ["8", str(errno.ENOSPC)], (res.stdout, res.error)
    finally:
        capped.close()


# -- IPC between trajectories ---------------------------------------------------------------------------

SEND = LIBC + (
    "key = 0x5EC2E7\n"
    "q = libc.msgget(key, 0o1000 | 0o666)\n"
    "out = {'msgget': err(q)}\n"
    "if q >= 0:\n"
    "    msg = ctypes.create_string_buffer(ctypes.sizeof(ctypes.c_long) + 16)\n"
    "    ctypes.c_long.from_buffer(msg).value = 1\n"
    "    msg[ctypes.sizeof(ctypes.c_long):ctypes.sizeof(ctypes.c_long) + 6] = b'secret'\n"
    "    out['msgsnd'] = err(libc.msgsnd(q, msg, 16, 0))\n"
    "mq = libc.mq_open(b'/hyflow-leak', os.O_CREAT | os.O_RDWR, 0o666, None)\n"
    "out['mq_open'] = err(mq)\n"
    "print(json.dumps(out))"
)
RECEIVE = LIBC + (
    "key = 0x5EC2E7\n"
    "q = libc.msgget(key, 0)\n"
    "out = {'msgget': err(q)}\n"
    "if q >= 0:\n"
    "    msg = ctypes.create_string_buffer(ctypes.sizeof(ctypes.c_long) + 16)\n"
    "    n = libc.msgrcv(q, msg, 16, 0, 0o4000)\n"  # IPC_NOWAIT
    "    out['received'] = msg.raw[ctypes.sizeof(ctypes.c_long):][:max(n, 0)].decode(errors='replace')\n"
    "print(json.dumps(out))"
)


def test_no_ipc_channel_between_trajectories(sandbox):
    """A message queue left by one trajectory (or a concurrent REPL of another uid) is a channel the
    policy could learn to use: no REPL can create one, so there is nothing for the next to read."""
    require(sandbox, "seccomp")
    with sandbox.create() as first:
        sent = run(first, SEND)
        with sandbox.create() as concurrent:
            seen_now = run(concurrent, RECEIVE)
    with sandbox.create() as later:
        seen_later = run(later, RECEIVE)
    assert sent == {"msgget": errno.EPERM, "mq_open": errno.EPERM}
    assert seen_now == seen_later == {"msgget": errno.EPERM}


# -- cleanup that resists removal -----------------------------------------------------------------------

RESISTANT = (
    "import os, subprocess\n"
    "top = os.getcwd()\n"
    "os.makedirs('locked/inner')\n"
    "open('locked/inner/f', 'w').write('x')\n"
    "os.chmod('locked/inner', 0)\n"
    "os.chmod('locked', 0o500)\n"
    "open('odd\\nname ' + 'n' * 200, 'w').write('x')\n"
    "os.mkdir('many')\n"
    "for i in range(3000):\n"
    "    open(f'many/{i}', 'w').close()\n"
    "os.mkdir('deep')\n"
    "os.chdir('deep')\n"
    "for i in range(1500):\n"  # deeper than Python's recursion limit, paths past PATH_MAX
    "    os.mkdir('d' * 40)\n"
    "    os.chdir('d' * 40)\n"
    "open('bottom', 'w').write('x')\n"
    "os.chdir(top)\n"
    "keeper = subprocess.Popen(['sleep', '1000'], stdout=open('held', 'w'), start_new_session=True)\n"
    "print(sorted(os.listdir('.'))[:3])"
)


def test_a_scratch_dir_built_to_resist_removal_is_not_handed_to_the_next_trajectory(sandbox):
    """Depth past the recursion limit and PATH_MAX, thousands of files, odd names, no permissions and a
    process holding a file open: the next trajectory still starts in an empty scratch dir, the old
    one is gone from the sandbox, and the sandbox reports no failed cleanup."""
    one = _open(sandbox.mode, max_repls=1)  # one slot: the next REPL takes the same one
    try:
        with one.create() as repl:
            res = repl.execute(RESISTANT, timeout_s=60)
            assert res.error is None, res.error
            first_dir = repl.scratch_dir
        with one.create() as repl:
            out = run(
                repl,
                "import json, os\n"
                f"print(json.dumps({{'here': os.listdir('.'), 'old': os.path.lexists({first_dir!r})}}))",
            )
            assert out == {"here": [], "old": False}  # the same slot and uid, nothing of the last one
            assert repl.scratch_dir != first_dir
        assert one.stats["cleanup_failures"] == 0 and one.stats["cleanups"] == 2
    finally:
        one.close()


def test_a_failed_cleanup_is_reported_and_never_handed_on(sandbox):
    """Where removal fails (forced here by a test hook: the zygote's next remover is a failing
    command), the failure is counted and logged, the next trajectory of the slot (the same uid) gets
    a dir of another name, and the one left behind is root's: the slot's uid cannot enter it."""
    require(sandbox, "signals")
    one = _open(sandbox.mode, max_repls=1)
    # the sandbox's own logger, whatever an earlier test of the session did to logging's configuration
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("workers.sandbox.sandbox")
    was = (log.disabled, log.level)
    log.disabled, log.level = False, logging.WARNING
    log.addHandler(handler)
    try:
        with one.create() as repl:
            repl.execute("open('secret', 'w').write('from the last trajectory')")
            first_dir = repl.scratch_dir
            one._zygote.request({"op": "test_hooks", "fail_next_cleanup": True}).result(5)
        assert one.stats == {"cleanups": 1, "cleanup_failures": 1, "stuck_kill_helpers": 0}
        assert any(f"{first_dir} is left, owned by root, never reused" in r.getMessage() for r in records)
        with one.create() as repl:
            out = run(
                repl,
                "import json, os\n"
                "try:\n"
                f"    old = open({first_dir!r} + '/secret').read()\n"
                "except OSError as e:\n"
                "    old = e.strerror\n"
                "print(json.dumps({'here': os.listdir('.'), 'old': old}))",
            )
        assert out == {"here": [], "old": "Permission denied"}
    finally:
        log.removeHandler(handler)
        log.disabled, log.level = was
        one.close()


# -- the kill path ----------------------------------------------------------------------------------------

STOPPER = (
    "import os, signal, threading\n"
    "me = os.getuid()\n"
    "mine = set()\n"
    "def stop_strangers():\n"  # SIGSTOP every process the REPL may signal that it did not start
    "    while True:\n"
    "        for p in os.listdir('/proc'):\n"
    "            if p.isdigit() and int(p) not in mine:\n"
    "                try:\n"
    "                    os.kill(int(p), signal.SIGSTOP)\n"
    "                    stopped.append(int(p))\n"
    "                except OSError:\n"
    "                    pass\n"
    "stopped = []\n"
    "mine.update(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
    "mine.update(int(t) for t in os.listdir('/proc/self/task'))\n"
    "threading.Thread(target=stop_strangers, daemon=True).start()\n"
    "while True:\n"
    "    pass"
)


def test_the_timeout_kill_cannot_be_stopped_from_inside(sandbox):
    """The REPL's code SIGSTOPs every process it may signal while it overruns its timeout. The helper
    that kills it must not be one of them: the block ends as a timeout, a concurrent REPL keeps its
    state and the zygote is not restarted. The window in which the helper runs is widened by a
    test hook (the zygote's next helper pauses 2 s before it acts, past the 1 s after which the zygote
    takes a helper for stuck, kills it and sends another) to make the race deterministic."""
    require(sandbox, "signals")
    starts = sandbox._zygote_starts
    sandbox._zygote.request({"op": "test_hooks", "kill_helper_pause_s": 2.0}).result(5)

    async def main():
        a, b = await sandbox.acreate(), await sandbox.acreate()
        try:
            await b.aexecute("state = 'mine'")
            t0 = time.perf_counter()
            res = await a.aexecute(STOPPER, timeout_s=1.0)
            took = time.perf_counter() - t0
            calm = await b.aexecute("print(state)", timeout_s=30)
            return res, took, calm
        finally:
            await a.aclose()
            await b.aclose()

    res, took, calm = asyncio.run(main())
    assert res.timed_out and res.restarted, res.error
    assert took < 10, took
    assert calm.stdout == "mine\n" and not calm.restarted
    assert sandbox._zygote_starts == starts
    assert sandbox.stats["stuck_kill_helpers"] >= 1  # the paused helper was taken for stuck and replaced


# -- host-side amplification ------------------------------------------------------------------------------

RAW_FRAME = (
    "import os, stat, struct, time\n"
    "fd = [f for f in range(3, 64) if os.path.exists(f'/proc/self/fd/{f}') and stat.S_ISSOCK(os.fstat(f).st_mode)][0]\n"
    "body = {body}\n"
    "os.write(fd, struct.pack('!I', len(body)))\n"
    "view = memoryview(body)\n"
    "while view:\n"
    "    view = view[os.write(fd, view[:1 << 20]):]\n"
    "time.sleep(5)"
)
FRAMES = {
    # about 22 MiB of empty lists: some 7 million list objects once parsed
    "huge": "b'{\"op\": \"result\", \"x\": [' + b'[],' * (22 << 18) + b'[]]}'",
    # under the size limit, but a million items
    "many-items": "b'{\"op\": \"result\", \"x\": [' + b'[],' * 1_000_000 + b'[]]}'",
    "deep": "b'{\"op\": \"result\", \"x\": ' + b'[' * 100_000 + b']' * 100_000 + b'}'",
}


@pytest.mark.parametrize("frame", FRAMES.values(), ids=FRAMES.keys())
def test_a_reply_that_would_amplify_in_the_host_is_refused(sandbox, frame):
    """What a REPL sends the host is bounded before it is parsed (size, items, nesting): the REPL is
    restarted with an error naming the bound, the host's Python heap grows by less than the frame's
    size, and the host's event loop is never blocked for long."""

    async def main():
        repl = await sandbox.acreate(context="kept")
        gaps = []

        async def ticker():
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.01)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        tracemalloc.start()
        try:
            res = await repl.aexecute(RAW_FRAME.replace("{body}", frame), timeout_s=30)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            tick.cancel()
        after = await repl.aexecute("print(context)")
        await repl.aclose()
        return res, peak, max(gaps), after

    res, peak, worst_gap, after = asyncio.run(main())
    assert res.killed and res.restarted and "refused" in res.error, res.error
    assert "max_message_mb" in res.error or "items" in res.error or "nested" in res.error, res.error
    assert peak < 24 << 20, f"the host's heap peaked at {peak / 2**20:.0f} MiB"
    assert worst_gap < 1.0, f"the event loop was blocked for {worst_gap:.2f} s"  # 1.7-8.3 s before
    assert after.stdout == "kept\n"


# -- socket families ------------------------------------------------------------------------------------


def test_socket_families_a_repl_never_needs_are_refused(sandbox):
    """Only IP sockets (in the REPL's own network namespace) and netlink (the C library's address
    lookups) can be created; vsock, packet, alg and the rest fail with EPERM."""
    require(sandbox, "seccomp")
    with sandbox.create() as repl:
        out = run(
            repl,
            "import json, socket\n"
            "out = {}\n"
            "for name, fam, kind in [('vsock', 40, 1), ('packet', 17, 2), ('alg', 38, 5), ('tipc', 30, 2),\n"
            "                        ('inet', 2, 1), ('inet6', 10, 2), ('netlink', 16, 3)]:\n"
            "    try:\n"
            "        socket.socket(fam, kind).close()\n"
            "        out[name] = 0\n"
            "    except OSError as e:\n"
            "        out[name] = e.errno\n"
            "a, b = socket.socketpair()\n"
            "out['socketpair'] = 0\n"
            "print(json.dumps(out))",
        )
    assert out == {
        "vsock": errno.EPERM,
        "packet": errno.EPERM,
        "alg": errno.EPERM,
        "tipc": errno.EPERM,
        "inet": 0,
        "inet6": 0,
        "netlink": 0,
        "socketpair": 0,
    }


def test_an_honest_oversized_sub_call_fails_in_the_code_and_keeps_the_repl(sandbox):
    """The REPL's own runtime checks a sub-call against the same bounds before sending it: llm_query
    returns an error string that names the limit, and the REPL keeps its variables."""
    with sandbox.create() as repl:
        res = repl.execute("x = 1\nr = llm_query('y' * (20 << 20))\nprint(r[:200])", timeout_s=30)
        assert res.error is None and not res.restarted
        assert res.stdout.startswith("Error: ") and "over the limit of 16 MiB" in res.stdout, res.stdout
        assert "max_message_mb" in res.stdout
        assert repl.execute("print(x)").stdout == "1\n"


def test_the_isolation_report_says_what_contains_these_classes(sandbox):
    report = sandbox.isolation_report()
    assert report["memory"].startswith("RLIMIT_AS 256 MB per process; ")
    assert "memory outside the address space is refused: memfd_create, SysV shared memory" in report["memory"]
    assert (
        report["ipc"]
        == "SysV IPC and POSIX message queues refused (seccomp); a private IPC namespace for the sandbox"
    )
    assert "removed by rm -rf" in report["cleanup"] and "never reused" in report["cleanup"]
    assert report["messages"].startswith(
        "a REPL's message to the host is bounded before it is parsed: 16 MiB"
    )
    assert "a helper whose real uid the REPL cannot signal" in report["limits"]["timeout"]
    assert "AF_INET, AF_INET6 and AF_NETLINK" in report["seccomp"] and "memfd_create" in report["seccomp"]
