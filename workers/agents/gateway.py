"""The rollout served as an OpenAI-compatible HTTP endpoint, recording each trajectory's exact tokens.

``Gateway`` is a FastAPI app (served by uvicorn on the caller's event loop, the loop the engine generates on):

* ``POST /v1/chat/completions`` (tools, ``tool_choice`` auto/none, streaming), ``POST /v1/completions``,
  ``GET /v1/models``; the same under ``/trajectories/{id}/v1/...``. The chat template is the tokenizer's; tool
  calls in a reply are parsed by the registered parser (``tool_parser``, ``workers.agents.tool_calls``) into
  OpenAI ``tool_calls``. Replies carry usage, the finish reason, and as extensions (vLLM's names)
  ``prompt_token_ids``, ``choices[0].token_ids`` and ``hyflow.completion_logprobs`` / ``hyflow.weight_version``.
* **Trajectories.** A request names its trajectory in the URL (``base_url=<server>/trajectories/<id>/v1``), the
  ``X-Hyflow-Trajectory`` header or the body's ``trajectory_id`` (``extra_body``). During training the agent
  loop opens a trajectory (``open``) with the policy and sampling that serve it and collects its turns when the
  agent is done (``close``); a request for a trajectory that is not open is a 404. Every call's fed and sampled
  tokens, log-probs and weight versions are kept, never re-tokenised:

  - chat: a request whose messages start with what an earlier call of the trajectory was sent plus the reply it
    got back (``canonical_message``: as the template renders them) continues that call's token sequence (a
    ``TokenConversation``: the sampled tokens stay as sampled, only the new messages are rendered and appended);
    any other request starts a new conversation from the template's rendering;
  - the trajectory's turns are the calls in the order they finished: a call whose fed tokens extend the previous
    call's prompt and reply is a continuation; any other starts a new segment (``TrajectoryTurn.full_prompt``),
    and such a trajectory trains one row per call (``workers.agents.batch``), each row exactly what was fed.

  During training the trajectory's sampling (the rollout's temperature, greedy in validation, its seed) replaces
  what the agent asks for: the log-probs must be the policy's; ``max_tokens`` is honoured up to the trajectory's
  per-call cap.
* Without a trajectory (``/v1/...``) the ``default`` policy serves plain inference (``recipes/serve.py``).
* Bad input is a 4xx with OpenAI's error body: malformed JSON, an unknown model (404), a prompt with no room to
  generate (``context_length_exceeded``), an unsupported parameter, a body over ``max_request_bytes`` (413),
  more than ``max_concurrent_requests`` in flight (429), a wrong API key when one is set (401).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from workers.agents.llm import ContextFull, EngineLLM, ModelResponse, TokenConversation
from workers.agents.openai_protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    Reply,
    Sampling,
    assistant_message,
    canonical_message,
    chat_chunks,
    chat_response,
    completion_chunks,
    completion_response,
    error_body,
    template_message,
)
from workers.agents.tool_calls import ToolParser, tool_parser
from workers.agents.trajectory import TrajectoryTurn
from workers.rollout.sampling import SamplingParams

__all__ = ["Gateway", "GatewayConfig", "LiveTrajectory", "TrajectorySampling"]

TRAJECTORY_HEADER = "x-hyflow-trajectory"


@dataclass
class GatewayConfig:
    """The server's settings (``env.server`` of an ``openai_agent`` recipe, the flags of ``recipes/serve.py``)."""

    host: str = "127.0.0.1"  # localhost only unless set otherwise
    port: int = 0  # 0: a free port
    model_name: str = "policy"  # what /v1/models lists and requests must name
    tool_parser: str = "hermes"  # the model family's tool-call format (workers/agents/tool_calls.py)
    api_key: str | None = None  # when set, requests must send "Authorization: Bearer <key>"
    max_request_bytes: int = 4 * 1024 * 1024
    max_concurrent_requests: int = 1024  # in flight at once; more get 429 (the openai client retries those)
    default_max_tokens: int = 256  # a chat request without max_tokens (capped by the room left)

    def __post_init__(self):
        for key in ("max_request_bytes", "max_concurrent_requests", "default_max_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"server.{key} must be >= 1, got {getattr(self, key)}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"server.port must be in [0, 65535], got {self.port}")


@dataclass
class TrajectorySampling:
    """How a trajectory's calls are sampled during training, whatever the agent asks (module docstring)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None  # call k samples with seed + 7919 k
    max_new_tokens: int = 256  # per call
    max_sequence_tokens: int | None = None  # prompt + reply of one call
    max_calls: int = 32


@dataclass
class _Branch:
    """One token sequence of a trajectory: its conversation and the messages a continuing request starts with."""

    conv: TokenConversation
    expected: list[dict]  # canonical messages: the request that made the last call, plus the reply it got
    tools: list[dict] | None
    busy: bool = False


@dataclass
class LiveTrajectory:
    """An open trajectory: its policy, sampling, and the turns recorded so far."""

    id: str
    policy: EngineLLM
    sampling: TrajectorySampling
    turns: list[TrajectoryTurn] = field(default_factory=list)
    calls: int = 0  # calls started (finished ones are ``turns``)
    failed_calls: int = 0
    branches: list[_Branch] = field(default_factory=list)
    _sequence: list[int] = field(default_factory=list)  # the last turn's whole prompt and reply

    def record(self, prompt_ids: list[int], resp: ModelResponse) -> TrajectoryTurn:
        """Append a finished call as the next turn: a continuation when its fed tokens extend the previous turn's
        prompt and reply, else a new segment (its whole prompt, ``full_prompt``)."""
        n = len(self._sequence)
        extends = bool(self.turns) and prompt_ids[:n] == self._sequence
        own = prompt_ids[n:] if extends else list(prompt_ids)
        turn = TrajectoryTurn(
            index=len(self.turns),
            prompt_text=self.policy.format.raw_text(own),
            response_text=resp.text,
            prompt_token_ids=own,
            response_token_ids=list(resp.token_ids),
            response_logprobs=list(resp.log_probs),
            response_versions=list(resp.versions),
            usage={
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": resp.num_tokens,
                "model": resp.model,
            },
            finish_reason=resp.finish_reason,
            full_prompt=bool(self.turns) and not extends,
            routes=resp.routes,
        )
        self.turns.append(turn)
        self._sequence = list(prompt_ids) + list(resp.token_ids)
        return turn


class _Server(contextlib.AbstractContextManager):
    """uvicorn on the running loop, without taking the process's signal handlers (it runs inside a worker)."""

    def __init__(self, app, sock: socket.socket):
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                yield

        self.sock = sock
        self.server = Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises what stopped it
                raise RuntimeError("the OpenAI endpoint stopped while starting")
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task

    def __exit__(self, *exc):
        self.sock.close()


class Gateway:
    """The OpenAI-compatible endpoint over token-exact policies (module docstring). ``default``: the policy that
    serves requests without a trajectory (None: those get a 404)."""

    def __init__(self, config: GatewayConfig | None = None, default: EngineLLM | None = None):
        self.config = config or GatewayConfig()
        self.default = default
        self.parser: ToolParser = tool_parser(self.config.tool_parser)
        self.live: dict[str, LiveTrajectory] = {}
        self.in_flight = 0
        self.app = self._build_app()
        self._server: _Server | None = None
        self._http: Any = None  # the connection pool of the clients ``client`` makes
        self.url = ""

    # -- life cycle ------------------------------------------------------------------------------------------

    async def start(self) -> str:
        """Serve on the running event loop; returns the base URL (``http://host:port``)."""
        if self._server is not None:
            return self.url
        sock = socket.socket(socket.AF_INET6 if ":" in self.config.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.config.host, self.config.port))
        except OSError as e:
            sock.close()
            raise OSError(
                f"the OpenAI endpoint cannot listen on {self.config.host}:{self.config.port}: {e}"
            ) from e
        sock.listen(2048)
        server = _Server(self.app, sock)
        await server.start()
        self._server = server
        host, port = sock.getsockname()[:2]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        return self.url

    async def stop(self) -> None:
        if self._http is not None:
            http, self._http = self._http, None
            await http.aclose()
        if self._server is not None:
            server, self._server = self._server, None
            with server:
                await server.stop()

    def client(self, trajectory_id: str, **options: Any):
        """An ``openai.AsyncOpenAI`` for the trajectory (``options``: the client's, e.g. ``max_retries``). The
        clients share one connection pool: a pool per client would build an SSL context each (~30 ms of CPU),
        more than the calls themselves cost. Do not close it; ``stop`` closes the pool."""
        import openai

        if self._http is None:
            self._http = openai.DefaultAsyncHttpxClient()
        return openai.AsyncOpenAI(
            base_url=self.trajectory_url(trajectory_id),
            api_key=self.config.api_key or "hyflow",
            http_client=self._http,
            **options,
        )

    def trajectory_url(self, trajectory_id: str) -> str:
        """The ``base_url`` an OpenAI client of that trajectory uses."""
        return f"{self.url}/trajectories/{trajectory_id}/v1"

    # -- trajectories ----------------------------------------------------------------------------------------

    def open(self, trajectory_id: str, policy: EngineLLM, sampling: TrajectorySampling) -> LiveTrajectory:
        if trajectory_id in self.live:
            raise ValueError(f"trajectory {trajectory_id!r} is already open")
        if not policy.token_exact:
            raise TypeError(f"the endpoint records token ids: {policy.name!r} is not a token-level LLM")
        traj = LiveTrajectory(trajectory_id, policy, sampling)
        self.live[trajectory_id] = traj
        return traj

    def close(self, trajectory_id: str) -> LiveTrajectory:
        """Stop serving the trajectory (later requests get a 404) and return it with its recorded turns."""
        return self.live.pop(trajectory_id)

    # -- requests --------------------------------------------------------------------------------------------

    def _target(self, trajectory_id: str | None) -> tuple[LiveTrajectory | None, EngineLLM]:
        if trajectory_id is None:
            if self.default is None:
                raise APIError(
                    404,
                    "this endpoint serves trajectories only: use base_url <server>/trajectories/<id>/v1",
                    code="trajectory_required",
                )
            return None, self.default
        traj = self.live.get(trajectory_id)
        if traj is None:
            raise APIError(
                404,
                f"trajectory {trajectory_id!r} is not live: it finished, was never started, or belongs to another "
                "rollout",
                param="trajectory_id",
                code="trajectory_not_found",
            )
        if traj.calls >= traj.sampling.max_calls:
            raise APIError(
                400,
                f"trajectory {trajectory_id!r} made its {traj.sampling.max_calls} calls (env.agent.max_calls)",
                code="call_budget_exceeded",
            )
        return traj, traj.policy

    def _check_model(self, model: str) -> None:
        if model != self.config.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist here; this server serves {self.config.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def _params(self, traj: LiveTrajectory | None, s: Sampling, room: int | None) -> SamplingParams:
        if traj is None:  # inference: what the client asks, OpenAI's defaults
            max_new = s.max_tokens or self.config.default_max_tokens
            temperature, top_p, top_k, seed = (
                1.0 if s.temperature is None else s.temperature,
                1.0 if s.top_p is None else s.top_p,
                -1 if s.top_k is None else s.top_k,
                s.seed,
            )
        else:  # training: the trajectory's sampling (module docstring)
            t = traj.sampling
            max_new = min(s.max_tokens or t.max_new_tokens, t.max_new_tokens)
            temperature, top_p, top_k = t.temperature, t.top_p, t.top_k
            seed = None if t.seed is None else t.seed + 7919 * traj.calls
        if room is not None:
            if room < 1:
                raise _context_full(f"the prompt leaves no room to generate under the limit of {room} tokens")
            max_new = min(max_new, room)
        return SamplingParams(
            max_new_tokens=max_new, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=s.stop
        )

    def _conversation(self, traj: LiveTrajectory | None, policy: EngineLLM, req: ChatRequest):
        """The branch a chat request continues (and the messages it adds), or a new one (module docstring)."""
        if traj is not None:
            for branch in traj.branches:
                n = len(branch.expected)
                if not branch.busy and branch.tools == req.tools and req.messages[:n] == branch.expected:
                    new = req.messages[n:]
                    if new and not branch.conv.add_messages([template_message(m) for m in new]):
                        raise _context_full("the conversation reached its token limit")
                    return branch
        limit = traj.sampling.max_sequence_tokens if traj is not None else None
        conv = policy.conversation([template_message(m) for m in req.messages], limit, req.tools)
        branch = _Branch(conv, [], req.tools)
        if traj is not None:
            traj.branches.append(branch)
        return branch

    async def chat(self, req: ChatRequest, trajectory_id: str | None) -> Reply:
        self._check_model(req.model)
        traj, policy = self._target(trajectory_id or req.trajectory_id)
        branch = self._conversation(traj, policy, req)
        conv = branch.conv
        room = None if conv.limit is None else conv.limit - len(conv)
        params = self._params(traj, req.sampling, room)
        prompt_ids = list(conv.ids)
        branch.busy = True
        if traj is not None:
            traj.calls += 1
        try:
            resp = await conv.respond(params)
        except ContextFull as e:
            raise _context_full(str(e)) from None
        except BaseException:
            if traj is not None:
                traj.failed_calls += 1
                traj.branches.remove(branch)  # its conversation is in an unknown state
            raise
        finally:
            branch.busy = False
        if resp.finish_reason == "abort":
            if traj is not None:
                traj.branches.remove(branch)
            raise APIError(503, "the generation was aborted by a weight update; send the request again")
        if traj is not None:
            traj.record(prompt_ids, resp)
        reply = self._reply(policy, prompt_ids, resp, req.parse_tools)
        branch.expected = req.messages + [canonical_message(assistant_message(reply))]
        return reply

    async def complete(self, req: CompletionRequest, trajectory_id: str | None) -> Reply:
        self._check_model(req.model)
        traj, policy = self._target(trajectory_id or req.trajectory_id)
        ids = policy.format.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
        vocab = len(policy.tokenizer)
        if max(ids) >= vocab:
            raise APIError(400, f"prompt token ids must be below the vocabulary size {vocab}", param="prompt")
        limit = policy.max_model_len
        if traj is not None and traj.sampling.max_sequence_tokens is not None:
            limit = min(x for x in (limit, traj.sampling.max_sequence_tokens) if x is not None)
        params = self._params(traj, req.sampling, None if limit is None else limit - len(ids))
        if traj is not None:
            traj.calls += 1
        try:
            out = await policy._generate(ids, params)
        except BaseException:
            if traj is not None:
                traj.failed_calls += 1
            raise
        if out.finish_reason == "abort":
            raise APIError(503, "the generation was aborted by a weight update; send the request again")
        tokens = [int(t) for t in out.token_ids]
        resp = ModelResponse(
            text=policy.format.decode(tokens),
            token_ids=tokens,
            log_probs=[float(x) for x in out.log_probs] if out.log_probs is not None else [0.0] * len(tokens),
            finish_reason=out.finish_reason,
            prompt_ids=ids,
            prompt_text="",
            num_tokens=len(tokens),
            prompt_tokens=len(ids),
            model=policy.name,
            versions=list(out.versions or []),
            routes=out.routes,
        )
        if traj is not None:
            traj.record(ids, resp)
        return self._reply(policy, ids, resp, parse_tools=False)

    def _reply(
        self, policy: EngineLLM, prompt_ids: list[int], resp: ModelResponse, parse_tools: bool
    ) -> Reply:
        fmt = policy.format
        parsed = self.parser.parse(resp.text) if parse_tools else None
        has_calls = parsed is not None and bool(parsed.calls)
        return Reply(
            text=resp.text,
            token_ids=list(resp.token_ids),
            log_probs=list(resp.log_probs),
            token_texts=[fmt.token_text(t) for t in resp.token_ids],
            prompt_token_ids=prompt_ids,
            finish_reason="tool_calls" if has_calls and resp.finish_reason == "stop" else resp.finish_reason,
            weight_version=max(resp.versions, default=getattr(policy.engine, "weight_version", 0) or 0),
            parsed=parsed,
            call_ids=[f"call_{uuid.uuid4().hex[:24]}" for _ in (parsed.calls if parsed else [])],
        )

    # -- HTTP ------------------------------------------------------------------------------------------------

    def _build_app(self):
        app = FastAPI(
            title="hyflow OpenAI-compatible endpoint", docs_url=None, redoc_url=None, openapi_url=None
        )
        config = self.config

        @app.exception_handler(APIError)
        async def api_error(request: Request, exc: APIError):
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.exception_handler(HTTPException)
        async def http_error(request: Request, exc: HTTPException):
            message = f"{request.method} {request.url.path}: {exc.detail}"
            return JSONResponse(error_body(message, "invalid_request_error"), status_code=exc.status_code)

        @app.exception_handler(Exception)
        async def server_error(request: Request, exc: Exception):
            message = f"the server failed on this request: {type(exc).__name__}: {exc}"
            return JSONResponse(error_body(message, "server_error"), status_code=500)

        async def read(request: Request) -> Any:
            if config.api_key is not None:
                if request.headers.get("authorization", "") != f"Bearer {config.api_key}":
                    raise APIError(401, "a wrong or missing API key (Authorization: Bearer <key>)")
            size = request.headers.get("content-length")
            if size is not None and size.isdigit() and int(size) > config.max_request_bytes:
                raise _too_large(int(size), config.max_request_bytes)
            body = await request.body()
            if len(body) > config.max_request_bytes:
                raise _too_large(len(body), config.max_request_bytes)
            try:
                return json.loads(body)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise APIError(400, f"the request body is not valid JSON: {e}") from None

        @contextlib.asynccontextmanager
        async def slot():
            if self.in_flight >= config.max_concurrent_requests:
                raise APIError(
                    429, f"more than {config.max_concurrent_requests} requests in flight; retry later"
                )
            self.in_flight += 1
            try:
                yield
            finally:
                self.in_flight -= 1

        def trajectory_of(request: Request) -> str | None:
            return request.path_params.get("trajectory_id") or request.headers.get(TRAJECTORY_HEADER)

        def sse(chunks: Sequence[dict]) -> StreamingResponse:
            async def events() -> AsyncIterator[str]:
                for c in chunks:
                    yield f"data: {json.dumps(c)}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        async def chat_completions(request: Request):
            req = ChatRequest.parse(await read(request))
            async with slot():
                reply = await self.chat(req, trajectory_of(request))
            if req.stream:
                return sse(chat_chunks(reply, req.model, req.sampling.logprobs, req.include_usage))
            # JSONResponse as it is: FastAPI's encoder for a returned dict walks every token id in Python
            return JSONResponse(chat_response(reply, req.model, req.sampling.logprobs))

        async def completions(request: Request):
            req = CompletionRequest.parse(await read(request))
            async with slot():
                reply = await self.complete(req, trajectory_of(request))
            if req.stream:
                return sse(completion_chunks(reply, req.model, req.sampling.logprobs, req.include_usage))
            return JSONResponse(completion_response(reply, req.model, req.sampling.logprobs))

        async def models(request: Request):
            return {
                "object": "list",
                "data": [{"id": config.model_name, "object": "model", "owned_by": "hyflow"}],
            }

        for prefix in ("", "/trajectories/{trajectory_id}"):
            app.add_api_route(prefix + "/v1/chat/completions", chat_completions, methods=["POST"])
            app.add_api_route(prefix + "/v1/completions", completions, methods=["POST"])
            app.add_api_route(prefix + "/v1/models", models, methods=["GET"])
        return app


def _context_full(message: str) -> APIError:
    return APIError(400, message, param="messages", code="context_length_exceeded")


def _too_large(size: int, limit: int) -> APIError:
    return APIError(
        413, f"the request body is {size} bytes; this server takes at most {limit} (server.max_request_bytes)"
    )
