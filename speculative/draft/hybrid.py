"""A hybrid proposer: a model-free copier (suffix decoding) and a model drafter (a feature head or
a draft model) together, each iteration drafting with the one expected to get more tokens accepted.

Why both. Where the answer follows its input (a summary, an answer from a document, an edit, a
second turn that reuses the first) the copier proposes long runs that the target keeps, at no
cost; elsewhere it has nothing to say, and a model drafts a few tokens that the target keeps
about half the time. Neither wins everywhere, and the choice can be made per iteration, because
Algorithm 1 is exact for any q chosen from what is already known (the sequence so far and the
acceptance recorded before this iteration): which drafter proposed never changes the output's
distribution, only how many tokens each target call keeps. This is the idea of SuffixDecoding's
hybrid with a model drafter (Oliaro et al. 2024, arXiv 2411.04975) and of SAM-Decoding's
retrieval-or-model choice (Hu et al. 2024, arXiv 2411.10666).

**The choice, per row and iteration**, by the expected number of drafted tokens accepted:

* the copier's chain t_1..t_n comes with each token's frequency f_i after its context
  (speculative.draft.suffix); the chance that the first k are all kept is estimated by the
  product f_1 ... f_k, so the chain is expected to get sum_k f_1 ... f_k accepted
  (``Continuation.expected``). Frequencies
  are counts in the text so far, not the target's probabilities, so that sum is scaled by how
  the copier's estimates have come out for this row: (accepted + 1) / (estimated + 1), summed
  over the iterations it drafted;
* the model drafts m tokens (its own length, ``model_gamma``); with a per-position acceptance a
  (how often a drafted token the target verified was kept, for this row, starting from a prior)
  it is expected to get a + a^2 + ... + a^m accepted;
* the larger wins; on a tie the copier, whose draft costs no forward. A copier without a match
  proposes nothing and the model drafts; a model that cannot draft yet (a head before the
  target's first features) leaves the iteration to the copier.

**With measured costs** (the ``priced`` hook; generate.py measures them once per machine and
set-up, speculative.cli.costs.iteration_costs) the choice is by expected tokens per second instead:
the copier's chain is cut to its prefix with the most (1 + expected accepted) / seconds of an
iteration verifying it, the model's chain is worth (1 + a + ... + a^m) / seconds of an iteration
with the model drafting, and a plain step 1 / its seconds; the best of the three is drafted. A
count alone treats a long chain as free, which it is not where a wide verification costs
markedly more than a step (a compiled target on a CPU with few cores; docs/drafters.md).

The engine's gamma bounds the copier's chain (its room and the guard's choice); the model drafts
at most ``model_gamma`` of it. So a hybrid runs with a long gamma (the longest copy worth one
verification) while the model keeps the draft length it was trained for.

The model drafter is asked to draft only for the rows it won (gamma 0 for the others). Its state
stays right: it is told every row's new length on every commit, and a drafter that did not
draft for a row catches up on the tokens it missed at its next proposal (speculative.draft.eagle
and speculative.draft.model both keep the position they have read up to, and read from it).

A drafted chain is a chain: q is the model's where the model drafted, one-hot on the copied
tokens where the copier did (speculative.draft.protocol).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from speculative.draft.costs import IterationCosts
from speculative.draft.protocol import Draft, pad_rows, trait
from speculative.draft.suffix import Calibration, Continuation, SuffixDrafter
from speculative.sampling import Sampling

# The model's acceptance before a row has any of its own: a prior worth PRIOR_WEIGHT verified
# positions. Half is what the shipped heads keep on open text (docs/drafters.md), a neutral start.
MODEL_PRIOR = 0.5
PRIOR_WEIGHT = 8.0


@dataclass
class RowRecord:
    """What one row's drafts have come to so far: the copier's accepted tokens against its
    estimates (suffix decoding's own Calibration), and the model's accepted tokens against the
    drafted positions the target verified (starting from ``model_prior`` over PRIOR_WEIGHT
    positions)."""

    copier: Calibration = field(default_factory=Calibration)
    model_accepted: float = MODEL_PRIOR * PRIOR_WEIGHT
    model_verified: float = PRIOR_WEIGHT

    @classmethod
    def fresh(cls, model_prior: float) -> RowRecord:
        return cls(model_accepted=model_prior * PRIOR_WEIGHT)

    @property
    def copier_scale(self) -> float:
        return self.copier.scale

    @property
    def model_alpha(self) -> float:
        return self.model_accepted / self.model_verified


@dataclass
class Pending:
    """One row's proposal this iteration, kept until commit says how it went."""

    source: str  # "copier", "model" or "none"
    length: int  # the sequence's length when it was proposed
    drafted: int  # tokens drafted
    estimate: float  # the copier's unscaled expected accepted tokens (0 for the model)


def model_estimate(alpha: float, length: int) -> float:
    """alpha + alpha^2 + ... + alpha^length: a chain whose every position is kept with alpha."""
    return sum(alpha**k for k in range(1, length + 1))


class HybridDrafter:
    """Each iteration and row, the copier's chain or the model drafter's, whichever is expected
    to get more tokens accepted (see the module docstring)."""

    def __init__(
        self,
        copier: SuffixDrafter,
        drafter: Any,
        model_gamma: int = 4,
        model_prior: float = MODEL_PRIOR,
    ) -> None:
        if isinstance(model_gamma, bool) or not isinstance(model_gamma, int) or model_gamma < 1:
            raise ValueError(f"model_gamma must be an integer >= 1, got {model_gamma!r}")
        if not 0 <= model_prior <= 1:
            raise ValueError(f"model_prior must lie in [0, 1], got {model_prior!r}")
        self.copier = copier
        self.drafter = drafter
        self.model_gamma = model_gamma
        self.model_prior = model_prior
        # what the engine reads of a drafter is the model drafter's: the copier needs nothing
        self.reads_features = trait(drafter, "reads_features")
        self.vocab_size = trait(drafter, "vocab_size")
        self.max_seq_len = trait(drafter, "max_seq_len")
        self.model = trait(drafter, "model")
        self.head = trait(drafter, "head")
        # a row that goes on from an earlier one: the model drafter keeps what it can (its hook, or
        # None: it reads the row from 0); the copier's index is built from the sequence anyway
        self.resumed = trait(drafter, "resumed")
        self.records: list[RowRecord] = []
        self.pending: list[Pending] = []
        # what an iteration costs (the priced hook), or None: the choice is by accepted tokens
        self.costs: IterationCosts | None = None

    def start(self, max_rows: int = 0, cache_len: int = 0, target: Any = None) -> None:
        self.copier.start(max_rows, cache_len, target)
        self.drafter.start(max_rows, cache_len, target)
        self.records = []
        self.pending = []

    def choose(
        self, record: RowRecord, chain: Continuation, gamma: int
    ) -> tuple[str, Continuation]:
        """Which drafter drafts this row, "copier", "model" or "none" (gamma 0, or with measured
        costs a plain step expected to be fastest), and the copier's chain as it would draft it."""
        if gamma == 0:
            return "none", chain
        modelled = model_estimate(record.model_alpha, min(gamma, self.model_gamma))
        if self.costs is None:  # by expected accepted tokens
            if not chain.tokens:
                return "model", chain
            if record.copier_scale * chain.expected >= modelled:
                return "copier", chain
            return "model", chain
        # by expected tokens per second: the copier's best prefix, the model's own length, or a
        # plain step (where the model's cost was not measured, it is not drafted)
        chain, copied_rate = chain.priced(self.costs, record.copier_scale)
        plain_rate = 1.0 / self.costs.verify(0)
        model_rate = 0.0
        if self.costs.model_s is not None:
            model_rate = (1.0 + modelled) / self.costs.model_s
        if chain.tokens and copied_rate >= model_rate:
            return "copier", chain
        if model_rate > plain_rate:
            return "model", chain
        return "none", chain

    def propose(
        self,
        ids: list[list[int]],
        gammas: list[int],
        samplings: list[Sampling],
        generators: list[torch.Generator],
        device: torch.device,
    ) -> Draft:
        # each row's copied chain: its own text's, or its key's earlier responses' (serve.py)
        found = [
            self.copier.continuation(b, row_ids, g) if g else Continuation()
            for b, (row_ids, g) in enumerate(zip(ids, gammas))
        ]
        chosen = [
            self.choose(record, chain, g) for record, chain, g in zip(self.records, found, gammas)
        ]
        sources = [source for source, _ in chosen]
        found = [chain for _, chain in chosen]
        model_gammas = [
            min(g, self.model_gamma) if source == "model" else 0
            for g, source in zip(gammas, sources)
        ]
        modelled = None
        if any(model_gammas):
            modelled = self.drafter.propose(ids, model_gammas, samplings, generators, device)
        chains: list[list[int]] = []
        self.pending = []
        for b, (source, chain, row_ids) in enumerate(zip(sources, found, ids)):
            tokens = []
            if source == "model" and modelled is not None:
                tokens = modelled.tokens[b, : modelled.lengths[b]].tolist()
            if source == "model" and not tokens:
                # the model has nothing yet (a head before the target's first features): copy
                source = "copier"
            if source == "copier":
                tokens = chain.tokens
            if not tokens:
                source = "none"
            sources[b] = source
            estimate = chain.expected if source == "copier" else 0.0
            chains.append(tokens)
            self.pending.append(Pending(source, len(row_ids), len(tokens), estimate))
        return self.merged(chains, sources, modelled, device)

    def merged(
        self,
        chains: list[list[int]],
        sources: list[str],
        modelled: Draft | None,
        device: torch.device,
    ) -> Draft:
        """One Draft of every row's chain: q is the model's on the rows it drafted and one-hot
        on the copied rows, or None (one-hot everywhere) when the model reported none."""
        width = max(map(len, chains), default=0)
        tokens = pad_rows(chains, device, width)  # [B, width]
        lengths = [len(chain) for chain in chains]
        calls = 0 if modelled is None else modelled.calls
        if modelled is None or modelled.q is None:
            return Draft(tokens, lengths, None, calls)
        vocab = modelled.q.shape[-1]
        q = torch.zeros(len(chains), width, vocab, dtype=modelled.q.dtype, device=device)
        for b, (chain, source) in enumerate(zip(chains, sources)):
            if source == "model":
                q[b, : len(chain)] = modelled.q[b, : len(chain)]
            else:  # a copied chain: q one-hot on each token (its padding stays zero, never read)
                q[b, torch.arange(len(chain), device=device), tokens[b, : len(chain)]] = 1.0
        return Draft(tokens, lengths, q, calls)

    def commit(
        self,
        lengths: list[int],
        hidden: torch.Tensor | None = None,
        hidden_starts: list[int] | None = None,
    ) -> None:
        for record, pending, length in zip(self.records, self.pending, lengths):
            accepted = max(0, length - pending.length - 1)  # the last new token is the target's own
            if pending.source == "copier":
                record.copier.accepted += accepted
                record.copier.estimated += pending.estimate
            elif pending.source == "model":
                # verified positions: the accepted ones and the first rejected one, if any
                record.model_accepted += accepted
                record.model_verified += min(pending.drafted, accepted + 1)
        self.pending = []
        self.copier.commit(lengths, hidden, hidden_starts)
        self.drafter.commit(lengths, hidden, hidden_starts)

    def keep_rows(self, rows: list[int], new: int = 0) -> None:
        self.copier.keep_rows(rows, new)
        self.drafter.keep_rows(rows, new)
        self.records = [self.records[r] for r in rows] + [
            RowRecord.fresh(self.model_prior) for _ in range(new)
        ]
        self.pending = []

    def priced(self, costs: IterationCosts) -> None:
        """What an iteration costs, measured on this machine (the protocol's hook): by the tokens
        the target verifies, and with the model drafting (``model_s``). From now on each row
        drafts whichever of the copier's best prefix, the model's chain and a plain step is
        expected to give the most tokens per second."""
        self.costs = costs
        self.copier.priced(costs)

    # serve.py's memory of earlier responses per API key reaches the copier (speculative.draft.protocol)
    def joined(self, memories: list[Any]) -> None:
        self.copier.joined(memories)

    def finished(self, rows: list[int], ids: list[list[int]], prompt_lengths: list[int]) -> None:
        self.copier.finished(rows, ids, prompt_lengths)
