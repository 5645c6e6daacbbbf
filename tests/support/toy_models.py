"""Toy language models for the speculative decoding tests, and the independent references
the tests compare the implementation with.

The models and references that ``python -m speculative.prove`` also uses live in
speculative/proofs/toys.py and are imported from there (:class:`NGramModel`, :func:`random_llama`,
:func:`noisy_copy`, :func:`llama_next_logits`, :func:`ref_warp`, :func:`sequence_distribution`,
:func:`chi_square_pvalue`, :func:`random_head`), so that they exist once. Here: :class:`Recording`
wraps a model and logs every call; :func:`reference_greedy`, :func:`reference_greedy_toy` and
:func:`far_from_argmax` are the greedy references; :func:`target_distribution` is a toy target's
own law of its first tokens, with the reference warp.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from model.call import CacheCall
from speculative.proofs.toys import (  # noqa: F401 -- the tests import them from here
    NGramModel,
    chi_square_pvalue,
    llama_next_logits,
    noisy_copy,
    random_eagle3_head,
    random_head,
    random_llama,
    ref_warp,
    sequence_distribution,
)
from speculative.sampling import Sampling


class Recording:
    """Delegates to a model and records (first slot, tokens) of every call."""

    def __init__(self, model: object) -> None:
        self.model = model
        self.config = model.config
        self.calls: list[tuple[int, list[int]]] = []
        self.cache_lengths: list[int] = []

    def setup_cache(self, max_batch_size: int, max_seq_len: int) -> None:
        self.cache_lengths.append(max_seq_len)
        self.model.setup_cache(max_batch_size, max_seq_len)

    @property
    def cache_len(self) -> int:
        return self.model.cache_len

    def __call__(self, tokens: torch.Tensor, call: CacheCall) -> torch.Tensor:
        self.calls.append((int(call.slots[0, 0]), tokens[0].tolist()))
        return self.model(tokens, call)

    def next_logits(self, context: Sequence[int]) -> torch.Tensor:
        return self.model.next_logits(context)


class FakeTokenizer:
    """Anything with ``fingerprint() -> bytes`` is a tokenizer to check_pair."""

    def __init__(self, serialized: bytes) -> None:
        self.serialized = serialized

    def fingerprint(self) -> bytes:
        return self.serialized


@torch.no_grad()
def reference_greedy(model: torch.nn.Module, prompt: Sequence[int], count: int) -> list[int]:
    """The target's own greedy output: argmax of a no-cache forward over the whole sequence."""
    seq = list(prompt)
    for _ in range(count):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


NEAR_TIE = 1e-4  # docs/algorithm.md, numerics policy: float32 greedy may differ from the argmax only this close
NEAR_TIE_16 = 1e-2  # the same in 16 bits, relative to the largest logit (8 bits of mantissa)


@torch.no_grad()
def far_from_argmax(
    model: torch.nn.Module, prompt: Sequence[int], tokens: Sequence[int]
) -> list[tuple[int, float]]:
    """(index, gap) of every emitted token whose logit is more than NEAR_TIE below the
    model's maximum logit after the emitted prefix (no-cache forward): [] for greedy output
    that is the model's own up to the numerics policy's near-ties. A 16-bit model's near-tie
    is NEAR_TIE_16 of its largest logit."""
    bad, seq = [], list(prompt)
    for i, token in enumerate(tokens):
        logits = model(torch.tensor([seq]))[0, -1].double()
        gap = (logits.max() - logits[token]).item()
        sixteen = getattr(model, "dtype", None) in (torch.float16, torch.bfloat16)
        if gap > (NEAR_TIE_16 * max(1.0, logits.abs().max().item()) if sixteen else NEAR_TIE):
            bad.append((i, gap))
        seq.append(token)
    return bad


def reference_greedy_toy(model: NGramModel, prompt: list[int], count: int) -> list[int]:
    """A toy n-gram model's own greedy output: the argmax of its next-token logits, token by token."""
    seq = list(prompt)
    for _ in range(count):
        seq.append(int(model.next_logits(seq).argmax()))
    return seq[len(prompt) :]


def target_distribution(
    target: NGramModel, prompt: tuple[int, ...], length: int, sampling: Sampling
) -> dict[tuple[int, ...], float]:
    """The target's own autoregressive distribution, with the reference warp."""
    return sequence_distribution(
        lambda ctx: ref_warp(
            target.next_logits(ctx).tolist(), sampling.temperature, sampling.top_k, sampling.top_p
        ),
        prompt,
        length,
    )
