"""The four generation functions, each a few lines over the one engine (speculative.engine):
speculative decoding and the target alone, for one prompt or a list of prompts."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from speculative.engine.engine import Callback, Engine, Row
from speculative.engine.gamma_policy import Guard
from speculative.engine.stats import (
    AutoregressiveStats,
    BatchResult,
    GenerationResult,
    SpeculativeStats,
)
from speculative.inputs import check_max_new_tokens


def speculative_generate(
    target: Any,
    draft: Any,
    prompt_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    gamma: int | str | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | Collection[int] | None = None,
    seed: int | None = None,
    callback: Callback | None = None,
    verify: str | None = None,
    tree: Sequence[int] | None = None,
    tree_mode: str = "without_replacement",
    guard: Guard | bool | tuple[float, ...] = False,
    context: int | None = None,
    stop: Callable[[], bool] | None = None,
) -> GenerationResult[SpeculativeStats]:
    """Sample from ``target`` after ``prompt_ids``, with ``draft`` proposing up to ``gamma``
    tokens per target call (an int >= 1, or "auto"; None: DEFAULT_GAMMA). ``draft`` is a model of the target's
    vocabulary (wrapped in speculative.draft.ModelDrafter) or any drafter. The output has
    exactly the distribution of autoregressive_generate(target, ...) with the same
    settings; temperature 0 is greedy.

    ``verify`` chooses lines 5-9: "token" (Algorithm 1, token by token) or "block" (Sun et
    al. 2025, speculative.verify.block: the block judged jointly, never fewer accepted tokens in
    expectation); None, the default of generate.py and serve.py too, is block for a chain and the
    tree's own walk for a tree (speculative.verify.default_rule). At temperature 0 both are the
    comparison of argmaxes (verify_greedy).

    ``tree``: draft a token tree of this branching per depth instead of a chain, e.g.
    (3, 2, 1, 1) (speculative.draft.trees), score all of its nodes in one target call
    with tree attention, and verify it by multi-draft rejection sampling (speculative.verify.tree);
    ``tree_mode`` says how children are drawn ("without_replacement", "iid" or
    "deterministic", the top-k; greedy decoding always takes the top-k). The tree's depth
    takes gamma's place (gamma must be left alone).

    ``guard`` (a speculative.engine.gamma_policy.Guard, or True for "timed" and the costs for
    "recorded"): plain target steps wherever this run's own timings say that speculating loses
    (speculative.engine.gamma.Switch; gamma="auto" always does so), or where recorded costs (plain
    seconds a token, seconds a speculating iteration[, more for the first after plain steps]) say
    so. The output's law is the same; with the timed guard a sampled output depends on the clock as
    well as the seed. Off by default: the library reads no clock and no file unless asked, while
    generate.py reads costs it recorded on this machine (speculative.cli.costs) and hands them here.

    Stops after max_new_tokens (never more), after emitting eos_id, or any of several ids (even in the middle of an
    accepted block: nothing after it is emitted) or when prompt + output reaches the smaller
    max_seq_len of the two models (gamma shrinks near every limit); stats.stop_reason says
    which. ``callback(new_ids, from_draft)`` sees each iteration's tokens: accepted draft
    tokens (True), then the target's own (False). Returns the new token ids and
    SpeculativeStats. Raises NonFiniteLogitsError if the target's logits are not finite.

    ``context``: the most tokens the sequence may hold, fewer than the models' max_seq_len (the KV
    caches are sized to it at most; stop_reason max_seq_len there). ``stop()``, asked after each
    iteration's callback, True ends the row there (generate.py's --stop: the text met a stop string;
    stop_reason "stop_string"): no token is generated after that iteration, whose tokens are all
    returned (the caller cuts its text where the string begins).
    """
    wall_start = time.perf_counter()
    engine = Engine(
        target,
        draft,
        gamma=gamma,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        verify=verify,
        tree=tree,
        tree_mode=tree_mode,
        guard=guard,
        context=context,
    )
    row = one_row(engine, prompt_ids, max_new_tokens, eos_id, seed, callback, stop)
    row.stats.wall_time_s = time.perf_counter() - wall_start
    return row.result()


def autoregressive_generate(
    model: Any,
    prompt_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | Collection[int] | None = None,
    seed: int | None = None,
    callback: Callback | None = None,
    context: int | None = None,
    stop: Callable[[], bool] | None = None,
) -> GenerationResult[AutoregressiveStats]:
    """The baseline: up to ``max_new_tokens`` tokens from ``model`` alone after ``prompt_ids``,
    one call per token, with the same warping and sampling as speculative decoding.

    Stops after max_new_tokens, after emitting eos_id (any of them, when several), or when prompt + output reaches the
    model's max_seq_len (stats.stop_reason says which). ``callback(new_ids, from_draft)`` is
    called with each token (from_draft is always [False]). Returns the new token ids and
    AutoregressiveStats. Raises NonFiniteLogitsError if the model's logits are not finite:
    at once when tokens are seen one by one (an EOS id or a callback), else when the loop
    ends (no token is returned): without them the tokens stay on the device until the end.
    ``context`` and ``stop``: as speculative_generate's.
    """
    wall_start = time.perf_counter()
    engine = Engine(model, None, temperature=temperature, top_k=top_k, top_p=top_p, context=context)
    row = one_row(engine, prompt_ids, max_new_tokens, eos_id, seed, callback, stop)
    row.stats.wall_time_s = time.perf_counter() - wall_start
    return GenerationResult(tokens=row.result().tokens, stats=AutoregressiveStats.of(row.stats))


def one_row(
    engine: Engine,
    prompt_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    eos_id: int | Collection[int] | None,
    seed: int | None,
    callback: Callback | None,
    stop: Callable[[], bool] | None,
) -> Row:
    """One prompt through ``engine`` to its end; a row that failed raises its error. A ``stop()``
    that says True cancels the row (Engine.cancel): it leaves at the end of the iteration it saw."""
    seen = callback
    if stop is not None:

        def seen(new_ids: list[int], from_draft: list[bool]) -> None:
            if callback is not None:
                callback(new_ids, from_draft)
            if stop():
                engine.cancel(row)

    row = engine.add(prompt_ids, max_new_tokens, eos_id=eos_id, seed=seed, callback=seen)
    engine.run()
    if row.error is not None:
        raise row.error
    if row.cancelled:
        row.stats.stop_reason = "stop_string"
    return row


def speculative_generate_batch(
    target: Any,
    draft: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    gamma: int | str | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | Collection[int] | None = None,
    seed: int | Sequence[int] | None = None,
    verify: str | None = None,
    batch_size: int | None = None,
    guard: Guard | bool = False,
    context: int | None = None,
) -> BatchResult:
    """speculative_generate for every prompt of ``prompts`` (token-id lists, any lengths), at
    most ``batch_size`` rows at a time (default: all), one target call per iteration for all
    rows, every row accepting its own number of tokens (ragged acceptance, as in vLLM,
    SGLang and BASS, Qian et al. 2024; docs/batching.md). Returns one GenerationResult per
    prompt, in order, and the batch's BatchStats.

    Each row's output has exactly the target's distribution, and row i's tokens are those of
    speculative_generate(target, draft, prompts[i], seed=seed + i, ...) (seed[i] for a list)
    up to the numerics policy (speculative.engine). Token trees are not batched. ``guard`` and
    ``context``: as speculative_generate's, for the whole batch."""
    return over_rows(
        target,
        draft,
        prompts,
        max_new_tokens,
        seed,
        batch_size,
        eos_id,
        context,
        SpeculativeStats,
        gamma=gamma,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        verify=verify,
        guard=guard,
    )


def autoregressive_generate_batch(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | Collection[int] | None = None,
    seed: int | Sequence[int] | None = None,
    batch_size: int | None = None,
    context: int | None = None,
) -> BatchResult:
    """autoregressive_generate for every prompt, one model call per token for all rows (each
    at its own position), at most ``batch_size`` rows at a time. Row i draws with seed + i,
    as autoregressive_generate(model, prompts[i], seed=seed + i) does alone. ``context``: as
    speculative_generate's."""
    return over_rows(
        model,
        None,
        prompts,
        max_new_tokens,
        seed,
        batch_size,
        eos_id,
        context,
        AutoregressiveStats,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
    )


def over_rows(
    target: Any,
    draft: Any,
    prompts: Any,
    max_new_tokens: int,
    seed: Any,
    batch_size: Any,
    eos_id: int | Collection[int] | None,
    context: int | None,
    kind: type,
    **settings: Any,
) -> BatchResult:
    """Every prompt through one engine, as rows; results in the prompts' order."""
    wall_start = time.perf_counter()
    prompts = check_prompts(prompts)
    check_max_new_tokens(max_new_tokens)
    seeds = row_seeds(seed, len(prompts))
    engine = Engine(
        target,
        draft,
        max_rows=check_batch_size(batch_size, len(prompts)),
        context=context,
        **settings,
    )
    rows = []
    for i, (prompt, row_seed) in enumerate(zip(prompts, seeds)):
        try:
            rows.append(engine.add(prompt, max_new_tokens, eos_id=eos_id, seed=row_seed))
        except ValueError as error:
            raise ValueError(f"prompt {i}: {error}") from None
    engine.run()
    for row in rows:
        if row.error is not None:
            raise row.error
    engine.stats.seed, engine.stats.wall_time_s = seed, time.perf_counter() - wall_start
    for row in rows:
        row.stats.wall_time_s = engine.stats.wall_time_s
    results = [row.result() for row in rows]
    if kind is AutoregressiveStats:
        results = [GenerationResult(r.tokens, AutoregressiveStats.of(r.stats)) for r in results]
    return BatchResult(results=results, stats=engine.stats)


def row_seeds(seed: int | Sequence[int] | None, count: int) -> list[int | None]:
    """seed + i for prompt i, a list as given, or None (fresh entropy) for every row."""
    if seed is None:
        return [None] * count
    if isinstance(seed, int) and not isinstance(seed, bool):
        return [seed + i for i in range(count)]
    seeds = list(seed) if isinstance(seed, Sequence) else None
    if (
        seeds is None
        or len(seeds) != count
        or any(isinstance(s, bool) or not isinstance(s, int) for s in seeds)
    ):
        raise ValueError(
            f"seed must be an integer, None, or a list of {count} integers (one per prompt), got {seed!r}"
        )
    return seeds


def check_prompts(prompts: Any) -> list[Any]:
    if (
        isinstance(prompts, torch.Tensor)
        or not isinstance(prompts, Sequence)
        or isinstance(prompts, str)
    ):
        raise ValueError("prompts must be a list of prompts, each a list of token ids")
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str) or not isinstance(prompt, (Sequence, torch.Tensor)):
            raise ValueError(f"prompt {i} must be a list of token ids, got {type(prompt).__name__}")
    return list(prompts)


def check_batch_size(batch_size: Any, count: int) -> int:
    if batch_size is None:
        return count
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    return min(batch_size, count)


# ----------------------------------------------------------------------------- a drafter's acceptance, measured
# What measure_acceptance's numbers mean, written next to them into a summary.json.
ACCEPTANCE_NOTES = {
    "alpha": "alpha_greedy, alpha_t1: the paper's alpha, the probability that the target accepts a drafted token "
    "(the mean of sum_x min(p, q) over the verified draft positions); the alpha of the cost model",
    "acceptance": "acceptance_greedy, acceptance_t1: accepted / drafted tokens; lower than alpha, because the "
    "tokens drafted after a rejection count as drafted but are never verified",
    "tau": "tau_greedy, tau_t1: new tokens per target call",
}


@torch.no_grad()
def measure_acceptance(
    target: Any, draft: Any, prompts: list[list[int]], new_tokens: int, gamma: int, seed: int
) -> dict[str, float]:
    """Acceptance of speculative decoding on the prompts, greedy and at temperature 1 (prompt
    i sampling with ``seed`` + i), as ACCEPTANCE_NOTES describes them.

    ``alpha_*`` is the paper's alpha: the mean over verified positions of sum_x min(p, q), the
    probability that a drafted token is accepted. ``acceptance_*`` is the empirical fraction of
    drafted tokens that were kept, which is lower because the tokens after a rejection count
    as drafted but never get their chance. ``tau_*`` is the number of tokens per target call.
    ``draft`` is a draft model or any drafter (speculative.draft).
    """
    result = {}
    for name, temperature in (("greedy", 0.0), ("t1", 1.0)):
        accepted = drafted = new = target_calls = 0
        alpha_sum = alpha_count = 0.0
        for i, prompt in enumerate(prompts):
            out = speculative_generate(
                target,
                draft,
                prompt,
                new_tokens,
                gamma=gamma,
                temperature=temperature,
                seed=seed + i,
            )
            accepted += out.stats.accepted_draft_tokens
            drafted += out.stats.drafted_tokens
            alpha_sum += out.stats.overlap_sum
            alpha_count += out.stats.verified_positions
            new += out.stats.new_tokens
            target_calls += out.stats.target_calls
        result[f"alpha_{name}"] = alpha_sum / max(1.0, alpha_count)
        result[f"acceptance_{name}"] = accepted / max(1, drafted)
        result[f"tau_{name}"] = new / max(1, target_calls)
    return result


# ----------------------------------------------------------------------------- what the target writes
@torch.no_grad()
def conversations(
    target: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_ids: Collection[int],
    seed: int,
    first: int = 0,
    rows: int = 32,
) -> list[list[int]]:
    """Each prompt followed by the target's answer to it (to its first stop id, kept, or
    ``max_new_tokens``), ``rows`` prompts at a time through the batched engine, greedy and at
    temperature 1 in turn, as it will decode. What a chat model's drafter trains on (train.py
    --data chat). ``first``: the position of ``prompts[0]`` in a longer list made in pieces: the
    groups of ``rows`` fall where they fall in the whole list, and item i samples with ``seed`` + i,
    so each prompt gets the answer it would get there, wherever a piece starts."""
    out: list[list[int]] = []
    at, end = first, first + len(prompts)
    while at < end:
        upto = min((at // rows + 1) * rows, end)  # to the end of item at's group in the whole list
        chunk = prompts[at - first : upto - first]
        result = autoregressive_generate_batch(
            target,
            chunk,
            max_new_tokens,
            eos_id=stop_ids,
            temperature=0.0 if (at // rows) % 2 == 0 else 1.0,
            seed=seed + at,
        )
        out += [[*prompt, *row.tokens] for prompt, row in zip(chunk, result.results)]
        at = upto
    return out
