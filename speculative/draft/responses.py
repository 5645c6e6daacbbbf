"""Suffix decoding across requests: a store of earlier responses, kept per partition (serve.py's API
keys), within a token budget (SuffixDecoding's global tree, Oliaro et al. 2024, arXiv 2411.04975).

speculative/draft/suffix.py indexes a row's own prompt and output. The paper also indexes the
responses of earlier requests in one global tree and matches the current suffix against both.
Here that tree is cut into **partitions**, one per API key in serve.py, so that a client's text
is never proposed for another client's request: a row reads only the partition it was admitted
with (the Drafter protocol's ``joined`` hook, Engine.add's ``memory``), and its response goes into
that partition when it ends (the ``finished`` hook).

**What is stored.** A finished row's generated tokens, preceded by the last ``max_match`` tokens of
its prompt (for a chat, the template's turn header and the end of the user's turn), so that the
first tokens of a later response can be matched on the same header. Each stored sequence is a
*response*; the trie holds every substring of it of at most ``max_depth`` tokens, with counts,
as suffix.py's index does (its Node, its rule for following the counts), ``max_depth`` being
STORE_DEPTH by default, twice the longest match: what a proposal of spec_factor 1 can reach.

**The budget.** ``max_tokens`` counts the stored tokens of every partition together: the memory
bound is the server's, whoever fills it. A response that would take the total past it evicts the
oldest responses, whichever partition holds them, until it fits (a response longer than the
budget keeps its last ``max_tokens`` tokens). Removing a response walks its substrings again and
takes their counts down, removing the nodes that reach 0, so the trie is always the one built from
scratch over the responses kept (the counts are exact; a node's ``last``, which only breaks ties,
may still name an evicted occurrence). 0 disables the store.

**Bytes.** A trie holds at most ``max_depth`` nodes per stored token, fewer where text repeats.
Its size is estimated as its node count times the bytes one node takes, measured once with
tracemalloc on a trie built here (:func:`bytes_per_node`: the Node, its children dict, and its
entry in its parent's dict). It is an estimate: CPython's allocator rounds and shares.

Thread safety: the engine's thread alone adds and reads proposals; another thread (a server's
/metrics) reads the figures through :meth:`ResponseStore.figures`, under the store's lock.
"""

from __future__ import annotations

import functools
import random
import threading
import tracemalloc
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

from speculative.draft.suffix import (
    MAX_MATCH,
    MIN_SCORE,
    SPEC_FACTOR,
    Continuation,
    Node,
    check_arguments,
    follow,
)

STORE_TOKENS = 8192  # serve.py's default budget (--suffix-cache-tokens)
# The store's trie depth: a match of up to MAX_MATCH tokens and as many after it (spec_factor 1
# proposes no more than the match's length), half suffix.py's MAX_DEPTH: half the nodes a token.
STORE_DEPTH = 2 * MAX_MATCH


class ResponseTrie:
    """The bounded-depth suffix trie of a set of sequences, each added and removed whole."""

    def __init__(self, max_depth: int = STORE_DEPTH) -> None:
        self.max_depth = max_depth
        self.root = Node()
        self.nodes = 0  # nodes below the root

    def add(self, sequence: list[int], clock: int) -> None:
        """Every substring of ``sequence`` of at most max_depth tokens, counted once per
        occurrence; ``clock`` numbers its first token for the ties (``Node.last``)."""
        for start in range(len(sequence)):
            node = self.root
            for at in range(start, min(start + self.max_depth, len(sequence))):
                child = node.children.get(sequence[at])
                if child is None:
                    child = node.children[sequence[at]] = Node()
                    self.nodes += 1
                child.count += 1
                child.last = clock + at
                node = child

    def remove(self, sequence: list[int]) -> None:
        """Undo :meth:`add` of ``sequence`` (which must have been added): a node whose count reaches
        0 leaves with what is below it, which counted the same occurrence only."""
        for start in range(len(sequence)):
            path = sequence[start : start + self.max_depth]
            node = self.root
            for depth, token in enumerate(path):
                child = node.children[token]
                child.count -= 1
                if child.count == 0:  # a chain of count-1 nodes: the rest of this path
                    del node.children[token]
                    self.nodes -= len(path) - depth
                    break
                node = child

    def matched(self, ids: list[int], max_match: int) -> tuple[Node, int]:
        """The node of the longest suffix of ``ids`` (at most max_match tokens) that occurs here
        with a token after it, and its length (the root and 0: none)."""
        for k in range(min(max_match, len(ids)), 0, -1):
            node: Node | None = self.root
            for token in ids[len(ids) - k :]:
                node = node.children.get(token)
                if node is None:
                    break
            if node is not None and node.children:
                return node, k
        return self.root, 0


@dataclass(frozen=True)
class Figures:
    """What /metrics and --plan show of a store: its budget and what it holds now (no key)."""

    max_tokens: int
    tokens: int
    nodes: int
    bytes: int  # estimated: nodes x bytes_per_node()
    # per partition holding something, by its label (str of its key; None: "anonymous"):
    # (responses, tokens)
    partitions: dict[str, tuple[int, int]]


class ResponseStore:
    """Earlier responses by partition, at most ``max_tokens`` tokens in all (see the module
    docstring). :meth:`partition` gives the view a row reads and adds to."""

    def __init__(
        self,
        max_tokens: int = STORE_TOKENS,
        max_match: int = MAX_MATCH,
        max_depth: int = STORE_DEPTH,
        spec_factor: float = SPEC_FACTOR,
        min_score: float = MIN_SCORE,
    ) -> None:
        check_arguments(None, max_match, max_depth, spec_factor, min_score)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {max_tokens!r}")
        self.max_tokens = max_tokens
        self.max_match = max_match
        self.max_depth = max_depth
        self.spec_factor = spec_factor
        self.min_score = min_score
        self.tries: dict[Hashable, ResponseTrie] = {}
        self.held: dict[Hashable, int] = {}  # tokens per partition
        self.order: deque[tuple[Hashable, list[int]]] = deque()  # every response, oldest first
        self.tokens = 0
        self.clock = 0  # tokens ever added: each occurrence's number for the ties
        self.lock = threading.Lock()

    def partition(self, key: Hashable) -> Partition:
        """The view of partition ``key``: what a row admitted under it reads and leaves."""
        return Partition(self, key)

    def add(self, key: Hashable, sequence: list[int]) -> None:
        """One response into partition ``key``, the oldest ones out until the budget holds."""
        if not self.max_tokens or not sequence:
            return
        sequence = list(sequence[-self.max_tokens :])
        with self.lock:
            while self.order and self.tokens + len(sequence) > self.max_tokens:
                self.evict()
            trie = self.tries.get(key)
            if trie is None:
                trie = self.tries[key] = ResponseTrie(self.max_depth)
                self.held[key] = 0
            trie.add(sequence, self.clock)
            self.clock += len(sequence)
            self.order.append((key, sequence))
            self.held[key] += len(sequence)
            self.tokens += len(sequence)

    def evict(self) -> None:
        """The oldest response leaves (the caller holds the lock)."""
        key, sequence = self.order.popleft()
        self.tries[key].remove(sequence)
        self.held[key] -= len(sequence)
        self.tokens -= len(sequence)
        if not self.held[key]:  # nothing left of it: not even its name is kept
            del self.tries[key]
            del self.held[key]

    def continuation(self, key: Hashable, ids: list[int], gamma: int) -> Continuation:
        """The continuation of the longest suffix of ``ids`` that partition ``key``'s responses hold,
        by suffix.py's rule (empty without a match)."""
        trie = self.tries.get(key)
        if trie is None:
            return Continuation()
        node, match = trie.matched(ids, self.max_match)
        return follow(node, match, gamma, self.spec_factor, self.min_score)

    def figures(self) -> Figures:
        with self.lock:
            nodes = sum(trie.nodes for trie in self.tries.values())
            partitions = {
                label(key): (sum(1 for k, _ in self.order if k == key), self.held[key])
                for key in self.held
            }
            tokens = self.tokens
        return Figures(self.max_tokens, tokens, nodes, nodes * bytes_per_node(), partitions)

    def most_bytes(self) -> int:
        """The most the trie can take at the budget (max_depth nodes a token), by the estimate."""
        return self.max_tokens * self.max_depth * bytes_per_node()


@dataclass(frozen=True)
class Partition:
    """One partition of a store, as a row's ``memory`` (Engine.add): what suffix.py's drafter
    reads (:meth:`continuation`) and leaves when the row ends (:meth:`add`)."""

    store: ResponseStore
    key: Hashable

    def continuation(self, ids: list[int], gamma: int) -> Continuation:
        return self.store.continuation(self.key, ids, gamma)

    def add(self, ids: list[int], prompt_length: int) -> None:
        """A finished row: its generated tokens, after its prompt's last max_match tokens."""
        if len(ids) > prompt_length:
            self.store.add(self.key, ids[max(0, prompt_length - self.store.max_match) :])


def label(key: Hashable) -> str:
    """A partition's name in /metrics: its key as text (serve.py's: the API key's number)."""
    return "anonymous" if key is None else str(key)


@functools.cache
def bytes_per_node() -> int:
    """The bytes one trie node takes, measured once with tracemalloc over the trie of a seeded
    text that repeats itself (Node, its children dict, its parent's dict entry): an estimate."""
    rng = random.Random(0)
    phrases = [[rng.randrange(2000) for _ in range(rng.randint(3, 12))] for _ in range(40)]
    text = [token for _ in range(60) for token in rng.choice(phrases)]
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    trie = ResponseTrie(STORE_DEPTH)
    trie.add(text, 0)
    taken = tracemalloc.get_traced_memory()[0] - before
    if not tracing:
        tracemalloc.stop()
    return max(1, round(taken / trie.nodes))


__all__ = [
    "STORE_DEPTH",
    "Figures",
    "Partition",
    "ResponseStore",
    "ResponseTrie",
    "STORE_TOKENS",
    "bytes_per_node",
]
