"""A conversation in one process (generate.py --interactive, as ``ollama run`` or ``llama-cli -cnv``):
the pair loaded once, the user's turns read from standard input line by line, each answer streamed
to standard output as generate.py streams a run, and one line of its numbers on standard error.

Every turn's prompt is the whole conversation in the target's chat template
(speculative.serving.text.encode_dialog): the system prompt, each earlier user turn and answer, then
the new turn. An answer is kept as the text that was shown, without the spaces around it, and the
conversation is encoded again from text at every turn, so that a prompt is exactly what the
template makes of that conversation (what a server would be sent), whichever ids the model emitted.

One engine of one row holds the conversation: each turn's row goes on from the previous turn's
(``Engine.add``'s ``continues``), so the target reads only what its KV cache does not hold yet (from
the first token where the new prompt differs from the previous row's sequence, at most from where
that cache ends: usually the end of the answer and the new turn), and the drafter keeps what it can.
The answer is the one a fresh run on the same prompt gives.

A line alone that is a command: ``/reset`` forgets the conversation and its caches, ``/exit`` leaves,
as the end of the input (Ctrl-D) does. A turn that would not fit in the context gets one line and
the conversation goes on; Ctrl-C stops an answer (the turn is not kept) and, at the prompt, leaves.
Turn i since the start or the last /reset samples with seed + i, so the same turns after a /reset
give the same answers.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

import torch

from speculative.cli import output
from speculative.cli.options import UsageError
from speculative.draft.model import as_drafter
from speculative.draft.protocol import trait
from speculative.engine.engine import Engine
from speculative.engine.rows import Row
from speculative.serving.text import continuation_text, encode_dialog

RESET, EXIT = "/reset", "/exit"
COMMANDS = f"{RESET} forgets the conversation, {EXIT} (or Ctrl-D) leaves"
# the flags a conversation cannot go with, and why (generate.py refuses them before loading anything)
REFUSED = {
    "prompt": "reads its turns from standard input",
    "prompts_file": "reads its turns from standard input",
    "json": "streams each answer as text",
    "compare": "answers each turn once (--compare measures one --prompt)",
}


def check_flags(given: set[str]) -> None:
    """UsageError for a flag given with --interactive that a conversation cannot use."""
    for dest, why in REFUSED.items():
        if dest in given:
            raise UsageError(f"--interactive {why}: drop --{dest.replace('_', '-')}")


def check_template(tokenizer: Any, name: str) -> None:
    """UsageError, before any weight is read, for a target without a chat template (a base model)."""
    if getattr(tokenizer, "chat", None) is None:
        raise UsageError(
            f"{name} has no chat template (a base model, which continues text); --interactive needs one"
        )


class Conversation:
    """A conversation's history and the engine of one row that holds it (see the module docstring).
    ``sampling``: generate.py's temperature, top_k, top_p, eos_id and seed."""

    def __init__(self, pair: Any, args: argparse.Namespace, sampling: dict[str, Any]) -> None:
        self.pair = pair
        self.args = args
        self.sampling = sampling
        self.drafter = None if pair.draft is None else as_drafter(pair.draft)
        # the caches cover the longest conversation: the target's context, or its drafter's if shorter
        self.context = pair.target.config.max_seq_len
        if self.drafter is not None:
            self.context = min(self.context, trait(self.drafter, "max_seq_len") or self.context)
        if args.ctx_size is not None:  # -c: generate.py checked that it fits
            self.context = min(self.context, args.ctx_size)
        self.reset()

    def reset(self) -> None:
        """Forget the conversation; the next turn starts a new engine, new caches."""
        self.messages: list[tuple[str, str]] = []
        if self.args.system:
            self.messages.append(("system", self.args.system))
        self.engine: Engine | None = None
        self.previous: Row | None = None
        self.turns = 0

    def prompt(self, text: str) -> list[int]:
        """The ids of the conversation with ``text`` as the user's next turn."""
        return encode_dialog(self.pair.tokenizer, [*self.messages, ("user", text)])

    def new_engine(self) -> Engine:
        args = self.args
        options: dict[str, Any] = {
            "temperature": self.sampling["temperature"],
            "top_k": self.sampling["top_k"],
            "top_p": self.sampling["top_p"],
            "max_rows": 1,
            "cache_len": self.context,
        }
        if self.drafter is not None:  # as generate.py's single run drafts
            options.update(
                gamma=None if args.tree else args.gamma,
                verify=args.verify,
                tree=args.tree,
                tree_mode=args.tree_mode,
                guard=args.guard,
            )
        return Engine(self.pair.target, self.drafter, **options)

    def answer(self, text: str, prompt: list[int], streamer: output.Streamer) -> Row:
        """The answer to the user's turn ``text`` (``prompt``: :meth:`prompt`'s ids for it), its tokens
        passed to ``streamer`` as they come, and ended at the iteration whose text met a stop
        string (--stop: stop_reason "stop_string", the answer cut before it); the turn and the
        answer join the conversation. A row that failed raises its error (non-finite logits: one
        line from generate.py)."""
        if self.engine is None:
            self.engine = self.new_engine()
        engine = self.engine
        seed = self.sampling["seed"]

        def seen(new_ids: list[int], from_draft: list[bool]) -> None:
            streamer(new_ids, from_draft)
            if streamer.stopped():
                engine.cancel(row)

        row = engine.add(
            prompt,
            self.args.max_new_tokens,
            eos_id=self.sampling["eos_id"],
            seed=None if seed is None else seed + self.turns,
            callback=seen,
            continues=self.previous,
        )
        try:
            with torch.inference_mode():
                self.engine.run()
        except KeyboardInterrupt:
            # stopped inside an iteration: the caches are not to be trusted, the next turn reads
            # the conversation from 0 in a new engine
            self.engine = None
            self.previous = None
            raise
        if row.error is not None:
            raise row.error
        shown = continuation_text(self.pair.tokenizer, prompt, row.ids[len(prompt) :])
        if streamer.stopped():  # a cancelled row: the next turn reads the conversation from 0
            row.stats.stop_reason = "stop_string"
            shown = streamer.shown
        self.messages += [("user", text), ("assistant", shown.strip())]
        self.previous = row
        self.turns += 1
        return row


def stats_line(row: Row, speculative: bool) -> str:
    """One line on an answer: its tokens, the decode speed, the acceptance rate (alpha), the prompt
    tokens the target did not read again, and why it stopped."""
    stats = row.stats
    speed = "?"
    if stats.tokens_per_second:
        speed = f"{stats.tokens_per_second:.1f}"
    parts = [f"answer: {stats.new_tokens} tokens at {speed} tokens/s"]
    if speculative and stats.acceptance_rate is not None:
        parts.append(f"acceptance {stats.acceptance_rate:.2f}")
    parts.append(f"{row.cached} of {len(row.prompt)} prompt tokens from the cache")
    parts.append(f"stopped: {stats.stop_reason}")
    line = ", ".join(parts)
    if stats.stop_reason == "max_seq_len":
        line += f"; the context is full: {RESET} starts a new conversation"
    return line


def converse(
    args: argparse.Namespace,
    pair: Any,
    sampling: dict[str, Any],
    color: bool,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """generate.py --interactive, after the pair is loaded and the header printed: turns from
    ``stdin`` until /exit or its end, answers to ``stdout``, everything else to ``stderr``. Returns
    the exit status (0)."""
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    terminal = stdin.isatty()
    conversation = Conversation(pair, args, sampling)
    if terminal:
        print(f"a conversation with {args.target}: type a turn; {COMMANDS}", file=stderr)
    while True:
        if terminal:
            stderr.write("> ")
            stderr.flush()
        line = stdin.readline()
        if not line:  # the end of the input
            if terminal:
                print(file=stderr)
            return 0
        text = line.strip()
        if text == EXIT:
            return 0
        if text == RESET:
            conversation.reset()
            print("reset: a new conversation", file=stderr)
        elif text.startswith("/") and " " not in text:
            print(f"unknown command {text}: {COMMANDS}", file=stderr)
        elif text:
            turn(conversation, text, color, stdout, stderr)


def turn(
    conversation: Conversation, text: str, color: bool, stdout: TextIO, stderr: TextIO
) -> None:
    """One user turn: its answer streamed, then its line of numbers; a turn that cannot be taken
    (it would overflow the context, the template refuses it) gets one line instead."""
    try:
        prompt = conversation.prompt(text)
    except (
        ValueError
    ) as err:  # the template refuses the conversation (weights.chat.ChatTemplateError)
        print(f"this turn is not taken: {err}".splitlines()[0], file=stderr)
        return
    if len(prompt) >= conversation.context:
        print(
            f"this turn is not taken: the conversation would be {len(prompt)} tokens, which leaves no "
            f"room in the {conversation.context}-token context; {RESET} starts a new conversation",
            file=stderr,
        )
        return
    streamer = output.Streamer(
        conversation.pair.tokenizer, prompt, stdout, color, stops=conversation.args.stop
    )
    try:
        row = conversation.answer(text, prompt, streamer)
    except KeyboardInterrupt:
        streamer.finish()
        print("interrupted: this turn is not kept", file=stderr)
        return
    streamer.finish()
    print(stats_line(row, conversation.pair.draft is not None), file=stderr)
