"""The drafter interface: what the engine (speculative.engine) needs of whatever proposes tokens.

Algorithm 1 never asks where q came from. Lines 1-3 say "draft x_1..x_gamma with their
distributions q_1..q_gamma"; lines 5-9 accept x_i with probability min(1, p_i(x_i)/q_i(x_i))
and otherwise sample from norm(max(0, p_i - q_i)). Any procedure that draws x_i from a
q_i it can report, given the sequence so far, keeps the output exactly the target's.

The engine drafts for rows (many sequences, each at its own length, each with its own random
stream); a single prompt is a batch of one. A drafter is four calls, the engine's seams:

* ``start(max_rows, cache_len, target)``: allocate (or reset) state for up to max_rows rows;
* ``propose(ids, gammas, samplings, generators, device) -> Draft``: gammas[b] tokens after
  row b's sequence ids[b] (host lists), warped with samplings[b] and drawn with
  generators[b] only, and the distributions they were drawn from, as tensors on ``device``;
* ``commit(lengths, hidden, hidden_starts)``: after verification row b has lengths[b]
  tokens; roll back whatever depended on rejected tokens. A drafter whose
  ``reads_features`` is set also gets the target's features of the positions its call
  just read (``hidden`` [rows, T, ...], row b's from position hidden_starts[b] on): the
  final norm's output (True) or the inputs of the target layers it names (a tuple);
* ``keep_rows(rows, new)``: rows 0..len(rows)-1 become the old rows ``rows`` (finished rows
  leave), followed by ``new`` fresh sequences.

A drafter that can also grow token trees has ``propose_tree(ids, branching, mode, sampling,
generator, device) -> (TokenTree, calls) | None`` for row 0 (speculative.draft.trees); the
model and feature drafters do, prompt lookup does not (its ``propose_tree`` is the default, None:
:func:`grows_trees` asks).

A drafter that keeps something of a request for the requests after it (suffix decoding's store of
earlier responses, speculative.draft.responses) has two hooks more, both optional (None: the
engine calls nothing):

* ``joined(memories)``: right after ``keep_rows(rows, new)`` with new > 0, the memory of each of
  the ``new`` rows, in order: what the caller gave Engine.add as ``memory`` (serve.py: the
  partition of the store for the request's API key), None by default. A drafter reads, for a row,
  only the memory that row joined with;
* ``finished(rows, ids, prompt_lengths)``: right before ``keep_rows`` drops rows that ended
  (finished or cancelled; not those that failed), their indexes among the current rows, their
  whole sequences and their prompts' lengths.

A memory changes what is proposed, never the output's law: that is exact whatever is proposed,
as long as q says what it was drawn from (one-hot for a copied token), so it changes speed only.

A drafter whose chain has a length of its own (suffix decoding, a hybrid) may choose that length
by what an iteration costs on the machine. It has one hook more, optional too:

* ``priced(costs)``: a speculative.draft.costs.IterationCosts, the seconds of an iteration by
  the number of tokens it verifies (and, for a hybrid, with its model drafting), measured once
  per machine and set-up (speculative.cli.costs.iteration_costs); given before the first
  ``start``, or between runs. Costs are constants of a run, never its clock, so a seeded run
  still repeats.

A drafter with a cache of its own may keep what it read of a finished row for the row that goes on
from it (Engine.add's ``continues``: a conversation's next turn), with one hook more, optional too
(None: the engine calls nothing, and the drafter reads the new row from 0 as any new row):

* ``resumed(rows, shared)``: right after ``keep_rows(rows, new)`` (and ``joined``) added them,
  the indexes of new rows whose first ``shared[i]`` tokens are those of the row that last left
  the same slot of the caches, and which the target will not read again: its call starts at
  ``shared[i]``, so a drafter that reads the target's features gets them from there on only. A
  drafter keeps what it computed from those tokens in that slot (what it holds of the row that
  left it: :func:`left_behind` keeps count) and reads the rest as for a new row. The engine calls it
  only in an engine of one row, whose slot no other row used since. A drafter that reads the
  target's features and has no such hook makes the target read the row from 0.

Besides the four calls, the engine and the tools read a few attributes, all declared on
:class:`Drafter` with the value that a drafter without them has (:data:`DEFAULTS`, read with
:func:`trait`): what it reads of the target (``reads_features``), the ids and lengths it can
handle (``vocab_size``, ``max_seq_len``), whether one call drafts the whole chain
(``parallel``: gamma="auto" then weighs a call's cost once, not per token), the networks it
runs (``model``, a draft model; ``head``, a head on the target's features), which the set-ups
of model/fast prepare and the benchmarks time, ``propose_tree``, ``joined``, ``finished``,
``priced`` and ``resumed``. A head is read the same
way: :class:`Head`, :data:`HEAD_DEFAULTS`, :func:`head_trait`. Nothing else of a drafter or a
head is read anywhere.

A draft handed to the loops may also be a plain model (:func:`is_model`: anything callable with
a ``config``), which they wrap in a ModelDrafter (speculative.draft.model.as_drafter).

A deterministic drafter (prompt lookup, or any drafter at temperature 0) reports q = None:
its q is one-hot on each token it proposed. Algorithm 1 then accepts x with probability
p(x), and the residual is p with x removed and renormalised; the engine builds the one-hot
rows only where it needs them (temperature > 0).

The drafters that implement it: :class:`ModelDrafter` (a smaller model of the same family,
the paper's M_q), :class:`speculative.draft.lookup.PromptLookupDrafter` (n-gram copying from the
sequence), :class:`speculative.draft.eagle.FeatureDrafter` (a head that reads the target's
own features, EAGLE), and the parallel drafters of speculative.draft.parallel (the whole chain
from one call: PARD, P-EAGLE). docs/drafters.md compares them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from speculative.sampling import Sampling, full_width, sample_rows, warp_rows
from speculative.verify.token_tree import TokenTree


@dataclass
class Draft:
    """One iteration's proposals (lines 1-3 for every row): row b drafted tokens[b, :lengths[b]]
    from q[b, :lengths[b]]. One tensor for all rows, so that the engine builds the target's
    input and reads the greedy outcome in a few operators, not a few per row. A token tree
    (one row) has its nodes in tokens[0] and its own q in ``tree``."""

    tokens: torch.Tensor  # [B, width] LongTensor; width >= max(lengths) (0 when nobody drafted)
    lengths: list[int]
    q: torch.Tensor | None = None  # [B, width, V]; None: one-hot on the tokens
    calls: int = 0  # drafter forwards (one per step for all rows; 0 for a lookup)
    tree: TokenTree | None = None

    def depth(self, b: int) -> int:
        """Positions row b drafted ahead: its chain's length, or the tree's depth."""
        return self.lengths[b] if self.tree is None else max(self.tree.depths(), default=0)


@runtime_checkable
class Drafter(Protocol):
    """Anything that proposes tokens for the engine (see the module docstring). The attributes
    may be left out: :data:`DEFAULTS` holds what the engine then takes."""

    # commit() wants the target's features (True: final; a tuple: layers)
    reads_features: bool | tuple[int, ...]
    vocab_size: int | None  # the ids it proposes lie below this (None: any id of the sequence)
    max_seq_len: int | None  # the longest sequence it can draft for (None: no limit of its own)
    parallel: (
        bool  # one call drafts the whole chain (PARD, P-EAGLE): its cost does not grow with gamma
    )
    model: Any  # the draft model it runs (a model.Llama), or None
    head: Any  # the head on the target's features it runs (a Head), or None
    # row 0's token tree (see the module docstring), or None for a drafter that drafts chains only
    propose_tree: Callable[..., tuple[TokenTree, int] | None] | None
    # the memories (Engine.add's memory) of the rows keep_rows just added, or None (no hook)
    joined: Callable[[list[Any]], None] | None
    # (rows, sequences, prompt lengths) of the rows that ended, before keep_rows drops them; or None
    finished: Callable[[list[int], list[list[int]], list[int]], None] | None
    # the measured costs of an iteration (an IterationCosts), to choose its draft length; or None
    priced: Callable[[Any], None] | None
    # (rows, shared) of the new rows that go on from the row that last left their slot; or None
    resumed: Callable[[list[int], list[int]], None] | None

    def start(self, max_rows: int, cache_len: int, target: Any) -> None: ...

    def propose(
        self,
        ids: list[list[int]],
        gammas: list[int],
        samplings: list[Sampling],
        generators: list[torch.Generator],
        device: torch.device,
    ) -> Draft: ...

    def commit(
        self,
        lengths: list[int],
        hidden: torch.Tensor | None = None,
        hidden_starts: list[int] | None = None,
    ) -> None: ...

    def keep_rows(self, rows: list[int], new: int = 0) -> None: ...


# What the engine takes for an attribute a drafter does not have (the Drafter protocol's attributes).
DEFAULTS: dict[str, Any] = {
    "reads_features": False,
    "vocab_size": None,
    "max_seq_len": None,
    "parallel": False,
    "model": None,
    "head": None,
    "propose_tree": None,
    "joined": None,
    "finished": None,
    "priced": None,
    "resumed": None,
}
DRAFTER_METHODS = ("start", "propose", "commit", "keep_rows")  # the four calls every drafter has


def trait(drafter: Any, name: str) -> Any:
    """A drafter's protocol attribute, or its default (:data:`DEFAULTS`)."""
    return getattr(drafter, name, DEFAULTS[name])


def is_drafter(obj: Any) -> bool:
    """Whether ``obj`` has the four calls of a drafter (its attributes may be left to DEFAULTS)."""
    return all(callable(getattr(obj, name, None)) for name in DRAFTER_METHODS)


def grows_trees(drafter: Any) -> bool:
    """Whether a drafter can grow token trees (its ``propose_tree`` is not the default, None)."""
    return callable(trait(drafter, "propose_tree"))


def is_model(obj: Any) -> bool:
    """Whether a draft is a plain model (callable as ``model(tokens, call)``, with a ``config``), which
    the loops wrap in a drafter, rather than a drafter."""
    return callable(obj) and hasattr(obj, "config")


@runtime_checkable
class Head(Protocol):
    """A network on the target's features that a feature drafter runs (speculative.draft.eagle,
    speculative.draft.parallel): model.feature_head.FeatureHead (EAGLE), model.eagle3_head.Eagle3Head
    (EAGLE-3) and PEagleHead (P-EAGLE). Its calls are the model's cached call, ``setup_cache``,
    ``move_cache``, ``cache_len`` and ``project``; the attributes below may be left out:
    :data:`HEAD_DEFAULTS` holds what a drafter and the set-ups of model/fast then take (the heads of
    model/ declare every one of them, since model/fast reads them there and cannot import this)."""

    config: Any  # its LLaMA shape (a model.ModelConfig): its width and longest sequence
    dtype: torch.dtype
    device: torch.device
    # what the target's calls return for it (Llama's return_hidden): its final features (True), or
    # the inputs of the target layers it names (a tuple, EAGLE-3's)
    reads_features: bool | tuple[int, ...]
    # its own output layer: its outputs [..., dim] -> logits over its draft vocabulary; None: the
    # target's output head reads its outputs, over the target's vocabulary
    draft_logits: Callable[[torch.Tensor], torch.Tensor] | None
    # () -> the target id of each id of its draft vocabulary [draft_vocab]; None without draft_logits
    target_ids: Callable[[], torch.Tensor] | None
    # (ids, the target's embedding table) -> token embeddings of its own (P-EAGLE's); None: the target's
    embed: Callable[[torch.Tensor, Any], torch.Tensor] | None

    def project(self, features: torch.Tensor) -> torch.Tensor: ...


# What a drafter and the set-ups take for an attribute a head does not have (the Head protocol's).
HEAD_DEFAULTS: dict[str, Any] = {
    "reads_features": True,
    "draft_logits": None,
    "target_ids": None,
    "embed": None,
}


def head_trait(head: Any, name: str) -> Any:
    """A head's protocol attribute, or its default (:data:`HEAD_DEFAULTS`)."""
    return getattr(head, name, HEAD_DEFAULTS[name])


def draw_rows(
    logits: torch.Tensor,
    samplings: list[Sampling],
    generators: list[torch.Generator | None],
    probs: list[torch.Tensor],
) -> torch.Tensor:
    """Line 3 for every row at once: logits [B, V] -> tokens [B], row b warped with samplings[b]
    and drawn with generators[b] (a row whose generator is None draws nothing); q [B, V]
    appended to ``probs`` unless every row is greedy.

    Greedy (temperature 0) takes a shortcut with the same result: q is one-hot on the argmax
    and sampling it returns the argmax. q is then None (one-hot on the drafted tokens, and
    verify_greedy needs only the tokens): a draft step of a small model costs about as much
    as the operators it runs, and warping and sampling would add a dozen."""
    if all(s.greedy for s in samplings):
        return logits.argmax(-1)
    q = warp_rows(full_width(logits), samplings)
    probs.append(q)
    return sample_rows(q, generators)


def drafted(
    tokens: list[torch.Tensor],
    probs: list[torch.Tensor],
    gammas: list[int],
    calls: int,
    device: torch.device,
) -> Draft:
    """Per-step drafts of a batch (tokens [B] and q [B, V] per step) as one Draft."""
    if not tokens:
        return Draft(torch.empty(len(gammas), 0, dtype=torch.long, device=device), list(gammas))
    q = torch.stack(probs, dim=1) if probs else None  # [B, steps, V]
    return Draft(torch.stack(tokens, dim=1), list(gammas), q, calls)


def left_behind(left: dict[int, Any], states: list[Any], rows: list[int]) -> dict[int, Any]:
    """What the cache slots that no row holds after ``keep_rows(rows)`` still hold: slot -> the
    drafter's own state (its ``next``, ...) of the row that last left it, for ``resumed``. ``left``:
    the same before the call, ``states``: each current row's. Rows that stay in their slots
    (rows == 0..len(rows)-1) leave the slots of the others as they were; a move writes over slots,
    and then nothing is kept. A slot that a row holds has no entry after the next call."""
    if rows != list(range(len(rows))):
        return {}
    kept = {slot: state for slot, state in left.items() if slot >= len(states)}
    kept.update({slot: states[slot] for slot in range(len(rows), len(states))})
    return kept


def pad_rows(rows: list[list[int]], device: torch.device, width: int | None = None) -> torch.Tensor:
    """Token rows of different lengths (host lists) as one [B, width] batch on the device,
    padded at the end with 0 (a ragged call: the model ignores what the padding computes, see
    model.model); one copy to the device."""
    width = max(1, max(map(len, rows))) if width is None else width
    return torch.tensor(
        [row + [0] * (width - len(row)) for row in rows], dtype=torch.long, device=device
    )


def copied_chains(found: list[list[int]], device: torch.device) -> Draft:
    """The Draft of a drafter that copies tokens rather than drawing them (prompt lookup, suffix
    decoding): row b's chain found[b] (possibly empty), q one-hot on each token, no forward."""
    width = max(map(len, found), default=0)
    return Draft(pad_rows(found, device, width), [len(chain) for chain in found])


def newest(out: torch.Tensor, widths: list[int]) -> torch.Tensor:
    """Each row's output at its last real (unpadded) position: [B, T, ...] -> [B, ...]."""
    if len(set(widths)) == 1:  # no padding (a single row, or every row fed one token)
        return out[:, -1]
    last = torch.tensor([max(w - 1, 0) for w in widths], device=out.device)
    return out[torch.arange(out.shape[0], device=out.device), last]
