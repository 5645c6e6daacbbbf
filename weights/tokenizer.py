"""Tokenizers, of the two kinds that LLaMA checkpoints ship, behind one interface.

* ``tokenizer.model``: a SentencePiece model (Llama-2, TinyLlama, CodeLlama, the shipped pair),
  read by ``sentencepiece`` exactly as Meta's reference code reads it.
* ``tokenizer.json``: a Hugging Face ``tokenizers`` file (every Llama-3.x, SmolLM2, most
  checkpoints published since 2024: byte-level BPE), read by ``tokenizers``, the library that
  defines the format. Meta's ``original/tokenizer.model`` of Llama-3 is tiktoken's format, not
  SentencePiece's, so for those checkpoints this is the only file that can be read.

Both give what the rest of the project uses: ``encode(text, bos=True)``, ``decode(ids)``,
``bos_id``, ``eos_id``, ``vocab_size``, ``piece(id)``, and ``fingerprint()``, which is the same for
two tokenizers exactly when every id means the same piece (what speculation needs of a draft and
its target: Algorithm 1 compares p and q id by id), whichever kind each was read from.

Special tokens written in text (``<|eot_id|>``, ``<s>``) follow transformers:
:meth:`Tokenizer.encode_special` turns them into their ids, which is how a rendered chat template
is encoded (``apply_chat_template(..., tokenize=True)``: the template writes its own BOS, none is
added). ``encode`` of a SentencePiece tokenizer keeps SentencePiece's own behaviour, which is what
the shipped pair was trained with; ``encode`` of a tokenizer.json adds what its post-processor adds
(Llama-3's ``<|begin_of_text|>``) when ``bos`` is true, as transformers' ``tokenizer(text)`` does.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import sentencepiece as spm


class TokenizerError(ValueError):
    """A tokenizer file that cannot be read."""


class Tokenizer:
    """What every tokenizer offers (see the module docstring). ``chat`` is the checkpoint's chat
    format, set by weights.checkpoint.load_tokenizer: a weights.chat.ChatTemplate, the Llama-2 format
    of a Llama-2 chat model without a template, or None (a base model). ``name`` names the
    checkpoint in messages."""

    kind = ""
    bos_id: int | None
    eos_id: int | None
    vocab_size: int
    chat: Any = None
    name: str = "the model"

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        raise NotImplementedError

    def encode_special(self, text: str) -> list[int]:
        """The ids of ``text`` in which special tokens are written out (a rendered chat template),
        with nothing added around it."""
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def piece(self, token_id: int) -> str:
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes the token stands for in decoded text, alone: a word-boundary mark as a space, a
        byte piece (``<0xE2>``) as its byte, a byte-level BPE piece (``Ġcapital``) as the bytes it
        encodes, a special token as its own text. A character split over several tokens gives each
        of them part of its UTF-8 bytes (what OpenAI's ``logprobs`` report as ``bytes``)."""
        raise NotImplementedError

    def token_id(self, piece: str) -> int | None:
        """The id of a piece or special token (None: not in the vocabulary)."""
        raise NotImplementedError

    @property
    def special(self) -> dict[str, int]:
        """The special tokens that encode_special finds in text, by their text."""
        raise NotImplementedError

    def serialized(self) -> bytes:
        """The file's own bytes (two of them tokenize the same text alike iff these are equal)."""
        raise NotImplementedError

    def fingerprint(self) -> bytes:
        """A digest of what every id means: each piece in id order and the BOS and EOS ids. Equal
        for a SentencePiece model and a tokenizer.json converted from it."""
        digest = hashlib.sha256()
        for i in range(self.vocab_size):
            try:
                piece = self.piece(i)
            except IndexError:  # a tokenizer.json may leave ids unused
                piece = ""
            digest.update(piece.encode("utf-8", "surrogatepass") + b"\0")
        digest.update(json.dumps([self.bos_id, self.eos_id]).encode())
        return digest.digest()


class SentencePieceTokenizer(Tokenizer):
    """A ``tokenizer.model``; ``config``: the checkpoint's tokenizer_config.json, for its special
    tokens and its ``legacy`` flag (how text right after a special token is encoded)."""

    kind = "sentencepiece"

    def __init__(self, model_file: str | os.PathLike, config: dict[str, Any] | None = None) -> None:
        self.path = Path(model_file)
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(model_file))
        except (OSError, RuntimeError) as err:
            raise TokenizerError(
                f"{model_file} is not a SentencePiece model ({str(err).splitlines()[0]})"
            ) from None
        self.bos_id: int | None = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.eos_id: int | None = self.sp.eos_id() if self.sp.eos_id() >= 0 else None
        self.vocab_size: int = self.sp.vocab_size()
        config = config or {}
        # transformers' Llama tokenizer encodes the text after a special token without SentencePiece's
        # dummy-prefix space ("<s>[INST]" is "[", not "▁["), unless the config asks for legacy: true,
        # which encodes each piece of text as if it began the text (transformers 5's reading of both)
        self.legacy = config.get("legacy") is True
        self._special = {
            self.sp.id_to_piece(i): i
            for i in range(self.vocab_size)
            if self.sp.is_control(i) or self.sp.is_unknown(i)
        }
        for token in _added_tokens(config):
            if (token_id := self.token_id(token)) is not None:
                self._special[token] = token_id
        self._split = _splitter(self._special)
        self._bare: spm.SentencePieceProcessor | None = (
            None  # the model without the dummy prefix, when needed
        )

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        ids = self.sp.encode(text)
        return (
            ([self.bos_id] if bos and self.bos_id is not None else [])
            + ids
            + ([self.eos_id] if eos and self.eos_id is not None else [])
        )

    def encode_special(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, part in enumerate(self._split.split(text) if self._special else [text]):
            if i % 2:  # the splitter's group: a special token
                ids.append(self._special[part])
            elif part:
                ids += self.sp.encode(part) if i == 0 or self.legacy else self._without_prefix(part)
        return ids

    def _without_prefix(self, text: str) -> list[int]:
        """``text`` encoded without the dummy-prefix space, by the same model with that option off."""
        if self._bare is None:
            self._bare = spm.SentencePieceProcessor(
                model_proto=without_dummy_prefix(self.sp.serialized_model_proto())
            )
        return self._bare.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(list(ids))

    def piece(self, token_id: int) -> str:
        return self.sp.id_to_piece(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        return _metaspace_bytes(self.sp.id_to_piece(token_id))

    def token_id(self, piece: str) -> int | None:
        token_id = self.sp.piece_to_id(piece)
        return (
            None
            if token_id == self.sp.unk_id() and piece != self.sp.id_to_piece(token_id)
            else token_id
        )

    @property
    def special(self) -> dict[str, int]:
        return dict(self._special)

    def serialized(self) -> bytes:
        return self.sp.serialized_model_proto()


class JsonTokenizer(Tokenizer):
    """A ``tokenizer.json`` (its text) and the checkpoint's tokenizer_config.json, read by the
    ``tokenizers`` library."""

    kind = "tokenizer.json"

    def __init__(
        self, text: str, config: dict[str, Any] | None = None, origin: str = "tokenizer.json"
    ) -> None:
        # imported here: a SentencePiece checkpoint never needs it
        from tokenizers import Tokenizer as Backend

        try:
            self.backend = Backend.from_str(text)
        except (
            Exception
        ) as err:  # tokenizers raises its own Exception type for a file it cannot parse
            raise TokenizerError(
                f"{origin} is not a tokenizer.json that the tokenizers library reads "
                f"({str(err).splitlines()[0][:200]})"
            ) from None
        self.text = text
        config = config or {}
        self.vocab_size: int = self.backend.get_vocab_size(with_added_tokens=True)
        self.bos_id: int | None = self._named(config, "bos_token", origin)
        self.eos_id: int | None = self._named(config, "eos_token", origin)
        added = self.backend.get_added_tokens_decoder()
        self._special = {t.content: i for i, t in added.items() if t.special}
        self._added = set(added)
        self._byte_level = _decodes_byte_level(text)

    def _named(self, config: dict[str, Any], key: str, origin: str) -> int | None:
        token = config.get(key)
        if isinstance(token, dict):  # an AddedToken as tokenizer_config.json may write it
            token = token.get("content")
        if token is None:
            return None
        token_id = self.backend.token_to_id(str(token))
        if token_id is None:
            raise TokenizerError(
                f"{origin}: the {key} {token!r} of tokenizer_config.json is not in the vocabulary"
            )
        return token_id

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=bos).ids
        return ids + ([self.eos_id] if eos and self.eos_id is not None else [])

    def encode_special(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        # special tokens are markup (<|im_end|>, <|eot_id|>), not text: dropped as SentencePiece drops
        # its control pieces, and as vLLM's output does
        # (clean_up_tokenization_spaces, which Llama-3's config sets, is not applied: transformers 5 no longer
        # does, and it would make decode(encode(text)) lose the text's own spaces)
        return self.backend.decode(list(ids), skip_special_tokens=True)

    def piece(self, token_id: int) -> str:
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            raise IndexError(f"token id {token_id} is out of range")
        return piece

    def token_bytes(self, token_id: int) -> bytes:
        piece = self.piece(token_id)
        if token_id in self._added:  # written as it is, never byte-encoded
            return piece.encode()
        if self._byte_level:
            return bytes(_BYTE_OF_CHAR.get(char, 0x3F) for char in piece)
        return _metaspace_bytes(piece)

    def token_id(self, piece: str) -> int | None:
        return self.backend.token_to_id(piece)

    @property
    def special(self) -> dict[str, int]:
        return dict(self._special)

    def serialized(self) -> bytes:
        return self.text.encode()


def _gpt2_byte_chars() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's bytes_to_unicode), reversed: each of the 256 bytes is one
    printable character, the printable ASCII and Latin-1 bytes themselves, the rest shifted past 255
    in byte order (so a space is written "Ġ", U+0120)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + shifted)] = byte
            shifted += 1
    return chars


_BYTE_OF_CHAR = _gpt2_byte_chars()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _metaspace_bytes(piece: str) -> bytes:
    """A SentencePiece piece's bytes: a byte-fallback piece as its byte, ▁ as a space."""
    if match := _BYTE_PIECE.fullmatch(piece):
        return bytes([int(match.group(1), 16)])
    return piece.replace("\u2581", " ").encode()


def _decodes_byte_level(text: str) -> bool:
    """Whether a tokenizer.json's decoder is byte-level BPE's (alone or in a sequence)."""
    try:
        decoder = json.loads(text).get("decoder")
    except (ValueError, AttributeError):
        return False
    if not isinstance(decoder, dict):
        return False
    parts = decoder.get("decoders") or [decoder]
    return any(isinstance(d, dict) and d.get("type") == "ByteLevel" for d in parts)


def without_dummy_prefix(proto: bytes) -> bytes:
    """A serialized SentencePiece ModelProto with its normalizer's ``add_dummy_prefix`` set to false.

    The option lives in the model file only (no encode argument turns it off), and the protobuf
    library is not a dependency here, so the wire format is edited directly: the ModelProto's field 3
    (NormalizerSpec, length-delimited) gets its own field 3 (add_dummy_prefix, a varint) as 0, any
    earlier value dropped. Every other field is copied byte for byte."""

    def varint(data: bytes, i: int) -> tuple[int, int]:
        value = shift = 0
        while True:
            byte = data[i]
            value |= (byte & 0x7F) << shift
            i, shift = i + 1, shift + 7
            if byte < 0x80:
                return value, i

    def encode_varint(value: int) -> bytes:
        out = bytearray()
        while True:
            out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
            value >>= 7
            if not value:
                return bytes(out)

    def fields(data: bytes) -> list[tuple[int, int, bytes]]:
        """(field number, wire type, the field's whole encoding) in order."""
        out = []
        i = 0
        while i < len(data):
            start = i
            key, i = varint(data, i)
            number, wire = key >> 3, key & 7
            if wire == 0:
                _, i = varint(data, i)
            elif wire == 1:
                i += 8
            elif wire == 2:
                length, i = varint(data, i)
                i += length
            elif wire == 5:
                i += 4
            else:
                raise TokenizerError(
                    f"a SentencePiece model with protobuf wire type {wire} cannot be read"
                )
            out.append((number, wire, data[start:i]))
        return out

    parts = []
    for number, wire, raw in fields(proto):
        if number == 3 and wire == 2:  # NormalizerSpec
            key_end = varint(raw, 0)[1]
            body_start = varint(raw, key_end)[1]
            body = b"".join(r for n, _, r in fields(raw[body_start:]) if n != 3) + bytes(
                [3 << 3, 0]
            )
            raw = raw[:key_end] + encode_varint(len(body)) + body
        parts.append(raw)
    return b"".join(parts)


def _added_tokens(config: dict[str, Any]) -> list[str]:
    """The special tokens a tokenizer_config.json names: bos/eos/unk/pad and added_tokens_decoder's."""
    names = [config.get(key) for key in ("bos_token", "eos_token", "unk_token", "pad_token")]
    added = config.get("added_tokens_decoder")
    names += [token for token in added.values()] if isinstance(added, dict) else []
    out = []
    for token in names:
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and token:
            out.append(token)
    return out


def _splitter(special: dict[str, int]) -> re.Pattern[str]:
    """A pattern that splits text around every special token, the longest first; the tokens are its group."""
    alternatives = "|".join(re.escape(token) for token in sorted(special, key=len, reverse=True))
    return re.compile(f"({alternatives})" if alternatives else "(?!)")
