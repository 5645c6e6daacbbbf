"""The checker's toy cases and toy drafters: small float64 models on which a law can be
enumerated, with the case described in the words a failure is reported in.

:class:`TableCase` is a verifier's case (order-2 n-gram tables); :class:`LlamaCase` a case
through the engine (a random float64 LLaMA). The ``*_drafter`` functions build each built-in
drafter for a toy target; a registration's ``toy`` names them
(``speculative.proofs.cases:model_drafter``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speculative.draft.costs import IterationCosts
from speculative.draft.eagle import FeatureDrafter
from speculative.draft.hybrid import HybridDrafter
from speculative.draft.model import ModelDrafter
from speculative.draft.parallel import ParallelDrafter, ParallelFeatureDrafter
from speculative.draft.suffix import SuffixDrafter
from speculative.proofs.toys import (
    NGramModel,
    noisy_copy,
    parallel_copy,
    random_eagle3_head,
    random_head,
    random_llama,
    random_peagle_head,
    toy_table,
)
from speculative.sampling import Sampling


def describe(sampling: Sampling) -> str:
    if sampling.greedy:
        return "temperature 0"
    parts = [f"temperature {sampling.temperature:g}"]
    if sampling.top_k is not None:
        parts.append(f"top-k {sampling.top_k}")
    if sampling.top_p is not None:
        parts.append(f"top-p {sampling.top_p:g}")
    return ", ".join(parts)


@dataclass(frozen=True)
class TableCase:
    """A verifier's toy case: order-2 n-gram tables (target and draft), the draft's rows equal to
    the target's in a fraction ``agree`` of the contexts (a draft that is sometimes right), and
    -inf logits (probability 0) in a fraction ``holes`` of the target's entries and
    ``draft_holes`` of the draft's (None: the same fraction)."""

    vocab: int
    gamma: int
    length: int
    sampling: Sampling
    seed: int
    holes: float = 0.0
    agree: float = 0.5
    draft_holes: float | None = None

    def models(self) -> tuple[NGramModel, NGramModel]:
        target = toy_table(self.vocab, 2, self.seed, self.holes)
        other = toy_table(
            self.vocab,
            2,
            self.seed + 1000,
            self.holes if self.draft_holes is None else self.draft_holes,
        )
        same = (
            torch.rand(self.vocab, generator=torch.Generator().manual_seed(self.seed)) < self.agree
        )
        return NGramModel(target), NGramModel(torch.where(same[:, None], target, other))

    def __str__(self) -> str:
        q_holes = self.holes if self.draft_holes is None else self.draft_holes
        zeros = (
            ""
            if not (self.holes or q_holes)
            else f", zeros in {self.holes:.0%} of p and {q_holes:.0%} of q"
        )
        return (
            f"vocab {self.vocab}, gamma {self.gamma}, first {self.length} tokens, {describe(self.sampling)}"
            f"{zeros}, n-gram tables seed {self.seed}"
        )


@dataclass(frozen=True)
class LlamaCase:
    """A case through the engine: a float64 random LLaMA target of ``vocab`` tokens (weights
    N(0, std)); one prompt, or several as the rows of one batch."""

    vocab: int
    gamma: int
    length: int  # tokens emitted (exact law) or counted (chi-square), per row
    sampling: Sampling
    seed: int
    prompts: tuple[tuple[int, ...], ...] = ((1, 0, 1),)
    runs: int = 0  # chi-square: seeds 0..runs-1
    std: float = 0.6

    def target(self) -> torch.nn.Module:
        return random_llama(
            vocab=self.vocab,
            dim=16,
            n_layers=1,
            n_heads=2,
            n_kv_heads=1,
            hidden_dim=32,
            max_seq_len=64,
            seed=self.seed,
            std=self.std,
            dtype=torch.float64,
        )

    def __str__(self) -> str:
        runs = f", {self.runs} runs (seeds 0-{self.runs - 1})" if self.runs else ""
        prompts = (
            f"prompt {list(self.prompts[0])}"
            if len(self.prompts) == 1
            else f"a batch of {len(self.prompts)} rows, prompts {', '.join(str(list(p)) for p in self.prompts)}"
        )
        return (
            f"vocab {self.vocab}, gamma {self.gamma}, first {self.length} tokens, {describe(self.sampling)}, "
            f"{prompts}, toy LLaMA seed {self.seed} (std {self.std:g}){runs}"
        )


VERIFIER_CASES = [
    TableCase(2, 1, 3, Sampling(), seed=1),
    TableCase(3, 2, 3, Sampling(), seed=2, holes=0.3, agree=0.3),
    TableCase(3, 3, 4, Sampling(temperature=0.7, top_k=2), seed=3),
    TableCase(4, 2, 3, Sampling(temperature=1.3, top_p=0.8), seed=4, holes=0.3),
    TableCase(2, 4, 5, Sampling(temperature=1.5), seed=5, agree=0.5),
    TableCase(5, 2, 2, Sampling(temperature=0.8), seed=6, holes=0.4, agree=0.2),
    TableCase(3, 2, 3, Sampling(temperature=0), seed=7),
]
DRAFTER_CASES = [
    LlamaCase(3, 2, 3, Sampling(temperature=0.7, top_k=2), seed=12),
    LlamaCase(2, 3, 4, Sampling(), seed=11),
    LlamaCase(3, 2, 4, Sampling(temperature=1.3, top_p=0.9), seed=13, prompts=((2, 1, 2),)),
    LlamaCase(4, 2, 3, Sampling(temperature=0.6), seed=14),
    LlamaCase(2, 2, 2, Sampling(temperature=0.8), seed=15, prompts=((1, 0, 1), (0, 0))),
]
CHI_SQUARE_CASES = [
    LlamaCase(
        8,
        1,
        2,
        Sampling(temperature=0.5, top_k=4),
        seed=21,
        prompts=((1, 5, 1),),
        runs=2000,
        std=0.4,
    ),
    LlamaCase(
        8, 2, 2, Sampling(temperature=0.8, top_k=5), seed=23, prompts=((1, 5, 1),), runs=2000
    ),
]
GREEDY_PROMPTS = [(1,), (3, 7, 3), (2, 2, 9, 4, 2, 2)]
GREEDY_GAMMAS = [1, 3, 5]


def quick_cases(cases: list, runs: int = 600) -> list:
    """--quick: the first half of the cases, chi-square with fewer runs."""
    return [
        LlamaCase(**{**vars(c), "runs": runs}) if isinstance(c, LlamaCase) and c.runs else c
        for c in cases[: max(1, (len(cases) + 1) // 2)]
    ]


# ----------------------------------------------------------------------------- toy drafts
def toy_draft(target: torch.nn.Module, std: float = 0.5, seed: int = 7) -> torch.nn.Module:
    """A draft model for the toy target: a noisy copy, often right and often wrong."""
    return noisy_copy(target, std=std, seed=seed)


def toy_head(target: torch.nn.Module, seed: int = 5) -> torch.nn.Module:
    """A feature head (model.feature_head.FeatureHead) with random weights for the toy target."""
    return random_head(target, seed=seed, std=0.3)


def model_drafter(target: torch.nn.Module) -> ModelDrafter:
    """The draft-model drafter (speculative.draft.ModelDrafter) over a toy draft of the target."""
    return ModelDrafter(toy_draft(target))


def parallel_drafter(target: torch.nn.Module) -> ParallelDrafter:
    """The parallel drafter (speculative.draft.parallel.ParallelDrafter) over a toy draft of the
    target with one more id, its mask: every chain from one call."""
    draft = parallel_copy(target, std=0.5, seed=7)
    return ParallelDrafter(draft, draft.config.extra["pard_token"], target.config.vocab_size)


def feature_drafter(target: torch.nn.Module) -> FeatureDrafter:
    """The feature drafter (speculative.draft.eagle.FeatureDrafter) with a random head for the target."""
    return FeatureDrafter(toy_head(target), target)


def eagle3_drafter(target: torch.nn.Module) -> FeatureDrafter:
    """The feature drafter around a random EAGLE-3 head (model.eagle3_head.Eagle3Head) whose draft
    vocabulary leaves out token 1: fused features of three target layers, its own output layer."""
    return FeatureDrafter(random_eagle3_head(target, seed=5, std=0.3), target)


def peagle_drafter(target: torch.nn.Module) -> ParallelFeatureDrafter:
    """The parallel feature drafter (P-EAGLE) around a random head whose draft vocabulary leaves
    out token 1: every chain from one head call."""
    return ParallelFeatureDrafter(random_peagle_head(target, seed=5, std=0.3), target)


def hybrid_drafter(target: torch.nn.Module) -> HybridDrafter:
    """The hybrid proposer (speculative.draft.hybrid): suffix decoding beside a random feature head,
    each iteration the one whose expected accepted length is larger. On the toy's small vocabulary
    the sequence repeats itself often, so both of them draft, and rows switch between them."""
    return HybridDrafter(SuffixDrafter(), feature_drafter(target), model_gamma=2)


# Costs under which a priced chain is cut (two tokens cost a plain step, more cost twice as much)
# and a plain step sometimes beats the model: every choice of speculative.draft.hybrid happens.
PRICED = IterationCosts((1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0), model_s=1.6)


def priced_suffix_drafter(target: torch.nn.Module) -> SuffixDrafter:
    """Suffix decoding with its chains cut by measured costs (the priced hook): a chain, a shorter
    one or none, chosen from what is known before the iteration."""
    drafter = SuffixDrafter()
    drafter.priced(PRICED)
    return drafter


def priced_hybrid_drafter(target: torch.nn.Module) -> HybridDrafter:
    """The hybrid proposer choosing by tokens per second (the priced hook): the copier's best
    prefix, the head's chain, or a plain step."""
    drafter = hybrid_drafter(target)
    drafter.priced(PRICED)
    return drafter


def hybrid_model_drafter(target: torch.nn.Module) -> HybridDrafter:
    """The hybrid proposer around a draft model (catching up on the iterations the copier drafted)."""
    return HybridDrafter(SuffixDrafter(), model_drafter(target), model_gamma=2)
