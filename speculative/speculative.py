"""The loop of Algorithm 1 (Leviathan, Kalman & Matias 2023; "speculative sampling" in
Chen et al. 2023): draft gamma tokens, verify them with one target call, keep a prefix,
add one token of the target's own, repeat. Line numbers refer to Algorithm 1 as written
out in docs/algorithm.md.

One iteration, with L tokens in the sequence so far (prompt + output):

1. Draft (lines 1-3, :func:`draft_tokens`): gamma one-token draft calls give q_1..q_gamma
   and x_i ~ q_i.
2. Target (line 4): ONE call on [last token, x_1..x_gamma] gives p_1..p_{gamma+1}.
3. Verify (lines 5-9, :func:`speculative.verify.verify_step`): keep x_1..x_n, then one
   token t from the residual at the first rejection, or the bonus token from p_{gamma+1}.
   At temperature 0 p and q are one-hot, and :func:`speculative.verify.verify_greedy`
   computes the same outcome by comparing argmaxes.
4. Emit x_1..x_n, t (line 10), and roll back with the models' start_pos convention
   (docs/kv_cache.md): a call at start_pos s overwrites the cache from s on, so each model
   only needs to remember the next slot to feed. With L' = L + n + 1 the new length:
   * target: everything before the newest token is in its cache: next slot L' - 1;
   * draft: it was fed the last token and x_1..x_{gamma-1}, never its own last proposal
     x_gamma: next slot min(L + gamma - 1, L' - 1). When all gamma were accepted, its next
     call therefore feeds [x_gamma, t] together.

The only things used of a model are ``model(tokens, start_pos=...)`` (LongTensor [1, T]
-> logits [1, T, V]), ``model.setup_cache(max_batch_size, max_seq_len)`` and
``model.config.vocab_size`` / ``model.config.max_seq_len``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from speculative.gamma import AutoGamma
from speculative.inputs import check_gamma, check_max_new_tokens, check_prompt, check_seed, model_device
from speculative.pair import check_pair
from speculative.sampling import Sampling, make_generator, sample, warp
from speculative.stats import GenerationResult, SpeculativeStats, clock
from speculative.verify import verify_greedy, verify_step

Callback = Callable[[list[int], list[bool]], None]


def draft_tokens(draft: Any, context: torch.Tensor, start_pos: int, gamma: int, sampling: Sampling,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Algorithm 1, lines 1-3: for i = 1..gamma, q_i = M_q(prefix + x_1..x_{i-1}) and x_i ~ q_i.

    context: [1, T] tokens the draft has not seen yet (T >= 1: the prompt on the first
    iteration, then the sequence's last token or two), placed at start_pos.
    Returns the drafted tokens [gamma] and their distributions q [gamma, V]. x_gamma is
    never fed to the draft here.

    Greedy (temperature 0) takes a shortcut with the same result: q_i is one-hot on the
    argmax and sampling it returns the argmax, so x_i is the argmax. q is then None: it is
    one-hot on the drafted tokens, and verify_greedy needs only the tokens. A draft step of
    a small model costs about as much as the operators it runs, and warping and sampling
    each row would add a dozen.
    """
    tokens, probs = [], []
    for _ in range(gamma):
        logits = draft(context, start_pos=start_pos)[0, -1]
        start_pos += context.shape[1]
        if sampling.greedy:
            x_i = logits.argmax()
        else:
            q_i = warp(logits, sampling)
            x_i = sample(q_i, generator)
            probs.append(q_i)
        tokens.append(x_i)
        context = x_i.view(1, 1)
    return torch.stack(tokens), None if sampling.greedy else torch.stack(probs)


def speculative_generate(target: Any, draft: Any, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int,
                         gamma: int | str = 4, temperature: float = 1.0, top_k: int | None = None,
                         top_p: float | None = None, eos_id: int | None = None, seed: int | None = None,
                         callback: Callback | None = None) -> GenerationResult[SpeculativeStats]:
    """Sample from ``target`` after ``prompt_ids``, with ``draft`` proposing ``gamma`` tokens
    per target call (an int >= 1, or "auto"). The output has exactly the distribution of
    autoregressive_generate(target, ...) with the same settings; temperature 0 is greedy.

    Stops after max_new_tokens (never more), after emitting eos_id (even in the middle of an
    accepted block: nothing after it is emitted) or when prompt + output reaches the smaller
    max_seq_len of the two models (gamma shrinks near every limit). ``callback(new_ids,
    from_draft)`` sees each iteration's tokens: accepted draft tokens (True), then the
    target's own (False). Returns the new token ids and SpeculativeStats.
    """
    wall_start = time.perf_counter()
    check_pair(target, draft)
    if draft is target:
        raise ValueError("draft and target are the same object and would share one KV cache; "
                         "pass a copy (copy.deepcopy(model)) as the draft")
    sampling = Sampling(temperature, top_k, top_p)
    gamma_max = check_gamma(gamma)
    if gamma != "auto":
        gamma = gamma_max  # a plain int
    check_max_new_tokens(max_new_tokens)
    check_seed(seed)
    limit = min(target.config.max_seq_len, draft.config.max_seq_len)
    prompt = check_prompt(prompt_ids, target.config.vocab_size, limit)

    stats = SpeculativeStats(gamma_setting=gamma, accepted_per_position=[0] * gamma_max,
                             tried_per_position=[0] * gamma_max)
    auto = AutoGamma(gamma_max=gamma_max) if gamma == "auto" else None
    out: list[int] = []
    with torch.inference_mode():
        cache_len = min(limit, len(prompt) + max_new_tokens + gamma_max + 1)
        target.setup_cache(1, cache_len)
        draft.setup_cache(1, cache_len)
        device = model_device(target)
        generator = make_generator(device, seed)
        seq = torch.empty(1, cache_len, dtype=torch.long, device=device)  # prompt + output
        seq[0, :len(prompt)] = torch.tensor(prompt, device=device)
        length = len(prompt)  # L: tokens in seq
        target_next = draft_next = 0  # each model's first cache slot not holding a token of seq
        no_draft = torch.empty(0, dtype=torch.long, device=device)
        decode_start = clock(device)
        while len(out) < max_new_tokens and length < limit:
            # Never emit past max_new_tokens or max_seq_len: an iteration emits up to gamma + 1.
            g = min(auto.gamma if auto else gamma, max_new_tokens - len(out) - 1, limit - length - 1)

            t0 = clock(device)
            if g > 0:  # lines 1-3
                drafted, q = draft_tokens(draft, seq[:, draft_next:length], draft_next, g, sampling, generator)
                draft_next = length + g - 1
            else:  # only at the very end: the target's own token is the last one
                drafted = no_draft
            t1 = clock(device)
            # line 4: one target call over the g+1 positions L-1 .. L+g-1
            feed = torch.cat([seq[:, target_next:length], drafted.view(1, -1)], dim=1)
            logits = target(feed, start_pos=target_next)[0, -(g + 1):]
            t2 = clock(device)
            if sampling.greedy:  # lines 5-9 with one-hot p and q: a comparison of argmaxes
                step = verify_greedy(logits.argmax(-1), drafted)
            else:  # lines 5-9
                p = warp(logits, sampling)
                step = verify_step(p, q if g > 0 else p[:0], drafted, generator)  # g = 0: t from p_1 alone
            stats.record(g, step.accepted, step.overlap)
            stats.draft_time_s += t1 - t0
            stats.target_time_s += t2 - t1
            if auto is not None:  # the first iteration's times include the prompt
                timed = g > 0 and stats.target_calls > 1
                auto.update(step.overlap[:min(step.accepted + 1, g)],
                            (t1 - t0) / g if timed else None, t2 - t1 if timed else None)

            emitted = step.tokens  # line 10: x_1..x_n, t
            if eos_id is not None and eos_id in emitted:
                emitted = emitted[:emitted.index(eos_id) + 1]
            seq[0, length:length + len(emitted)] = torch.tensor(emitted, device=device)
            length += len(emitted)
            out.extend(emitted)
            # Roll back: both caches are valid up to, not including, the newest token.
            target_next = length - 1
            draft_next = min(draft_next, length - 1)
            if stats.target_calls == 1:  # this iteration also read the prompt: timed apart
                stats.first_iteration_s = clock(device) - decode_start
                stats.first_iteration_tokens = len(emitted)
            if callback is not None:
                callback(emitted, [i < step.accepted for i in range(len(emitted))])
            if emitted[-1] == eos_id:
                break
        stats.decode_time_s = clock(device) - decode_start
    stats.new_tokens = len(out)
    stats.wall_time_s = time.perf_counter() - wall_start
    return GenerationResult(tokens=out, stats=stats)
