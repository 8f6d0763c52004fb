"""Configuration, result and error types of the REPL sandbox."""

from dataclasses import asdict, dataclass, field

ISOLATION_MODES = ("auto", "bwrap", "rlimits")

# Imported once by the zygote, so a forked REPL has them in memory (``import json`` is then free).
DEFAULT_PREIMPORT = (
    "ast",
    "base64",
    "bisect",
    "collections",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "fractions",
    "functools",
    "hashlib",
    "heapq",
    "itertools",
    "json",
    "math",
    "operator",
    "pprint",
    "random",
    "re",
    "statistics",
    "string",
    "textwrap",
    "typing",
    "unicodedata",
)


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and behaviour of every REPL of a :class:`~workers.sandbox.ReplSandbox`.

    timeout_s: wall-clock limit of one code block, enforced from the host (SIGKILL of all the REPL's
        processes, then a fresh REPL). Time the block spends blocked in a host sub-call
        (``llm_query`` ...) is not counted; each sub-call is bounded by ``subcall_timeout_s`` instead.
    memory_mb: address-space limit (RLIMIT_AS) of each process of a REPL.
    cpu_s: CPU-time limit (RLIMIT_CPU) of each process of a REPL over its lifetime (SIGXCPU, SIGKILL
        one second later); it bounds background threads/processes that outlive a block.
    max_procs: processes + threads of one REPL (RLIMIT_NPROC on the REPL's own uid).
    max_file_mb: largest file a REPL may write (RLIMIT_FSIZE); also bounds output written to the
        REPL's stdout/stderr file descriptors by subprocesses.
    max_output_chars: stdout and stderr of a block are each cut to this many characters, with a
        ``... [truncated N chars]`` marker.
    max_message_mb: largest message a REPL may send the host (a sub-call's prompts, a tool's arguments);
        a sub-call over it fails in the REPL's code with the reason, and a bigger frame written to the
        channel by other means is refused unread and the REPL restarted.
    memory_cgroup: also put each REPL in a memory cgroup of its own limited to ``memory_mb`` (all its
        processes and its files in the scratch tmpfs together), where the host may create one
        (``workers/sandbox/memory_cgroup.py``); ``isolation_report()["memory"]`` says whether it is in force.
        Off by default: entering a cgroup waits for an RCU grace period, about 10 ms more per REPL
        creation (twice today's ~12 ms; ``python -m benchmarks.bench_repl --memory-cgroup``).
    show_vars: list the user variables (name, type) after each block.
    isolation: "bwrap" (require bubblewrap), "rlimits" (namespaces set up by the zygote itself where
        permitted, plus rlimits), or "auto" (bubblewrap when it works here, else "rlimits").
    """

    timeout_s: float = 30.0
    memory_mb: int = 1024
    cpu_s: int = 300
    max_procs: int = 64
    max_file_mb: int = 64
    max_output_chars: int = 20_000
    show_vars: bool = True
    isolation: str = "auto"
    # Less common knobs.
    max_open_files: int = 256
    max_answer_chars: int = 1_000_000
    max_message_mb: int = 16
    memory_cgroup: bool = False  # a memory cgroup per REPL of memory_mb, where this machine allows it
    echo_last_expr: bool = False  # print repr() of a block's trailing expression, like a notebook
    subcall_timeout_s: float = 600.0
    scratch_mb: int = 1024  # size of the tmpfs that holds all scratch dirs of one sandbox
    max_repls: int = 1024  # REPLs alive at once in one sandbox (each holds a uid of its own)
    start_timeout_s: float = 20.0  # zygote start and REPL spawn
    preimport: tuple[str, ...] = DEFAULT_PREIMPORT

    def __post_init__(self):
        if self.isolation not in ISOLATION_MODES:
            raise ValueError(f"isolation must be one of {ISOLATION_MODES}, got {self.isolation!r}")
        for name in ("timeout_s", "memory_mb", "cpu_s", "max_procs", "max_file_mb", "max_output_chars"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxConfig.{name} must be positive")
        if not 1 <= self.max_message_mb <= 64:  # _wire.MAX_FRAME
            raise ValueError("SandboxConfig.max_message_mb must be in [1, 64]")
        if not 1 <= self.max_repls <= 4095:  # the uid block's last uid is the kill helpers'
            raise ValueError("SandboxConfig.max_repls must be in [1, 4095]")

    def limits(self) -> dict:
        """What a REPL process needs to know (sent with every spawn)."""
        return {
            "cpu_s": int(self.cpu_s),
            "memory_mb": int(self.memory_mb),
            "max_file_mb": int(self.max_file_mb),
            "max_open_files": int(self.max_open_files),
            "max_procs": int(self.max_procs),
            "max_output_chars": int(self.max_output_chars),
            "max_answer_chars": int(self.max_answer_chars),
            "max_message_mb": int(self.max_message_mb),
            "show_vars": bool(self.show_vars),
            "echo_last_expr": bool(self.echo_last_expr),
        }


@dataclass
class ExecResult:
    """What one code block did. Failures of the code, of its limits and of the REPL process are all
    reported here (``error``), never raised.

    stdout / stderr: captured output (Python-level and file-descriptor level), each truncated.
    error: the traceback (user frames only) of an exception the block raised, or a description of
        what the sandbox did (timeout, process death, restart); None when the block ran cleanly.
    timed_out: the block hit the wall-clock limit.
    killed: the REPL process was killed or died during this block; its variables are lost.
    restarted: this block ran in a fresh REPL (after a kill/death), so earlier variables are lost.
    variables: (name, type name) of the user variables after the block (if ``show_vars``).
    final_answer: set by ``FINAL(answer)`` / ``FINAL_VAR(name)`` during this block.
    tool_calls: one record per custom-tool call of this block, in completion order: ``name``, ``args``
        and ``result`` (JSON text, cut) or ``error``, ``started`` (host ``perf_counter``), ``elapsed_s``.
    """

    stdout: str = ""
    stderr: str = ""
    error: str | None = None
    timed_out: bool = False
    killed: bool = False
    restarted: bool = False
    variables: list[tuple[str, str]] = field(default_factory=list)
    final_answer: str | None = None
    elapsed_s: float = 0.0
    tool_calls: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["variables"] = [list(v) for v in self.variables]
        return d

    @property
    def ok(self) -> bool:
        return self.error is None

    def render(self) -> str:
        """A plain-text observation: stdout, stderr, error, then the variable listing."""
        parts = [s.rstrip("\n") for s in (self.stdout, self.stderr) if s]
        if self.error:
            parts.append(self.error)
        if self.variables:
            parts.append("REPL variables: " + ", ".join(f"{n}: {t}" for n, t in self.variables))
        return "\n".join(parts) if parts else "(no output)"


class SandboxError(RuntimeError):
    """Misuse (a closed REPL, concurrent use of one REPL) or a sandbox that cannot start at all."""
