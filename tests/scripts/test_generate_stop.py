"""generate.py's --stop and -c/--ctx-size on the shipped pair: a stop string ends the text before it
(streamed and in --json), also when it is split across tokens, in a batch and in a conversation,
and the tokens up to it are those of the run without --stop; -c refuses a prompt that does not fit
and stops a run at the cap, with the tokens of the uncapped run. Greedy runs in float64 with the
plain set-up and no guard, so that the runs compared are exact (docs/algorithm.md, numerics policy).
"""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import pytest

from speculative.serving.text import continuation_text
from tests.scripts.test_generate_chat import RUN as CHAT_RUN
from tests.scripts.test_generate_chat import answer_lines, converse, fresh_answers
from tests.support.cli import PAIR, TARGET, main_error, main_json, main_ok, needs_pair
from weights import load_tokenizer, read_config

PROMPT = "Once upon a time"
EXACT = ["--dtype", "float64", "--setup", "plain", "--no-guard", "-n", "30", "--prompt", PROMPT]
DRAFTS = {"drafted": PAIR, "the target alone": ["--target", str(TARGET), "--no-draft"]}


def reference(capsys: pytest.CaptureFixture[str], drafts: list[str]) -> dict[str, Any]:
    doc, _ = main_json(capsys, [*drafts, *EXACT])
    assert doc["stats"]["stop_reason"] == "max_new_tokens"
    return doc


def assert_stopped_before(doc: dict[str, Any], whole: dict[str, Any], stop: str) -> None:
    """``doc``'s text is ``whole``'s up to the first ``stop``; its tokens are a prefix of ``whole``'s
    ending with the token that completed the string; its stop reason says so."""
    assert doc["text"] == whole["text"][: whole["text"].index(stop)]
    tokens = doc["tokens"]
    assert tokens == whole["tokens"][: len(tokens)]
    assert len(tokens) < len(whole["tokens"])
    tokenizer = load_tokenizer(TARGET)
    prompt = tokenizer.encode(PROMPT, bos=True)
    assert stop in continuation_text(tokenizer, prompt, tokens)
    assert stop not in continuation_text(tokenizer, prompt, tokens[:-1])
    assert doc["stats"]["stop_reason"] == "stop_string"
    assert doc["settings"]["stop"] == [stop]


@needs_pair
@pytest.mark.parametrize("drafts", DRAFTS.values(), ids=DRAFTS.keys())
def test_a_stop_string_ends_the_text_before_it(
    capsys: pytest.CaptureFixture[str], drafts: list[str]
) -> None:
    whole = reference(capsys, drafts)
    stop = whole["text"].split()[5]  # a word of the greedy continuation
    doc, _ = main_json(capsys, [*drafts, *EXACT, "--stop", stop])
    assert_stopped_before(doc, whole, stop)
    # streamed: the prompt, the text before the stop string and a newline, nothing held back
    out, err = main_ok(capsys, [*drafts, *EXACT, "--stop", stop, "--no-color"])
    assert out == PROMPT + doc["text"] + "\n"
    assert any("stopped: stop_string" in line for line in err), err


@needs_pair
def test_a_stop_string_split_across_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    """A string that begins in one token and ends in a later one; of two strings the first met."""
    whole = reference(capsys, PAIR)
    tokenizer = load_tokenizer(TARGET)
    prompt = tokenizer.encode(PROMPT, bos=True)
    boundary = len(continuation_text(tokenizer, prompt, whole["tokens"][:8]))
    stop = whole["text"][boundary - 2 : boundary + 2]
    assert stop not in whole["text"][: boundary - 2]
    doc, _ = main_json(capsys, [*PAIR, *EXACT, "--stop", "never in the text", "--stop", stop])
    assert doc["text"] == whole["text"][: whole["text"].index(stop)]
    assert doc["tokens"] == whole["tokens"][: len(doc["tokens"])]
    assert doc["stats"]["stop_reason"] == "stop_string"


@needs_pair
def test_stop_strings_cut_each_row_of_a_batch(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{PROMPT}\nThe little dog\n")
    run = [*PAIR, *EXACT[:-2], "--prompts-file", str(prompts)]
    whole, _ = main_json(capsys, run)
    stop = whole["prompts"][0]["text"].split()[4]
    doc, _ = main_json(capsys, [*run, "--stop", stop])
    for row, full in zip(doc["prompts"], whole["prompts"]):
        if stop in full["text"]:
            assert row["text"] == full["text"][: full["text"].index(stop)]
            assert row["stats"]["stop_reason"] == "stop_string"
        else:
            assert row["text"] == full["text"]
        assert row["tokens"] == full["tokens"][: len(row["tokens"])]
    assert doc["prompts"][0]["stats"]["stop_reason"] == "stop_string"


@needs_pair
def test_a_conversation_turn_stops_at_the_string(chat_target: Path) -> None:
    answer = fresh_answers(chat_target, ["Tell me a story."])[0]
    stop = answer.split()[3]
    argv = ["--target", str(chat_target), *CHAT_RUN, "--interactive", "--stop", stop]
    proc = converse(*argv, stdin="Tell me a story.\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == answer[: answer.index(stop)] + "\n"
    assert "stopped: stop_string" in answer_lines(proc.stderr)[0]


@needs_pair
def test_ctx_size_stops_a_run_at_the_cap(capsys: pytest.CaptureFixture[str]) -> None:
    for drafts in DRAFTS.values():
        whole = reference(capsys, drafts)
        doc, _ = main_json(capsys, [*drafts, *EXACT, "-c", "12"])
        assert doc["prompt_tokens"] + len(doc["tokens"]) == 12
        assert doc["tokens"] == whole["tokens"][: len(doc["tokens"])]
        assert doc["stats"]["stop_reason"] == "max_seq_len"
        assert doc["settings"]["ctx_size"] == 12


@needs_pair
def test_ctx_size_refuses_a_prompt_that_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    main_error(
        capsys, [*PAIR, "--prompt", PROMPT, "-c", "4"], "prompt", "4-token context", "--ctx-size"
    )
    context = read_config(TARGET).max_seq_len  # the model's context, named in the error
    main_error(
        capsys, [*PAIR, "--ctx-size", "100000"], "--ctx-size 100000", f"{context}-token context"
    )


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--stop", ""], "--stop"),
        (["-c", "0"], "--ctx-size"),
        (["--max-model-len", "x"], "invalid"),
    ],
)
def test_bad_stop_and_ctx_size(
    capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str
) -> None:
    main_error(capsys, argv, fragment)


@needs_pair
def test_ctx_size_bounds_a_conversation(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, chat_target: Path
) -> None:
    """A turn longer than -c is not taken; a turn that fits answers until the capped context is full."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("word " * 40 + "\nHi\n"))
    argv = ["--target", str(chat_target), *CHAT_RUN, "--interactive", "-c", "40"]
    _, err = main_ok(capsys, argv)
    refused = [line for line in err if line.startswith("this turn is not taken: ")]
    assert len(refused) == 1 and "40-token context" in refused[0], err
    answers = answer_lines("\n".join(err))
    assert len(answers) == 1 and "stopped: max_seq_len" in answers[0], err
