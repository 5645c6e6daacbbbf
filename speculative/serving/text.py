"""Text in and out of a tokenizer (a weights.Tokenizer, or anything with its encode, decode and
bos_id/eos_id): a conversation's prompt in the model's own chat format, the text that new
tokens add to a prompt, incremental detokenisation for streaming, and a request's text out with
its stop strings (:class:`Output`).

Decoding token by token would lose SentencePiece's word-boundary spaces and split
multi-byte characters (byte-fallback pieces such as ``<0xC3>``, or a byte-level BPE's tokens,
which may end in the middle of a character). :class:`TextStream` decodes a window of the
growing sequence instead and hands out what is new; text ending in U+FFFD is an incomplete
UTF-8 sequence and waits for the token that completes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Llama-2 chat format (Meta's reference code): the system prompt sits inside the first [INST].
B_INST, E_INST = "[INST]", "[/INST]"
B_SYS, E_SYS = "<<SYS>>\n", "\n<</SYS>>\n\n"


class NoChatTemplateError(ValueError):
    """A conversation for a model that has no chat format (a base model)."""


def encode_prompt(
    tokenizer: Any, prompt: str, chat: bool = False, system: str | None = None
) -> list[int]:
    """The prompt's ids with BOS; with ``chat``, one user turn (after ``system``, when given) in the
    model's chat format (:func:`encode_dialog`)."""
    if chat:
        return encode_dialog(
            tokenizer, ([("system", system)] if system else []) + [("user", prompt)]
        )
    return tokenizer.encode(prompt, bos=True)


def encode_dialog(tokenizer: Any, messages: Sequence[tuple[str, str]]) -> list[int]:
    """A conversation's ids, (role, text) pairs, in the model's chat format: ``tokenizer.chat``,
    set by weights.load_tokenizer (the checkpoint's own template, or :data:`LLAMA2_CHAT`).
    NoChatTemplateError for a model without one; a template may refuse a conversation
    (a ValueError too)."""
    chat = getattr(tokenizer, "chat", None)
    if chat is None:
        name = getattr(tokenizer, "name", "the model")
        raise NoChatTemplateError(
            f"{name} has no chat template (its tokenizer_config.json names none): it is a base "
            "model, which continues text rather than answering turns; send it a plain prompt"
        )
    return chat.encode(tokenizer, messages)


class Llama2Chat:
    """Llama-2's chat format (Meta's reference ``chat_completion``), for a Llama-2 chat model whose
    folder has no template: an optional ("system", text) first, then ("user", text) and
    ("assistant", text) turns in turn, ending with the user's. Each answered turn is
    ``<s>[INST] {user} [/INST] {answer} </s>``; the last is ``<s>[INST] {user} [/INST]``, with the
    system prompt inside the first [INST]. ValueError for any other order of roles."""

    def encode(
        self, tokenizer: Any, messages: Sequence[tuple[str, str]] | Sequence[dict[str, Any]]
    ) -> list[int]:
        turns = [(m["role"], m["content"]) if isinstance(m, dict) else tuple(m) for m in messages]
        system = turns.pop(0)[1] if turns and turns[0][0] == "system" else None
        roles = [role for role, _ in turns]
        if not turns or roles != ["user", "assistant"] * (len(turns) // 2) + ["user"]:
            raise ValueError(
                "messages must be an optional system message, then user and assistant messages in "
                f"turn, ending with a user message; got {', '.join(roles) or 'no user message'}"
            )
        texts = [text for _, text in turns]
        if system:
            texts[0] = B_SYS + system.strip() + E_SYS + texts[0].strip()
        ids: list[int] = []
        for user, answer in zip(texts[:-1:2], texts[1::2]):
            ids += tokenizer.encode(
                f"{B_INST} {user.strip()} {E_INST} {answer.strip()} ", bos=True, eos=True
            )
        return ids + tokenizer.encode(f"{B_INST} {texts[-1].strip()} {E_INST}", bos=True)


LLAMA2_CHAT = Llama2Chat()


def continuation_text(tokenizer: Any, prompt_ids: Sequence[int], new_ids: Sequence[int]) -> str:
    """The text the new tokens add to the prompt, with the spaces SentencePiece puts between them."""
    before = tokenizer.decode(list(prompt_ids))
    full = tokenizer.decode(list(prompt_ids) + list(new_ids))
    return full[len(before) :] if full.startswith(before) else tokenizer.decode(list(new_ids))


class TextStream:
    """Incremental detokenisation: :meth:`add` a token, get the text it completes.

    ``prompt_ids`` are the tokens already shown (their text is never handed out again).
    What it hands out, :meth:`finish` included, adds up to the whole sequence's text after
    the prompt's: ``decode(prompt + new)[len(decode(prompt)):]``.

    Decoding the whole sequence at every token would cost O(length) each, O(length^2) a
    request. Only a window is decoded: from ``start`` (the first token of the last piece handed
    out) to the end, against the same window up to ``read`` (what is handed out). Both begin at
    the same token, so SentencePiece's dropping of a first piece's leading space, or a
    character cut at the window's start, is the same in both, and their difference is the new
    text. The window moves on each time text is handed out."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = [int(t) for t in prompt_ids]
        self.read = len(self.ids)  # tokens whose text is handed out (or is the prompt's)
        # a few tokens of context: the window never starts at the new one
        self.start = max(0, self.read - 4)

    def add(self, token: int) -> str:
        """The text that is complete now that ``token`` follows ("" while a character waits)."""
        self.ids.append(int(token))
        before = self.tokenizer.decode(self.ids[self.start : self.read])
        ready = self.tokenizer.decode(self.ids[self.start :]).rstrip("\ufffd")
        if len(ready) <= len(before) or not ready.startswith(before):
            return ""
        self.start, self.read = self.read, len(self.ids)
        return ready[len(before) :]

    def finish(self) -> str:
        """Whatever was held back at the end (a byte sequence that never completed)."""
        before = self.tokenizer.decode(self.ids[self.start : self.read])
        text = self.tokenizer.decode(self.ids[self.start :])[len(before) :]
        self.start, self.read = self.read, len(self.ids)
        return text


class StopStrings:
    """Stop strings found as text arrives, in time linear in the text (a request's stops were
    searched in the whole tail and every prefix of every stop compared at every token: four long
    stops stalled the event loop). Each stop has a Knuth-Morris-Pratt automaton whose state is
    the longest prefix of the stop that the text ends with."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.fallback = [self._fallback(s) for s in self.stops]
        self.state = [0] * len(self.stops)

    @staticmethod
    def _fallback(stop: str) -> list[int]:
        """fallback[k]: the longest proper prefix of stop[:k + 1] that is also its suffix."""
        table = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = table[k - 1]
            if stop[i] == stop[k]:
                k += 1
            table[i] = k
        return table

    def feed(self, text: str, offset: int) -> int | None:
        """Read ``text``, which starts at position ``offset`` of the whole text; the earliest
        start of a stop string completed in it (None: none)."""
        found = None
        for i, char in enumerate(text):
            for j, stop in enumerate(self.stops):
                k = self.state[j]
                table = self.fallback[j]
                while k and char != stop[k]:
                    k = table[k - 1]
                if char == stop[k]:
                    k += 1
                if k == len(stop):
                    start = offset + i + 1 - k
                    found = start if found is None else min(found, start)
                    k = table[k - 1]
                self.state[j] = k
        return found

    @property
    def held(self) -> int:
        """How much of the end of the text could begin a stop string."""
        return max(self.state, default=0)


class Output:
    """A request's text as its tokens come: incremental detokenisation (:class:`TextStream`)
    and stop strings. Text that could be the start of a stop string is held back until the
    next tokens show it is not; a stop string ends the output before it, at the token that
    completed it (``tokens`` are the ones kept)."""

    def __init__(self, tokenizer: Any, shown: Sequence[int], stops: Sequence[str]) -> None:
        self.stream = TextStream(tokenizer, shown)
        self.stops = StopStrings(stops)
        self.text = ""
        self.sent = 0
        self.tokens: list[int] = []
        self.stopped = False

    def add(self, ids: Sequence[int]) -> str:
        """The text ready to hand out after ``ids``."""
        for token in ids:
            if self.stopped:
                break
            self.tokens.append(int(token))
            piece = self.stream.add(token)
            found = self.stops.feed(piece, len(self.text)) if self.stops.stops else None
            self.text += piece
            if found is not None:
                self.text = self.text[:found]
                self.stopped = True
        return self.release(self.stopped)

    def release(self, everything: bool) -> str:
        end = len(self.text) if everything else len(self.text) - self.held()
        piece = self.text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return piece

    def held(self) -> int:
        """How much of the end of the text could begin a stop string."""
        return self.stops.held

    def finish(self) -> str:
        """The rest: held-back text, and any incomplete character at the end."""
        if not self.stopped:
            self.text += self.stream.finish()
        return self.release(True)
