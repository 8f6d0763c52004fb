"""``ChatFormat``: a tokenizer's chat template as the pieces an incremental, token-exact conversation needs.

The model's own tokens are never re-tokenised: after a model turn, only the text the template puts *after* it
(the end of the turn, the new messages -- user observations, ``tool`` results -- and the next generation prompt)
is rendered and tokenised by itself, then appended (``continuation``). Tools (OpenAI function schemas) go to the
template as ``apply_chat_template(..., tools=...)`` does, so each model family sees them in its own format.

Some templates rewrite earlier turns when the conversation grows (Qwen3 and DeepSeek-R1 drop earlier
``<think>`` blocks, others add dates or reorder): then the grown token sequence is no longer what the template
renders for the whole history. ``workers.agents.llm.TokenConversation`` detects that by comparing the two texts
and from then on feeds the template's full rendering at every turn, recording that turn's prompt as a whole
prompt (``TrajectoryTurn.full_prompt``), so training can use each turn's exact prompt (``workers.agents.batch``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["ChatFormat"]

_S1, _S2, _SA = "HYFLOWSENTINELONE", "HYFLOWSENTINELTWO", "HYFLOWSENTINELSYS"


class ChatFormat:
    """The tokenizer's chat template split into the pieces an incremental conversation needs.

    ``render(messages, tools)``: the prompt text (template + generation prompt). ``continuation(history,
    new_messages, tools, last_token)``: the text after the model's last turn (``history[-1]``, an assistant
    message) up to the next generation prompt -- without the token that closed the model's turn when it emitted
    one itself. Tokenizers without a chat template get a plain ``User:/Assistant:`` format.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        if self.has_template:
            text = self._render(
                [
                    {"role": "system", "content": _SA},
                    {"role": "user", "content": "A"},
                    {"role": "assistant", "content": _S1},
                    {"role": "user", "content": _S2},
                ],
                add_generation_prompt=True,
            )
            i1, i2 = text.find(_S1), text.find(_S2)
            if i1 < 0 or i2 < i1:
                raise ValueError("the chat template drops message contents; ChatFormat cannot split it")
        self.eos_ids = set()
        for name in ("eos_token_id",):
            v = getattr(tokenizer, name, None)
            if isinstance(v, int):
                self.eos_ids.add(v)
        # The text of each special token, so a turn that ended with one does not get it twice.
        self._special_text: dict[int, str] = {}

    def _render(self, messages, add_generation_prompt: bool, tools=None) -> str:
        kwargs = {"tools": list(tools)} if tools else {}
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def render(self, messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None) -> str:
        """The prompt text of ``messages`` (and ``tools``) with the generation prompt."""
        if self.has_template:
            return self._render(messages, add_generation_prompt=True, tools=tools)
        return "\n\n".join(_plain(m) for m in messages) + "\n\nAssistant: "

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def raw_text(self, ids: Sequence[int]) -> str:
        """The exact text of ``ids``: special tokens kept, no clean-up of spaces (for comparing with a render)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def prompt_ids(self, messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None) -> list[int]:
        return self.encode(self.render(messages, tools))

    def token_text(self, token: int) -> str:
        if token not in self._special_text:
            self._special_text[token] = self.raw_text([token])
        return self._special_text[token]

    def continuation(
        self,
        history: Sequence[Mapping],
        new_messages: Sequence[Mapping],
        tools: Sequence[Mapping] | None = None,
        last_token: int | None = None,
    ) -> str:
        """The text between the model's last turn (``history[-1]``) and the next generation, holding
        ``new_messages``: the template's rendering of the whole conversation with that turn's content replaced by a
        sentinel, cut after the sentinel (so the model's own text is not re-rendered). ``last_token``: the model's
        closing token when it emitted one (its text is not repeated)."""
        if not self.has_template:
            return "".join("\n\n" + _plain(m) for m in new_messages) + "\n\nAssistant: "
        probe = [*history[:-1], {**history[-1], "content": _S1}, *new_messages]
        text = self._render(probe, add_generation_prompt=True, tools=tools)
        i = text.rfind(_S1)
        if i < 0:
            raise ValueError(
                "the chat template drops the assistant turn's content; ChatFormat cannot split it"
            )
        after = text[i + len(_S1) :]
        if last_token is not None:
            closing = self.token_text(last_token)
            if closing and after.startswith(closing):
                after = after[len(closing) :]
        return after


def _plain(message: Mapping) -> str:
    return f"{str(message['role']).capitalize()}: {message.get('content') or ''}"
