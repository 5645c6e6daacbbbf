"""generate.py --interactive end to end (speculative/cli/chat.py): a conversation on the shipped pair
through standard input, each answer the one a fresh run on the encoded conversation gives, the KV
cache reused across turns, /reset and /exit; a turn too long for the context is one line and the
conversation goes on; what a conversation cannot go with is one error line, exit status 2.

The target is conftest's ``chat_target``: the shipped target under a name that marks it a Llama-2 chat
model, whose format is Llama-2's (the shipped target itself has no chat template and is refused). Runs
are in float64 with the plain set-up, so that the answers compared are exact (docs/algorithm.md,
numerics policy), and without the guard, which would time the run first.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import generate
from speculative import speculative_generate
from speculative.serving.text import continuation_text, encode_dialog
from tests.support.cli import (
    DRAFT,
    TARGET,
    assert_one_error_line,
    cli,
    main_error,
    main_ok,
    needs_pair,
)
from weights import load_pair

NEW = 24
RUN = [
    "--draft",
    str(DRAFT),
    "--dtype",
    "float64",
    "--setup",
    "plain",
    "--no-guard",
    "-n",
    str(NEW),
]
TURNS = ["Tell me a story.", "What happened next?"]
CACHED = re.compile(r"(\d+) of (\d+) prompt tokens from the cache")


def converse(*args: str, stdin: str) -> subprocess.CompletedProcess[str]:
    """generate.py in a subprocess with one CPU thread, ``stdin`` its standard input (not a terminal)."""
    return cli(*args, stdin=stdin)


def fresh_answers(target: Path, turns: list[str]) -> list[str]:
    """Each turn's answer from a fresh run on the whole conversation so far, encoded in the chat
    format, an answer kept as its text without the spaces around it: what was streamed, in order."""
    pair = load_pair(target, DRAFT, dtype=torch.float64, prepare_models=False)
    messages: list[tuple[str, str]] = []
    answers = []
    for text in turns:
        prompt = encode_dialog(pair.tokenizer, [*messages, ("user", text)])
        tokens = speculative_generate(
            pair.target, pair.draft, prompt, NEW, gamma=4, temperature=0, eos_id=pair.stop_ids
        ).tokens
        shown = continuation_text(pair.tokenizer, prompt, tokens)
        messages += [("user", text), ("assistant", shown.strip())]
        answers.append(shown)
    return answers


def answer_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("answer: ")]


def cached(line: str) -> int:
    found = CACHED.search(line)
    assert found is not None, line
    return int(found.group(1))


@needs_pair
def test_a_conversation_reuses_its_cache_and_answers_as_a_fresh_run(chat_target: Path) -> None:
    """Two turns, /reset, the first turn again, /exit (the line after it is never read): stdout is
    the three answers, each the answer of a fresh run on its conversation, and the first one that
    of a one-shot --chat run; the second turn read only what the cache lacked, and the turn after
    /reset read everything again."""
    stdin = f"{TURNS[0]}\n{TURNS[1]}\n/reset\n{TURNS[0]}\n/exit\nnever read\n"
    proc = converse("--target", str(chat_target), *RUN, "--interactive", stdin=stdin)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    first, second = fresh_answers(chat_target, TURNS)
    assert proc.stdout == f"{first}\n{second}\n{first}\n"
    lines = answer_lines(proc.stderr)
    assert len(lines) == 3, proc.stderr
    assert [cached(lines[0]), cached(lines[2])] == [0, 0]
    assert cached(lines[1]) > 0
    assert "reset: a new conversation" in proc.stderr.splitlines()
    # no "> " prompt where standard input is not a terminal
    assert not any(line.startswith(">") for line in proc.stderr.splitlines())
    one_shot = converse(
        "--target", str(chat_target), *RUN, "--chat", "--prompt", TURNS[0], stdin=""
    )
    assert one_shot.returncode == 0, one_shot.stderr
    assert one_shot.stdout == f"{first}\n"


@needs_pair
def test_a_turn_too_long_for_the_context_is_one_line_and_the_conversation_goes_on(
    chat_target: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sampled: a turn longer than the context, an unknown command, a turn, /reset and the same
    turn, then the end of the input. The long turn and the command get one line each; turn 0 of
    a conversation samples with the seed, so both answers are the same."""
    stdin = "word " * 600 + "\n/help\nHi\n\n/reset\nHi\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    argv = [
        "--target",
        str(chat_target),
        *RUN,
        "--temperature",
        "0.8",
        "--seed",
        "5",
        "--interactive",
    ]
    out, err = main_ok(capsys, argv)
    refused = [line for line in err if line.startswith("this turn is not taken: ")]
    assert len(refused) == 1 and "context" in refused[0] and "/reset" in refused[0], err
    assert any(line.startswith("unknown command /help: ") for line in err), err
    assert len(answer_lines("\n".join(err))) == 2, err
    answers = out.split("\n")
    assert len(answers) == 3 and answers[0] == answers[1] and answers[2] == "", out


@needs_pair
def test_a_conversation_drafts_trees(
    chat_target: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--tree goes with --interactive: greedy, the answers are the chain's (the target's greedy
    ones)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(TURNS) + "\n"))
    out, err = main_ok(capsys, ["--target", str(chat_target), *RUN, "--tree", "2,1", "-i"])
    first, second = fresh_answers(chat_target, TURNS)
    assert out == f"{first}\n{second}\n"
    assert cached(answer_lines("\n".join(err))[1]) > 0


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--json"], "--json"),
        (["--prompt", "Hi"], "--prompt"),
        (["--prompts-file", "prompts.txt"], "--prompts-file"),
        (["--compare"], "--compare"),
    ],
)
def test_what_a_conversation_cannot_go_with_is_refused(
    capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str
) -> None:
    main_error(capsys, ["--interactive", *argv], "--interactive", fragment)


@needs_pair
def test_a_target_without_a_chat_template_is_refused_in_a_real_process() -> None:
    proc = converse("--target", str(TARGET), "--no-draft", "--interactive", stdin="Hi\n")
    assert_one_error_line(
        proc.returncode, proc.stderr, proc.stdout, "no chat template", "--interactive needs one"
    )


def test_the_flag_is_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        generate.main(["--help"])
    text = capsys.readouterr().out
    assert "-i, --interactive" in text and "/reset" in text
