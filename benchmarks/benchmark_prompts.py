"""The prompt sets of benchmarks/benchmark.py: where each drafter should win or lose.

* ``stories``: story openings, as a user of the shipped pair types them. The output owes
  nothing to the prompt's words, so prompt lookup finds little to copy; a draft model or a
  feature head has to predict the story.
* ``retell``: input-grounded. A held-out TinyStories story is given whole, then started
  again, "<story>\\n\\nRetell the story:\\n<its first words>", so that a faithful output
  copies long runs of its input: what prompt lookup is for (summaries, edits, code and
  quotations behave the same way).

The retell stories come from TinyStories' validation split in ../shared/data, which the
shipped models never trained on. The benchmark reads the file where it lies and copies
nothing into the repository; without it the set is empty and the report says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RETELL_CORPUS = ROOT.parent / "shared" / "data" / "tinystories" / "tinystories_v1_valid_head.txt"
RETELL_SEPARATOR = "\n\nRetell the story:\n"
OPENING_WORDS = 6  # how much of the story the retelling is started with
# The file has no separator between stories; nearly every TinyStories story starts so.
STORY_START = "Once upon a time"

STORY_OPENINGS = [
    "Once upon a time",
    "One day, a little girl named Lily found a",
    "Tom and his dog went to the park. They",
    "The sun was shining and the birds were singing. Ben wanted to",
    "There was a big red ball in the garden.",
    "Mia had a small cat called Fluffy. Every morning,",
    "Once upon a time, in a land far away, there lived a wise old owl who",
    "The boy looked at the sky and said,",
]
PROMPT_SETS = ("stories", "retell")


@dataclass
class PromptSet:
    name: str
    description: str
    prompts: list[list[int]]  # token ids, BOS first
    note: str = ""  # why the set is smaller than asked, or empty


def held_out_stories(path: Path) -> list[str]:
    """The file's stories, each with its whitespace folded as the models saw their training
    text (weights/corpus.py): a story runs from a paragraph that starts with STORY_START to
    the next one. A stretch that holds two stories, one of which starts otherwise, is long
    and mostly filtered out by :func:`retell_set`'s length limits."""
    paragraphs = [
        " ".join(p.split())
        for p in path.read_text(encoding="utf-8", errors="replace").split("\n\n")
    ]
    stories: list[list[str]] = []
    for paragraph in paragraphs:
        if paragraph.startswith(STORY_START):
            stories.append([])
        if stories and paragraph:  # the file starts in the middle of a story: that part is dropped
            stories[-1].append(paragraph)
    return [" ".join(story) for story in stories]


def retell_set(
    tokenizer: Any, count: int, max_new_tokens: int, room: int, path: Path = RETELL_CORPUS
) -> PromptSet:
    """The first ``count`` held-out stories long enough to be copied for all max_new_tokens
    (so that the whole output could come from the prompt), and short enough that prompt and
    output fit in ``room`` tokens, as retelling prompts."""
    description = (
        f"input-grounded: a held-out TinyStories story ({path.name}), then "
        f"{RETELL_SEPARATOR!r} and the story's first {OPENING_WORDS} words"
    )
    if not path.is_file():
        return PromptSet(
            "retell",
            description,
            [],
            f"{path} is absent (a fresh clone): the retell set is skipped",
        )
    prompts = []
    for story in held_out_stories(path):
        story_tokens = len(tokenizer.encode(story, bos=False))
        prompt = tokenizer.encode(
            story + RETELL_SEPARATOR + " ".join(story.split()[:OPENING_WORDS])
        )
        if story_tokens >= max_new_tokens and len(prompt) + max_new_tokens <= room:
            prompts.append(prompt)
            if len(prompts) == count:
                break
    note = (
        ""
        if len(prompts) == count
        else f"only {len(prompts)} stories of {path} fit ({count} asked for)"
    )
    return PromptSet("retell", description, prompts, note)


def build_prompt_sets(
    names: list[str],
    tokenizer: Any,
    count: int,
    max_new_tokens: int,
    room: int,
    corpus: Path = RETELL_CORPUS,
) -> list[PromptSet]:
    """The named sets, ``count`` prompts each, in the order asked for."""
    sets = []
    for name in names:
        if name == "stories":
            sets.append(
                PromptSet(
                    "stories",
                    "story openings, as a user types them",
                    [tokenizer.encode(p) for p in STORY_OPENINGS[:count]],
                )
            )
        else:
            sets.append(retell_set(tokenizer, count, max_new_tokens, room, corpus))
    return sets
