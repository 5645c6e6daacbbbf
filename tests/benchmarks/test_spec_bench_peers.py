"""benchmarks/spec_bench_peers.py: llama.cpp's timings read from logs written by hand in its format,
the prompt a peer is given equal to ours, a --peer that cannot run refused in one line (status 2),
and, where transformers or a built llama.cpp is at hand, the peers' rows in every table of the page."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks import spec_bench
from benchmarks.spec_bench import TASKS, conversation, encode_messages, last_tokens, read_questions
from benchmarks.spec_bench_peers import (
    SameText,
    completion_text,
    completion_timing,
    generated_text,
    lookup_command,
    prompt_text,
    speculative_timing,
    verbose_prompt_ids,
)
from tests.benchmarks.test_spec_bench import FIXTURE, write_questions
from tests.support.checkpoints import needs_smollm2, smollm2_gguf
from tests.support.paths import ROOT, needs_shared

# The end of a llama-completion log (its lines after the log's time and level), 7 new tokens:
# the first from the prompt's pass, 6 eval runs.
COMPLETION_LOG = """
0.04.980.170 I common_perf_print:    sampling time =       1.25 ms
0.04.980.171 I common_perf_print:    samplers time =       0.50 ms /    20 tokens
0.04.980.172 I common_perf_print:        load time =     180.10 ms
0.04.980.173 I common_perf_print: prompt eval time =      40.00 ms /    13 tokens (    3.08 ms per token,   325.00 tokens per second)
0.04.980.174 I common_perf_print:        eval time =      60.00 ms /     6 runs   (   10.00 ms per token,   100.00 tokens per second)
0.04.980.175 I common_perf_print:       total time =     102.00 ms /    19 tokens
0.04.980.176 I common_perf_print:    graphs reused =          5
"""

# The end of a llama-lookup log: "encoded" the prompt's pass, "decoded" the rest.
LOOKUP_LOG = """
0.04.980.170 I encoded   13 tokens in    0.040 seconds, speed:  325.000 t/s
0.04.980.171 I decoded   11 tokens in    0.075 seconds, speed:  146.667 t/s

0.04.980.173 I n_draft      = 10
0.04.980.174 I n_predict    = 11
0.04.980.175 I n_drafted    = 12
0.04.980.176 I t_draft_flat = 0.01 ms
0.04.980.177 I t_draft      = 0.20 ms, 16.67 us per token, 60000.00 tokens per second
0.04.980.178 I n_accept     = 5
0.04.980.179 I accept       = 41.667%
"""

# llama-completion --verbose-prompt's listing, each line after the log's time and level; a piece with a
# newline in it
VERBOSE_LOG = """0.01.202.940 I main: prompt: '<|im_start|>user
Hi<|im_end|>
'
0.01.202.947 I main: number of tokens in prompt = 4
0.01.202.950 I      1 -> '<|im_start|>'
0.01.202.951 I   4093 -> 'user'
0.01.202.951 I    198 -> '
'
0.01.202.952 I     12 -> 'Hi'
0.01.202.953 I   main: static prompt
"""


def test_llama_completion_counts_the_prompt_pass_and_every_eval_run() -> None:
    new, seconds = completion_timing(COMPLETION_LOG)
    assert new == 7
    assert seconds == pytest.approx((40.0 + 60.0 + 1.25) / 1e3)


def test_llama_lookup_counts_its_encoded_and_decoded_seconds() -> None:
    new, seconds, accepted = speculative_timing(LOOKUP_LOG)
    assert (new, accepted) == (11, 5)
    assert seconds == pytest.approx(0.040 + 0.075)


def test_the_verbose_prompt_ids_are_read_across_pieces_with_newlines() -> None:
    assert verbose_prompt_ids(VERBOSE_LOG) == [1, 4093, 198, 12]
    assert verbose_prompt_ids("no listing here") == []


def test_the_new_text_follows_the_printed_prompt() -> None:
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert generated_text(f"\n\n{prompt}Hello there.<|im_end|>\n\n\n\n", prompt) == (
        "Hello there.<|im_end|>"
    )


def test_the_completion_text_ends_at_the_end_of_turn() -> None:
    assert completion_text("Hello there.<|im_end|> [end of text]\n\n\n") == "Hello there.<|im_end|>"
    assert completion_text("Cut at the limit\n\n") == "Cut at the limit"


class Pieces:
    """A tokenizer whose id i is the text PIECES[i]."""

    PIECES = ["", "Ana", " M", "aria", " Maria", "<|im_end|>"]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.PIECES[i] for i in ids if self.PIECES[i] != "<|im_end|>")


def test_llama_cpp_tokens_equal_the_ids_of_the_same_text() -> None:
    """llama.cpp's text re-encoded may split a word otherwise than the model did: the same text."""
    tokens = SameText([1, 4, 5], Pieces(), longer=False)
    assert tokens == [1, 2, 3, 5] and tokens == [1, 4]
    assert tokens != [1, 2] and tokens != [1, 4, 4]
    # past the limit, the target alone's text is where it begins
    longer = SameText([1, 4, 4], Pieces(), longer=True)
    assert longer == [1, 2, 3] and longer != [4]


def test_llama_lookup_drops_the_flags_only_llama_completion_takes(tmp_path: Path) -> None:
    from types import SimpleNamespace

    args = SimpleNamespace(bin=tmp_path, max_new_tokens=8, threads=2)
    cmd = lookup_command(args, tmp_path / "m.gguf", "Hi", 64, ["--temp", "0"])
    assert cmd[0] == str(tmp_path / "llama-lookup")
    assert "-no-cnv" not in cmd and "--no-display-prompt" not in cmd
    assert cmd[cmd.index("-p") + 1] == "Hi"
    # it stops once past its -n: 7, to stop at 8 new tokens
    assert cmd[cmd.index("-n") + 1] == "7"
    assert cmd[-2:] == ["--spec-draft-n-max", "10"]


@needs_smollm2
@needs_shared
def test_a_peer_is_given_our_very_prompt() -> None:
    """Each task's first question and a second turn: the text is the chat template's rendering of
    the conversation, and it encodes back to the ids our target decodes, cut prompts included."""
    from weights import load_tokenizer

    tokenizer = load_tokenizer(str(smollm2_gguf()))
    questions = read_questions(spec_bench.QUESTIONS)
    firsts = [next(q for q in questions if q.task == task) for task in TASKS]
    conversations = [conversation(q.turns, []) for q in firsts]
    conversations.append(conversation(firsts[0].turns, ["An answer, with “quotes” and é."]))
    for messages in conversations:
        ids = encode_messages(tokenizer, messages)
        text = prompt_text(tokenizer, ids)
        rendered = tokenizer.chat.render([{"role": r, "content": c} for r, c in messages])
        assert text == rendered
        assert tokenizer.encode_special(text) == ids
        cut = last_tokens(ids, 40)
        assert tokenizer.encode_special(prompt_text(tokenizer, cut)) == cut


def fixture_argv(tmp_path: Path, *peers: str) -> list[str]:
    argv = ["--questions", str(write_questions(tmp_path / "question.jsonl", FIXTURE[:3]))]
    argv += ["--per-task", "1", "--max-new-tokens", "8", "--draft", "lookup"]
    return argv + [arg for peer in peers for arg in ("--peer", peer)]


@pytest.mark.parametrize(
    ("peer", "message"),
    [
        ("llama.cpp={bin},{bin}/m.gguf", "error: --peer llama.cpp: no llama-completion in {bin} "),
        ("transformers={bin}", "error: --peer transformers: no config.json in {bin} "),
        ("vllm={bin}", "error: --peer vllm={bin}: the peers are llama.cpp="),
    ],
)
def test_a_peer_that_cannot_run_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], peer: str, message: str
) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    assert spec_bench.main(fixture_argv(tmp_path, peer.format(bin=empty))) == 2
    err = capsys.readouterr().err
    assert err.startswith(message.format(bin=empty)) and err.count("\n") == 1


def peer_rows(page: str, name: str) -> list[str]:
    return [line for line in page.splitlines() if line.startswith(f"| {name} | ")]


def test_transformers_takes_its_turns_and_has_a_row_in_every_table(tmp_path: Path) -> None:
    """transformers (float32) on the tiny target, alone and with prompt lookup of 3 and 10 tokens:
    each a row in the four tables by task and the set-ups'; greedy, its tokens are ours."""
    pytest.importorskip("transformers", reason="transformers (the peer) is in the [test] extras")
    page = tmp_path / "page.md"
    argv = fixture_argv(tmp_path, f"transformers={ROOT / 'weights' / 'tiny-target'},3,10")
    assert spec_bench.main([*argv, "--out", str(page)]) == 0
    text = page.read_text()
    names = ["transformers f32, target alone"] + [
        f"transformers f32, prompt lookup {n}" for n in (3, 10)
    ]
    for name in names:
        rows = peer_rows(text, name)
        assert len(rows) == 5, rows
        assert rows[-1].endswith("| 3/3 turns |")  # greedy: the target alone's tokens
    assert set(json.loads(page.with_suffix(".json").read_text())) >= set(names)


LLAMA_CPP_PEER = os.environ.get("SPEC_BENCH_LLAMA_CPP", "")


@needs_smollm2
@pytest.mark.skipif(
    not LLAMA_CPP_PEER,
    reason="llama.cpp is not built here: set SPEC_BENCH_LLAMA_CPP=BIN_DIR,SMOLLM2_F32.gguf[,HEAD.gguf] "
    "(benchmarks/spec_bench_peers.py says how to build and convert them)",
)
def test_llama_cpp_takes_its_turns_and_has_a_row_in_every_table(tmp_path: Path) -> None:
    """llama.cpp on SmolLM2 in float32, target alone and its lookup (and the head where given): each
    a row in every table; llama-completion read back our very prompt ids (else the run stops)."""
    page = tmp_path / "page.md"
    argv = ["--target", str(smollm2_gguf()), *fixture_argv(tmp_path, f"llama.cpp={LLAMA_CPP_PEER}")]
    assert spec_bench.main([*argv, "--out", str(page)]) == 0
    text = page.read_text()
    model = Path(LLAMA_CPP_PEER.split(",")[1]).stem
    for name in (f"llama.cpp {model}, target alone", f"llama.cpp {model}, lookup"):
        assert len(peer_rows(text, name)) == 5
