"""The drafter interface: what Algorithm 1's loop needs of whatever proposes tokens.

Algorithm 1 never asks where q came from. Lines 1-3 say "draft x_1..x_gamma with their
distributions q_1..q_gamma"; lines 5-9 accept x_i with probability min(1, p_i(x_i)/q_i(x_i))
and otherwise sample from norm(max(0, p_i - q_i)). Any procedure that draws x_i from a
q_i it can report, given the sequence so far, keeps the output exactly the target's. So a
drafter is three calls (the seams of the loop in speculative/speculative.py):

* ``start(cache_len, target)``: a new sequence begins (allocate or reset state);
* ``propose(seq, ids, gamma, sampling, generator) -> Draft``: up to gamma tokens after
  the sequence so far, and the distributions they were drawn from;
* ``commit(length, hidden, hidden_start)``: after verification the sequence has ``length``
  tokens; roll back whatever state depended on rejected tokens. A drafter whose
  ``reads_features`` is True also gets the target's hidden states of the positions the
  target just read (``hidden`` [T, dim] for positions hidden_start..hidden_start+T-1),
  from the same target call that verified the draft.

A drafter that can also grow token trees has ``propose_tree(seq, ids, branching, mode,
sampling, generator) -> (TokenTree, calls)`` (speculative.tree_drafting); the model and
feature drafters do, prompt lookup does not.

Batched speculation (speculative.batch) needs the same three calls for many sequences at
once, each row with its own length and its own random stream: a :class:`RowDrafter` has
``start_rows``, ``propose_rows``, ``commit_rows`` and ``keep_rows`` (rows that finished
leave, new prompts join). All three drafters have them.

A deterministic drafter (prompt lookup, or any drafter at temperature 0) reports q = None:
its q is one-hot on each token it proposed. Algorithm 1 then accepts x with probability
p(x), and the residual is p with x removed and renormalised; the loop builds the one-hot
rows only where it needs them (temperature > 0).

Three drafters implement it: :class:`ModelDrafter` (a smaller model of the same family,
the paper's M_q), :class:`speculative.lookup.PromptLookupDrafter` (n-gram copying from the
sequence) and :class:`speculative.eagle.FeatureDrafter` (a head that reads the target's
own features, EAGLE). docs/drafters.md compares them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from speculative import calls
from speculative.sampling import Sampling, sample, sample_rows, warp
from speculative.tree import TokenTree
from speculative.tree_drafting import grow_tree


@dataclass
class Draft:
    """One iteration's proposal (Algorithm 1, lines 1-3)."""

    tokens: torch.Tensor  # [g] LongTensor on the target's device; g may be 0 (nothing to propose)
    q: torch.Tensor | None  # [g, V] the distributions the tokens were drawn from; None: one-hot on tokens
    calls: int = 0  # forward calls the drafter made for it (0 for a lookup)
    tree: TokenTree | None = None  # a token tree (its nodes are `tokens`, its q its own); None: a chain

    @property
    def depth(self) -> int:
        """Positions drafted ahead: the chain's length, or the tree's depth."""
        if self.tree is None:
            return self.tokens.shape[0]
        return max(self.tree.depths(), default=0)


@dataclass
class RowDrafts:
    """One iteration's proposals for a batch (lines 1-3 for every row): row b drafted
    tokens[b, :lengths[b]] from q[b, :lengths[b]]. One tensor for all rows, so that the loop
    builds the target's input and reads the greedy outcome in a few operators, not a few per row."""

    tokens: torch.Tensor  # [B, width] LongTensor; width >= max(lengths) (0 when nobody drafted)
    lengths: list[int]
    q: torch.Tensor | None = None  # [B, width, V]; None: one-hot on the tokens
    calls: int = 0  # batched drafter calls

    def row(self, b: int) -> Draft:
        n = self.lengths[b]
        return Draft(self.tokens[b, :n], None if self.q is None else self.q[b, :n], calls=self.calls)


@runtime_checkable
class Drafter(Protocol):
    """Anything that proposes tokens for the loop of Algorithm 1 (see the module docstring)."""

    reads_features: bool  # commit() wants the target's hidden states
    vocab_size: int | None  # the ids it proposes lie below this (None: any id of the sequence)
    max_seq_len: int | None  # the longest sequence it can draft for (None: no limit of its own)

    def start(self, cache_len: int, target: Any) -> None: ...

    def propose(self, seq: torch.Tensor, ids: list[int], gamma: int, sampling: Sampling,
                generator: torch.Generator) -> Draft: ...

    def commit(self, length: int, hidden: torch.Tensor | None = None, hidden_start: int = 0) -> None: ...


@runtime_checkable
class RowDrafter(Protocol):
    """A drafter for a batch of sequences (rows), each at its own length (speculative.batch).

    ``propose_rows(ids, gammas, sampling, generators, device)`` drafts gammas[b] tokens for row
    b (ids: the rows' tokens, on the host; the drafts are tensors on ``device``), drawing them
    with generators[b] only, and returns one Draft per row; ``commit_rows(lengths, hidden,
    hidden_starts)`` is commit() for every row (hidden [rows, T, dim], row b's features
    of positions hidden_starts[b]..); ``keep_rows(rows, new)`` makes rows 0..len(rows)-1 the
    old rows ``rows``, followed by ``new`` fresh sequences."""

    def start_rows(self, max_rows: int, cache_len: int, target: Any) -> None: ...

    def propose_rows(self, ids: list[list[int]], gammas: list[int], sampling: Sampling,
                     generators: list[torch.Generator], device: torch.device) -> RowDrafts: ...

    def commit_rows(self, lengths: list[int], hidden: torch.Tensor | None = None,
                    hidden_starts: list[int] | None = None) -> None: ...

    def keep_rows(self, rows: list[int], new: int = 0) -> None: ...


def draft_tokens(draft: Any, context: torch.Tensor, start: int, gamma: int, sampling: Sampling,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Algorithm 1, lines 1-3, with a draft model: for i = 1..gamma, q_i = M_q(prefix +
    x_1..x_{i-1}) and x_i ~ q_i.

    context: [1, T] tokens the draft has not seen yet (T >= 1: the prompt on the first
    iteration, then the sequence's last token or two), placed at slots from start on.
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
        logits = draft(context, calls.chain(start, context.shape[1], context.device))[0, -1]
        start += context.shape[1]
        x_i = draw(logits, sampling, generator, probs)
        tokens.append(x_i)
        context = x_i.view(1, 1)
    return torch.stack(tokens), None if sampling.greedy else torch.stack(probs)


def draw(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator,
         probs: list[torch.Tensor]) -> torch.Tensor:
    """Line 3 for one position: x ~ q = warp(logits), q appended to ``probs``; at temperature 0
    the argmax, without building the one-hot q (see draft_tokens)."""
    if sampling.greedy:
        return logits.argmax()
    q = warp(logits, sampling)
    probs.append(q)
    return sample(q, generator)


def draw_rows(logits: torch.Tensor, sampling: Sampling, generators: list[torch.Generator | None],
              probs: list[torch.Tensor]) -> torch.Tensor:
    """Line 3 for every row at once: logits [B, V] -> tokens [B], row b drawn with generators[b]
    exactly as :func:`draw` would draw it alone (a row whose generator is None draws
    nothing); q [B, V] appended to ``probs`` unless greedy."""
    if sampling.greedy:
        return logits.argmax(-1)
    q = warp(logits, sampling)
    probs.append(q)
    return sample_rows(q, generators)


def drafted_rows(tokens: list[torch.Tensor], probs: list[torch.Tensor], gammas: list[int], calls: int,
                 device: torch.device) -> RowDrafts:
    """Per-step drafts of a batch (tokens [B] and q [B, V] per step) as RowDrafts."""
    if not tokens:
        return RowDrafts(torch.empty(len(gammas), 0, dtype=torch.long, device=device), list(gammas))
    q = torch.stack(probs, dim=1) if probs else None  # [B, steps, V]
    return RowDrafts(torch.stack(tokens, dim=1), list(gammas), q, calls)


def pad_rows(rows: list[list[int]], device: torch.device, width: int | None = None) -> torch.Tensor:
    """Token rows of different lengths (host lists) as one [B, width] batch on the device,
    padded at the end with 0 (a ragged call: the model ignores what the padding computes, see
    model.model); one copy to the device."""
    width = max(1, max(map(len, rows))) if width is None else width
    return torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.long, device=device)


class ModelDrafter:
    """The paper's M_q: a smaller model of the target's family, with its own KV cache.

    Its rollback is writing at an earlier slot (docs/kv_cache.md): a chain call at slot s
    overwrites the cache from s on, so the drafter only remembers ``next``, its first cache
    slot not holding a token of the sequence. It is fed the last token and x_1..x_{gamma-1},
    never its own last proposal x_gamma, so after proposing next = L + gamma - 1; after
    verification (length L') everything before the newest token is valid at most:
    next = min(next, L' - 1). When all gamma were accepted, its next call therefore feeds
    [x_gamma, t] together, and it never re-runs a proposal.

    The model is used only through its cached call ``model(tokens, call)``, ``setup_cache``,
    ``move_cache`` and
    ``config.vocab_size`` / ``config.max_seq_len``.
    """

    reads_features = False

    def __init__(self, model: Any) -> None:
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.max_seq_len = model.config.max_seq_len
        self.next = 0

    def start(self, cache_len: int, target: Any = None) -> None:
        self.model.setup_cache(1, cache_len)
        self.next = 0

    def propose(self, seq: torch.Tensor, ids: list[int], gamma: int, sampling: Sampling,
                generator: torch.Generator) -> Draft:
        length = len(ids)
        tokens, q = draft_tokens(self.model, seq[:, self.next:length], self.next, gamma, sampling, generator)
        self.next = length + gamma - 1
        return Draft(tokens, q, calls=gamma)

    def propose_tree(self, seq: torch.Tensor, ids: list[int], branching: Sequence[int], mode: str,
                     sampling: Sampling, generator: torch.Generator) -> tuple[TokenTree, int]:
        """A tree of the static shape ``branching`` (speculative.tree_drafting): one call that
        catches up to the sequence and gives the root's distribution, then one call per
        further depth over all nodes so far, placed after the sequence with tree attention
        (the nodes are re-fed each time: a call of a small draft costs its fixed overhead
        more than its rows). Its cache slots from L on then hold tree nodes: next = L."""
        length = len(ids)
        root = self.model(seq[:, self.next:length], calls.chain(self.next, length - self.next, seq.device))[0, -1]
        self.next = length

        def expand(tokens: torch.Tensor, parents: list[int], depths: list[int], rows: list[int]) -> torch.Tensor:
            tree = TokenTree(tokens, parents, mode="deterministic")
            logits = self.model(tokens.view(1, -1), calls.tree(length, 0, tree, tokens.device))[0]
            return logits[torch.tensor(rows, device=logits.device)]

        tree = grow_tree(root, expand, branching, mode, sampling, generator)
        return tree, len(branching)

    def commit(self, length: int, hidden: torch.Tensor | None = None, hidden_start: int = 0) -> None:
        self.next = min(self.next, length - 1)

    # ------------------------------------------------------------------------- rows (a batch)
    def start_rows(self, max_rows: int, cache_len: int, target: Any = None) -> None:
        self.model.setup_cache(max_rows, cache_len)
        self.row_next: list[int] = []

    def propose_rows(self, ids: list[list[int]], gammas: list[int], sampling: Sampling,
                     generators: list[torch.Generator], device: torch.device) -> RowDrafts:
        """draft_tokens for every row in one draft call per step: the first call catches each
        row up (its own number of tokens, padded), later ones feed each row's x_i. A row that
        has drafted its gamma (fewer, near its limits) feeds a placeholder that it writes at
        its first unused slot, and draws nothing."""
        steps = max(gammas, default=0)
        if steps == 0:
            return drafted_rows([], [], gammas, 0, device)
        starts = list(self.row_next)
        feeds = [row[nxt:] if g else row[:1] for row, nxt, g in zip(ids, starts, gammas)]
        widths = [len(f) if g else 0 for f, g in zip(feeds, gammas)]
        batch, tokens, probs = pad_rows(feeds, device), [], []
        last = torch.tensor([max(w - 1, 0) for w in widths], device=device)
        rows = torch.arange(len(ids), device=device)
        for i in range(steps):
            call = calls.ragged(starts, batch.shape[1], self.model.cache_len, device)
            logits = self.model(batch, call)[rows, last]  # [B, V]: each row's newest position
            live = [gen if g > i else None for gen, g in zip(generators, gammas)]
            tokens.append(draw_rows(logits, sampling, live, probs))
            starts = [s + w if g > i else s for s, w, g in zip(starts, widths, gammas)]
            batch, widths, last = tokens[-1].view(-1, 1), [1] * len(ids), torch.zeros_like(last)
        self.row_next = [len(row) + g - 1 if g else nxt for row, g, nxt in zip(ids, gammas, self.row_next)]
        return drafted_rows(tokens, probs, gammas, steps, device)

    def commit_rows(self, lengths: list[int], hidden: torch.Tensor | None = None,
                    hidden_starts: list[int] | None = None) -> None:
        self.row_next = [min(nxt, length - 1) for nxt, length in zip(self.row_next, lengths)]

    def keep_rows(self, rows: list[int], new: int = 0) -> None:
        if rows != list(range(len(rows))):
            self.model.move_cache(rows)
        self.row_next = [self.row_next[r] for r in rows] + [0] * new


def as_drafter(draft: Any) -> Drafter:
    """A drafter as it is, or a plain model (anything with a ``config``) wrapped in ModelDrafter."""
    if isinstance(draft, Drafter):
        return draft
    if hasattr(draft, "config") and callable(draft):
        return ModelDrafter(draft)
    raise TypeError(f"draft must be a model (with .config, callable as model(tokens, call)) or a "
                    f"drafter (start/propose/commit, see speculative.drafter), got {type(draft).__name__}")
