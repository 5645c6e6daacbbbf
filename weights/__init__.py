"""Checkpoint I/O: the only package that touches files."""

from __future__ import annotations

import os

from weights.checkpoint import CheckpointError, load_model, read_config, save_model
from weights.registry import UnknownCheckpointError, resolve
from weights.tokenizer import Tokenizer


def load_tokenizer(name_or_path: str | os.PathLike) -> Tokenizer:
    """The SentencePiece tokenizer (``tokenizer.model``) stored with a checkpoint."""
    directory = resolve(name_or_path)
    path = directory / "tokenizer.model"
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the checkpoint has no SentencePiece tokenizer.model")
    return Tokenizer(path)


__all__ = ["CheckpointError", "Tokenizer", "UnknownCheckpointError", "load_model", "load_tokenizer",
           "read_config", "resolve", "save_model"]
