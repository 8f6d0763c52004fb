"""A persistent RLM session: ``RLM(persistent=True)`` keeps the root's REPL and conversation between ``completion``
calls, and compacts the conversation when it fills the model's window.

* The REPL: the first call creates the root REPL (holding that call's context as ``context``) and the session keeps
  it open; later calls run in it, so every variable the model made is still there. A later call's context is bound
  to the next free ``context_1``, ``context_2``, ... (``context`` stays the first call's, as in rlms); the model is
  told which name holds it. Children (``rlm_query``) still get fresh REPLs of their own.
* The conversation: a later call's root starts from the whole conversation so far (the first call's system
  prompt, every earlier question, turn and observation) plus a user message with the new question.
* Compaction (``compaction_threshold``, a fraction of the root's token window; None: never): before a model turn,
  when the conversation plus the turn's ``max_new_tokens`` would pass that fraction of the window -- or when an
  observation did not fit at all -- the older messages are replaced by a summary: the model is asked for one
  (a plain completion of the transcript: what was done, exact intermediate results and variable names, what is
  left), and if that fails the transcript itself, cut to the length a summary may have, stands in for it. The
  system prompt, the current question and the last exchange are kept verbatim; the REPL is untouched. Each
  compaction is recorded in the root trajectory's ``metadata["compactions"]`` (trigger, tokens before/after,
  method, summary, usage; the summary call counts in the budget and the usage). The window is the token limit of the
  root's conversation: ``AgentConfig.max_sequence_tokens`` and the engine's ``max_model_len``; for a text-only
  (chat) model, ``max_sequence_tokens``, with tokens estimated at 4 characters each.

Sessions are for inference: a compacted conversation is rebuilt from text, so its turns are not one token-exact
sequence (a turn after a compaction has the whole rebuilt prompt as its ``prompt_ids``). Training never uses them.
One completion at a time runs in a session.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from workers.agents.llm import Completion, ContextFull, ModelResponse, TokenConversation
from workers.rlm.prompts import Contexts, describe_context
from workers.rlm.protocol import truncate
from workers.rollout.sampling import SamplingParams

__all__ = ["Session", "SessionConversation", "follow_up_message"]

SUMMARY_REQUEST = (
    "Below is the earlier part of a conversation in which you answer questions by writing Python code in a REPL. "
    "Summarize it so you can continue without it. Include: the questions asked and the answers given; which "
    "steps are done and which remain; every concrete intermediate result (numbers, values, REPL variable names) "
    "exactly; what you were about to do next. Be concise.\n\n"
)
SUMMARY_INTRO = "Summary of the earlier conversation (it was compacted to fit the context window):\n"
RESTATED = "The question you are answering now:\n"
SUMMARY_MAX_TOKENS = 512  # per summary request
SUMMARY_TRIES = 4  # a transcript too long for the model is halved and asked again this many times in all
RECORD_CHARS = 2000  # summary characters kept in a compaction record
CHARS_PER_TOKEN = 4  # estimate for text-only (chat) models


def _bind_context_code(value) -> str:
    """REPL code that binds the JSON value ``value`` to the first free ``context_<i>`` (i >= 1) and prints
    the name."""
    return (
        "import json as _json\n"
        "_i = 1\n"
        "while f'context_{_i}' in globals():\n"
        "    _i += 1\n"
        f"globals()[f'context_{{_i}}'] = _json.loads({json.dumps(value, ensure_ascii=False)!r})\n"
        "print(f'context_{_i}')\n"
        "del _i, _json\n"
    )


def follow_up_message(query: str, bound: dict[str, Any]) -> str:
    """The user message that starts a later call of a session; ``bound``: this call's context variables."""
    where = "".join(describe_context(v).describe(name=name) + " " for name, v in bound.items())
    return (
        f"{query.strip()}\n\n{where}The REPL still holds every variable from the earlier questions "
        "(`context` included). Answer this new question with FINAL(...) or FINAL_VAR(...) as before."
    )


class Session:
    """What a persistent RLM keeps between completions: the root REPL and the root conversation's messages."""

    def __init__(self, compaction_threshold: float | None = 0.85):
        if compaction_threshold is not None and not 0 < compaction_threshold <= 1:
            raise ValueError(f"compaction_threshold must be in (0, 1] or None, got {compaction_threshold}")
        self.compaction_threshold = compaction_threshold
        self.repl = None
        self.messages: list[dict[str, str]] = []  # the conversation so far ([] before the first call)
        self._handler: Callable[..., Any] | None = None  # the running call's sub-call handler

    @property
    def running(self) -> bool:
        return self._handler is not None

    async def _dispatch(self, kind: str, payload: dict) -> str:
        # The REPL outlives calls: its sub-calls go to whichever call is running now.
        if self._handler is None:
            return f"Error: {kind} outside a completion call"
        return await self._handler(kind, payload)

    def begin(self, handler) -> None:
        """Start a call whose root answers the REPL's sub-calls with ``handler``."""
        if self._handler is not None:
            raise RuntimeError("a persistent RLM session runs one completion at a time")
        self._handler = handler

    async def repl_for(self, create: Callable[[Any], Awaitable[Any]], context) -> tuple[Any, dict[str, Any]]:
        """The session's REPL and ``{variable: value}`` for this call's context. The first call's REPL is
        ``await create(handler)`` (holding ``context`` the usual way: ``{}``); a later call binds its context (each
        of `Contexts`) to the next free ``context_<i>``."""
        if self.repl is None or self.repl.closed:
            self.repl = await create(self._dispatch)
            return self.repl, {}
        values = context.values if isinstance(context, Contexts) else [] if context is None else [context]
        bound = {}
        for value in values:
            res = await self.repl.aexecute(_bind_context_code(value))
            if res.error or not res.stdout.strip():
                raise RuntimeError(f"could not bind this call's context in the session's REPL: {res.error}")
            bound[res.stdout.strip()] = value
        return self.repl, bound

    def conversation(
        self, llm, messages, limit: int | None, on_compaction, tools=None
    ) -> SessionConversation:
        return SessionConversation(llm, messages, limit, self.compaction_threshold, on_compaction, tools)

    def end(self, conv) -> None:
        """End the running call; its conversation (if it got one) is the session's history from now on."""
        if isinstance(conv, SessionConversation):
            self.messages = list(conv.messages)
        self._handler = None

    async def aclose(self) -> None:
        repl, self.repl = self.repl, None
        if repl is not None:
            await repl.aclose()

    def close(self) -> None:
        repl, self.repl = self.repl, None
        if repl is not None:
            repl.close()


class SessionConversation:
    """A root conversation of a session: the model's conversation (`workers.agents.llm`) plus the messages it
    was built from, so that it can be carried to the next call and compacted (module docstring).
    ``on_compaction(record)`` is told of each compaction."""

    def __init__(
        self,
        llm,
        messages,
        limit: int | None,
        threshold: float | None,
        on_compaction: Callable[[dict], None],
        tools=None,
    ):
        self.llm = llm
        self.tools = tools
        self.messages = [dict(m) for m in messages]
        self.limit = limit
        self.threshold = threshold
        self.on_compaction = on_compaction
        self.query = self.messages[-1]["content"]  # the current question: compaction keeps it verbatim
        self.query_index: int | None = len(self.messages) - 1  # its message (None: restated after a summary)
        self.conv = llm.conversation(self.messages, limit, tools=tools)
        self.stale = False  # an observation did not fit: the inner conversation lacks it until a compaction

    def __len__(self) -> int:
        return len(self.conv)

    @property
    def window(self) -> int | None:
        return self.conv.limit if isinstance(self.conv, TokenConversation) else self.limit

    def used_tokens(self) -> int:
        if isinstance(self.conv, TokenConversation):
            return len(self.conv)
        return sum(len(m["content"]) for m in self.messages) // CHARS_PER_TOKEN

    async def respond(self, params: SamplingParams) -> ModelResponse:
        window = self.window
        if self.threshold is not None and window is not None:
            full = self.used_tokens() + params.max_new_tokens > self.threshold * window
            trigger = "observation did not fit" if self.stale else "threshold" if full else None
            if trigger is not None and not await self.compact(params, trigger) and self.stale:
                raise ContextFull("the conversation does not fit its window even after compaction")
        resp = await self.conv.respond(params)
        self.messages.append({"role": "assistant", "content": resp.text})
        return resp

    def add_user(self, text: str) -> bool:
        return self.add_messages([{"role": "user", "content": text}])

    def add_messages(self, messages) -> bool:
        new = [dict(m) for m in messages]
        self.messages += new
        if self.conv.add_messages(new):
            return True
        if self.threshold is None or self.window is None:
            del self.messages[-len(new) :]
            return False
        self.stale = True  # the next respond compacts, then rebuilds the conversation with these messages
        return True

    async def compact(self, params: SamplingParams, trigger: str = "threshold") -> bool:
        """Replace the older messages by a summary; False when there is nothing older to summarise.
        ``trigger`` is recorded: "threshold", or "observation did not fit" (then ``tokens_before`` counts the
        conversation without that observation)."""
        msgs = self.messages
        tail_from = max(len(msgs) - 2, 1)  # the last exchange (response + observation) stays verbatim
        old = [m for i, m in enumerate(msgs[1:tail_from], 1) if i != self.query_index]
        if not old:
            return False
        before = self.used_tokens()
        summary, method, usage = await self._summarize(old, params)
        first = SUMMARY_INTRO + summary
        if self.query_index is None or self.query_index < tail_from:
            first += "\n\n" + RESTATED + self.query
        tail = [dict(m) for m in msgs[tail_from:]]
        if tail and tail[0]["role"] == "user":  # keep roles alternating: merge into the first user message
            first += "\n\n" + tail.pop(0)["content"]
        self.messages = [dict(msgs[0]), {"role": "user", "content": first}, *tail]
        self.query_index = None
        self.conv = self.llm.conversation(self.messages, self.limit, tools=self.tools)
        self.stale = False
        self.on_compaction(
            {
                "trigger": trigger,
                "messages_summarized": len(old),
                "tokens_before": before,
                "tokens_after": self.used_tokens(),
                "method": method,
                "summary": truncate(summary, RECORD_CHARS),
                "usage": usage,
            }
        )
        return True

    async def _summarize(self, old: list[dict], params: SamplingParams) -> tuple[str, str, dict]:
        """(summary, "model" | "truncated", the summary call's usage)."""
        transcript = "\n\n".join(f"[{m['role']}]\n{m['content']}" for m in old)
        sampling = SamplingParams(
            max_new_tokens=min(SUMMARY_MAX_TOKENS, params.max_new_tokens),
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed,
            logprobs=False,
        )
        chars = len(transcript)
        for _ in range(SUMMARY_TRIES):
            try:
                out: Completion = await self.llm.complete(
                    SUMMARY_REQUEST + truncate(transcript, chars), sampling
                )
            except ContextFull:
                chars //= 2
                continue
            except Exception:  # the summary is a convenience: fall back to the transcript itself
                break
            usage = {
                "prompt_tokens": out.prompt_tokens,
                "completion_tokens": out.completion_tokens,
                "model": out.model,
            }
            if out.text.strip():
                return out.text.strip(), "model", usage
            break
        return self._cut(transcript, sampling.max_new_tokens), "truncated", {}

    def _cut(self, text: str, max_tokens: int) -> str:
        """``text`` truncated to about ``max_tokens`` tokens (exactly at most, for a token-level model): the
        fallback summary takes no more room than a model's summary could have."""
        chars = max_tokens * CHARS_PER_TOKEN
        cut = truncate(text, chars)
        if isinstance(self.conv, TokenConversation):
            encode = self.conv.llm.format.encode
            while chars > 1 and len(encode(cut)) > max_tokens:
                chars = chars * 3 // 4
                cut = truncate(text, chars)
        return cut
