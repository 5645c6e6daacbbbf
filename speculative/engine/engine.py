"""The production engine: Algorithm 1 (speculative.reference) over rows, with its refinements
plugged in at four named seams. One iteration (:meth:`Engine.step`):

1. Propose (lines 1-3): the drafter drafts gamma_b tokens for every row b, one drafter call
   per step for all rows, row b drawing from its own stream (speculative.draft); or a
   token tree for a single row (speculative.draft.trees).
2. Score (line 4): ONE target call over every row's unread tokens and its draft, row b at
   its own cache slots (model.call), giving p_1..p_{g_b+1} for every row.
3. Verify (lines 5-9): each row by itself, with its own p, q and random stream, by a pure
   verifier (token-wise, block, greedy or tree: device tensors in, device tensors out); the
   iteration's verdicts reach the host in ONE copy, with the check that the logits are finite.
4. Commit (line 10): row b emits its own x_1..x_n, t and the caches roll back by position:
   a call overwrites the slots it is given before anything reads them, so the target's next
   call for the row starts at its newest token. No row waits for another's acceptance.

The target alone is the same engine with nothing drafted (``draft=None``): every iteration samples t from p_1.
Where nothing is drafted (the target alone, a drafter switched off) and the rows stop only by their count, the
tokens stay on the device until the rows change or a drafter drafts again: no host read per token.

Rows join and leave between iterations (:meth:`Engine.add`, :meth:`Engine.step`, :attr:`Engine.finished`): a
finished row leaves at once (the KV caches drop it, model.move_cache compacts the rest) and a waiting one
takes its place. A row can also be stopped from outside (:meth:`Engine.cancel`, a server's client that left):
it leaves at the start of the next step, before that step computes anything for it.

A row may go on from a finished one (``Engine.add``'s ``continues``: a conversation's next turn, whose prompt
is the earlier turn's sequence and more). In an engine of one row the KV caches still hold what the target
read of that row, so the new row's first call starts at the first token where the two differ (at most where
the cache ends) instead of at 0; a drafter with a cache of its own keeps what it can through its
``resumed`` hook (speculative.draft.protocol). The tokens are those of a fresh row with the same prompt: only
the positions read differ, as they do between the calls of any row (the numerics policy). Where the
earlier row was cancelled or failed, or another row used the caches since, the row reads from 0.

Each row has its own sampling settings (``Engine.add``'s ``sampling``) and seed: row b draws everything from its own
torch.Generator, in the order a batch of one would, so its tokens do not depend on the other rows, up to the numerics
policy (docs/algorithm.md: near-ties of a matmul of another shape). gamma="auto" and ``guard`` time all rows at once:
under them a sampled row's tokens depend on the others and on the clock (not with recorded costs). Trees: one row.

Of the target the engine uses its cached call ``target(tokens, call)`` (LongTensor [B, T] -> logits [B, T, V];
with ``return_hidden`` also the features a drafter asks for, ``reads_features``), ``setup_cache``,
``move_cache`` (whole rows with ``upto``), ``cache_len`` and ``config.vocab_size`` / ``config.max_seq_len``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from typing import Any

import torch

from model import call as calls
from speculative.draft.model import as_drafter
from speculative.draft.protocol import Draft, pad_rows, trait
from speculative.engine.gamma_policy import Choice, GammaPolicy, Guard
from speculative.engine.judging import judge_rows
from speculative.engine.logprobs import record_logprobs, record_prompts
from speculative.engine.rows import Callback, Row, RowFailedError, cut_at_eos
from speculative.engine.stats import (
    BatchStats,
    Clock,
    SpeculativeStats,
    record_iteration,
    stop_reason,
)
from speculative.engine.trees import check_tree_request, fit_tree, keep_path
from speculative.inputs import (
    NonFiniteLogitsError,
    check_gamma,
    check_max_new_tokens,
    check_pair,
    check_prompt,
    check_seed,
    check_stop_ids,
    finite_rows,
    model_device,
    read_host,
)
from speculative.sampling import KeyedNoise, Sampling, make_generator
from speculative.verify.registry import default_rule, keyed
from speculative.verify.registry import rule as registered
from speculative.verify.tree import branching_parents
from speculative.verify.verdict import Verdict, Verification

DEFAULT_GAMMA = 4


class Engine:
    """Speculative decoding of many rows at once (see the module docstring).

    ``draft``: a model of the target's vocabulary (wrapped in speculative.draft.ModelDrafter),
    any drafter, or None for the target alone.

    ``gamma``: tokens drafted per iteration, an int >= 1 or "auto". How many each iteration really
    drafts is the gamma policy's to say (``gamma_policy``, speculative.engine.gamma_policy: a row's
    pinned gamma, a chooser from outside, "auto", the guard, a tree's shape).

    ``verify``: the name of a registered rule (speculative.verify.RULES: "token", Algorithm 1,
    "block", Sun et al. 2025, or "invariant", whose noise is keyed by seed and position so that a seed
    gives the target alone's tokens whatever the drafter: its rows' plain steps draw with that noise
    too), which says what it does at temperature 0; None, the default, is
    speculative.verify.default_rule's (block for a chain, the tree's walk for a tree); or your own
    verifier with their signature, ``rule(p [g+1, V], q [g, V], drafted [g], generator) ->
    Verdict``, which then judges every chain, at temperature 0 too (on one-hot p and q): what
    ``python -m speculative.prove`` runs through the engine.

    ``tree``: draft a token tree of this branching per depth instead of a chain (one row; its depth
    takes gamma's place), drawn by ``tree_mode``; "auto": the shape by measurement, iteration by
    iteration (speculative.engine.trees.AutoTree).

    ``guard`` (a gamma_policy.Guard; True is timed, a tuple of seconds recorded costs): a fixed
    gamma or a named tree is turned off (plain target steps) where this run measures that it loses
    (gamma.Switch; gamma="auto" always is), or where recorded costs say so (no clock read).

    ``context``: the most tokens a row's sequence may hold, fewer than the models' max_seq_len (its
    stop_reason max_seq_len there; the KV caches sized to it at most).

    ``max_rows``: rows in one call at most. ``cache_len``: the KV caches' length; None sizes them at
    the first step for the rows added by then (a later row longer than that stops when the cache is
    full)."""

    def __init__(
        self,
        target: Any,
        draft: Any = None,
        *,
        gamma: int | str | None = None,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        verify: str | Callable | None = None,
        tree: Sequence[int] | str | None = None,
        tree_mode: str = "without_replacement",
        max_rows: int = 1,
        cache_len: int | None = None,
        guard: Guard | bool | tuple[float, ...] = False,
        context: int | None = None,
    ) -> None:
        self.target = target
        self.drafter = None
        if draft is not None:
            self.drafter = drafter_for(target, draft)
        self.sampling = Sampling(temperature, top_k, top_p)
        if verify is None:  # the library's, generate.py's and serve.py's default
            verify = default_rule(tree)
        if not callable(verify):
            registered(verify)  # ValueError for a name that is not registered
        self.rule = verify
        self.tree = None
        self.tree_mode = tree_mode
        if tree is not None:
            self.tree, gamma = check_tree_request(
                tree, tree_mode, self.drafter, gamma, verify, max_rows
            )
        if gamma is None:  # not given
            gamma = DEFAULT_GAMMA
        self.gamma_max = 0
        if self.drafter is not None:
            self.gamma_max = check_gamma(gamma)
        self.gamma_policy = GammaPolicy(
            self.gamma_max,
            auto=gamma == "auto",
            guard=Guard.of(guard),
            tree=self.tree,
            tree_auto=tree == "auto",
            parallel=trait(self.drafter, "parallel"),
        )
        self.limit = min(
            target.config.max_seq_len,
            trait(self.drafter, "max_seq_len") or target.config.max_seq_len,
        )
        if context is not None:  # fewer than the models' max_seq_len (generate.py's --ctx-size)
            if isinstance(context, bool) or not isinstance(context, int) or context < 1:
                raise ValueError(f"context must be an integer >= 1, got {context!r}")
            self.limit = min(self.limit, context)
        # The cache slots a row keeps free past its sequence: a chain's gamma, or a tree's nodes.
        self.slack = self.gamma_max
        if self.tree is not None:
            self.slack = len(branching_parents(self.tree))
        if self.tree is not None and self.slack + 1 >= self.limit:
            raise ValueError(
                f"the tree {self.tree} has {self.slack} nodes, which cannot fit in the "
                f"{self.limit}-token context"
            )
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"max_rows must be an integer >= 1, got {max_rows!r}")
        self.max_rows = max_rows
        self.cache_len = cache_len
        self.device = model_device(target)
        self.rows: list[Row] = []
        self.waiting: deque[Row] = deque()
        # the row whose tokens the caches' one slot holds (one row at most: a row that continues it
        # reads on from what they hold)
        self.resident: Row | None = None
        self.finished: list[Row] = []  # rows that are done, in the order they finished
        self.stats = BatchStats(prompts=0, batch_size=max_rows)
        self.clock: Clock | None = None
        self.pending: list[torch.Tensor] = []  # plain steps' tokens not read yet (Engine.defer)
        self.pending_finite: list[torch.Tensor] = []

    # ------------------------------------------------------------------------- rows in and out
    def add(
        self,
        prompt_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int,
        *,
        eos_id: int | Collection[int] | None = None,
        seed: int | None = None,
        callback: Callback | None = None,
        sampling: Sampling | None = None,
        gamma: int | None = None,
        logprobs: int | None = None,
        echo: bool = False,
        memory: Any = None,
        continues: Row | None = None,
    ) -> Row:
        """Queue a request; it joins the batch at the next step with room. ``sampling``: its own
        temperature, top-k and top-p (default: the engine's). ``gamma``: pin its drafted tokens
        per iteration (0..the engine's gamma; default: the engine's choice). ``callback(new_ids,
        from_draft)`` sees each of its iterations' tokens: accepted draft tokens (True), then
        the target's own (False). The row stops after max_new_tokens (never more), after
        emitting eos_id, or any of them when it is several ids (even in the middle of an accepted
        block: nothing after it is emitted), or when it fills the context; its stats.stop_reason says which. A row whose
        logits are not finite fails alone: ``row.error`` is a NonFiniteLogitsError, its
        stop_reason "error", and the other rows go on; so does a row whose callback raises
        (``row.error`` a RowFailedError). ``logprobs``: record each emitted token's
        log-probability and this many top ones (``row.logprob_record``); ``echo``: the prompt's
        too (``row.prompt_record``), from the target call that reads it. ``memory``: what the
        drafter may read of earlier requests and keep of this one (its ``joined`` and ``finished``
        hooks, speculative.draft.protocol; serve.py's partition of a suffix cache), None: nothing.
        ``continues``: a finished row of this engine whose sequence the prompt goes on from (a
        conversation's earlier turn; an engine of one row, ``max_rows=1``): the target reads the prompt
        from the first token where it differs from that row's sequence, at most from where the cache
        of that row ends, and its drafter keeps what its ``resumed`` hook can (``row.cached``: the
        tokens not read again). The tokens are those of the same prompt without ``continues``; where
        that row was cancelled or failed, another row ran since, or ``echo`` wants the whole prompt
        read, the prompt is read from 0."""
        check_max_new_tokens(max_new_tokens)
        check_seed(seed)
        prompt = check_prompt(prompt_ids, self.target.config.vocab_size, self.row_limit)
        stats = SpeculativeStats(
            gamma_setting=self.gamma_policy.setting,
            gamma_policy=self.gamma_policy.name,
            accepted_per_position=[0] * self.gamma_max,
            tried_per_position=[0] * self.gamma_max,
        )
        if sampling is not None and not isinstance(sampling, Sampling):
            raise ValueError(
                f"sampling must be a speculative.sampling.Sampling, got {type(sampling).__name__}"
            )
        if gamma is not None and (
            isinstance(gamma, bool)
            or not isinstance(gamma, int)
            or not 0 <= gamma <= self.gamma_max
        ):
            raise ValueError(
                f"a row's gamma must be an integer in 0..{self.gamma_max}, got {gamma!r}"
            )
        if logprobs is not None and (
            isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0
        ):
            raise ValueError(
                f"logprobs must be an integer >= 0 (the top ones to record) or None, got {logprobs!r}"
            )
        if (logprobs is not None or echo) and self.tree is not None:
            raise ValueError("logprobs are recorded for chains only, not token trees")
        if continues is not None and not isinstance(continues, Row):
            raise ValueError(
                f"continues must be a Row of this engine, got {type(continues).__name__}"
            )
        if continues is not None and self.max_rows != 1:
            # with several rows the caches move rows between slots: what a finished row left is not kept
            raise ValueError(
                f"continues needs an engine of one row (max_rows=1), not {self.max_rows}: rows move "
                "between the caches' slots and a finished row's cache is not kept"
            )
        row = Row(
            prompt,
            max_new_tokens,
            check_stop_ids(eos_id),
            callback,
            sampling or self.sampling,
            make_generator(self.device, seed),
            stats,
            list(prompt),
            gamma=gamma,
            logprobs=logprobs,
            echo=echo,
            memory=memory,
            continues=continues,
        )
        self.waiting.append(row)
        self.stats.prompts += 1
        self.stats.rows.append(stats)
        return row

    @property
    def row_limit(self) -> int:
        """The longest a row may grow: the context, or the KV caches once sized."""
        return self.limit if self.cache_len is None else min(self.limit, self.cache_len)

    def cancel(self, row: Row) -> None:
        """Stop ``row`` before its end: a waiting row is dropped at once, a row in the batch leaves
        at the start of the next step, before that step computes anything for it (the KV caches
        drop it as they drop a finished row). Either way it joins :attr:`finished` with what it
        produced so far and stop_reason "cancelled". A row that is done already is left alone."""
        if row.done or row.cancelled:
            return
        row.cancelled = True
        for i, waiting in enumerate(self.waiting):
            if waiting is row:
                del self.waiting[i]
                row.done = True
                row.stats.stop_reason = "cancelled"
                self.finished.append(row)
                return

    def start(self) -> None:
        """Size and set up the KV caches (once, at the first step)."""
        if self.cache_len is None:
            longest = max(
                (len(row.prompt) + row.max_new_tokens for row in self.waiting), default=self.limit
            )
            self.cache_len = min(self.limit, longest + self.slack + 1)
        self.target.setup_cache(self.max_rows, self.cache_len)
        if self.drafter is not None:
            self.drafter.start(self.max_rows, self.cache_len, self.target)
        self.clock = Clock(self.device)
        self.decode_start = self.clock.mark()

    def admit(self) -> None:
        """Waiting rows take the free places, behind the rows already there; a row that continues the
        one the caches hold reads on from what they hold (:meth:`cached_prefix`)."""
        old = len(self.rows)
        while self.waiting and len(self.rows) < self.max_rows:
            self.flush()
            row = self.waiting.popleft()
            row.joined = self.clock.mark()
            row.cached = self.cached_prefix(row)
            # let go: a conversation's rows would otherwise hold every earlier one
            row.continues = None
            if self.is_done(row):  # its prompt fills the context already
                self.finish(row, row.joined)
                continue
            row.target_next = row.cached
            self.rows.append(row)
            self.resident = row
        if self.drafter is not None and len(self.rows) > old:
            self.drafter.keep_rows(list(range(old)), len(self.rows) - old)
            joined = trait(self.drafter, "joined")
            if joined is not None:
                joined([row.memory for row in self.rows[old:]])
            # a drafter without the hook reads a new row from 0, whatever the target skips
            hook = trait(self.drafter, "resumed")
            resumed = [
                (b, row.cached) for b, row in enumerate(self.rows) if b >= old and row.cached
            ]
            if hook is not None and resumed:
                hook([b for b, _ in resumed], [n for _, n in resumed])

    def cached_prefix(self, row: Row) -> int:
        """The first tokens of ``row``'s prompt that the target need not read: those that the row it
        continues had too and that the caches still hold (the target read them: ``target_next``),
        never the prompt's last token (its call gives the first new token's logits). 0 unless that
        row finished by its own end (not cancelled, not failed) and was the last in the caches, and
        unless the drafter can go on without them: one that reads the target's features needs the
        positions the target reads, so it must keep the others through its ``resumed`` hook."""
        previous = row.continues
        if previous is None or previous is not self.resident or row.echo:
            return 0
        if not previous.done or previous.cancelled or previous.error is not None:
            return 0
        drafter = self.drafter
        if (
            drafter is not None
            and trait(drafter, "reads_features")
            and trait(drafter, "resumed") is None
        ):
            return 0
        limit = min(previous.target_next, len(row.prompt) - 1)
        shared = 0
        while shared < limit and row.prompt[shared] == previous.ids[shared]:
            shared += 1
        return shared

    def retire(self, now: Any) -> list[Row]:
        """Rows that finished leave the batch (and every KV cache); the rest move up."""
        done = [row for row in self.rows if self.is_done(row)]
        if not done:
            return []
        self.flush()
        for row in done:
            self.finish(row, now)
        finished = trait(self.drafter, "finished")
        if finished is not None:  # before keep_rows drops them: their responses, for later requests
            ended = [b for b, row in enumerate(self.rows) if row.done and row.error is None]
            rows = [self.rows[b] for b in ended]
            finished(ended, [row.ids for row in rows], [len(row.prompt) for row in rows])
        kept = [b for b, row in enumerate(self.rows) if not row.done]
        self.rows = [self.rows[b] for b in kept]
        if kept != list(range(len(kept))):  # the slots the kept rows hold, not the whole context
            self.target.move_cache(
                kept, upto=min(self.cache_len, max(row.length for row in self.rows) + 1)
            )
        if self.drafter is not None:
            self.drafter.keep_rows(kept)
        return done

    def finish(self, row: Row, now: Any) -> None:
        row.done = True
        row.stats.new_tokens = row.produced
        if row.error:
            row.stats.stop_reason = "error"
        elif row.cancelled:
            row.stats.stop_reason = "cancelled"
        else:
            new = row.ids[len(row.prompt) :]
            row.stats.stop_reason = stop_reason(new, row.stop_ids, row.max_new_tokens)
        row.stats.stop_token = row.ids[-1] if row.stats.stop_reason == "eos" else None
        self.clock.add(row.stats, "decode_time_s", row.joined, now)
        self.finished.append(row)

    def is_done(self, row: Row) -> bool:
        return (
            row.error is not None
            or row.cancelled
            or row.produced >= row.max_new_tokens
            or row.length >= self.row_limit
            or (row.produced > 0 and row.ids[-1] in row.stop_ids)
        )

    @property
    def idle(self) -> bool:
        return not self.rows and not self.waiting

    def run(self) -> None:
        """Step until every row added so far has finished; then wait for the device once."""
        while not self.idle:
            self.step()
        if self.clock is not None:
            self.clock.add(self.stats, "decode_time_s", self.decode_start, self.clock.mark())
            self.clock.settle()

    # ------------------------------------------------------------------------- one iteration
    def step(self) -> list[Row]:
        """One iteration of Algorithm 1 for every row. Returns the rows that finished (the cancelled first)."""
        with torch.inference_mode():
            if self.clock is None:
                self.start()
            cancelled = []
            if any(row.cancelled for row in self.rows):
                cancelled = self.retire(self.clock.mark())
            self.admit()
            rows = self.rows
            clock = self.clock
            if not rows:
                return cancelled
            choice = self.gamma_policy.choose(self, rows)  # each row's gamma, a tree's shape
            t0 = clock.mark()
            draft = self.propose(rows, choice)  # lines 1-3
            t1 = clock.mark()
            logits, hidden = self.score(rows, draft)  # line 4
            t2 = clock.mark()
            # lines 5-9 (None: nothing drafted, the tokens left on the device)
            steps = self.verify(rows, draft, logits)
            self.commit(rows, draft, steps, hidden)  # line 10
            t3 = clock.mark()
            if steps is None:  # deferred: nothing drafted, nothing verified on the host
                steps = [Verification([], 0, [])] * len(rows)
            self.learn(rows, draft, steps, (t0, t1, t2, t3))
            return cancelled + self.retire(t3)

    def room(self, row: Row) -> int:
        """The most ``row`` may draft this iteration: an iteration emits up to gamma + 1 tokens,
        which must not pass the row's max_new_tokens or its context."""
        return min(row.max_new_tokens - row.produced - 1, self.row_limit - row.length - 1)

    @property
    def policy(self) -> Callable[[Engine], int] | None:
        """The chooser of gamma installed from outside (a server's), held by the gamma policy."""
        return self.gamma_policy.outside

    @policy.setter
    def policy(self, chooser: Callable[[Engine], int] | None) -> None:
        self.gamma_policy.steer(chooser)

    def verify(
        self, rows: list[Row], draft: Draft, logits: torch.Tensor
    ) -> list[Verification] | None:
        """Lines 5-9: every row's verdict (its own rule, sampling and generator), read in one copy,
        cut at the row's first end id (even inside an accepted block), and the log-probabilities of
        what it emits recorded from these logits, the target's own laws. None when nothing was drafted and
        the rows stop by their count: the tokens stay on the device (Engine.defer)."""
        # Read with the verdicts: a row whose logits are not finite fails alone.
        finite = finite_rows(logits)
        sources = [row.generator for row in rows]
        if keyed(self.rule):
            # noise keyed by the row's seed and the position of p_1's token, for the rule and for a
            # plain step alike: the target's token at a position is the same whoever drafted
            sources = [KeyedNoise(row.generator.initial_seed(), row.length) for row in rows]
        verdict = judge_rows(
            logits, draft, [row.sampling for row in rows], self.rule, sources, finite
        )
        if self.deferred(rows, draft):
            self.defer(rows, verdict.parts[0], finite)
            return None
        steps = self.read(rows, draft, verdict, finite)
        for b, (row, step) in enumerate(zip(rows, steps)):
            # A new object only where one is cut.
            if row.stop_ids and not row.stop_ids.isdisjoint(step.tokens):
                steps[b] = replace(step, tokens=cut_at_eos(step.tokens, row.stop_ids))
        if draft.tree is None and any(row.logprobs is not None for row in rows):
            record_logprobs(
                rows, [step.tokens for step in steps], [g + 1 for g in draft.lengths], logits
            )
        return steps

    def read(
        self, rows: list[Row], draft: Draft, verdict: Verdict, finite: torch.Tensor
    ) -> list[Verification]:
        """The verdicts and every logit row's finite flag in ONE copy. A row with a non-finite
        logit emits nothing and fails alone (``row.error``); the others' outcomes stand."""
        *host, flags = read_host([*verdict.parts, finite])
        steps = verdict.finish(*host)
        at = 0  # row b's logit rows in the flags: g_b + 1 of them
        for b, (row, n) in enumerate(zip(rows, [g + 1 for g in draft.lengths])):
            if not all(flags[at : at + n]):
                row.error = NonFiniteLogitsError()
                steps[b] = Verification([], 0, [])
            at += n
        return steps

    def propose(self, rows: list[Row], choice: Choice) -> Draft:
        """Lines 1-3: a chain of up to choice.gammas[b] tokens for every row, or a tree of
        choice.shape for one row that fits in the cache slots after its sequence. Nothing (a
        plain target step) where gamma is 0."""
        gammas = choice.gammas
        nothing = Draft(
            torch.empty(len(rows), 0, dtype=torch.long, device=self.device), [0] * len(rows)
        )
        if self.drafter is None or max(gammas) == 0:
            return nothing
        self.flush()  # the tokens of plain steps not read yet (Engine.defer): a drafter reads the sequence
        if self.tree is None:
            return self.drafter.propose(
                [row.ids for row in rows],
                gammas,
                [row.sampling for row in rows],
                [row.generator for row in rows],
                self.device,
            )
        row = rows[0]
        levels = fit_tree(choice.shape, gammas[0], self.cache_len - row.length)
        if not levels:
            return nothing
        grown = trait(self.drafter, "propose_tree")(
            row.ids, levels, self.tree_mode, row.sampling, row.generator, self.device
        )
        if grown is None:  # the drafter has nothing to go on yet
            return nothing
        tree, count = grown
        return Draft(tree.tokens.view(1, -1), [tree.num_nodes], None, count, tree)

    def score(self, rows: list[Row], draft: Draft) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Line 4: ONE target call in which row b feeds what the target has not read of it and
        its draft, at its own cache position. Returns every row's logits for its g_b + 1
        positions L_b-1 .. L_b+g_b-1 (a tree: the root and every node), stacked as one
        [sum of (g_b + 1), V] tensor, and for a drafter that reads them the call's features."""
        reads = False  # True: the final norm's output; a tuple: those layers' outputs
        if self.drafter is not None:
            reads = trait(self.drafter, "reads_features")
        starts = [row.target_next for row in rows]
        wanted = [g + 1 for g in draft.lengths]
        # plain steps, rows unchanged: each feeds its newest token, still on the device
        if self.pending:
            feed = self.pending[-1].view(-1, 1)
        else:
            unread = [row.ids[start:] for row, start in zip(rows, starts)]
            if len(rows) == 1:
                feed = torch.cat(
                    [torch.tensor([unread[0]], device=self.device), draft.tokens], dim=1
                )
            else:
                feed = pad_rows(
                    unread, self.device, max(len(u) + g for u, g in zip(unread, draft.lengths))
                )
                at = [
                    (b, len(u) + j, j)
                    for b, (u, g) in enumerate(zip(unread, draft.lengths))
                    for j in range(g)
                ]
                if at:
                    index = torch.tensor(at, device=self.device).T
                    feed[index[0], index[1]] = draft.tokens[index[0], index[2]]
        if draft.tree is not None:  # a tree: each node at the position of its depth
            call = calls.tree(starts[0], feed.shape[1] - draft.lengths[0], draft.tree, self.device)
        else:
            call = calls.ragged(starts, feed.shape[1], self.cache_len, self.device)
        hidden = None
        if reads:
            logits, hidden = self.target(feed, call, return_hidden=reads)
        else:
            logits = self.target(feed, call)
        # A prompt's log-probabilities are read from column 0 of its row.
        if any(row.echo and start == 0 for row, start in zip(rows, starts)):
            record_prompts(rows, starts, logits)
        if len(rows) == 1:
            return logits[0, -wanted[0] :], hidden
        sizes = [len(row.ids) - start + g for row, start, g in zip(rows, starts, draft.lengths)]
        same_shape = len(set(sizes)) == 1 and len(set(wanted)) == 1
        if self.pending or same_shape:  # every row's positions at the same columns
            return logits[:, -wanted[0] :].reshape(-1, logits.shape[-1]), hidden
        at_row = [b for b, n in enumerate(wanted) for _ in range(n)]
        at_col = [size - n + j for size, n in zip(sizes, wanted) for j in range(n)]
        index = torch.tensor([at_row, at_col], device=logits.device)
        return logits[index[0], index[1]], hidden

    def commit(
        self,
        rows: list[Row],
        draft: Draft,
        steps: list[Verification] | None,
        hidden: torch.Tensor | None,
    ) -> None:
        """Line 10: row b emits x_1..x_n, t (cut at an end id by verify; ``steps`` None: one token each, on the
        device) and rolls back: everything before its newest token is in the target's cache, whatever the other
        rows accepted (a tree's accepted path is first moved into place); the drafter learns the new lengths
        and, if it reads them, the target's features of the accepted paths."""
        starts = [row.target_next for row in rows]
        steps = steps or []
        if draft.tree is not None and rows[0].error is None:
            hidden = keep_path(self.target, steps[0].path, rows[0].length, starts[0], hidden)
        for row, step in zip(rows, steps):
            row.ids.extend(step.tokens)
        for row in rows:
            row.target_next = row.length - 1
        if self.drafter is not None:
            self.drafter.commit([row.length for row in rows], hidden, starts)
        for row, step in zip(rows, steps):
            if row.callback is not None and step.tokens:
                try:
                    row.callback(step.tokens, [i < step.accepted for i in range(len(step.tokens))])
                except (
                    Exception
                ) as error:  # its own handler failed: it leaves at the end of this step
                    row.error = RowFailedError(f"{type(error).__name__}: {error}".splitlines()[0])

    # ------------------------------------------------------------------------- plain steps: the target alone, or off
    def deferred(self, rows: list[Row], draft: Draft) -> bool:
        """Nothing drafted (the target alone; a drafter switched off on a CPU, where the switch's clock needs
        no host read to time an iteration) and every row stops by its count alone: no need to see the tokens yet."""
        return (
            draft.tokens.shape[1] == 0
            and (self.drafter is None or not self.clock.events)
            and all(
                not row.stop_ids and row.callback is None and row.logprobs is None for row in rows
            )
        )

    def defer(self, rows: list[Row], tokens: torch.Tensor, finite: torch.Tensor) -> None:
        self.pending.append(tokens)
        self.pending_finite.append(finite)
        for row in rows:
            row.owed += 1

    def flush(self) -> None:
        """Read the deferred tokens of the rows in ONE copy, with every call's finite flags; a
        row that met a non-finite logit fails alone and keeps none of them."""
        if not self.pending:
            return
        tokens, flags = read_host(
            [torch.stack(self.pending, dim=1), torch.stack(self.pending_finite, dim=1)]
        )
        width = len(self.pending)
        for b, row in enumerate(self.rows):
            row.owed = 0
            if all(flags[b * width : (b + 1) * width]):
                row.ids.extend(tokens[b * width : (b + 1) * width])
            else:
                row.error = NonFiniteLogitsError()
        self.pending = []
        self.pending_finite = []

    # ------------------------------------------------------------------------- what happened
    def learn(self, rows: list[Row], draft: Draft, steps: list[Verification], marks: tuple) -> None:
        """One iteration into the records (stats.record_iteration: marks before proposing, scoring,
        verifying, after committing) and into the gamma policy (its timings and estimates)."""
        record_iteration(self.stats, self.clock, rows, draft, steps, marks)
        self.gamma_policy.observe(self, rows, draft, steps, marks)


def drafter_for(target: Any, draft: Any) -> Any:
    """``draft`` as a drafter (a model is wrapped in ModelDrafter), checked against ``target`` (speculative.inputs),
    and never the target object itself: the two would share one KV cache."""
    drafter = as_drafter(draft)
    check_pair(target, drafter)
    if draft is target or trait(drafter, "model") is target:
        raise ValueError(
            "draft and target are the same object and would share one KV cache; "
            "pass a copy (copy.deepcopy(model)) as the draft"
        )
    return drafter


__all__ = ["DEFAULT_GAMMA", "Engine", "NonFiniteLogitsError", "Row", "RowFailedError"]
