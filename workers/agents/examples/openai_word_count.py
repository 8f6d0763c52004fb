"""An agent written only against the OpenAI client, trained by hyflow unchanged (``env.loop: openai_agent``).

It counts the words of a text with a ``count_words`` tool declared as an OpenAI function, in a loop of chat
completions like any tool-calling agent: each reply's ``tool_calls`` are run and answered with ``tool`` messages,
and a reply without one is the answer ``ANSWER: N``. Nothing here knows about tokens, engines or training::

    python -m workers.agents.examples.word_count_tools        # the data: runs/word_count_tools/data/*.parquet
    python -m recipes.rlm --config recipes/rlm_openai_agent.yaml

The same function runs against any OpenAI-compatible server, e.g. hyflow's own after training
(``python -m recipes.serve --model runs/openai_agent/hf_model``, docs/openai_agents.md).
"""

from __future__ import annotations

import json
import re

from workers.agents.examples.word_count_tools import COUNT_TOOL

SYSTEM_PROMPT = "Count the words of the text you are given with the count_words tool; answer ANSWER: N."
_ANSWER = re.compile(r"ANSWER:\s*(\d+)")


def count_words(text: str) -> str:
    return f"{len(text.split())} words"


async def agent(client, row: dict) -> str | None:
    """One task: at most three model calls; the answer is the N of ``ANSWER: N`` (None without one)."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, *row["messages"]]
    for _ in range(3):
        response = await client.chat.completions.create(
            model=row["model"], messages=messages, tools=[COUNT_TOOL], max_tokens=96
        )
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            answer = _ANSWER.search(message.content or "")
            if answer:
                return answer.group(1)
            messages.append({"role": "user", "content": "Call count_words or answer ANSWER: N."})
            continue
        for call in message.tool_calls:
            try:
                result = count_words(json.loads(call.function.arguments)["text"])
            except (ValueError, KeyError, TypeError) as e:
                result = f"Error: {type(e).__name__}: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
