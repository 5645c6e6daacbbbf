"""benchmarks/spec_bench.py: the questions read and grouped into Spec-Bench's six tasks, the
prompts of a two-turn conversation, the figures against hand-worked numbers, and one smoke run on
the shipped tiny pair whose greedy tokens must be the target alone's in every set-up."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import spec_bench
from benchmarks.spec_bench import (
    BASELINE,
    TASKS,
    Question,
    Turn,
    answer_text,
    by_task,
    conversation,
    encode_messages,
    figures,
    last_tokens,
    read_questions,
)
from tests.support.paths import needs_shared

# One question of every task as the real file writes them; two conversations of different MT-Bench
# categories, and a summary too long for the tiny pair's 512-token context (its prompt is cut).
FIXTURE = [
    {"question_id": 81, "category": "writing", "turns": ["Write a story.", "Now make it shorter."]},
    {"question_id": 82, "category": "coding", "turns": ["Write a loop.", "Explain it."]},
    {
        "question_id": 161,
        "category": "translation",
        "turns": ["Translate German to English: Hallo"],
    },
    {"question_id": 241, "category": "summarization", "turns": ["Summarize: " + "Tom ran. " * 400]},
    {"question_id": 321, "category": "qa", "turns": ["Who is the cat?"]},
    {"question_id": 401, "category": "math_reasoning", "turns": ["Lily has 3 apples. How many?"]},
    {"question_id": 481, "category": "rag", "turns": ["The dog was red. What colour was the dog?"]},
    {"question_id": 482, "category": "rag", "turns": ["The sun was hot. Was the sun hot?"]},
]


def write_questions(path: Path, records: list[dict] = FIXTURE) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_questions_are_read_and_grouped_into_the_six_tasks(tmp_path: Path) -> None:
    questions = read_questions(write_questions(tmp_path / "question.jsonl"))
    assert questions[0] == Question(81, "mt_bench", ("Write a story.", "Now make it shorter."))
    grouped = by_task(questions)
    assert list(grouped) == list(TASKS)
    assert [q.id for q in grouped["mt_bench"]] == [81, 82]  # the MT-Bench categories together
    assert [q.id for q in grouped["rag"]] == [481, 482]
    first = by_task(questions, 1)
    assert [[q.id for q in first[task]] for task in TASKS] == [
        [81],
        [161],
        [241],
        [321],
        [401],
        [481],
    ]


def test_an_unknown_category_is_refused(tmp_path: Path) -> None:
    path = write_questions(
        tmp_path / "q.jsonl", [{"question_id": 1, "category": "poetry", "turns": ["x"]}]
    )
    with pytest.raises(ValueError, match="poetry"):
        read_questions(path)


@needs_shared
def test_the_real_file_has_80_questions_in_each_task() -> None:
    grouped = by_task(read_questions(spec_bench.QUESTIONS))
    assert {task: len(questions) for task, questions in grouped.items()} == dict.fromkeys(TASKS, 80)
    assert sum(map(len, grouped.values())) == 480
    assert {len(q.turns) for q in grouped["mt_bench"]} == {2}
    assert {len(q.turns) for task in TASKS[1:] for q in grouped[task]} == {1}


class Template:
    """A chat template that records the conversations it encodes."""

    def __init__(self) -> None:
        self.seen: list[list[tuple[str, str]]] = []

    def encode(self, tokenizer: object, messages: list[tuple[str, str]]) -> list[int]:
        self.seen.append(list(messages))
        return [7]


class Chars:
    """A tokenizer of one id per character (BOS 1, the end of turn 2), with or without a chat
    template (weights.Tokenizer's ``chat``)."""

    bos_id, eos_id = 1, 2

    def __init__(self, chat: Template | None = None) -> None:
        self.chat = chat

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        return [self.bos_id] * bos + [ord(c) for c in text] + [self.eos_id] * eos

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids if i > 2)


def test_a_second_turn_follows_the_first_answer() -> None:
    turns = ("Write a story.", "Now make it shorter.")
    assert conversation(turns, []) == [("user", "Write a story.")]
    assert conversation(turns, ["Once upon a time."]) == [
        ("user", "Write a story."),
        ("assistant", "Once upon a time."),
        ("user", "Now make it shorter."),
    ]


def test_a_conversation_is_posed_in_the_chat_template_or_as_plain_text() -> None:
    messages = conversation(("Hi?", "Why?"), ["Yes."])
    plain = Chars()
    assert encode_messages(plain, messages) == plain.encode("Hi?\n\nYes.\n\nWhy?", bos=True)
    template = Template()
    assert encode_messages(Chars(template), messages) == [7]
    assert template.seen == [messages]


def test_the_answer_is_cut_at_the_end_of_turn_and_stripped() -> None:
    tokenizer = Chars()
    prompt = tokenizer.encode("Q:", bos=True)
    tokens = tokenizer.encode(" It is red. ") + [2] + tokenizer.encode("more")
    assert answer_text(tokenizer, prompt, tokens, (2,)) == "It is red."
    assert last_tokens([1, 2, 3, 4, 5], 3) == [3, 4, 5]
    assert last_tokens([1, 2], 3) == [1, 2]


def test_the_figures_of_each_task_and_overall() -> None:
    """Hand-worked: the target alone makes 10 tokens in 1 s (mt_bench) and 20 in 4 s (qa); the
    drafting set-up makes the same tokens, mt_bench's in two turns (6 in 0.2 s over 2 calls, 4 in
    0.3 s over 2 calls) and qa's 20 in 1 s over 5 calls."""
    base = {"mt_bench": [[Turn([], 10, 10, 1.0)]], "qa": [[Turn([], 20, 20, 4.0)]]}
    drafted = {
        "mt_bench": [
            [Turn([], 6, 2, 0.2, [2, 1], [2, 2]), Turn([], 4, 2, 0.3, [1, 1, 1], [2, 1, 1])]
        ],
        "qa": [[Turn([], 20, 5, 1.0, [0], [1])]],
    }
    table = figures({BASELINE: base, "draft": drafted})
    mt, qa, overall = (table["draft"][task] for task in ("mt_bench", "qa", "overall"))
    assert mt["tokens_per_s"] == pytest.approx(20.0)  # 10 tokens in 0.5 s
    assert mt["speedup"] == pytest.approx(2.0)  # 20 / 10
    assert mt["tau"] == pytest.approx(2.5)  # 10 tokens / 4 calls
    assert mt["alpha_by_position"] == pytest.approx([3 / 4, 2 / 3, 1.0])
    assert qa["speedup"] == pytest.approx(4.0)  # 20 / 5
    assert qa["tau"] == pytest.approx(4.0)
    assert qa["alpha_by_position"] == pytest.approx([0.0])
    # overall: the mean over questions of tokens/s, (20 + 20) / 2 against (10 + 5) / 2
    assert overall["tokens_per_s"] == pytest.approx(20.0)
    assert overall["speedup"] == pytest.approx(20.0 / 7.5)
    assert overall["tau"] == pytest.approx(30 / 9)
    assert overall["alpha_by_position"] == pytest.approx([3 / 5, 2 / 3, 1.0])
    assert table[BASELINE]["overall"]["tau"] == 1.0 and table[BASELINE]["qa"]["speedup"] == 1.0


def test_a_missing_question_file_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert spec_bench.main(["--questions", str(tmp_path / "absent.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no Spec-Bench questions at ") and err.count("\n") == 1


def test_a_smoke_run_on_the_tiny_pair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two drafting set-ups and the target alone, one question of each task (a conversation of two
    turns among them): every task in the table, and every set-up's greedy tokens the target's."""
    page = tmp_path / "spec_bench.md"
    argv = ["--questions", str(write_questions(tmp_path / "question.jsonl")), "--per-task", "1"]
    argv += [
        "--max-new-tokens",
        "8",
        "--draft",
        "tiny-draft",
        "--draft",
        "lookup",
        "--out",
        str(page),
    ]
    assert spec_bench.main(argv) == 0
    text = page.read_text()
    assert f"    python -m benchmarks.spec_bench {' '.join(argv)}" in text
    assert f"| set-up | {' | '.join(TASKS)} | overall |" in text
    assert "1 of 7 prompts kept their last tokens" in text  # the long summary
    assert "plain text" in text  # the tiny pair has no chat template
    for name in ("tiny-draft, γ = 4", "lookup, γ = 4"):
        assert f"| {name} | " in text
        assert text.count(f"| {name} | ") == 5  # four tables by task and the set-ups'
        assert "7/7 turns |" in next(
            line for line in text.splitlines() if "turns |" in line and name in line
        )
    assert set(json.loads(page.with_suffix(".json").read_text())) == {
        BASELINE,
        "tiny-draft, γ = 4",
        "lookup, γ = 4",
    }


def test_a_page_warns_where_the_targets_decode_differently() -> None:
    def setup(name: str, target: str) -> spec_bench.SetUp:
        chosen = SimpleNamespace(choices=[("target", SimpleNamespace(chosen=target))], lines=[])
        return spec_bench.SetUp(name, None, 4, chosen)

    same = [setup("target alone", "compiled"), setup("suffix", "compiled")]
    assert spec_bench.mixed_note(same) == []
    mixed = [*same, setup("lookup", "prepacked")]
    (_, warning) = spec_bench.mixed_note(mixed)
    assert "compiled in target alone, suffix; prepacked in lookup" in warning
