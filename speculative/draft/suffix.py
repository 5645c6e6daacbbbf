"""Suffix decoding: propose the continuation that most often followed the sequence's longest
recurring suffix (SuffixDecoding, Oliaro et al. 2024, arXiv 2411.04975).

Prompt lookup (speculative/draft/lookup.py) copies what followed the *latest* occurrence of the
sequence's suffix. Suffix decoding keeps, for every recent substring, how often each token
followed it, and builds its proposal token by token from those counts:

1. **Match.** The longest suffix of the sequence, at most ``max_match`` tokens, that also
   occurred earlier with a token after it. Without one nothing is proposed, and the iteration
   is a plain target step.
2. **Continue greedily by frequency.** From that context, take the token that most often
   followed it: its frequency is the count of (context + token) over the count of the
   context's occurrences that have a next token (ties: the token whose latest occurrence is
   the latest, as lookup prefers). The context becomes context + token, and so on. The
   proposal's score is the product of the chosen tokens' frequencies, the paper's estimate of
   the probability that the whole chain is accepted.
3. **Adaptive length.** The chain stops before a token that would take the score below
   ``min_score``, and at ``spec_factor`` × the match length, and at gamma. This is the
   paper's adaptive speculation length as this module reads it (its section on determining
   MAX_SPEC, the size of the speculation tree: MAX_SPEC = α·p grows linearly with the match
   length p, since longer matches are followed more faithfully), with Arctic Inference's names
   for α and the score's floor (``max_spec_factor``, ``min_token_prob``). The floor is its
   default, 0.1; α is 4 here where Arctic Inference's default is 1: on a CPU a target call that
   verifies a dozen tokens costs little more than one that verifies one, so a chain cut at the
   match length leaves accepted tokens unproposed (docs/drafters.md, "Suffix decoding").

The drafter is deterministic: q is one-hot on each proposed token, exactly as lookup's, so
Algorithm 1 accepts x with probability p(x) and otherwise samples from p with x removed
(speculative.draft.protocol), and the output is exactly the target's whatever it proposes.

**The structure: a suffix trie of bounded depth with counts.** Every substring of the indexed
text of at most ``max_depth`` tokens is a node, with the number of its occurrences and the
position of its latest one's last token; the children of a node are the tokens that followed
it. This is the paper's suffix tree cut at a depth (as Arctic Inference's ``max_tree_depth``),
without its path compression. It is chosen over a suffix automaton because what a proposal
reads is per-context next-token counts: in the trie they are the children's counts, kept
exact by adding one token in O(max_depth) (the nodes of the last max_depth - 1 suffixes each
gain a child or a count) and by removing the oldest start in O(max_depth). A suffix automaton
is smaller (O(n) states) but its occurrence counts live on the suffix-link tree, and an
appended token changes the counts of a whole suffix-link chain, O(n) in the worst case. A
proposal costs O(max_match) to find the match (the nodes of the current suffixes are kept) and
one step per proposed token, each a scan of the context's children.

**Memory.** Each row indexes the substrings that start in its last ``max_tokens`` tokens (a
sliding window: the oldest start leaves as a new token comes in), so a row holds at most
``max_tokens`` × ``max_depth`` nodes, far fewer where the text repeats itself. ``max_tokens``
None indexes the whole sequence up to the engine's cache length (the longest sequence it
holds, ``start``'s ``cache_len``). Every row has its own index (:class:`SuffixIndex`): rows
share nothing.

This is a chain. SuffixDecoding proposes a tree of the top continuations by score, verified at
once; growing that tree where the cost model says the wider verification pays is the next step
(``propose_tree``, speculative.draft.trees). So is the paper's choice of the best-scoring match
among several match lengths; this drafter takes the longest.

**Across requests.** A row may also have a *memory* (Engine.add's ``memory``, handed over by the
protocol's ``joined`` hook): a partition of a store of earlier responses
(speculative.draft.responses; serve.py keeps one per API key). The row's proposal is then the
better of its own index's continuation and the partition's, by the expected number of tokens
kept (:attr:`Continuation.expected`; a tie keeps the row's own), and its response goes into the
partition when it ends (the ``finished`` hook). Without a memory (generate.py) nothing crosses
requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from speculative.draft.costs import IterationCosts, best_prefix
from speculative.draft.protocol import Draft, copied_chains
from speculative.draft.registry import DrafterKind, register_drafter
from speculative.sampling import Sampling

# The defaults: the longest suffix matched, the deepest substring indexed (a match of max_match
# leaves max_depth - max_match tokens to continue), SuffixDecoding's α (the module docstring says
# why 4), and the lowest score kept.
MAX_MATCH = 8
MAX_DEPTH = 32
SPEC_FACTOR = 4.0
MIN_SCORE = 0.1
FALLBACK_MAX_TOKENS = 4096  # the window when neither the caller nor the engine gives a length


class Node:
    """A substring: how many times it occurs in the window, where its latest occurrence ends,
    and the tokens that followed it (token -> the node of substring + token)."""

    __slots__ = ("count", "last", "children")

    def __init__(self) -> None:
        self.count = 0
        self.last = -1  # the position of the last token of its latest occurrence
        self.children: dict[int, Node] = {}


@dataclass
class Continuation:
    """A proposal: the tokens, each one's frequency after its context, and the match length."""

    tokens: list[int] = field(default_factory=list)
    frequencies: list[float] = field(default_factory=list)
    match: int = 0

    @property
    def score(self) -> float:
        """The product of the frequencies: the estimated chance that the whole chain is kept."""
        score = 1.0
        for f in self.frequencies:
            score *= f
        return score

    @property
    def expected(self) -> float:
        """The expected number of its tokens kept, by the same estimate: the sum over its prefixes
        of their chance to be kept whole (f1 + f1 f2 + ...; the paper's score of a speculation
        tree, a sum over its nodes, for a chain). 0 for an empty proposal."""
        return self.expected_by_length()[-1] if self.tokens else 0.0

    def expected_by_length(self, scale: float = 1.0) -> list[float]:
        """For k = 1..len(tokens), the expected number of the first k tokens kept (f1, f1 + f1 f2,
        ...), each times ``scale`` (how the estimates have come out so far, by a caller that
        keeps that record)."""
        totals = []
        total = 0.0
        kept = 1.0
        for f in self.frequencies:
            kept *= f
            total += kept
            totals.append(scale * total)
        return totals

    def cut(self, length: int) -> Continuation:
        """Its first ``length`` tokens."""
        return Continuation(self.tokens[:length], self.frequencies[:length], self.match)

    def priced(
        self, costs: IterationCosts | None, scale: float = 1.0
    ) -> tuple[Continuation, float]:
        """The prefix worth verifying by the measured ``costs`` (costs.best_prefix: the most
        expected tokens per second, none where a plain step is faster), and its expected tokens
        per second; the whole chain, and no rate (0), without costs."""
        if costs is None:
            return self, 0.0
        length, rate = best_prefix(self.expected_by_length(scale), costs)
        return self.cut(length), rate


@dataclass
class Calibration:
    """How one row's estimates have come out: the copied tokens the target kept, against the number
    its chains' frequencies expected. Frequencies are counts in the text, not the target's
    probabilities: a target that samples keeps far fewer copied tokens than the counts say, a
    greedy one that copies its input often more. Measured costs weigh a chain's estimate by
    ``scale`` before choosing its length (Continuation.priced)."""

    accepted: float = 0.0
    estimated: float = 0.0

    @property
    def scale(self) -> float:
        """(accepted + 1) / (estimated + 1): 1 before the row has drafted."""
        return (self.accepted + 1.0) / (self.estimated + 1.0)


def most_frequent(children: dict[int, Node]) -> int:
    """The token that most often followed; of equal counts, the one seen latest."""
    return max(children, key=lambda t: (children[t].count, children[t].last))


class SuffixIndex:
    """The bounded-depth suffix trie of one sequence's last ``max_tokens`` tokens, kept up to
    date as the sequence grows (see the module docstring)."""

    def __init__(
        self,
        max_tokens: int = FALLBACK_MAX_TOKENS,
        max_match: int = MAX_MATCH,
        max_depth: int = MAX_DEPTH,
        spec_factor: float = SPEC_FACTOR,
        min_score: float = MIN_SCORE,
    ) -> None:
        self.max_tokens = max_tokens
        self.max_match = max_match
        self.max_depth = max_depth
        self.spec_factor = spec_factor
        self.min_score = min_score
        self.root = Node()
        self.seen: list[int] = []  # the ids indexed so far (a prefix of every later sequence)
        self.start = 0  # the first position whose substrings are indexed (the window's start)
        # suffixes[k]: the node of the last k tokens, k = 0 .. min(max_depth - 1, len(seen))
        self.suffixes: list[Node] = [self.root]

    def reset(self) -> None:
        self.__init__(
            self.max_tokens, self.max_match, self.max_depth, self.spec_factor, self.min_score
        )

    def update(self, ids: list[int]) -> None:
        """Index the tokens added since the last call (a different sequence: start over)."""
        if ids[: len(self.seen)] != self.seen:
            self.reset()
        for token in ids[len(self.seen) :]:
            self.append(token)

    def append(self, token: int) -> None:
        """One token more: each of the last max_depth - 1 suffixes gains it as a child, and the
        oldest start leaves once the window is full."""
        position = len(self.seen)
        self.seen.append(token)
        grown = [self.root]
        for node in self.suffixes[: self.max_depth]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = Node()
            child.count += 1
            child.last = position
            grown.append(child)
        self.suffixes = grown[: self.max_depth]  # the node of max_depth tokens gets no children
        if len(self.seen) - self.start > self.max_tokens:
            self.evict()

    def evict(self) -> None:
        """Forget the substrings that start at the window's first position (its oldest
        occurrences: each node's latest occurrence stays where it was, unless it was the only)."""
        path = self.seen[self.start : self.start + self.max_depth]
        self.start += 1
        node = self.root
        for token in path:
            child = node.children[token]
            child.count -= 1
            if child.count == 0:  # its whole subtree counted this occurrence only
                del node.children[token]
                return
            node = child

    def continuation(self, ids: list[int], gamma: int) -> Continuation:
        """The longest recurring suffix of ``ids``, continued greedily by frequency (see the
        module docstring); empty without a match."""
        self.update(ids)
        longest = min(self.max_match, len(self.suffixes) - 1)
        match = next((k for k in range(longest, 0, -1) if self.suffixes[k].children), 0)
        return follow(self.suffixes[match], match, gamma, self.spec_factor, self.min_score)


def follow(
    node: Node, match: int, gamma: int, spec_factor: float, min_score: float
) -> Continuation:
    """The chain from ``node`` (the context of a match of ``match`` tokens), greedily by frequency,
    within the adaptive length (steps 2 and 3 of the module docstring)."""
    found = Continuation(match=match)
    limit = min(gamma, int(spec_factor * match))
    score = 1.0
    while len(found.tokens) < limit and node.children:
        token = most_frequent(node.children)
        child = node.children[token]
        frequency = child.count / sum(c.count for c in node.children.values())
        if score * frequency < min_score:
            break
        score *= frequency
        found.tokens.append(token)
        found.frequencies.append(frequency)
        node = child
    return found


def check_arguments(
    max_tokens: int | None, max_match: int, max_depth: int, spec_factor: float, min_score: float
) -> None:
    """Refuse settings under which the index cannot work (ValueError, with which one)."""
    for name, value in (("max_match", max_match), ("max_depth", max_depth)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if max_match >= max_depth:
        raise ValueError(
            f"max_match ({max_match}) must be below max_depth ({max_depth}): a match needs room to continue"
        )
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise ValueError(f"max_tokens must be an integer or None, got {max_tokens!r}")
        if max_tokens < max_depth:
            raise ValueError(
                f"max_tokens ({max_tokens}) must be at least max_depth ({max_depth}): the window holds the current suffixes"
            )
    if not spec_factor > 0:
        raise ValueError(f"spec_factor must be > 0, got {spec_factor!r}")
    if not 0 <= min_score <= 1:
        raise ValueError(f"min_score must lie in [0, 1], got {min_score!r}")


class SuffixDrafter:
    """Propose, for each row, the most frequent continuation of its longest recurring suffix."""

    reads_features = False
    vocab_size = None  # it proposes ids taken from the sequence, which the engine has checked
    max_seq_len = None

    def __init__(
        self,
        max_tokens: int | None = None,
        max_match: int = MAX_MATCH,
        max_depth: int = MAX_DEPTH,
        spec_factor: float = SPEC_FACTOR,
        min_score: float = MIN_SCORE,
    ) -> None:
        check_arguments(max_tokens, max_match, max_depth, spec_factor, min_score)
        self.max_tokens = max_tokens  # None: the engine's cache length (start's cache_len)
        self.max_match = max_match
        self.max_depth = max_depth
        self.spec_factor = spec_factor
        self.min_score = min_score
        self.window = max_tokens or FALLBACK_MAX_TOKENS
        self.rows: list[SuffixIndex] = []
        # each row's share of a store of earlier responses (joined: a server's partition for the
        # request's API key, speculative.draft.responses), or None: the row's own text alone
        self.memories: list[Any] = []
        # what an iteration costs by the tokens it verifies (the priced hook), or None: the
        # whole chain is proposed, as long as min_score, spec_factor and gamma let it run
        self.costs: IterationCosts | None = None
        # each row's record of its estimates against what was kept, and this iteration's
        # proposal (the length it followed, its unscaled estimate), or None where it drafted none
        self.calibrations: list[Calibration] = []
        self.pending: list[tuple[int, float] | None] = []

    def start(self, max_rows: int = 0, cache_len: int = 0, target: Any = None) -> None:
        self.rows = []
        self.memories = []
        self.calibrations = []
        self.pending = []
        if self.max_tokens is None:
            self.window = max(cache_len, self.max_depth) if cache_len else FALLBACK_MAX_TOKENS

    def index(self) -> SuffixIndex:
        """A fresh row's index."""
        return SuffixIndex(
            self.window, self.max_match, self.max_depth, self.spec_factor, self.min_score
        )

    def propose(
        self,
        ids: list[list[int]],
        gammas: list[int],
        samplings: list[Sampling],
        generators: list[torch.Generator],
        device: torch.device,
    ) -> Draft:
        found = []
        self.pending = []
        for b, (row_ids, g) in enumerate(zip(ids, gammas)):
            chain = self.proposal(b, row_ids, g)
            found.append(chain.tokens)
            self.pending.append((len(row_ids), chain.expected) if chain.tokens else None)
        return copied_chains(found, device)

    def proposal(self, b: int, ids: list[int], gamma: int) -> Continuation:
        """Row b's chain as drafted: its continuation, cut where measured costs are known by the
        tokens per second its estimate promises, scaled by the row's calibration."""
        if not gamma:
            return Continuation()
        chain = self.continuation(b, ids, gamma)
        return chain.priced(self.costs, self.calibrations[b].scale)[0]

    def priced(self, costs: IterationCosts) -> None:
        """What an iteration costs by the tokens it verifies, measured on this machine (the
        protocol's hook): from now on each chain is cut to the prefix with the most expected
        tokens per second (Continuation.priced, the estimate scaled by the row's Calibration), and
        a chain that no prefix makes worth more than a plain step is not proposed."""
        self.costs = costs

    def continuation(self, b: int, ids: list[int], gamma: int) -> Continuation:
        """Row b's proposal: its own index's continuation, or the one its memory of earlier
        responses gives where that one expects more tokens kept (Continuation.expected; a tie
        keeps the row's own, from the request's own text)."""
        own = self.rows[b].continuation(ids, gamma)
        memory = self.memories[b]
        if memory is None:
            return own
        earlier = memory.continuation(ids, gamma)
        if earlier.expected > own.expected:
            return earlier
        return own

    def commit(
        self,
        lengths: list[int],
        hidden: torch.Tensor | None = None,
        hidden_starts: list[int] | None = None,
    ) -> None:
        # nothing to roll back (the indexes hold only the sequences' own tokens); each proposal's
        # outcome goes into its row's calibration: the tokens kept, the last one the target's own
        for calibration, pending, length in zip(self.calibrations, self.pending, lengths):
            if pending is not None:
                calibration.accepted += max(0, length - pending[0] - 1)
                calibration.estimated += pending[1]
        self.pending = []

    def keep_rows(self, rows: list[int], new: int = 0) -> None:
        self.rows = [self.rows[r] for r in rows] + [self.index() for _ in range(new)]
        self.memories = [self.memories[r] for r in rows] + [None] * new
        self.calibrations = [self.calibrations[r] for r in rows] + [
            Calibration() for _ in range(new)
        ]
        self.pending = []

    def joined(self, memories: list[Any]) -> None:
        """The memories of the rows that keep_rows just added, the last ``len(memories)`` rows (the
        protocol's hook): a partition of a store of earlier responses each, or None."""
        if memories:
            self.memories[-len(memories) :] = memories

    def finished(self, rows: list[int], ids: list[list[int]], prompt_lengths: list[int]) -> None:
        """Rows that end (the protocol's hook, before keep_rows drops them): each one's response
        goes into its memory, for the requests that come after it under the same key."""
        for b, sequence, prompt_length in zip(rows, ids, prompt_lengths):
            memory = self.memories[b]
            if memory is not None:
                memory.add(sequence, prompt_length)


register_drafter(
    DrafterKind(
        "suffix",
        "suffix decoding: the most frequent continuation of the longest recurring suffix, no model at all",
        build=lambda network, target: SuffixDrafter(),
        toy="speculative.draft.suffix:SuffixDrafter",
    )
)
