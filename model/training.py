"""Training a LLaMA-shaped network: the initialisation, the learning-rate schedule, random
windows of a token stream, the held-out loss (and a run's held-out figures), and :func:`fit`, the optimisation loop that
every ``train.py`` command shares (pretraining, distilling a draft, training a feature head).

:func:`fit` knows nothing of what is trained: a ``batch_loss`` callable gives each step's
loss, and the run folder it is given (weights.runs.RunFolder) keeps the log, the
resumable state and the loss plot. Progress bars need tqdm (the ``train`` extra).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from model.config import ConfigError, ModelConfig
from model.model import Llama


def init_weights(model: nn.Module, n_layers: int) -> None:
    """GPT-2-style initialisation: matrices N(0, 0.02), the residual outputs (o_proj, down_proj)
    scaled down by sqrt(2 n_layers), biases zero; the norms' weights are left as they are."""
    for name, p in model.named_parameters():
        if p.dim() == 2:
            residual = name.endswith(("o_proj.weight", "down_proj.weight"))
            torch.nn.init.normal_(
                p, mean=0.0, std=0.02 / math.sqrt(2 * n_layers) if residual else 0.02
            )
        elif name.rsplit(".", 1)[-1] == "bias":
            torch.nn.init.zeros_(p)


def fresh_draft(
    target: nn.Module, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, hidden_dim: int
) -> Llama:
    """A small LLaMA of ``target``'s vocabulary, context and special ids, to be distilled toward it.
    Its tied embedding starts as the target's projected on their ``dim`` principal directions: the
    geometry the target gives its ids, which a draft trained on a few million tokens could not
    learn for 49,152 of them; everything else starts as :func:`init_weights` starts it."""
    config = ModelConfig(
        **{
            **vars(target.config),
            "dim": dim,
            "n_layers": n_layers,
            "n_heads": n_heads,
            "n_kv_heads": n_kv_heads,
            "hidden_dim": hidden_dim,
            "head_dim": None,
            "tie_word_embeddings": True,
            "extra": {},
            "unclassified": (),
        }
    )
    if dim > target.config.dim:
        raise ConfigError(
            f"a draft wider than its target ({dim} > {target.config.dim}) has no projection to start "
            "from"
        )
    init_weights(draft := Llama(config), n_layers)
    with torch.no_grad():
        table = target.embed_tokens.weight.float()
        sample = torch.randperm(len(table), generator=torch.Generator().manual_seed(0))[
            :16384
        ]  # the same directions
        _, _, directions = torch.linalg.svd(table[sample] - table.mean(0), full_matrices=False)
        draft.embed_tokens.weight.copy_(table @ directions[:dim].T)
    return draft


def lr_at(step: int, peak: float, warmup: int, steps: int) -> float:
    """Linear warmup to ``peak`` over ``warmup`` steps, then cosine decay to 10% of it at ``steps``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def random_batch(
    data: np.ndarray, batch: int, seq_len: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` windows of ``seq_len + 1`` tokens at random starts in ``data``: inputs [B, T]
    and next-token targets [B, T]."""
    starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen).tolist()
    chunk = torch.stack(
        [torch.from_numpy(data[s : s + seq_len + 1].astype(np.int64)) for s in starts]
    )
    return chunk[:, :-1], chunk[:, 1:]


def next_token_loss(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, bf16: bool = False
) -> torch.Tensor:
    """Mean cross-entropy of ``model(x)`` against ``y``; ``bf16``: the forward under bfloat16
    autocast (float32 master weights, about twice the throughput where the CPU has bfloat16
    instructions)."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


@torch.no_grad()
def evaluate(
    model: nn.Module, data: np.ndarray, seq_len: int, batches: int = 8, batch: int = 8
) -> float:
    """Mean cross-entropy on ``batches`` x ``batch`` held-out windows drawn from one fixed seed:
    the same windows at every call, and the first ones of a call with more batches."""
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    losses = [
        next_token_loss(model, *random_batch(data, batch, seq_len, gen)).item()
        for _ in range(batches)
    ]
    model.train()
    return sum(losses) / len(losses)


# Held-out loss: log.jsonl's eval_loss, every --eval-every steps, averages LOG_EVAL_BATCHES
# batches of EVAL_BATCH windows; summary.json's held_out_loss, once at the end, averages
# FINAL_EVAL_BATCHES. The windows are drawn from one fixed seed, so the log's are the first
# of the summary's, and both files name how many they average.
EVAL_BATCH = 8
LOG_EVAL_BATCHES = 8
FINAL_EVAL_BATCHES = 32


def held_out(
    model: nn.Module, data: np.ndarray, seq_len: int, final: bool = False
) -> dict[str, Any]:
    """The held-out figures of a run: a log row's (eval_loss over LOG_EVAL_BATCHES batches, and
    how many windows that is), or ``final``: the summary's, over FINAL_EVAL_BATCHES, with its
    perplexity and a note on how the two relate."""
    if not final:
        return {
            "eval_loss": evaluate(model, data, seq_len, LOG_EVAL_BATCHES, EVAL_BATCH),
            "eval_windows": LOG_EVAL_BATCHES * EVAL_BATCH,
        }
    loss = evaluate(model, data, seq_len, FINAL_EVAL_BATCHES, EVAL_BATCH)
    windows = FINAL_EVAL_BATCHES * EVAL_BATCH
    return {
        "held_out_loss": loss,
        "held_out_windows": windows,
        "held_out_perplexity": math.exp(loss),
        "note": f"held_out_loss averages {windows} fixed held-out windows of --seq-len tokens; log.jsonl's "
        f"eval_loss averages the first {LOG_EVAL_BATCHES * EVAL_BATCH} of them (eval_windows), so at the "
        "same step the two differ a little",
    }


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's parameter groups: the matrices decay by ``weight_decay``; the norms and biases do not."""
    return [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]


def progress_fields(row: dict[str, Any]) -> dict[str, str]:
    """The progress bar's fields of a logged row: the loss (EAGLE's two, where logged), the alpha
    of the first and last draft position (where logged by depth), tokens/s."""
    shown = (
        {"reg": f"{row['regression']:.4f}", "cls": f"{row['classification']:.3f}"}
        if "regression" in row
        else {"loss": f"{row['loss']:.3f}"}
    )
    if "alpha_by_depth" in row:
        shown.update(
            a1=f"{row['alpha_by_depth'][0]:.2f}", a_last=f"{row['alpha_by_depth'][-1]:.2f}"
        )
    return {**shown, "tok_s": f"{row['tokens_per_s']:.0f}"}


def fit(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    gen: torch.Generator,
    run: Any,
    *,
    start: int,
    steps: int,
    lr: float,
    warmup: int,
    batch_loss: Callable[[int], tuple[torch.Tensor, dict[str, Any], int]],
    save_every: int,
    title: str,
    desc: str,
    progress: bool = True,
    after: Callable[[int], dict[str, Any]] | None = None,
    show: Callable[[dict[str, Any]], dict[str, str]] | None = None,
    rng: random.Random | None = None,
) -> int:
    """Optimise ``model`` from step ``start`` to ``steps``; returns the last step.

    Each step sets the learning rate (:func:`lr_at`), calls ``batch_loss(step)`` for (loss,
    extra log fields, tokens read), steps AdamW with gradients clipped to norm 1, and logs
    ``{"step", "loss", **extra, "tokens_per_s", **after(step)}`` to ``run`` (``after``: e.g. a
    held-out loss at some steps). Every ``save_every`` steps and at the end, ``run`` saves the
    resumable state (model, optimizer, and the generators ``batch_loss`` draws from: ``gen`` and
    ``rng``, so that a resumed run draws the batches an uninterrupted one would) and plots the
    losses under ``title``. ``desc`` and ``show`` (a row's fields for the bar, :func:`progress_fields`
    unless given) label the progress bar."""
    from tqdm import tqdm  # the train extra: imported by training only

    bar = tqdm(total=steps, initial=start, desc=desc, dynamic_ncols=True, disable=not progress)
    step = start
    while step < steps:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, lr, warmup, steps)
        begin = time.perf_counter()
        loss, extra, tokens = batch_loss(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        row = {
            "step": step,
            "loss": loss.item(),
            **extra,
            "tokens_per_s": tokens / (time.perf_counter() - begin),
        }
        row.update(after(step) if after is not None else {})
        run.log(row)
        bar.set_postfix((show or progress_fields)(row))
        bar.update(1)
        if step % save_every == 0 or step == steps:
            run.save_state(step, model, optimizer, gen, rng)
            run.plot(title)
    bar.close()
    return step
