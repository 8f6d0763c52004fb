"""``ChatFormat``: a tokenizer's chat template split into the pieces an incremental, token-exact conversation needs.

Template pieces are tokenised once per segment, never the whole conversation, so the model's own tokens are never
re-tokenised (``workers.agents.llm.EngineLLM`` builds its conversations on it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["ChatFormat"]

_S1, _S2, _SA = "HYFLOWSENTINELONE", "HYFLOWSENTINELTWO", "HYFLOWSENTINELSYS"


class ChatFormat:
    """The tokenizer's chat template split into the pieces an incremental conversation needs.

    ``prompt_ids(messages)``: the initial prompt (template + generation prompt). ``continuation_text(text,
    last_token)``: the text of the tokens that close the model's turn (unless its last token already did), open a
    user turn holding ``text``, close it and open the next assistant turn -- tokenised by itself, so
    the model's own tokens before it are never touched. Tokenizers without a chat template get a
    plain ``User:/Assistant:`` format.
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
            self.between = text[i1 + len(_S1) : i2]  # end of assistant turn + start of user turn
            self.tail = text[i2 + len(_S2) :]  # end of user turn + generation prompt
        else:
            self.between, self.tail = "\n\nUser: ", "\n\nAssistant: "
        self.eos_ids = set()
        for name in ("eos_token_id",):
            v = getattr(tokenizer, name, None)
            if isinstance(v, int):
                self.eos_ids.add(v)
        # The text of each special token, so a turn that ended with one does not get it twice.
        self._special_text: dict[int, str] = {}

    def _render(self, messages, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def render(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt text of ``messages`` with the generation prompt."""
        if self.has_template:
            return self._render(messages, add_generation_prompt=True)
        parts = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
        return "\n\n".join(parts) + self.tail

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def prompt_ids(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        return self.encode(self.render(messages))

    def _token_text(self, token: int) -> str:
        if token not in self._special_text:
            self._special_text[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return self._special_text[token]

    def continuation_text(self, text: str, last_token: int | None) -> str:
        between = self.between
        if last_token is not None:
            closing = self._token_text(last_token)
            if closing and between.startswith(closing):
                between = between[len(closing) :]
        return between + text + self.tail
