"""Checkpoint I/O: the only package that touches files."""

from __future__ import annotations

import os

from weights.checkpoint import CheckpointError, NonFiniteWeightsError, load_model, read_config, save_model
from weights.load import Pair, PairSpec, load_pair, read_pair
from weights.registry import UnknownCheckpointError, resolve
from weights.tokenizer import Tokenizer


def load_tokenizer(name_or_path: str | os.PathLike) -> Tokenizer:
    """The SentencePiece tokenizer (``tokenizer.model``) stored with a checkpoint."""
    directory = resolve(name_or_path)
    path = directory / "tokenizer.model"
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the checkpoint has no SentencePiece tokenizer.model")
    return Tokenizer(path)


def load_drafter(name_or_path: str | os.PathLike, target, target_name: str = "the target"):
    """The drafter a name means: ``lookup``, a feature head such as ``tiny-eagle``, or a draft
    model (see weights/drafters.py, which is imported only when a drafter is loaded)."""
    from weights.drafters import load_drafter as load

    return load(name_or_path, target, target_name)


__all__ = ["CheckpointError", "NonFiniteWeightsError", "Pair", "PairSpec", "Tokenizer", "UnknownCheckpointError",
           "load_drafter", "load_model", "load_pair", "load_tokenizer", "read_config", "read_pair", "resolve",
           "save_model"]
