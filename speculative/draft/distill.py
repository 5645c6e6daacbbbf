"""Training drafters toward their target: the token-level divergences of DistillSpec (Zhou et
al. 2023) on the draft's own (on-policy) sequences, EAGLE's losses for a feature head (Li et
al. 2024), with the data each trains on (:func:`on_policy_batch`, :func:`eagle_batch`).
``train.py distill`` and ``train.py eagle`` run them (docs/distillation.md); ``train.py
eagle3``, ``parallel`` and ``peagle`` train on :func:`target_continuations`.

The divergences take logits [..., vocab] of the target (p, no gradient) and the draft (q)
and return the mean over positions. Total variation is the one that speculative sampling
cares about directly: a draft token is accepted with probability sum_x min(p, q) = 1 - TV(p, q).
"""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.nn.functional as F

from model import call as calls
from model.training import random_batch


def forward_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q): mass-covering; the usual distillation loss."""
    log_p, log_q = F.log_softmax(p_logits.float(), -1), F.log_softmax(q_logits.float(), -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()


def reverse_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(q || p): mode-seeking."""
    log_p, log_q = F.log_softmax(p_logits.float(), -1), F.log_softmax(q_logits.float(), -1)
    return (log_q.exp() * (log_q - log_p)).sum(-1).mean()


def jsd(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence: the mean KL of p and q to their midpoint m = (p + q) / 2."""
    p, q = F.softmax(p_logits.float(), -1), F.softmax(q_logits.float(), -1)
    log_m = torch.log((p + q) / 2 + 1e-30)
    kl_pm = (p * (torch.log(p + 1e-30) - log_m)).sum(-1)
    kl_qm = (q * (torch.log(q + 1e-30) - log_m)).sum(-1)
    return (0.5 * (kl_pm + kl_qm)).mean()


def total_variation(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """TV(p, q) = 1/2 sum |p - q| = 1 - (expected acceptance of a draft token)."""
    p, q = F.softmax(p_logits.float(), -1), F.softmax(q_logits.float(), -1)
    return (0.5 * (p - q).abs().sum(-1)).mean()


DIVERGENCES = {"fkl": forward_kl, "rkl": reverse_kl, "jsd": jsd, "tv": total_variation}


def divergence(name: str, p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    if name not in DIVERGENCES:
        raise ValueError(f"unknown divergence {name!r}; choose one of {', '.join(DIVERGENCES)}")
    return DIVERGENCES[name](p_logits, q_logits)


def distill_loss(
    name: str,
    target: Any,
    draft: Any,
    sequences: torch.Tensor,
    prompt_tokens: int,
    bf16: bool = False,
) -> torch.Tensor:
    """The divergence ``name`` between the target's and the draft's next-token distributions
    over the generated part of ``sequences`` [B, T] (after their ``prompt_tokens``-token prompts);
    the target's side has no gradient (``bf16``: its forward under bfloat16 autocast)."""
    with torch.no_grad(), torch.autocast(sequences.device.type, dtype=torch.bfloat16, enabled=bf16):
        target_logits = target(sequences)[:, prompt_tokens - 1 : -1]
    return divergence(name, target_logits, draft(sequences)[:, prompt_tokens - 1 : -1])


@torch.no_grad()
def sample_sequences(
    model: Any, prompts: list[list[int]], length: int, gen: torch.Generator, greedy: bool = False
) -> torch.Tensor:
    """Prompts [B, P] of one length and ``length`` tokens ``model`` writes after each, sampled
    at temperature 1 with ``gen`` (or greedy): [B, P + length]. DistillSpec's on-policy data
    when ``model`` is the draft."""
    tokens = torch.tensor(prompts)
    model.setup_cache(len(prompts), tokens.shape[1] + length)
    logits = model(tokens, calls.chain(0, tokens.shape[1], tokens.device, rows=len(prompts)))[:, -1]
    pos = tokens.shape[1]
    out = [tokens]
    for _ in range(length):
        if greedy:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            nxt = torch.multinomial(F.softmax(logits.float(), -1), 1, generator=gen)
        out.append(nxt)
        logits = model(nxt, calls.chain(pos, 1, nxt.device, rows=len(prompts)))[:, -1]
        pos += 1
    return torch.cat(out, dim=1)


def target_continuations(
    target: Any, openings: list[list[int]], count: int, length: int, seed: int
) -> torch.Tensor:
    """``count`` sequences [count, P + length]: story openings (drawn with ``seed``) and the
    ``length`` tokens the target writes after each, in chunks of 64 sequences, greedy and
    sampled at temperature 1 in turn (as it will decode). What EAGLE-3, PARD and P-EAGLE heads
    train on: the target's own text, not the corpus's."""
    rng = random.Random(seed)  # the openings
    gen = torch.Generator().manual_seed(seed + 1)  # the sampled tokens
    chunk = 64
    chunks = []
    with torch.inference_mode():
        for start in range(0, count, chunk):
            prompts = [rng.choice(openings) for _ in range(min(chunk, count - start))]
            greedy = (start // chunk) % 2 == 0  # greedy and sampled chunks in turn
            chunks.append(sample_sequences(target, prompts, length, gen, greedy=greedy))
    return torch.cat(chunks)


def on_policy_batch(
    draft: Any,
    target: Any,
    openings: list[list[int]],
    rng: random.Random,
    gen: torch.Generator,
    batch: int,
    length: int,
    target_mix: float,
) -> torch.Tensor:
    """DistillSpec's on-policy data: ``batch`` story openings drawn with ``rng`` and ``length``
    tokens the draft itself writes after each (sampled with ``gen``); with probability
    ``target_mix`` the target writes them instead. The draft is left in training mode."""
    prompts = rng.sample(openings, batch)
    writer = target if rng.random() < target_mix else draft
    draft.eval()
    sequences = sample_sequences(writer, prompts, length, gen)
    draft.train()
    return sequences


def eagle_batch(
    target: Any,
    openings: list[list[int]],
    corpus: Any,
    rng: random.Random,
    gen: torch.Generator,
    batch: int,
    seq_len: int,
    self_mix: float,
) -> tuple[torch.Tensor, bool]:
    """EAGLE's data, ``batch`` sequences of ``seq_len`` tokens: with probability ``self_mix`` text the
    target writes itself after story openings (half of it greedy, half sampled at temperature 1:
    as it will decode), else windows of the token stream ``corpus``. Returns them, and whether
    the target wrote them."""
    kind = rng.random()
    if kind < self_mix:
        prompts = rng.sample(openings, batch)
        greedy = kind < self_mix / 2
        written = sample_sequences(target, prompts, seq_len - len(prompts[0]), gen, greedy=greedy)
        return written, True
    return random_batch(corpus, batch, seq_len, gen)[0], False


def eagle_losses(
    head: Any,
    target: Any,
    tokens: torch.Tensor,
    noise: float,
    gen: torch.Generator,
    bf16: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE's two losses on a batch of sequences [B, T] (Li et al. 2024, section 4.2).

    The frozen target gives its features f_0..f_{T-1} (what its output head reads). The head
    reads (f_j + noise, e(x_{j+1})) for j < T-1 and predicts f_{j+1}: a smooth-L1 regression
    on the features, and a cross-entropy of the target's output head applied to the
    prediction against the target's own next-token distribution softmax(head(f_{j+1})).
    The uniform noise on the input features (half-width ``noise``, drawn with ``gen``) stands
    in for the errors of the head's own predictions, which it reads back while drafting.
    ``bf16``: the target's forward under bfloat16 autocast.
    """
    with torch.no_grad(), torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=bf16):
        _, feats = target(tokens, return_hidden=True)
    feats = feats.float()
    with torch.no_grad():
        wanted = F.softmax(target.lm_head(feats[:, 1:]).float(), dim=-1)
        embeddings = target.embed_tokens(tokens[:, 1:])
        jitter = (torch.rand(feats[:, :-1].shape, generator=gen) * 2 - 1) * noise
    predicted = head(feats[:, :-1] + jitter, embeddings)
    regression = F.smooth_l1_loss(predicted, feats[:, 1:])
    log_q = F.log_softmax(target.lm_head(predicted).float(), dim=-1)
    classification = -(wanted * log_q).sum(-1).mean()
    return regression, classification
