"""A drafter of one's own, in one file with its one registration (docs/layout.md, "Add your own").

It proposes the row's last token again, gamma times: deterministic (q is one-hot on what it
proposes), no model, no file. Useless for speed, and exact like any drafter that reports the
q it drew from.
"""

from __future__ import annotations

from typing import Any

import torch

from speculative.draft import DrafterKind, register_drafter
from speculative.draft.protocol import Draft, pad_rows


class RepeatDrafter:
    reads_features = False
    vocab_size = None  # it proposes ids taken from the sequence
    max_seq_len = None

    def start(self, max_rows: int = 0, cache_len: int = 0, target: Any = None) -> None:
        pass

    def propose(
        self,
        ids: list[list[int]],
        gammas: list[int],
        samplings: Any,
        generators: Any,
        device: torch.device,
    ) -> Draft:
        rows = [[row[-1]] * g for row, g in zip(ids, gammas)]
        # q None: one-hot
        return Draft(pad_rows(rows, device, max(gammas, default=0)), list(gammas))

    def commit(self, lengths: list[int], hidden: Any = None, hidden_starts: Any = None) -> None:
        pass

    def keep_rows(self, rows: list[int], new: int = 0) -> None:
        pass


register_drafter(
    DrafterKind(
        "repeat",
        "the row's last token again (an example of a drafter of one's own)",
        build=lambda network, target: RepeatDrafter(),
        toy=lambda target: RepeatDrafter(),
    )
)
