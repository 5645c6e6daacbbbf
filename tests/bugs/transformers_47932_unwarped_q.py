"""transformers #47932 (vLLM #10198 had the same slip): the draft token is drawn from the warped
q (temperature, top-k, top-p), but the verifier is handed the raw softmax of the draft's logits.

Algorithm 1 is exact for any q, but only if x ~ q and the ratio p(x)/q(x) and the residual use
that same q. At temperature 1 without top-k or top-p the two distributions coincide, so only a
decoding setting shows the bug; at temperature 0 the verifier compares argmaxes and ignores q.

A drafter, written by hand against the drafter protocol (speculative.draft): it runs its draft
model without a cache, one call per drafted token. ``drafter(target)`` builds it over a toy draft
of the checker's toy target; :meth:`NoCacheDrafter.handed` is where the bug is.

    python -m speculative.prove tests/bugs/transformers_47932_unwarped_q.py:drafter    # fails: exact law
"""

from typing import Any

import torch

from speculative.draft.protocol import Draft
from speculative.proofs.cases import toy_draft
from speculative.sampling import Sampling, sample, warp


class NoCacheDrafter:
    reads_features = False

    def __init__(self, model: Any) -> None:
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.max_seq_len = model.config.max_seq_len

    def start(self, max_rows: int, cache_len: int, target: Any = None) -> None:
        pass  # no cache, nothing to keep between calls

    def commit(self, lengths: list[int], hidden: Any = None, hidden_starts: Any = None) -> None:
        pass

    def keep_rows(self, rows: list[int], new: int = 0) -> None:
        pass

    def handed(self, logits: torch.Tensor, warped: torch.Tensor) -> torch.Tensor:
        """The q handed to the verifier for a token drawn from ``warped``."""
        # the bug: must be `warped`, the law the token was drawn from
        return torch.softmax(logits, -1)

    @torch.no_grad()
    def propose(
        self,
        ids: list[list[int]],
        gammas: list[int],
        samplings: list[Sampling],
        generators: list[torch.Generator],
        device: torch.device,
    ) -> Draft:
        width = max(gammas, default=0)
        tokens = torch.zeros(len(ids), width, dtype=torch.long, device=device)
        q = torch.zeros(len(ids), width, self.vocab_size, dtype=torch.float64, device=device)
        for b, (row, gamma, sampling, generator) in enumerate(
            zip(ids, gammas, samplings, generators)
        ):
            sequence = list(row)
            for i in range(gamma):
                logits = self.model(torch.tensor([sequence], device=device))[0, -1].double()
                warped = warp(logits, sampling)
                token = int(sample(warped, generator))
                tokens[b, i], q[b, i] = token, self.handed(logits, warped)
                sequence.append(token)
        return Draft(tokens, list(gammas), q, calls=width)


def drafter(target: torch.nn.Module) -> NoCacheDrafter:
    return NoCacheDrafter(toy_draft(target))
