"""Toy models small enough to enumerate in float64, and the independent references that the
proofs of exactness compare the implementation with (the tests and ``python -m
speculative.prove`` use the same ones).

Models: :class:`NGramModel` is an order-k Markov chain behind the same interface as
``model.Llama`` (``model(tokens, call)``, ``setup_cache``, ``config``), for one-row chain calls
(model.call.chain). Its "KV cache" is the token history by position, with the same
contract: a chain call at slot s writes slots s.., reads slots below, and a read of a slot
nobody wrote is an error. Next-token logits for any context are available without the cache
(``next_logits``), so exact distributions are cheap. :func:`toy_table` draws its tables.
:func:`random_llama` is a real ``model.Llama`` with random weights of order one,
:func:`noisy_copy` a draft that mostly agrees with it, :func:`random_head` a feature head
(speculative.draft.eagle) for it.

References (written without the code under test): :func:`ref_warp` (temperature, top-k,
top-p in plain Python), :func:`sequence_distribution` (the exact distribution of the first
n sampled tokens), :func:`chi_square_pvalue` (Pearson's test with pooling of small cells),
:func:`max_gap` (the largest difference between two exact distributions).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from model import Llama, ModelConfig
from model.call import CacheCall
from model.eagle3_head import Eagle3Head, PEagleHead, default_layers
from model.feature_head import FeatureHead


@dataclass
class ToyConfig:
    vocab_size: int
    max_seq_len: int = 64


class NGramModel:
    """p(x_t | x_{t-k+1} .. x_{t-1}) from a table of logits [V]*(order-1) + [V].

    Positions before the sequence start read as token ``pad`` (0).
    """

    def __init__(self, table: torch.Tensor, max_seq_len: int = 64, pad: int = 0) -> None:
        if table.dim() < 2:
            raise ValueError("an n-gram table needs order >= 2: [V]*(order-1) + [V]")
        self.table = table
        self.order = table.dim()
        self.config = ToyConfig(vocab_size=table.shape[-1], max_seq_len=max_seq_len)
        self.pad = pad
        self.history: torch.Tensor | None = None
        self.calls = 0

    @classmethod
    def random(
        cls,
        vocab: int,
        order: int = 2,
        seed: int = 0,
        scale: float = 1.5,
        max_seq_len: int = 64,
        dtype: torch.dtype = torch.float64,
    ) -> NGramModel:
        gen = torch.Generator().manual_seed(seed)
        table = scale * torch.randn([vocab] * order, generator=gen, dtype=torch.float64)
        return cls(table.to(dtype), max_seq_len=max_seq_len)

    def setup_cache(self, max_batch_size: int, max_seq_len: int) -> None:
        if max_batch_size != 1:
            raise ValueError("toy models hold one sequence")
        if max_seq_len > self.config.max_seq_len:
            raise ValueError(
                f"cache length {max_seq_len} exceeds max_seq_len {self.config.max_seq_len}"
            )
        # order-1 slots of padding in front, then one slot per position; -1 = never written
        self.history = torch.full((self.order - 1 + max_seq_len,), -1, dtype=torch.long)
        self.history[: self.order - 1] = self.pad

    @property
    def cache_len(self) -> int:
        return self.history.shape[0] - (self.order - 1)

    def __call__(self, tokens: torch.Tensor, call: CacheCall) -> torch.Tensor:
        if self.history is None:
            raise RuntimeError("setup_cache first")
        batch, length = tokens.shape
        if batch != 1 or length < 1:
            raise ValueError(f"bad input shape {tuple(tokens.shape)}")
        start = chain_start(call, length)
        if start < 0 or start + length > self.cache_len:
            raise ValueError(
                f"positions {start}..{start + length - 1} outside the cache ({self.cache_len})"
            )
        self.calls += 1
        offset = self.order - 1
        self.history[offset + start : offset + start + length] = tokens[0]
        window = self.history[start + 1 : offset + start + length]  # contexts of the new positions
        contexts = window.unfold(0, self.order - 1, 1)  # [T, order-1]
        if (contexts < 0).any():
            raise RuntimeError(f"call at slot {start} reads a cache slot that was never written")
        return self.table[tuple(contexts.T)].unsqueeze(0)

    def next_logits(self, context: Sequence[int]) -> torch.Tensor:
        """Logits of the token after ``context`` (no cache involved)."""
        padded = [self.pad] * (self.order - 1) + list(context)
        return self.table[tuple(padded[len(padded) - (self.order - 1) :])]


def chain_start(call: CacheCall, length: int) -> int:
    """The first slot of a one-row chain call (slots = positions = start.., causal); ValueError
    for any other call, which a toy model does not take."""
    slots = call.slots.tolist()
    start = slots[0][0]
    chained = slots == [list(range(start, start + length))] and call.positions.tolist() == slots
    causal = call.visible is None or call.visible.tolist() == [
        [[s <= start + i for s in range(call.window)] for i in range(length)]
    ]
    if not (chained and causal and call.window == start + length):
        raise ValueError("toy models take one-row chain calls only")
    return start


def toy_table(vocab: int, order: int, seed: int, holes: float) -> torch.Tensor:
    """Logits N(0, 2) with a fraction `holes` of -inf (probability 0), never a whole row."""
    gen = torch.Generator().manual_seed(seed)
    table = 2.0 * torch.randn([vocab] * order, generator=gen, dtype=torch.float64)
    mask = torch.rand(table.shape, generator=gen, dtype=torch.float64) < holes
    mask[..., 0] &= ~mask.all(-1)  # keep one token alive per row
    return table.masked_fill(mask, -math.inf)


# ----------------------------------------------------------------------------- tiny LLaMAs
@torch.no_grad()
def random_llama(
    vocab: int = 8,
    dim: int = 16,
    n_layers: int = 1,
    n_heads: int = 2,
    n_kv_heads: int = 1,
    hidden_dim: int = 32,
    max_seq_len: int = 32,
    seed: int = 0,
    std: float = 0.3,
    dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """A model.Llama with every matrix N(0, std) and norm weights 1 + N(0, 0.1): logits of
    order one, so next-token distributions are far from uniform."""
    config = ModelConfig(
        vocab_size=vocab,
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        hidden_dim=hidden_dim,
        max_seq_len=max_seq_len,
    )
    model = Llama(config)
    gen = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float64)
        param.copy_(1 + 0.1 * noise if param.ndim == 1 else std * noise)
    return model.to(dtype).eval()


@torch.no_grad()
def noisy_copy(model: torch.nn.Module, std: float, seed: int = 0) -> torch.nn.Module:
    """A deep copy with N(0, std) added to every parameter: a draft that mostly agrees."""
    twin = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    for param in twin.parameters():
        param.add_(
            std * torch.randn(param.shape, generator=gen, dtype=torch.float64).to(param.dtype)
        )
    return twin


@torch.no_grad()
def parallel_copy(model: torch.nn.Module, std: float, seed: int = 0) -> torch.nn.Module:
    """A noisy copy (as noisy_copy's) whose vocabulary gains one id, the mask of a parallel draft
    (speculative.draft.parallel), with a random embedding: it drafts sometimes right, and the
    positions after the sequence read masks."""
    vocab = model.config.vocab_size
    config = ModelConfig(
        **{**vars(model.config), "vocab_size": vocab + 1, "extra": {"pard_token": vocab}}
    )
    twin = type(model)(config).to(model.dtype)
    gen = torch.Generator().manual_seed(seed)
    own = model.state_dict()
    for name, param in twin.named_parameters():
        source = own[name]
        noise = std * torch.randn(param.shape, generator=gen, dtype=torch.float64).to(param.dtype)
        # embeddings, output head: the mask's row
        if param.shape[0] == vocab + 1 and source.shape[0] == vocab:
            source = torch.cat([source, source.mean(0, keepdim=True)])
        param.copy_(source + noise)
    return twin.eval()


@torch.no_grad()
def random_head(target: torch.nn.Module, seed: int = 5, std: float = 0.3) -> torch.nn.Module:
    """A model.feature_head.FeatureHead of the target's shape with random weights (as random_llama's)."""
    config = ModelConfig(**{**vars(target.config), "n_layers": 1, "extra": {}})
    head = FeatureHead(config)
    gen = torch.Generator().manual_seed(seed)
    for name, param in head.named_parameters():
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float64)
        param.copy_(1 + 0.1 * noise if name.endswith("layernorm.weight") else std * noise)
    return head.to(target.dtype).eval()


@torch.no_grad()
def random_eagle3_head(
    target: torch.nn.Module,
    seed: int = 5,
    std: float = 0.3,
    drop: Sequence[int] = (1,),
    kind: type = Eagle3Head,
) -> torch.nn.Module:
    """A model.eagle3_head.Eagle3Head for the target with random weights, its draft vocabulary
    the target's less the ids in ``drop`` (a reduced vocabulary: q must be 0 on them)."""
    config = ModelConfig(**{**vars(target.config), "n_layers": 1, "extra": {}})
    dropped = set(drop)
    kept = [i for i in range(config.vocab_size) if i not in dropped]
    head = kind(config, default_layers(target.config.n_layers), draft_vocab=len(kept))
    head.set_vocabulary(torch.tensor(kept))
    gen = torch.Generator().manual_seed(seed)
    for name, param in head.named_parameters():
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float64)
        param.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else std * noise)
    return head.to(target.dtype).eval()


@torch.no_grad()
def random_peagle_head(
    target: torch.nn.Module, seed: int = 5, std: float = 0.3, drop: Sequence[int] = (1,)
) -> torch.nn.Module:
    """A model.eagle3_head.PEagleHead for the target with random weights (a random mask feature
    and mask embedding among them), its draft vocabulary the target's less ``drop``."""
    return random_eagle3_head(target, seed, std, drop, kind=PEagleHead)


def llama_next_logits(model: torch.nn.Module) -> Callable[[Sequence[int]], torch.Tensor]:
    """Next-token logits of a model.Llama for any context, by a plain no-cache forward."""

    @torch.no_grad()
    def next_logits(context: Sequence[int]) -> torch.Tensor:
        return model(torch.tensor([list(context)]))[0, -1]

    return next_logits


# ----------------------------------------------------------------------------- references
def ref_warp(
    logits: Sequence[float],
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> list[float]:
    """Temperature, then top-k, then top-p, in plain Python floats (independent of speculative.sampling)."""
    logits = [float(v) for v in logits]
    size = len(logits)
    if temperature == 0:
        best = max(range(size), key=lambda i: (logits[i], -i))  # first index of the maximum
        return [1.0 if i == best else 0.0 for i in range(size)]
    z = [v / temperature for v in logits]
    alive = [i for i in range(size) if z[i] != -math.inf]
    if top_k is not None and top_k < len(alive):
        kth = sorted((z[i] for i in alive), reverse=True)[top_k - 1]
        alive = [i for i in alive if z[i] >= kth]
    top = max(z[i] for i in alive)
    weights = {i: math.exp(z[i] - top) for i in alive}
    total = math.fsum(weights.values())
    probs = [weights.get(i, 0.0) / total for i in range(size)]
    if top_p is not None and top_p < 1:
        kept = []  # the most likely tokens, until they hold top_p
        mass = 0.0  # their probability
        for i in sorted(alive, key=lambda i: -probs[i]):
            if mass >= top_p:
                break
            kept.append(i)
            mass += probs[i]
        total = math.fsum(probs[i] for i in kept)
        probs = [probs[i] / total if i in kept else 0.0 for i in range(size)]
    return probs


def sequence_distribution(
    next_probs: Callable[[tuple[int, ...]], Sequence[float]], prompt: Sequence[int], length: int
) -> dict[tuple[int, ...], float]:
    """Exact P(first `length` tokens) of plain sampling, where next_probs(context) gives the
    next-token distribution after a full context (prompt included)."""
    out: dict[tuple[int, ...], float] = {}

    def walk(context: tuple[int, ...], prob: float) -> None:
        if len(context) - len(prompt) == length:
            out[context[len(prompt) :]] = prob
            return
        for token, p in enumerate(next_probs(context)):
            if p > 0:
                walk(context + (token,), prob * p)

    walk(tuple(prompt), 1.0)
    return out


def chi_square_pvalue(
    counts: dict[tuple[int, ...], int],
    expected: dict[tuple[int, ...], float],
    min_expected: float = 5.0,
) -> float:
    """Pearson's chi-square goodness of fit of observed counts to exact probabilities.

    Cells expected fewer than ``min_expected`` times are pooled into one. An outcome of
    probability 0 that was observed gives p-value 0 (it cannot happen).
    """
    total = sum(counts.values())
    if any(n > 0 and expected.get(k, 0.0) <= 0 for k, n in counts.items()):
        return 0.0
    big = [k for k, p in expected.items() if p * total >= min_expected]
    small = [k for k, p in expected.items() if 0 < p * total < min_expected]
    observed = [counts.get(k, 0) for k in big]
    wanted = [expected[k] * total for k in big]
    if small:
        observed.append(sum(counts.get(k, 0) for k in small))
        wanted.append(sum(expected[k] for k in small) * total)
    stat = math.fsum((o - e) ** 2 / e for o, e in zip(observed, wanted))
    dof = len(observed) - 1
    if dof < 1:
        return 1.0
    # survival function of chi-square(dof) = regularized upper incomplete gamma Q(dof/2, stat/2)
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
        )
    )


def max_gap(a: dict[tuple[int, ...], float], b: dict[tuple[int, ...], float]) -> float:
    """The largest |a(x) - b(x)| over the outcomes of either distribution."""
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))
