"""Text corpora for training: split into documents, tokenised once, cached as a numpy memmap;
and a SentencePiece tokenizer trained on them (``train.py tokenizer``).

The cache file is keyed by the corpus files' paths, sizes and modification times and by
the tokenizer's bytes, so a second run with the same inputs starts at once.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
from pathlib import Path

import numpy as np
import sentencepiece as spm

from weights.tokenizer import SentencePieceTokenizer, Tokenizer

STORY_SEPARATOR = "<|endoftext|>"


class CorpusError(ValueError):
    """Training text that cannot serve (too few documents, a model with no chat template); one line."""


def read_documents(path: str | os.PathLike) -> list[str]:
    """Stories of a TinyStories-style file: split on ``<|endoftext|>`` lines when present,
    otherwise on blank lines (paragraphs); empty pieces are dropped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"corpus file {path} does not exist")
    text = path.read_text(encoding="utf-8", errors="replace")
    pieces = text.split(STORY_SEPARATOR) if STORY_SEPARATOR in text else text.split("\n\n")
    return [" ".join(p.split()) for p in pieces if p.strip()]


def train_tokenizer(
    paths: list[str | os.PathLike], vocab_size: int, out: str | os.PathLike
) -> tuple[Path, int, int]:
    """A SentencePiece BPE tokenizer of ``vocab_size`` pieces trained on the documents of
    ``paths``: the tokenizer.model written into ``out``, its pieces and the number of documents."""
    docs = [doc for path in paths for doc in read_documents(path)]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # Llama-2-style settings: BPE, digits split, bytes for anything unseen, no normalisation.
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(docs),
        model_prefix=str(out / "tokenizer"),
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        max_sentence_length=1 << 15,
        num_threads=2,
        minloglevel=2,
        input_sentence_size=0,
    )
    return (
        out / "tokenizer.model",
        SentencePieceTokenizer(out / "tokenizer.model").vocab_size,
        len(docs),
    )


def _cache_key(paths: list[Path], tokenizer: Tokenizer) -> str:
    h = hashlib.sha256(tokenizer.serialized())
    for p in paths:
        st = p.stat()
        h.update(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def tokenize_corpus(
    paths: list[str | os.PathLike], tokenizer: Tokenizer, cache_dir: str | os.PathLike
) -> np.memmap:
    """All documents as one stream ``BOS doc EOS BOS doc EOS ...`` of uint16 ids (memory-mapped)."""
    paths = [Path(p) for p in paths]
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"corpus file {p} does not exist")
    if tokenizer.vocab_size > 65535:
        raise CorpusError("the uint16 corpus cache needs a vocabulary below 65536")
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    cache = cache_dir / f"corpus-{_cache_key(paths, tokenizer)}.u16"
    if not cache.is_file():
        ids: list[int] = []
        for p in paths:
            for doc in read_documents(p):
                ids.extend(tokenizer.encode(doc, bos=True, eos=True))
        tmp = cache.with_suffix(".tmp")
        np.asarray(ids, dtype=np.uint16).tofile(tmp)
        tmp.replace(cache)  # atomic: an interrupted run never leaves a half-written cache
    return np.memmap(cache, dtype=np.uint16, mode="r")


def story_openings(
    paths: list[str | os.PathLike], tokenizer: Tokenizer, length: int
) -> list[list[int]]:
    """The first ``length`` tokens (with BOS) of every document at least that long, in order:
    prompts of one length, which batch without padding."""
    openings = [tokenizer.encode(doc)[:length] for path in paths for doc in read_documents(path)]
    return [opening for opening in openings if len(opening) == length]


def held_out_prompts(
    paths: list[str | os.PathLike], tokenizer: Tokenizer, count: int, length: int, seed: int
) -> list[list[int]]:
    """The first ``length`` tokens (with BOS) of ``count`` documents drawn at random with
    ``seed`` (all of them when there are fewer): the same prompts for the same arguments."""
    docs = [doc for path in paths for doc in read_documents(path)]
    picked = random.Random(seed).sample(docs, min(count, len(docs)))
    return [tokenizer.encode(doc)[:length] for doc in picked]


# ----------------------------------------------------------------------------- chat requests
# What a user might ask an assistant, made from a corpus's documents. A chat model's drafter is trained on the
# target's answers to them (train.py --data chat); the held-out figures ask about other documents (--eval-corpus).
CHAT_TASKS = (
    "Continue this story:\n\n{opening}",
    "Summarize this story in two sentences:\n\n{passage}",
    "What is the moral of this story?\n\n{passage}",
    "Give this story a title, and say why you chose it.\n\n{passage}",
    "Retell this story for a five-year-old:\n\n{passage}",
    "Who are the characters in this text, and what do they want?\n\n{passage}",
    "Explain this passage in plain modern English:\n\n{passage}",
    "Write a short poem about {subject}.",
    "Explain to a child what {subject} is.",
    "Give three facts about {subject}.",
    "Write a short story about {subject}.",
    "Ask a question about {subject} that a curious student might ask, then answer it.",
    "What is {subject} like?",
    "Write an email to a friend about {subject}.",
)
# Words that follow "a" or "the" but are seldom the thing itself.
NOT_SUBJECTS = frozenset(
    "very little small great good best same other first last whole next only most more big "
    "young happy beautiful biggest special new long high bright sweet nice strong".split()
)


def chat_requests(
    paths: list[str | os.PathLike], count: int, seed: int, passage_chars: int = 600
) -> list[str]:
    """``count`` user requests drawn with ``seed``: a task of :data:`CHAT_TASKS` about a document of the
    files (a passage of it up to ``passage_chars`` characters, from and to a sentence's end; its
    opening; or, as the subject, "the" and a word that follows "a" or "the" in it). The same requests for the
    same arguments."""
    rng = random.Random(seed)
    docs = [doc for path in paths for doc in read_documents(path) if len(doc) >= 80]
    if not docs:
        raise CorpusError(f"no document of 80 characters or more in {', '.join(map(str, paths))}")
    requests = []
    for _ in range(count):
        doc = rng.choice(docs)
        start = rng.randrange(max(1, len(doc) - passage_chars))
        # from a sentence's start
        start = doc.find(". ", start) + 2 if start and ". " in doc[start:] else 0
        passage = doc[start : start + passage_chars]
        passage = passage[: passage.rfind(".") + 1] or passage  # to a sentence's end
        nouns = sorted(set(re.findall(r"\b(?:a|an|the) ([a-z]{4,})\b", doc.lower())) - NOT_SUBJECTS)
        requests.append(
            rng.choice(CHAT_TASKS).format(
                passage=passage,
                opening=passage[:200].rsplit(" ", 1)[0],
                subject="the " + (rng.choice(nouns) if nouns else "sea"),
            )
        )
    return requests


def chat_prompts(
    paths: list[str | os.PathLike],
    tokenizer: Tokenizer,
    count: int,
    seed: int,
    max_tokens: int | None = None,
) -> list[list[int]]:
    """``count`` of :func:`chat_requests`, each as one user turn in the model's chat template
    (``tokenizer.chat``), ready for the assistant's answer; requests of more than ``max_tokens``
    tokens so (the room an answer leaves in the context) are passed over."""
    if getattr(tokenizer, "chat", None) is None:
        raise CorpusError(
            f"{getattr(tokenizer, 'name', 'the target')} has no chat template: --data chat is for a "
            "chat model"
        )
    prompts = []
    for request in chat_requests(paths, 4 * count, seed):
        prompt = tokenizer.chat.encode(tokenizer, [("user", request)])
        if max_tokens is None or len(prompt) <= max_tokens:
            prompts.append(prompt)
        if len(prompts) == count:
            return prompts
    raise CorpusError(
        f"fewer than {count} requests fit in {max_tokens} tokens: give shorter documents or more room"
    )
