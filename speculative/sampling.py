"""From logits to the distributions that Algorithm 1 samples from, and the sampling itself.

Algorithm 1 (Leviathan et al. 2023) is stated for any two distributions: p from the target
M_p and q from the draft M_q. Decoding settings change those distributions, not the
algorithm: :func:`warp` turns logits into probabilities (temperature, then top-k, then
top-p) and the loop applies it *identically* to both models, so speculative sampling
reproduces the warped target distribution exactly (the proof in docs/algorithm.md never
asks where p and q came from).

Temperature 0 is greedy decoding. The warped distribution is then one-hot on the argmax,
and Algorithm 1 run on one-hot p and q *is* greedy speculative decoding: p(x)/q(x) is 1
when the draft's token is the target's argmax and 0 otherwise, and the residual
max(0, p - q) is one-hot on the target's argmax. No separate code path is needed for
correctness; the loop takes shortcuts that give the same tokens with fewer operators
(argmax in place of sampling a one-hot row, speculative.verify.verify_greedy).

All randomness of a generation call comes from one ``torch.Generator`` (:func:`make_generator`),
except under a rule that draws with noise keyed by position (:class:`KeyedNoise`,
:func:`sample_keyed`: speculative.verify.invariant), where the target's token at each position of a
row is the Gumbel-max sample with noise that depends on the row's seed and that position alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral, Real

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Sampling:
    """Decoding settings, validated once; applied to target and draft logits alike.

    temperature: 0 means greedy (then top_k and top_p change nothing); otherwise logits are divided by it
    (any positive value, however small: see :func:`warp`).
    top_k: keep the k largest logits (ties with the k-th are kept too); None keeps all.
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p; None keeps all.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, Real) or not t >= 0 or t == float("inf"):
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 means greedy), got {t!r}"
            )
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, Integral) or k < 1):
            raise ValueError(f"top_k must be an integer >= 1 or None, got {k!r}")
        tp = self.top_p
        if tp is not None and (isinstance(tp, bool) or not isinstance(tp, Real) or not 0 < tp <= 1):
            raise ValueError(f"top_p must lie in (0, 1] or be None, got {tp!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Probabilities [..., V] from logits [..., V], in the logits' dtype and on their device.

    Order as in Hugging Face transformers: temperature, top-k, top-p. Top-p keeps token j
    of the descending order iff the mass of the tokens before it is below top_p, so the
    most likely token always survives (among equal probabilities the lower id comes first).
    """
    if sampling.temperature == 0:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    if sampling.temperature < 1:
        # logits / T overflows to inf for a tiny T (1e-300), and softmax of inf is NaN; shifted
        # by their max first, the logits divide to 0 at the argmax and to <= 0 elsewhere, so any
        # T > 0 gives its distribution, tending to greedy (ties share the mass) as T -> 0. A T
        # that is 0 in the logits' dtype is that limit itself.
        shifted = logits - logits.amax(-1, keepdim=True)
        if sampling.temperature < torch.finfo(logits.dtype).tiny:
            logits = torch.where(shifted == 0, 0.0, float("-inf")).to(logits.dtype)
        else:
            logits = shifted / sampling.temperature
    elif sampling.temperature != 1:
        logits = logits / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth_largest = logits.topk(sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p is not None and sampling.top_p < 1:
        # stable: ties keep the lower id first
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        mass_before = F.pad(sorted_probs.cumsum(-1)[..., :-1], (1, 0))
        drop_sorted = mass_before >= sampling.top_p
        drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def full_width(logits: torch.Tensor) -> torch.Tensor:
    """A 16-bit drafter's logits in float32 (float64 as they are): q then carries no rounding of
    its own into the verifier's sums, whatever dtype the drafter runs in."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def warp_rows(logits: torch.Tensor, samplings: list[Sampling]) -> torch.Tensor:
    """warp for every row of logits [B, V], row b with its own settings samplings[b] (rows of a
    batch are requests with their own temperature, top-k and top-p): one warp when they agree."""
    if all(s == samplings[0] for s in samplings):
        return warp(logits, samplings[0])
    return torch.stack([warp(row, s) for row, s in zip(logits, samplings)])


def cdf_dtype(probs: torch.Tensor) -> torch.dtype:
    """The dtype of the running sums of probs: float64 for float64 probs, float32 otherwise."""
    if probs.dtype == torch.float64:
        return torch.float64
    return torch.float32


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token id per distribution: probs [..., V] -> LongTensor [...].

    Tokens of probability 0 are never drawn, so sampling a one-hot distribution returns
    its argmax (greedy decoding needs nothing else).

    On a CPU this draws by inverse CDF: with C the running sum of probs and u uniform on
    [0, C[-1]), the token is the first j with C[j] > u, which happens with probability
    probs[j] / C[-1]. torch.multinomial costs several times as much per draw on a CPU, and the
    speculative loop draws once per drafted token and once per verification. Two facts make it
    exact in floating point: PyTorch's CPU cumsum adds sequentially (in double for float32), so
    a zero-probability entry repeats C[j-1] exactly and can never be the first C[j] > u; and u
    stays strictly below C[-1], since torch.rand is at most 1 - 2^-mantissa and rounding
    x * (1 - 2^-mantissa) to nearest never gives back x. A GPU's cumsum is a parallel scan whose
    rounding can break the first fact, so other devices use torch.multinomial.
    """
    flat = probs.reshape(-1, probs.shape[-1])
    if flat.device.type != "cpu":
        return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])
    cdf = flat.cumsum(-1, dtype=cdf_dtype(flat))
    u = torch.rand(flat.shape[0], 1, generator=generator, dtype=cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).view(probs.shape[:-1])


def sample_rows(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs [B, V], row b drawn with its own generator: the same draw,
    bit for bit, as ``sample(probs[b], generators[b])``, so a row of a batch consumes its
    random stream exactly as the same sequence alone would. A row whose generator is None
    draws nothing (its token is the argmax, and its stream is left untouched). The cumulative
    sums and the search run once for the whole batch; only the uniforms are drawn per row."""
    if probs.device.type != "cpu":
        return torch.stack(
            [
                sample(row, gen) if gen is not None else row.argmax()
                for row, gen in zip(probs, generators)
            ]
        )
    cdf = probs.cumsum(-1, dtype=cdf_dtype(probs))
    zero = torch.zeros(1, 1, dtype=cdf.dtype)
    # row b's uniform from its own generator; a row without one draws nothing (its argmax, below)
    uniforms = [
        torch.rand(1, 1, generator=gen, dtype=cdf.dtype) if gen is not None else zero
        for gen in generators
    ]
    u = torch.cat(uniforms) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, u, right=True).view(-1)
    if any(gen is None for gen in generators):
        idle = torch.tensor([gen is None for gen in generators])
        tokens = torch.where(idle, probs.argmax(-1), tokens)
    return tokens


MASK_64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """One step of SplitMix64 (Steele, Lea & Flood 2014): a bijection of 64-bit integers whose
    outputs for consecutive inputs look independent, so that nearby (seed, position) keys seed
    unrelated streams."""
    x = (x + 0x9E3779B97F4A7C15) & MASK_64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK_64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK_64
    return x ^ (x >> 31)


def noise_key(seed: int, position: int) -> int:
    """The seed of the noise at ``position`` of a row seeded ``seed``: a pure function of the two (63
    bits, what torch.Generator.manual_seed takes whatever the platform)."""
    return splitmix64(splitmix64(seed & MASK_64) ^ position) >> 1


@dataclass(frozen=True)
class KeyedNoise:
    """Gumbel noise keyed by a row's seed and the absolute position of a token in its sequence:
    G(position) [V] depends on nothing else (not on the iteration, the drafter, gamma, the batch, or
    how many random numbers were drawn before), so the target's token at a position is the same
    whoever asks for it. ``start`` is the position of the first token of a draw (row b's next token
    is at len(ids)). Drawn on the CPU in float64 from a torch.Generator seeded by
    :func:`noise_key`, so that the tokens do not depend on the device either."""

    seed: int
    start: int

    def gumbel(self, count: int, vocab: int) -> torch.Tensor:
        """G at positions start .. start + count - 1: [count, V] float64 on the CPU, each entry
        -log(-log u) of a uniform u, clamped away from 0 so that every G is finite (a token of
        probability 0 then never wins, log 0 + G = -inf)."""
        rows = []
        for position in range(self.start, self.start + count):
            generator = torch.Generator().manual_seed(noise_key(self.seed, position))
            u = torch.rand(vocab, generator=generator, dtype=torch.float64)
            rows.append(-(-u.clamp(min=torch.finfo(torch.float64).tiny).log()).log())
        return torch.stack(rows) if rows else torch.empty(0, vocab, dtype=torch.float64)


def gumbel_noise(source: KeyedNoise | torch.Generator, count: int, vocab: int) -> torch.Tensor:
    """[count, V] float64 Gumbel noise: keyed by position (a KeyedNoise), or the next draws of a
    plain generator's stream (a caller of the four-argument verifier signature that keys nothing,
    python -m speculative.prove: the same law, without the invariance)."""
    if isinstance(source, KeyedNoise):
        return source.gumbel(count, vocab)
    u = torch.rand(count, vocab, generator=source, dtype=torch.float64, device=source.device)
    return -(-u.clamp(min=torch.finfo(torch.float64).tiny).log()).log()


def sample_keyed(probs: torch.Tensor, source: KeyedNoise | torch.Generator) -> torch.Tensor:
    """One token per distribution by the Gumbel-max trick: probs [n, V] -> LongTensor [n], row i
    argmax_x (log probs[i, x] + G_i(x)) with G_i the noise at position source.start + i.

    With G_i(x) independent standard Gumbel variables, the argmax is x with probability
    probs[i, x] (the Gumbel-max lemma: docs/algorithm.md, "A seed that repeats whatever the
    drafter"), so each token has its law; and it is a function of probs and the noise alone, so
    the same law and the same noise give the same token, whoever computes it. A one-hot row gives
    its argmax. python -m speculative.prove enumerates this door as a draw from each row's law
    (speculative.proofs.branching)."""
    noise = gumbel_noise(source, probs.shape[0], probs.shape[-1]).to(probs.device)
    return (probs.double().log() + noise).argmax(-1)


def make_generator(device: torch.device, seed: int | None) -> torch.Generator:
    """The one generator of a generation call: seeded, or from OS entropy when seed is None."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
