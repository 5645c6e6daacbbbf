"""Text in and out of a tokenizer (a weights.Tokenizer, or anything with its encode, decode and
bos_id/eos_id): the Llama-2 chat template, the text that new
tokens add to a prompt, and incremental detokenisation for streaming.

Decoding token by token would lose SentencePiece's word-boundary spaces and split
multi-byte characters (byte-fallback pieces such as ``<0xC3>``). :class:`TextStream` decodes
the whole growing sequence instead and hands out what is new; text ending in U+FFFD is an
incomplete UTF-8 sequence and waits for the token that completes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Llama-2 chat format (Meta's reference code): the system prompt sits inside the first [INST].
B_INST, E_INST = "[INST]", "[/INST]"
B_SYS, E_SYS = "<<SYS>>\n", "\n<</SYS>>\n\n"


def encode_prompt(tokenizer: Any, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
    """The prompt's ids with BOS; with ``chat``, wrapped in the Llama-2 chat template
    ``[INST] <<SYS>>\\n{system}\\n<</SYS>>\\n\\n{prompt} [/INST]`` (the system part only when given)."""
    if chat:
        if system:
            prompt = B_SYS + system.strip() + E_SYS + prompt.strip()
        return tokenizer.encode(f"{B_INST} {prompt.strip()} {E_INST}", bos=True)
    return tokenizer.encode(prompt, bos=True)


def encode_dialog(tokenizer: Any, messages: Sequence[tuple[str, str]]) -> list[int]:
    """A conversation's ids in the Llama-2 chat format (Meta's reference ``chat_completion``):
    an optional ("system", text) first, then ("user", text) and ("assistant", text) turns in
    turn, ending with the user's. Each answered turn is ``<s>[INST] {user} [/INST] {answer} </s>``;
    the last is ``<s>[INST] {user} [/INST]``, with the system prompt inside the first [INST]. One
    user turn (and a system prompt) gives :func:`encode_prompt`'s ids with ``chat``. ValueError
    for any other order of roles."""
    turns = list(messages)
    system = turns.pop(0)[1] if turns and turns[0][0] == "system" else None
    roles = [role for role, _ in turns]
    if not turns or roles != ["user", "assistant"] * (len(turns) // 2) + ["user"]:
        raise ValueError("messages must be an optional system message, then user and assistant messages in turn, "
                         f"ending with a user message; got {', '.join(roles) or 'no user message'}")
    texts = [text for _, text in turns]
    if system:
        texts[0] = B_SYS + system.strip() + E_SYS + texts[0].strip()
    ids: list[int] = []
    for user, answer in zip(texts[:-1:2], texts[1::2]):
        ids += tokenizer.encode(f"{B_INST} {user.strip()} {E_INST} {answer.strip()} ", bos=True, eos=True)
    return ids + tokenizer.encode(f"{B_INST} {texts[-1].strip()} {E_INST}", bos=True)


def continuation_text(tokenizer: Any, prompt_ids: Sequence[int], new_ids: Sequence[int]) -> str:
    """The text the new tokens add to the prompt, with the spaces SentencePiece puts between them."""
    before = tokenizer.decode(list(prompt_ids))
    full = tokenizer.decode(list(prompt_ids) + list(new_ids))
    return full[len(before):] if full.startswith(before) else tokenizer.decode(list(new_ids))


class TextStream:
    """Incremental detokenisation: :meth:`add` a token, get the text it completes.

    ``prompt_ids`` are the tokens already shown (their text is never handed out again).
    What it hands out, :meth:`finish` included, adds up to the whole sequence's text after
    the prompt's: ``decode(prompt + new)[len(decode(prompt)):]``."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = [int(t) for t in prompt_ids]
        self.shown = len(tokenizer.decode(self.ids))

    def add(self, token: int) -> str:
        """The text that is complete now that ``token`` follows ("" while a character waits)."""
        self.ids.append(int(token))
        ready = self.tokenizer.decode(self.ids).rstrip("\ufffd")
        if len(ready) <= self.shown:
            return ""
        piece, self.shown = ready[self.shown:], len(ready)
        return piece

    def finish(self) -> str:
        """Whatever was held back at the end (a byte sequence that never completed)."""
        text = self.tokenizer.decode(self.ids)[self.shown:]
        self.shown += len(text)
        return text
