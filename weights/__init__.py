"""Files: checkpoints and tokenizers, the registry of short names, loading a pair or a drafter
by name (load.py, drafters.py), the compiled-step cache, training runs' folders and corpora."""

from __future__ import annotations

from weights.checkpoint import (
    CheckpointError,
    NonFiniteWeightsError,
    load_model,
    load_tokenizer,
    read_config,
    read_generation_config,
    save_model,
)
from weights.drafters import load_drafter
from weights.load import Pair, PairSpec, load_pair, read_pair
from weights.registry import UnknownCheckpointError, resolve
from weights.step_cache import StepCache
from weights.tokenizer import JsonTokenizer, SentencePieceTokenizer, Tokenizer

__all__ = [
    "CheckpointError",
    "JsonTokenizer",
    "NonFiniteWeightsError",
    "Pair",
    "PairSpec",
    "SentencePieceTokenizer",
    "StepCache",
    "Tokenizer",
    "UnknownCheckpointError",
    "load_drafter",
    "load_model",
    "load_pair",
    "load_tokenizer",
    "read_config",
    "read_generation_config",
    "read_pair",
    "resolve",
    "save_model",
]
