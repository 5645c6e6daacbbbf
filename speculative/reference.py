"""Algorithm 1 of Leviathan, Kalman & Matias (2023) alone: speculative sampling, for reading.

A draft model M_q proposes a chain of gamma tokens, the target M_p scores them in one call,
and token-wise verification keeps a prefix and adds one token of the target's own. Nothing
else: no statistics, trees, batches, compilation, EOS handling or callbacks (the engine,
speculative.engine, has those). Line numbers are those of Algorithm 1 as written out in
docs/algorithm.md; tests/speculative/test_reference.py proves this function exact by enumerating every
random choice it makes.

Both models are used through ``setup_cache(1, n)``, their cached call ``model(tokens [1, T],
call) -> logits [1, T, V]`` with ``call = chain(start, T, device)``, and ``config``. Rolling a
KV cache back is writing at an earlier slot (docs/kv_cache.md): for each model we only keep
``next``, its first slot not holding a token of the accepted sequence, and its next call
starts there. The draft never reads its own last proposal x_g, so after an iteration from
length L to L' its next slot is min(L + g - 1, L' - 1); the target's is L' - 1.

Temperature 0 (greedy) needs no branch: warp gives one-hot p and q, sample returns their
argmax, p(x)/q(x) is 1 or 0, and the residual is one-hot on the target's argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from model.call import chain
from speculative.inputs import check_pair, check_prompt, model_device
from speculative.sampling import Sampling, make_generator, sample, warp


def check_arguments(target: Any, draft: Any, max_new_tokens: int, gamma: int) -> None:
    """ValueError for arguments the loop below cannot run with (the prompt: check_prompt)."""
    for name, value, least in (("gamma", gamma, 1), ("max_new_tokens", max_new_tokens, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    if draft is target:  # one object would hold one KV cache for two sequences of calls
        raise ValueError("draft and target are the same object; pass a copy as the draft")
    check_pair(target, draft)  # one vocabulary, so that p - q compares the same tokens


def call(model: Any, context: list[int], start: int, device: torch.device) -> torch.Tensor:
    """Logits [T, V] of ``model`` on context[start:], written at cache slots start.. (the slots
    before start hold context[:start] already)."""
    tokens = torch.tensor([context[start:]], device=device)
    return model(tokens, chain(start, len(context) - start, device))[0]


@torch.inference_mode()
def speculative_decode(
    target: Any,
    draft: Any,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    gamma: int = 4,
    temperature: float = 1.0,
    seed: int | None = None,
) -> list[int]:
    """max_new_tokens new tokens after prompt_ids (fewer if the sequence reaches the smaller
    max_seq_len), distributed exactly as sampling from the target at ``temperature`` (0:
    greedy), the draft proposing up to gamma tokens per target call. Returns only the new tokens."""
    check_arguments(target, draft, max_new_tokens, gamma)
    limit = min(target.config.max_seq_len, draft.config.max_seq_len)
    prompt = check_prompt(prompt_ids, target.config.vocab_size, limit)
    sampling, device = Sampling(temperature), model_device(target)
    generator = make_generator(device, seed)  # every random draw comes from this one generator
    end = min(limit, len(prompt) + max_new_tokens)  # the longest the sequence may grow
    target.setup_cache(1, end)
    draft.setup_cache(1, end)
    # The loop is kept out of the formatter: its labels, the paper's line numbers, stay in one column.
    # fmt: off
    seq, target_next, draft_next = list(prompt), 0, 0  # prefix + output; each cache's first free slot
    while len(seq) < end:
        g = min(gamma, end - len(seq) - 1)  # an iteration emits up to g + 1 tokens: never past `end`
        xs, q = [], []
        for _ in range(g):                                                  # 1-3: x_1..x_g, one draft call each
            logits = call(draft, seq + xs, draft_next, device)[-1]         # 2: M_q(prefix + x_1..x_{i-1})
            draft_next = len(seq) + len(xs)                                 #    which its cache now holds
            q.append(warp(logits, sampling))                                # 2: q_i
            xs.append(int(sample(q[-1], generator)))                        # 3: x_i ~ q_i
        logits = call(target, seq + xs, target_next, device)[-(g + 1):]     # 4: ONE target call
        p = warp(logits, sampling)                                          # 4: p_1..p_{g+1}
        r = torch.rand(g, generator=generator, device=device, dtype=torch.float64)  # 5: r_i ~ U[0, 1)
        n = 0                                                               # 6: n = how many x_i lead with
        while n < g and r[n] < p[n][xs[n]] / q[n][xs[n]]:                  # 6: r_i < p_i(x_i) / q_i(x_i) (strict)
            n += 1
        p_prime = p[n]                                                      # 7-8: all kept: the bonus p_{g+1};
        if n < g:                                                           # 7-8: else the residual norm(max(0, p - q))
            residual = (p[n] - q[n]).clamp(min=0)
            p_prime = residual / residual.sum() if residual.sum() > 0 else p[n]  # mass 0: p = q up to rounding
        t = int(sample(p_prime, generator))                                 # 9: t ~ p'
        seq += xs[:n] + [t]                                                 # 10: prefix + x_1..x_n, t
        # Roll back: the newest token t is in neither cache; the draft never read x_g either.
        target_next, draft_next = len(seq) - 1, min(draft_next, len(seq) - 1)
    return seq[len(prompt):]
    # fmt: on
