"""Run an RLM for inference: ``RLM(...).completion(prompt, context=...) -> RLMResult``.

The same agent loop as training (`workers.rlm.agent`), over

* a token engine -- ``NativeEngine``, the SGLang adapter (``SGLangRollout``: same ``async generate``), or
  any ``async gen(prompt_ids, SamplingParams) -> GenerationOutput`` with its ``tokenizer``;
* a backend built by ``workers.agents.clients.make_llm`` -- ``RLM(backend="openai", backend_kwargs={"model_name":
  ..., "base_url": "http://host:port/v1", "api_key": ...})`` for any OpenAI-compatible server, ``"anthropic"``,
  ``"native"`` (a checkpoint on NativeEngine) or ``"sglang"`` (SGLang's offline engine); the HTTP backends'
  trajectories carry text only (no token ids). ``backend`` is ``"openai"`` when no ``engine`` is given.

::

    rlm = RLM(engine=NativeEngine.from_pretrained(path), max_depth=1, max_iterations=8,
              log_path="outputs/rlm.jsonl")
    res = rlm.completion("What is the magic number for quiet-harbor?", context=long_text)
    res.answer, res.status, res.trajectory_tree     # nested dict: root, its turns' children, ...
    rlm.close()

The keywords are rlms' (same names, same call forms) plus hyflow's settings grouped in ``agent_config``
(`AgentConfig`), ``sandbox`` (a ``SandboxConfig`` or a backend) and ``callbacks`` (`Callbacks`); `RLM`'s docstring
lists them. ``other_backends`` / ``other_backend_kwargs`` (lists, as in rlms) are more models that REPL code picks with
``llm_query(prompt, model=<model_name>)`` (the root backend's model is reachable by its name too); the first of
them answers ``llm_query`` without ``model=``, unless ``sub_engine`` (an engine or generate function) is given;
default: the main model. ``raise_on_error=True``: a root trajectory that fails (e.g. an unreachable endpoint)
raises `RLMError` instead of returning status ``"error"``. Every completion appends its
trajectories (root first, then children) to ``log_path`` as JSONL (`workers.agents.trajectory.load_jsonl` reads
it; ``python -m workers.rlm.viewer`` renders it as HTML).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from workers.agents.batch import trajectory_json
from workers.agents.clients import BACKENDS, close_llm, engine_loop, make_llm
from workers.agents.llm import LLM, ChatLLM, EngineLLM
from workers.agents.tool_calls import normalize_tools
from workers.agents.trajectory import Trajectory
from workers.event_loop import CallerLoop, LoopThread
from workers.rlm.agent import AgentConfig, RLMAgent
from workers.rlm.callbacks import Callbacks
from workers.rlm.console import VerbosePrinter
from workers.rlm.prompts import Contexts
from workers.rlm.session import Session
from workers.rlm.usage import Usage
from workers.sandbox import ReplSandbox, SandboxConfig
from workers.sandbox.backend import SandboxBackend
from workers.sandbox.tools import Tool, as_tools

__all__ = ["RLM", "RLMError", "RLMResult", "trajectory_tree"]

T = TypeVar("T")


def trajectory_tree(trajectories: list[Trajectory], root_id: str | None = None) -> dict:
    """Nested summary of a run: ``{id, depth, status, answer, query, turns, elapsed_s, children: [...]}``."""
    by_id = {t.id: t for t in trajectories}
    root = by_id[root_id] if root_id is not None else next(t for t in trajectories if t.parent_id is None)

    def node(t: Trajectory) -> dict:
        return {
            "id": t.id,
            "depth": t.depth,
            "status": t.status,
            "answer": t.final_answer,
            "query": t.query,
            "turns": len(t.turns),
            "elapsed_s": t.timings.get("total_s"),
            "children": [node(by_id[c]) for c in t.children if c in by_id],
        }

    return node(root)


@dataclass
class RLMResult:
    answer: str | None
    status: str
    root: Trajectory
    trajectories: list[Trajectory] = field(default_factory=list)  # root first, children in start order
    elapsed_s: float = 0.0
    # tokens (and cost under a price table) of every model call of the tree: total, by_depth, by_model
    usage: Usage = field(default_factory=Usage)

    @property
    def trajectory_tree(self) -> dict:
        return trajectory_tree(self.trajectories, self.root.id)


class RLMError(RuntimeError):
    """``RLM(raise_on_error=True)``: the root trajectory ended with status "error"; the message is its error
    (naming the backend, model and URL for a failed model call); ``result`` is the `RLMResult` (logged as usual)."""

    def __init__(self, message: str, result: RLMResult):
        super().__init__(message)
        self.result = result


# --------------------------------------------------------------------------------------------------
# The API


def declared(tools: dict, schemas: list[dict] | None) -> dict:
    """``tools`` with the OpenAI ``schemas`` given for some of them (their description and parameters)."""
    out = dict(tools)
    for schema in normalize_tools(schemas or []):
        fn = schema["function"]
        tool = out.get(fn["name"])
        if not isinstance(tool, Tool):
            raise ValueError(
                f"RLM(tools=...): the schema of {fn['name']!r} names no function of custom_tools "
                f"(they are: {', '.join(n for n, t in tools.items() if isinstance(t, Tool)) or 'none'})"
            )
        out[fn["name"]] = replace(
            tool, description=fn.get("description", tool.description), parameters=fn["parameters"]
        )
    return out


def _given(value: T | None, default: T) -> T:
    """A keyword argument of `RLM` left as None keeps the config's value (``default``)."""
    return default if value is None else value


def _agent_config(
    agent_config: AgentConfig | None,
    *,
    max_depth: int | None,
    max_iterations: int | None,
    max_errors: int | None,
    custom_system_prompt: str | None,
) -> AgentConfig:
    """The agent of an `RLM`: ``agent_config`` (default ``AgentConfig(final_answer_on_exhaustion=True)``, rlms'
    behaviour) with rlms' keywords, those given, over its fields of the same name."""
    cfg = agent_config if agent_config is not None else AgentConfig(final_answer_on_exhaustion=True)
    return replace(
        cfg,
        max_depth=_given(max_depth, cfg.max_depth),
        max_iterations=_given(max_iterations, cfg.max_iterations),
        max_errors=_given(max_errors, cfg.max_errors),
        prompt=replace(
            cfg.prompt, custom_system_prompt=_given(custom_system_prompt, cfg.prompt.custom_system_prompt)
        ),
    )


def _own_callbacks(callbacks) -> Callbacks:
    """The RLM's own `Callbacks` (``verbose`` adds its printer here, never to the caller's object): the listeners
    of a `Callbacks`, or an object's ``on_iteration`` / ``on_subcall`` / ``on_final`` methods."""
    own = Callbacks()
    if callbacks is None:
        return own
    if isinstance(callbacks, Callbacks):
        for event, listeners in callbacks.listeners.items():
            own.listeners[event].extend(listeners)
        return own
    if not any(callable(getattr(callbacks, event, None)) for event in own.listeners):
        raise TypeError(
            "RLM(callbacks=...): expected a Callbacks or an object with on_iteration / on_subcall / on_final "
            f"methods, got {type(callbacks).__name__}"
        )
    own.add(callbacks)
    return own


def _engine_llm(engine, tokenizer, name: str):
    """An LLM given as an object: an `EngineLLM`/`ChatLLM`, or a token engine / generate function."""
    if isinstance(engine, (EngineLLM, ChatLLM)):
        return engine
    if isinstance(engine, str):
        hint = (
            f"backend={engine!r}"
            if engine in BACKENDS
            else 'backend="openai", backend_kwargs={"base_url": ...}'
        )
        raise ValueError(f"{name}={engine!r}: a string is not an engine; for a model server pass {hint}")
    tok = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
    if tok is None:
        raise ValueError(f"{name}: pass tokenizer=... (the engine does not carry one)")
    return EngineLLM(engine, tok, name=name)


class RLM:
    """A Recursive Language Model for inference. See the module docstring.

    The keywords are rlms' (``backend``, ``backend_kwargs``, ``other_backends``, ``other_backend_kwargs``,
    ``max_depth``, ``max_iterations``, ``max_errors``, ``custom_system_prompt``, ``custom_tools``,
    ``custom_sub_tools``, ``persistent``, ``verbose``: the rlms library's names and call forms) and hyflow's, whose
    settings come grouped in the objects that training and the agent use too:

    * ``agent_config`` (`AgentConfig`): sampling (``temperature``, ``max_new_tokens``, ...), budgets
      (``max_total_tokens`` -- rlms' ``max_tokens``; ``max_cost_usd`` -- rlms' ``max_budget``, with ``prices``;
      ``max_concurrent_subcalls``, ...), ``final_answer_on_exhaustion``, ``tool_format`` and ``prompt``
      (`PromptConfig`: ``style``, ``system_prompts``, ...). rlms' ``max_depth``, ``max_iterations``,
      ``max_errors`` and ``custom_system_prompt``, when given, override its fields of the same name. Without an
      ``agent_config`` the agent is ``AgentConfig(final_answer_on_exhaustion=True)``: when the turns run out
      without an answer, one more model turn asks for it, as rlms does (status stays ``"max_iterations"``, with
      that answer); an ``agent_config`` you pass is used as it is (``AgentConfig``'s own default, training's,
      leaves that turn off).
    * ``sandbox``: a ``SandboxConfig`` (the limits of the RLM's own ``ReplSandbox``, closed by ``close()``) or
      an isolation backend to use and share (``workers.sandbox.backend.SandboxBackend``, e.g. a
      ``ReplSandbox``; never closed here). Default: a ``ReplSandbox()`` of its own.
    * ``callbacks``: a `Callbacks` (``Callbacks(on_iteration=[f], on_subcall=[g], on_final=[h])``), or an object
      with any of the methods ``on_iteration`` / ``on_subcall`` / ``on_final``; they are called with an event for
      every turn, sub-call and trajectory end, children included (``workers.rlm.callbacks``). ``verbose=True``
      adds a printer of the run (`rich`; ``workers.rlm.console``).

    Models: ``engine`` (an engine object or generate function; ``tokenizer`` if it carries none) or ``backend``
    + ``backend_kwargs`` (``workers.agents.clients``: "openai", "gemini", "vercel", "azure_openai", "anthropic",
    "native", "sglang"; "openai" when neither is given); ``other_backends`` + ``other_backend_kwargs``: sub-LMs
    by ``model_name`` (the first answers plain ``llm_query``); ``sub_engine``: the engine answering plain
    ``llm_query`` instead (``EngineLLM(engine, its_tokenizer)`` when its tokenizer is not ``tokenizer``).
    Unknown backends or kwargs raise ``ValueError`` here; a failed model call names backend, model and URL in
    the trajectory's error, and ``raise_on_error=True`` raises it as `RLMError`. ``close()`` closes the
    clients and engines built from backends (never ones passed in).

    ``persistent=True``: one session across ``completion`` calls -- the root's REPL (its variables) and its
    conversation carry over, a later call's context is bound to ``context_1``, ``context_2``, ...; the
    conversation is compacted (summarised by the model) when it would pass ``compaction_threshold`` of the
    root's token window (``workers.rlm.session``); ``close()`` ends the session.

    REPL extras: ``custom_tools={name: callable | Tool}`` -- host functions the model's code calls by name, run
    here (never in the sandbox) with JSON arguments and results and a per-tool timeout (``Tool(fn,
    description=None, timeout_s=60)``; a failure raises ``ToolError`` in the code), listed in the system prompt
    (``workers.sandbox.tools``); as in rlms an entry may also be ``{"tool": fn_or_value, "description": ...}``
    or a JSON value (a constant, restored after every block); ``custom_sub_tools`` -- those of child agents
    (None: the same as ``custom_tools``; ``{}``: none, as in rlms); ``setup_code`` -- Python run in every REPL
    before its first turn (its variables are listed in the system prompt; if it raises, the result has status
    ``"error"`` naming it). With ``AgentConfig.tool_format`` (``"hermes"``, ``"llama3_json"`` or
    ``"package.module:Parser"``, ``workers.agents.tool_calls``) the custom tools are also declared to the model
    through its chat template as OpenAI function schemas and the calls it writes in that format run on the
    host, answered as ``tool`` messages (the REPL functions stay); ``tools=[schema, ...]`` gives a tool's
    schema (description, ``parameters``) instead of the one read from its signature.

    Logs: every completion appends its trajectories (root first, then children) to ``log_path`` as JSONL,
    with token ids and log-probs when ``log_tokens=True``.
    """

    def __init__(
        self,
        engine=None,
        sub_engine=None,
        tokenizer=None,
        *,
        # rlms' keywords, as the rlms library names them
        backend: str | None = None,
        backend_kwargs: dict[str, Any] | None = None,
        other_backends: list[str] | None = None,
        other_backend_kwargs: list[dict[str, Any]] | None = None,
        max_depth: int | None = None,
        max_iterations: int | None = None,
        max_errors: int | None = None,
        custom_system_prompt: str | None = None,
        custom_tools: dict[str, Any] | None = None,
        custom_sub_tools: dict[str, Any] | None = None,
        persistent: bool = False,
        verbose: bool = False,
        # hyflow's: the agent, the sandbox, the listeners (grouped), and what has no group
        agent_config: AgentConfig | None = None,
        sandbox: SandboxBackend | SandboxConfig | None = None,
        callbacks: Callbacks | object | None = None,
        tools: list[dict] | None = None,
        setup_code: str | None = None,
        compaction_threshold: float | None = 0.85,
        log_path: str | os.PathLike | None = None,
        log_tokens: bool = False,
        raise_on_error: bool = False,
    ):
        self.config = _agent_config(
            agent_config,
            max_depth=max_depth,
            max_iterations=max_iterations,
            max_errors=max_errors,
            custom_system_prompt=custom_system_prompt,
        )
        if sandbox is None or isinstance(sandbox, SandboxConfig):
            self._sandbox, self._sandbox_config, self._own_sandbox = None, sandbox, True
        else:
            self._sandbox, self._sandbox_config, self._own_sandbox = sandbox, None, False
        self.log_path = os.fspath(log_path) if log_path is not None else None
        self.log_tokens = log_tokens
        self.callbacks = _own_callbacks(callbacks)
        if verbose:
            self.callbacks.add(VerbosePrinter())
        self.session = Session(compaction_threshold) if persistent else None
        self.custom_tools = declared(as_tools(custom_tools), tools)
        self.custom_sub_tools = (
            None if custom_sub_tools is None else declared(as_tools(custom_sub_tools), tools)
        )
        if tools and self.config.tool_format is None:
            raise ValueError(
                "RLM(tools=...): say how the model calls them, e.g. "
                "agent_config=AgentConfig(tool_format='hermes')"
            )
        self.setup_code = setup_code
        self._loop: LoopThread | CallerLoop | None = None
        self._log_lock = threading.Lock()
        self.raise_on_error = raise_on_error
        # the models last: every other argument is checked first, so a bad one leaves no engine running
        self._own_llms: list = []  # built here from backends: closed by close()
        self._build_llms(engine, tokenizer, backend, backend_kwargs, other_backends, other_backend_kwargs)
        if self.config.tool_format is not None and not getattr(self.policy, "token_exact", False):
            self.close()
            raise ValueError(
                f"RLM: AgentConfig.tool_format={self.config.tool_format!r} needs a token-level model (engine= "
                "and tokenizer=), whose chat template renders the tools; a message-level backend does not "
                "render them"
            )
        if sub_engine is not None:
            self.sub_llm = _engine_llm(sub_engine, tokenizer, "sub_engine")

    def _build_llms(self, engine, tokenizer, backend, backend_kwargs, other_backends, other_backend_kwargs):
        """``policy``, ``sub_llm`` (answers llm_query) and ``sub_llms`` (by name, for llm_query(model=...))."""
        if engine is not None and (backend is not None or backend_kwargs is not None):
            raise ValueError("RLM: pass engine=... or backend=/backend_kwargs=..., not both")
        others = list(other_backends or [])
        other_kwargs = [{} for _ in others] if other_backend_kwargs is None else list(other_backend_kwargs)
        if len(other_kwargs) != len(others):
            raise ValueError(
                f"RLM: other_backend_kwargs has {len(other_kwargs)} entries for {len(others)} other_backends"
            )
        try:
            if engine is not None:
                self.policy = _engine_llm(engine, tokenizer, "engine")
            else:
                self.policy = make_llm(backend or "openai", backend_kwargs)
                self._own_llms.append(self.policy)
            other_llms = []
            for i, (b, kw) in enumerate(zip(others, other_kwargs)):
                try:
                    other_llms.append(make_llm(b, kw))
                except ValueError as exc:
                    raise ValueError(f"other_backends[{i}]: {exc}") from None
                self._own_llms.append(other_llms[-1])
            self.sub_llms: dict[str, LLM] = {}
            for llm in ([] if engine is not None else [self.policy]) + other_llms:
                if llm.name in self.sub_llms:
                    raise ValueError(
                        f"RLM: two backends share the model_name {llm.name!r} (llm_query's model=)"
                    )
                self.sub_llms[llm.name] = llm
        except Exception:
            self._close_llms()
            raise
        self.sub_llm = (
            other_llms[0] if other_llms else self.policy
        )  # rlms: the other backend answers sub-calls

    def _close_llms(self) -> None:
        for llm in self._own_llms:
            close_llm(llm)
        self._own_llms = []

    @property
    def sandbox(self):
        if self._sandbox is None:
            self._sandbox = ReplSandbox(self._sandbox_config)
        return self._sandbox

    async def acompletion(
        self,
        prompt: str,
        context=None,
        *,
        contexts: list | None = None,
        seed: int | None = None,
        uid: str | None = None,
        metadata: dict | None = None,
    ) -> RLMResult:
        """Answer ``prompt`` about ``context``: one JSON value (a str, a list of documents, a dict ...) that the
        REPL holds as ``context``; or about several ``contexts=[c0, c1, ...]``, held as ``context_0``,
        ``context_1``, ... (``context`` is ``context_0``)."""
        if self.session is not None and self.session.running:
            raise RuntimeError("RLM(persistent=True) runs one completion at a time (its session is busy)")
        agent = RLMAgent(
            self.policy,
            self.sandbox,
            self.config,
            sub_llm=self.sub_llm,
            sub_llms=self.sub_llms,
            callbacks=self.callbacks,
            tools=self.custom_tools,
            sub_tools=self.custom_sub_tools,
            setup_code=self.setup_code,
        )
        if contexts is not None:
            if context is not None:
                raise ValueError("RLM: pass context= (one context) or contexts= (several), not both")
            context = Contexts(list(contexts))
        t0 = time.perf_counter()
        res = await agent.run(prompt, context, uid=uid, seed=seed, metadata=metadata, session=self.session)
        out = RLMResult(
            res.root.final_answer,
            res.root.status,
            res.root,
            res.trajectories,
            time.perf_counter() - t0,
            usage=Usage.from_dict(res.root.metadata["usage"]),
        )
        if self.log_path:
            self._log(self.log_path, out.trajectories)
        if self.raise_on_error and out.status == "error":
            raise RLMError(f"RLM failed: {out.root.error}", out)
        return out

    def completion(self, prompt: str, context=None, **kwargs) -> RLMResult:
        """Synchronous `acompletion`, run on the RLM's private event-loop thread (so it also works where an
        event loop is already running, e.g. a notebook); ``kwargs`` as for `acompletion`."""
        if self._loop is None:
            self._loop = self._event_loop()
        return self._loop.run(self.acompletion(prompt, context, **kwargs))

    def _event_loop(self) -> LoopThread | CallerLoop:
        """A private loop thread; the SGLang engine's own loop when a model runs on one (its replies are read
        there), driven by the calling thread."""
        llms = [self.policy, self.sub_llm, *self.sub_llms.values()]
        loops = {id(lp): lp for lp in map(engine_loop, llms) if lp is not None}
        if len(loops) > 1:
            raise ValueError("RLM: models on two SGLang engines cannot share one RLM (each has its own loop)")
        return CallerLoop(next(iter(loops.values()))) if loops else LoopThread(name="rlm-inference")

    def _log(self, path: str, trajectories: list[Trajectory]) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with self._log_lock, open(path, "a", encoding="utf-8") as f:
            for t in trajectories:
                f.write(trajectory_json(t, tokens=self.log_tokens) + "\n")

    def close(self) -> None:
        """Free what the RLM holds: a persistent session (its REPL and history), models built from backends,
        its own sandbox, its event loop."""
        if self.session is not None:
            if self._loop is not None:
                self._loop.run(self.session.aclose())
            else:
                self.session.close()
            self.session = None
        self._close_llms()
        if self._sandbox is not None and self._own_sandbox:
            self._sandbox.close()
            self._sandbox = None
        if self._loop is not None:
            self._loop.stop()
        self._loop = None

    def __enter__(self) -> RLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
