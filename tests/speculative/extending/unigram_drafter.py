"""A drafter with files of its own, in one file (docs/layout.md, "Add your own"): the drafter, the
reader and writer of its folder, the test that recognizes its folder, and its one registration.

It proposes every token from one fixed distribution over the vocabulary (a unigram table kept in
its folder), whatever came before: a poor guesser, and exact like any drafter that reports the
q it drew from. Its folder is config.json (model_type "unigram-drafter") and table.safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from speculative.draft import DrafterKind, register_drafter
from speculative.draft.protocol import Draft, drafted, draw_rows

MODEL_TYPE = "unigram-drafter"


class UnigramDrafter:
    """q is softmax(logits) at every position, for every row (warped by the row's sampling)."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits
        self.vocab_size = logits.shape[0]

    def start(self, max_rows: int, cache_len: int, target: Any) -> None:
        self.logits = self.logits.to(target.embed_tokens.weight.device)

    def propose(
        self,
        ids: list[list[int]],
        gammas: list[int],
        samplings: Any,
        generators: Any,
        device: torch.device,
    ) -> Draft:
        tokens, probs = [], []
        for step in range(max(gammas)):
            drawing = [g if step < gamma else None for g, gamma in zip(generators, gammas)]
            tokens.append(draw_rows(self.logits.expand(len(ids), -1), samplings, drawing, probs))
        return drafted(tokens, probs, gammas, 0, device)  # no network call: it costs nothing

    def commit(self, lengths: list[int], hidden: Any = None, hidden_starts: Any = None) -> None:
        pass  # it keeps nothing of the sequence

    def keep_rows(self, rows: list[int], new: int = 0) -> None:
        pass


def save(logits: torch.Tensor, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(
        json.dumps({"model_type": MODEL_TYPE, "vocab_size": logits.shape[0]})
    )
    save_file({"logits": logits.contiguous()}, folder / "table.safetensors")
    return folder


def read(
    folder: Path, target: Any, target_name: str, device: Any, dtype: torch.dtype
) -> torch.Tensor:
    logits = load_file(folder / "table.safetensors")["logits"]
    if logits.shape[0] != target.config.vocab_size:
        raise ValueError(
            f"{folder}: a table of {logits.shape[0]} ids for {target_name}'s {target.config.vocab_size}"
        )
    return logits.to(device=device, dtype=torch.float32)


def toy(target: Any) -> UnigramDrafter:
    """For the checker: a table drawn once, uneven enough that q differs from every p."""
    generator = torch.Generator().manual_seed(3)
    return UnigramDrafter(
        torch.randn(target.config.vocab_size, generator=generator, dtype=torch.float64) * 2
    )


KIND = register_drafter(
    DrafterKind(
        "unigram",
        "one fixed distribution over the vocabulary (an example of a drafter with files of its own)",
        build=lambda logits, target: UnigramDrafter(logits),
        toy=toy,
        loader=read,
        recognizes=lambda config: config.get("model_type") == MODEL_TYPE,
    )
)
