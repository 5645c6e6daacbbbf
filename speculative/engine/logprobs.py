"""The target's log-probabilities of what a row emits, and of its prompt (echo), read from the logits
the engine already has: the verification call computes the target's law at every position it
scores, so position j's logits are the law of the j-th token a row emits (the accepted prefix
before it is the sequence that position read), exact under speculation, with no call of its own.
OpenAI's ``logprobs`` (and ``echo``) are served from these records (speculative/serving)."""

from __future__ import annotations

import math

import torch

from speculative.engine.rows import Logprob, Row
from speculative.inputs import NonFiniteLogitsError, read_host


def record_logprobs(
    rows: list[Row], emitted: list[list[int]], wanted: list[int], logits: torch.Tensor
) -> None:
    """Each asking row's emitted tokens' log-probabilities under the target's own distribution at
    temperature 1, before any warping, and its top ones: the verification call's logits, row b's
    g_b + 1 positions one after another, position j being the target's law of the j-th token it
    emits (the accepted prefix before it is the sequence that position read). One host read."""
    starts = [sum(wanted[:b]) for b in range(len(rows))]
    asking = [
        b
        for b, row in enumerate(rows)
        if row.logprobs is not None and emitted[b] and row.error is None
    ]
    if not asking:
        return
    at = [starts[b] + j for b in asking for j in range(len(emitted[b]))]
    records = token_logprobs(
        logits[torch.tensor(at, device=logits.device)],
        [t for b in asking for t in emitted[b]],
        [rows[b].logprobs for b in asking for _ in emitted[b]],
    )
    for b in asking:
        rows[b].logprob_record.extend(records[: len(emitted[b])])
        records = records[len(emitted[b]) :]


def record_prompts(rows: list[Row], starts: list[int], logits: torch.Tensor) -> None:
    """The prompt's log-probabilities of each row that asks for them (echo) and is read from
    its start in this call: column i of its logits is the target's law of its token i + 1
    (every row's tokens begin at column 0, see Engine.score). The first token has none. A row
    whose prompt logits are not finite fails alone."""
    asking = [
        b
        for b, (row, start) in enumerate(zip(rows, starts))
        if row.echo and start == 0 and len(row.prompt) > 1
    ]
    for b, row in enumerate(rows):
        if row.echo and starts[b] == 0:
            row.prompt_record = [None]
    if not asking:
        return
    laws = torch.cat([logits[b, : len(rows[b].prompt) - 1] for b in asking])
    records = token_logprobs(
        laws,
        [t for b in asking for t in rows[b].prompt[1:]],
        [rows[b].logprobs or 0 for b in asking for _ in rows[b].prompt[1:]],
    )
    for b in asking:
        n = len(rows[b].prompt) - 1
        # finite logits give a finite log p
        if not all(math.isfinite(value) for value, _ in records[:n]):
            rows[b].error = NonFiniteLogitsError()
        rows[b].prompt_record += records[:n]
        records = records[n:]


def token_logprobs(logits: torch.Tensor, tokens: list[int], tops: list[int]) -> list[Logprob]:
    """For each row of ``logits`` [N, V]: the log-probability of ``tokens[i]`` under its softmax
    (temperature 1, no warping) and its ``tops[i]`` most likely (id, log p). One host read."""
    logp = torch.log_softmax(
        logits if logits.dtype in (torch.float32, torch.float64) else logits.float(), dim=-1
    )
    chosen = torch.tensor(tokens, device=logits.device)
    k = min(max(tops), logp.shape[-1])
    top = logp.topk(k, dim=-1) if k else None
    host = read_host(
        [logp.gather(1, chosen[:, None])[:, 0]] + ([top.values, top.indices] if top else [])
    )
    out = []
    for i, n in enumerate(tops):
        best = (
            []
            if top is None
            else [
                (int(t), v) for t, v in zip(host[2][i * k : i * k + n], host[1][i * k : i * k + n])
            ]
        )
        out.append((host[0][i], best))
    return out
