"""A thin wrapper over SentencePiece with the interface the rest of the project uses."""

from __future__ import annotations

import os
from pathlib import Path

import sentencepiece as spm


class Tokenizer:
    """``encode(text, bos=True)`` -> ids, ``decode(ids)`` -> text; exact SentencePiece behaviour."""

    def __init__(self, model_file: str | os.PathLike) -> None:
        self.path = Path(model_file)
        self.sp = spm.SentencePieceProcessor(model_file=str(model_file))
        self.bos_id: int = self.sp.bos_id()
        self.eos_id: int = self.sp.eos_id()
        self.vocab_size: int = self.sp.vocab_size()

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        ids = self.sp.encode(text)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(list(ids))

    def piece(self, token_id: int) -> str:
        return self.sp.id_to_piece(token_id)

    def fingerprint(self) -> bytes:
        """The serialized model; two tokenizers are the same iff these bytes are equal."""
        return self.sp.serialized_model_proto()
