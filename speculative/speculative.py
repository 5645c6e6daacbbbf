"""The loop of Algorithm 1 (Leviathan, Kalman & Matias 2023; "speculative sampling" in
Chen et al. 2023): draft gamma tokens, verify them with one target call, keep a prefix,
add one token of the target's own, repeat. Line numbers refer to Algorithm 1 as written
out in docs/algorithm.md.

One iteration, with L tokens in the sequence so far (prompt + output), has three seams:

1. Propose (lines 1-3): the drafter (speculative.drafter) gives up to gamma tokens x_i and
   the distributions q_i they were drawn from (None: one-hot, a deterministic drafter).
2. Verify (line 4, then lines 5-9): ONE target call on [last token, x_1..x_g] gives
   p_1..p_{g+1}; :func:`speculative.verify.verify_step` keeps x_1..x_n, then one token t
   from the residual at the first rejection, or the bonus token from p_{g+1}. At
   temperature 0 p and q are one-hot, and :func:`speculative.verify.verify_greedy`
   computes the same outcome by comparing argmaxes.
3. Commit (line 10): emit x_1..x_n, t, and let the drafter roll back. Rolling the target
   back is writing at an earlier slot (docs/kv_cache.md): a call overwrites the slots it
   is given before anything reads them, so with L' = L + n + 1 the new length everything
   before the newest token is in its cache, and its next call starts at slot L' - 1.

The only things used of the target are the model's one cached call, ``target(tokens, call)``
(LongTensor [1, T] -> logits [1, T, V], with ``call`` from speculative.calls; with
``return_hidden=True`` also its features, for a drafter that reads them),
``target.setup_cache(max_batch_size, max_seq_len)``, ``target.move_cache`` (a tree's
accepted path) and ``target.config.vocab_size`` / ``target.config.max_seq_len``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from speculative import block, calls
from speculative import tree as trees
from speculative import verify as rules
from speculative.drafter import Draft, as_drafter
from speculative.gamma import AutoGamma
from speculative.inputs import (
    check_gamma,
    check_max_new_tokens,
    check_prompt,
    check_seed,
    finite_flag,
    model_device,
    usable_logits,
)
from speculative.pair import check_pair
from speculative.sampling import Sampling, make_generator, warp
from speculative.stats import Clock, GenerationResult, SpeculativeStats, stop_reason
from speculative.tree import branching_parents
from speculative.tree_drafting import TREE_MODES, check_tree
from speculative.verify import Verdict, Verification

Callback = Callable[[list[int], list[bool]], None]
DEFAULT_GAMMA = 4
VERIFY_RULES = ("token", "block")  # lines 5-9 at temperature > 0: verify.verify_step, block.verify_block


def speculative_generate(target: Any, draft: Any, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int,
                         gamma: int | str = DEFAULT_GAMMA, temperature: float = 1.0, top_k: int | None = None,
                         top_p: float | None = None, eos_id: int | None = None, seed: int | None = None,
                         callback: Callback | None = None, verify: str = "token", tree: Sequence[int] | None = None,
                         tree_mode: str = "without_replacement") -> GenerationResult[SpeculativeStats]:
    """Sample from ``target`` after ``prompt_ids``, with ``draft`` proposing up to ``gamma``
    tokens per target call (an int >= 1, or "auto"). ``draft`` is a model of the target's
    vocabulary (wrapped in speculative.drafter.ModelDrafter) or any drafter. The output has
    exactly the distribution of autoregressive_generate(target, ...) with the same
    settings; temperature 0 is greedy.

    ``verify`` chooses lines 5-9: "token" (Algorithm 1, token by token) or "block" (Sun et
    al. 2025, speculative.block: the block judged jointly, never fewer accepted tokens in
    expectation). At temperature 0 both are the comparison of argmaxes (verify_greedy).

    ``tree``: draft a token tree of this branching per depth instead of a chain, e.g.
    (3, 2, 1, 1) (speculative.tree_drafting), score all of its nodes in one target call
    with tree attention, and verify it by multi-draft rejection sampling (speculative.tree);
    ``tree_mode`` says how children are drawn ("without_replacement", "iid" or
    "deterministic", the top-k; greedy decoding always takes the top-k). The tree's depth
    takes gamma's place (gamma must be left alone), and the target's call places the nodes
    (speculative.calls.tree) and its move_cache keeps the accepted path.

    Stops after max_new_tokens (never more), after emitting eos_id (even in the middle of an
    accepted block: nothing after it is emitted) or when prompt + output reaches the smaller
    max_seq_len of the two models (gamma shrinks near every limit); stats.stop_reason says
    which. ``callback(new_ids, from_draft)`` sees each iteration's tokens: accepted draft
    tokens (True), then the target's own (False). Returns the new token ids and
    SpeculativeStats. Raises NonFiniteLogitsError if the target's logits are not finite.
    """
    wall_start = time.perf_counter()
    drafter = drafter_for(target, draft)
    sampling = Sampling(temperature, top_k, top_p)
    if verify not in VERIFY_RULES:
        raise ValueError(f"verify must be one of {', '.join(map(repr, VERIFY_RULES))}, got {verify!r}")
    if tree is not None:
        tree, gamma = check_tree_request(tree, tree_mode, drafter, gamma, verify)
    gamma_max = check_gamma(gamma)
    if gamma != "auto":
        gamma = gamma_max  # a plain int
    check_max_new_tokens(max_new_tokens)
    check_seed(seed)
    limit = min(target.config.max_seq_len, drafter.max_seq_len or target.config.max_seq_len)
    prompt = check_prompt(prompt_ids, target.config.vocab_size, limit)
    slack = gamma_max if tree is None else len(branching_parents(tree))  # cache slots past the sequence
    if tree is not None and slack + 1 >= limit:
        raise ValueError(f"the tree {tuple(tree)} has {slack} nodes, which cannot fit in the {limit}-token context")

    stats = SpeculativeStats(gamma_setting=gamma, accepted_per_position=[0] * gamma_max,
                             tried_per_position=[0] * gamma_max)
    auto = AutoGamma(gamma_max=gamma_max) if gamma == "auto" else None
    ids = list(prompt)  # prompt + output, on the host
    with torch.inference_mode():
        cache_len = min(limit, len(prompt) + max_new_tokens + slack + 1)
        target.setup_cache(1, cache_len)
        drafter.start(cache_len, target)
        device = model_device(target)
        generator = make_generator(device, seed)
        seq = torch.empty(1, cache_len, dtype=torch.long, device=device)  # prompt + output, on the device
        seq[0, :len(prompt)] = torch.tensor(prompt, device=device)
        target_next = 0  # the target's first cache slot not holding a token of seq
        clock = Clock(device)
        decode_start = clock.mark()
        while len(ids) - len(prompt) < max_new_tokens and len(ids) < limit:
            length = len(ids)  # L
            # Never emit past max_new_tokens or max_seq_len: an iteration emits up to gamma + 1.
            g = min(auto.gamma if auto else gamma, max_new_tokens - (length - len(prompt)) - 1, limit - length - 1)

            t0 = clock.mark()
            proposal = propose(drafter, seq, ids, g, tree, tree_mode, cache_len - length, sampling, generator)  # 1-3
            t1 = clock.mark()
            logits, hidden = score(target, seq, target_next, length, proposal, drafter.reads_features)  # line 4
            t2 = clock.mark()
            finite = finite_flag(logits)
            step = judge(logits, proposal, sampling, verify, generator, finite).read(finite)  # lines 5-9, one read
            depth = proposal.depth
            stats.record(depth, proposal.calls, step.accepted, step.overlap, drafted=proposal.tokens.shape[0])
            clock.add(stats, "draft_time_s", t0, t1)
            clock.add(stats, "target_time_s", t1, t2)
            if auto is not None:  # the first iteration's times include the prompt
                timed = depth > 0 and stats.target_calls > 1  # t0..t2 are behind judge's host read
                auto.update(step.overlap[:min(step.accepted + 1, depth)],
                            clock.seconds(t0, t1) / depth if timed else None, clock.seconds(t1, t2) if timed else None)

            emitted = cut_at_eos(step.tokens, eos_id)  # line 10: x_1..x_n, t
            seq[0, length:length + len(emitted)] = torch.tensor(emitted, device=device)
            ids.extend(emitted)
            # Roll back: the target's cache is valid up to, not including, the newest token
            # (a tree's accepted path is first moved into place); the drafter learns the new
            # length (and, if it reads them, the target's features of the accepted path).
            hidden = keep_path(target, proposal, step, length, target_next, hidden)
            drafter.commit(len(ids), hidden, target_next)
            target_next = len(ids) - 1
            if stats.target_calls == 1:  # this iteration also read the prompt: timed apart
                clock.add(stats, "first_iteration_s", decode_start, clock.mark())
                stats.first_iteration_tokens = len(emitted)
            if callback is not None:
                callback(emitted, [i < step.accepted for i in range(len(emitted))])
            if emitted[-1] == eos_id:
                break
        clock.add(stats, "decode_time_s", decode_start, clock.mark())
        clock.settle()
    out = ids[len(prompt):]
    stats.new_tokens = len(out)
    stats.stop_reason = stop_reason(out, eos_id, max_new_tokens)
    stats.wall_time_s = time.perf_counter() - wall_start
    return GenerationResult(tokens=out, stats=stats)


def cut_at_eos(tokens: list[int], eos_id: int | None) -> list[int]:
    """Nothing after an emitted EOS, even in the middle of an accepted block."""
    if eos_id is not None and eos_id in tokens:
        return tokens[:tokens.index(eos_id) + 1]
    return tokens


def drafter_for(target: Any, draft: Any) -> Any:
    """``draft`` as a drafter (a model is wrapped in ModelDrafter), checked against ``target``
    (speculative.pair), and never the target object itself: the two would share one KV cache."""
    drafter = as_drafter(draft)
    check_pair(target, drafter)
    if draft is target or getattr(drafter, "model", None) is target:
        raise ValueError("draft and target are the same object and would share one KV cache; "
                         "pass a copy (copy.deepcopy(model)) as the draft")
    return drafter


# ----------------------------------------------------------------------------- the seams
def propose(drafter: Any, seq: torch.Tensor, ids: list[int], g: int, tree: tuple[int, ...] | None, tree_mode: str,
            room: int, sampling: Sampling, generator: torch.Generator) -> Draft:
    """Lines 1-3: a chain of up to g tokens, or a tree of at most g levels that fits in the
    ``room`` cache slots left after the sequence. Nothing (a plain target step) when g = 0."""
    if g > 0 and tree is not None:
        levels = fit_tree(tree, g, room)
        grown = drafter.propose_tree(seq, ids, levels, tree_mode, sampling, generator) if levels else None
        if grown is not None:  # None: the drafter has nothing to go on yet (a plain step)
            return Draft(grown[0].tokens, None, calls=grown[1], tree=grown[0])
    elif g > 0:
        return drafter.propose(seq, ids, g, sampling, generator)
    return Draft(seq.new_empty(0), None)


def score(target: Any, seq: torch.Tensor, target_next: int, length: int, proposal: Draft,
          reads_features: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Line 4: ONE target call over what it has not read of the sequence and the drafted
    tokens. Returns p's logits for the g + 1 positions L-1 .. L+g-1 (a tree: the root and
    every node) and, for a drafter that reads them, the target's features of the whole call.
    The logits are checked by the verifier (judge's ``finite``), in the copy it makes anyway."""
    feed = torch.cat([seq[:, target_next:length], proposal.tokens.view(1, -1)], dim=1)
    if proposal.tree is not None:  # each node at its depth, seeing its ancestors
        call = calls.tree(target_next, length - target_next, proposal.tree, seq.device)
    else:
        call = calls.chain(target_next, feed.shape[1], seq.device)
    out = target(feed, call, return_hidden=True) if reads_features else target(feed, call)
    logits, hidden = out if reads_features else (out, None)
    return logits[0, -(proposal.tokens.shape[0] + 1):], hidden


def judge(logits: torch.Tensor, proposal: Draft, sampling: Sampling, rule: str, generator: torch.Generator,
          finite: torch.Tensor | None = None) -> Verdict:
    """Lines 5-9 by the verifier that fits the draft: a tree's walk, the comparison of
    argmaxes at temperature 0, or the chosen rule ("token" or "block") on warped p and q. A
    deterministic drafter's q (None) is one-hot on its tokens. Returns the verifier's Verdict,
    on the device: the loop reads it, with ``finite`` (the logits' finite_flag), in its one
    host copy, which raises NonFiniteLogitsError; until then a sampled verification runs on
    usable_logits, so that no sampling kernel meets a NaN."""
    drafted = proposal.tokens
    if finite is not None and not sampling.greedy:
        logits = usable_logits(logits, finite)
    if proposal.tree is not None:
        if sampling.greedy:
            return trees.verify_tree_greedy(logits.argmax(-1), proposal.tree)
        return trees.verify_tree(warp(logits, sampling), proposal.tree, generator)
    if sampling.greedy:  # one-hot p and q
        return rules.verify_greedy(logits.argmax(-1), drafted)
    p = warp(logits, sampling)  # g = 0: t from p_1 alone
    q = proposal.q if proposal.q is not None else F.one_hot(drafted, p.shape[-1]).to(p.dtype)
    return (rules.verify_step if rule == "token" else block.verify_block)(p, q, drafted, generator)


def keep_path(target: Any, proposal: Draft, step: Verification, length: int, target_next: int,
              hidden: torch.Tensor | None) -> torch.Tensor | None:
    """After a tree's verification, move the accepted path's keys and values from the nodes'
    slots (L + node) to consecutive slots L.. of the target's cache, and return the target's
    features in sequence order (the call's chain part, then the path) for the drafter. A
    chain is in order already: its features are returned as they are."""
    if proposal.tree is None:
        return None if hidden is None else hidden[0]
    path = step.path
    if path and path != list(range(len(path))):
        target.move_cache([0], [[length + node for node in path]], [list(range(length, length + len(path)))])
    if hidden is None:
        return None
    prefix = length - target_next
    rows = list(range(prefix)) + [prefix + node for node in path]
    return hidden[0, torch.tensor(rows, device=hidden.device)]


def fit_tree(tree: tuple[int, ...], depth: int, room: int) -> tuple[int, ...]:
    """The first levels of ``tree``: at most ``depth`` of them, with fewer nodes than the
    ``room`` cache slots left (the nodes sit in slots L..L+N-1)."""
    levels = tree[:depth]
    while levels and len(branching_parents(levels)) >= room:
        levels = levels[:-1]
    return levels


def check_tree_request(tree: Sequence[int], tree_mode: str, drafter: Any, gamma: Any,
                       verify: str) -> tuple[tuple[int, ...], int]:
    """The tree as a tuple, and its depth in gamma's place; ValueError for what cannot combine."""
    shape = check_tree(tree)
    if tree_mode not in TREE_MODES:
        raise ValueError(f"tree_mode must be one of {', '.join(map(repr, TREE_MODES))}, got {tree_mode!r}")
    if not hasattr(drafter, "propose_tree"):
        raise ValueError(f"{type(drafter).__name__} cannot build token trees (a draft model or a feature head can)")
    if gamma not in (DEFAULT_GAMMA, len(shape)):
        raise ValueError("gamma and tree both set: a tree's depth is its gamma; leave gamma alone")
    if verify != "token":
        raise ValueError("block verification is for a chain; a tree is verified by its own walk")
    return shape, len(shape)
