"""A scripted policy for tests, benchmarks, demos and the reference replay: ``scripted_generate(tokenizer, respond)``
is a `GenerateFn` that answers ``respond(prompt text)``; ``ReplayScript`` is a ``respond`` that replays fixed turns
per query (e.g. a task's ``extra_info["reference_turns"]``)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping, Sequence

from workers.agents.llm import GenerateFn
from workers.rollout.sampling import GenerationOutput, SamplingParams

__all__ = ["ReplayScript", "scripted_generate"]


def scripted_generate(
    tokenizer,
    respond: Callable[[str], str],
    *,
    log_prob: float = -0.5,
    tokenization: str = "bpe",
    add_eos: bool = True,
    delay_s: float = 0.0,
) -> GenerateFn:
    """A `GenerateFn` that answers ``respond(prompt text)`` instead of sampling a model.

    The prompt ids are decoded (special tokens kept, so the chat structure is visible to ``respond``);
    the reply is tokenised (``tokenization="bpe"``: the tokenizer's own encoding; ``"chars"``: each
    character encoded alone -- a valid but non-canonical token sequence that re-tokenising the text
    would *not* reproduce) and ended with the EOS token, unless ``max_new_tokens`` cuts it first
    (finish_reason "length"). Every token gets ``log_prob``. ``delay_s`` simulates generation time.
    """
    if tokenization not in ("bpe", "chars"):
        raise ValueError(f"tokenization must be 'bpe' or 'chars', got {tokenization!r}")
    eos = tokenizer.eos_token_id

    async def generate(prompt_ids, params: SamplingParams) -> GenerationOutput:
        text = tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
        reply = respond(text)
        if inspect.isawaitable(reply):
            reply = await reply
        if tokenization == "bpe":
            ids = list(tokenizer.encode(reply, add_special_tokens=False))
        else:
            ids = [t for ch in reply for t in tokenizer.encode(ch, add_special_tokens=False)]
        if add_eos and eos is not None:
            ids.append(int(eos))
        finish = "stop"
        if len(ids) > params.max_new_tokens:
            ids, finish = ids[: params.max_new_tokens], "length"
        if delay_s:
            await asyncio.sleep(delay_s)
        else:
            await asyncio.sleep(0)
        return GenerationOutput(
            token_ids=ids,
            log_probs=[log_prob] * len(ids) if params.logprobs else None,
            finish_reason=finish,
            text=tokenizer.decode(ids, skip_special_tokens=True),
        )

    return generate


class ReplayScript:
    """A ``respond(prompt_text) -> str`` for `scripted_generate` that replays fixed turns (tests, benchmarks,
    demos such as replaying a task's ``extra_info["reference_turns"]``).

    ``by_query``: ``{query: [turn 1 text, turn 2 text, ...]}``; a prompt containing a query is that
    agent's conversation (the query that occurs first wins, the longest among equals: the agent's own
    query precedes its history, which may quote other queries) -- roots and ``rlm_query`` children alike (a child's query
    is the ``rlm_query`` prompt) -- and its turn number is the count of ``turn_marker`` (the template's
    assistant header) in the prompt minus one; past the last text the last one repeats. Any other prompt
    is a plain ``llm_query`` completion and gets ``sub(prompt_text)`` (default: ``"ok"``).
    """

    def __init__(
        self,
        by_query: Mapping[str, Sequence[str]],
        sub: Callable[[str], str] | None = None,
        turn_marker: str = "<|im_start|>assistant",
    ):
        self.by_query = {str(k): list(v) for k, v in by_query.items()}
        self.order = sorted(self.by_query, key=len, reverse=True)
        self.sub = sub
        self.turn_marker = turn_marker

    def __call__(self, prompt_text: str) -> str:
        found = [(prompt_text.find(q), -len(q), q) for q in self.order if q in prompt_text]
        if not found:
            return self.sub(prompt_text) if self.sub is not None else "ok"
        turns = self.by_query[min(found)[2]]
        k = max(prompt_text.count(self.turn_marker) - 1, 0)
        return turns[min(k, len(turns) - 1)]
