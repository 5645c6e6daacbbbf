"""Text corpora for training: split into documents, tokenised once, cached as a numpy memmap;
and a SentencePiece tokenizer trained on them (``train.py tokenizer``).

The cache file is keyed by the corpus files' paths, sizes and modification times and by
the tokenizer's bytes, so a second run with the same inputs starts at once.
"""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import numpy as np
import sentencepiece as spm

from weights.tokenizer import SentencePieceTokenizer, Tokenizer

STORY_SEPARATOR = "<|endoftext|>"


def read_documents(path: str | os.PathLike) -> list[str]:
    """Stories of a TinyStories-style file: split on ``<|endoftext|>`` lines when present,
    otherwise on blank lines (paragraphs); empty pieces are dropped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"corpus file {path} does not exist")
    text = path.read_text(encoding="utf-8", errors="replace")
    pieces = text.split(STORY_SEPARATOR) if STORY_SEPARATOR in text else text.split("\n\n")
    return [" ".join(p.split()) for p in pieces if p.strip()]


def train_tokenizer(paths: list[str | os.PathLike], vocab_size: int, out: str | os.PathLike) -> tuple[Path, int, int]:
    """A SentencePiece BPE tokenizer of ``vocab_size`` pieces trained on the documents of
    ``paths``: the tokenizer.model written into ``out``, its pieces and the number of documents."""
    docs = [doc for path in paths for doc in read_documents(path)]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # Llama-2-style settings: BPE, digits split, bytes for anything unseen, no normalisation.
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(docs), model_prefix=str(out / "tokenizer"), vocab_size=vocab_size,
        model_type="bpe", character_coverage=1.0, byte_fallback=True, split_digits=True,
        normalization_rule_name="identity", add_dummy_prefix=True, remove_extra_whitespaces=False,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, max_sentence_length=1 << 15,
        num_threads=2, minloglevel=2, input_sentence_size=0)
    return out / "tokenizer.model", SentencePieceTokenizer(out / "tokenizer.model").vocab_size, len(docs)


def _cache_key(paths: list[Path], tokenizer: Tokenizer) -> str:
    h = hashlib.sha256(tokenizer.serialized())
    for p in paths:
        st = p.stat()
        h.update(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def tokenize_corpus(paths: list[str | os.PathLike], tokenizer: Tokenizer,
                    cache_dir: str | os.PathLike) -> np.memmap:
    """All documents as one stream ``BOS doc EOS BOS doc EOS ...`` of uint16 ids (memory-mapped)."""
    paths = [Path(p) for p in paths]
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"corpus file {p} does not exist")
    if tokenizer.vocab_size > 65535:
        raise ValueError("the uint16 corpus cache needs a vocabulary below 65536")
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


def story_openings(paths: list[str | os.PathLike], tokenizer: Tokenizer, length: int) -> list[list[int]]:
    """The first ``length`` tokens (with BOS) of every document at least that long, in order:
    prompts of one length, which batch without padding."""
    openings = [tokenizer.encode(doc)[:length] for path in paths for doc in read_documents(path)]
    return [opening for opening in openings if len(opening) == length]


def held_out_prompts(paths: list[str | os.PathLike], tokenizer: Tokenizer, count: int, length: int,
                     seed: int) -> list[list[int]]:
    """The first ``length`` tokens (with BOS) of ``count`` documents drawn at random with
    ``seed`` (all of them when there are fewer): the same prompts for the same arguments."""
    docs = [doc for path in paths for doc in read_documents(path)]
    picked = random.Random(seed).sample(docs, min(count, len(docs)))
    return [tokenizer.encode(doc)[:length] for doc in picked]
