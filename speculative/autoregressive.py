"""The baseline: plain autoregressive decoding with the target alone, one target call per token.

This is what speculative decoding is measured against, so it is kept as lean as the
speculative loop: one forward per token through the KV cache, the same warping and the
same sampling, and no device-to-host copy per token unless the caller needs to see each
token as it comes (an EOS id to stop at, or a callback).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from speculative import calls
from speculative.inputs import (
    NonFiniteLogitsError,
    check_max_new_tokens,
    check_prompt,
    check_seed,
    finite_flag,
    model_device,
    read_host,
    usable_logits,
)
from speculative.sampling import Sampling, make_generator, sample, warp
from speculative.stats import AutoregressiveStats, Clock, GenerationResult, stop_reason

Callback = Callable[[list[int], list[bool]], None]


def autoregressive_generate(model: Any, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int,
                            temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                            eos_id: int | None = None, seed: int | None = None,
                            callback: Callback | None = None) -> GenerationResult[AutoregressiveStats]:
    """Sample up to ``max_new_tokens`` tokens from ``model`` after ``prompt_ids``.

    Stops after max_new_tokens, after emitting eos_id, or when prompt + output reaches the
    model's max_seq_len (stats.stop_reason says which). ``callback(new_ids, from_draft)`` is
    called with each token (from_draft is always [False]). Returns the new token ids and
    AutoregressiveStats. Raises NonFiniteLogitsError if the model's logits are not finite:
    at once when tokens are seen one by one, else when the loop ends (no token is returned).
    """
    wall_start = time.perf_counter()
    sampling = Sampling(temperature, top_k, top_p)
    check_max_new_tokens(max_new_tokens)
    check_seed(seed)
    limit = model.config.max_seq_len
    prompt = check_prompt(prompt_ids, model.config.vocab_size, limit)
    steps = min(max_new_tokens, limit - len(prompt))
    stats = AutoregressiveStats()
    tokens: list[int] = []
    with torch.inference_mode():
        model.setup_cache(1, min(limit, len(prompt) + max_new_tokens))
        device = model_device(model)
        generator = make_generator(device, seed)
        feed = torch.tensor([prompt], device=device)
        on_device: list[torch.Tensor] = []  # tokens not yet copied to the host
        per_token = eos_id is not None or callback is not None
        finite = torch.ones((), dtype=torch.bool, device=device)  # all logits so far, without a host read per token
        slot = 0
        clock = Clock(device)
        start = clock.mark()
        for _ in range(steps):
            logits = model(feed, calls.chain(slot, feed.shape[1], device))[0, -1]
            slot += feed.shape[1]
            # Greedy: sampling the one-hot warp would return the argmax, so take it directly
            # (as the speculative loop's draft does) and skip a dozen small operators a token.
            usable = finite_flag(logits)  # read later, or with the token: never sample NaN meanwhile
            token = logits.argmax() if sampling.greedy else sample(
                warp(usable_logits(logits, usable), sampling), generator)
            feed = token.view(1, 1)
            stats.target_calls += 1
            if stats.target_calls == 1:  # the prompt's forward: timed apart from decoding
                clock.add(stats, "first_call_s", start, clock.mark())
            if not per_token:
                finite &= usable  # as check_finite, without the host read
                on_device.append(token)
                continue
            ((value,),) = read_host([token.view(1)], usable)  # the check rides in the token's copy
            tokens.append(value)
            if callback is not None:
                callback([value], [False])
            if value == eos_id:
                break
        if not per_token and not bool(finite):  # per token, every copy checked its own
            raise NonFiniteLogitsError()
        if on_device:
            tokens = torch.stack(on_device).tolist()
        clock.add(stats, "target_time_s", start, clock.mark())
        clock.settle()
    stats.new_tokens = len(tokens)
    stats.stop_reason = stop_reason(tokens, eos_id, max_new_tokens)
    stats.wall_time_s = time.perf_counter() - wall_start
    return GenerationResult(tokens=tokens, stats=stats)
