"""Exact laws without sampling, of a verifier and of whole generations.

:func:`verifier_outcomes` runs a verifier once per branch of its randomness
(speculative.proofs.branching) and returns every outcome with its exact probability;
:func:`verifier_distribution` chains those laws over drafted chains and iterations on toy
models, the exact law of the first tokens of a generation. speculative.prove and the tests
use them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from speculative.proofs.branching import Branching, Broken, Contract
from speculative.sampling import Sampling, warp
from speculative.verify.token import verify_step


# ----------------------------------------------------------------------------- verifiers
def verifier_outcomes(
    verifier: Callable,
    p: torch.Tensor,
    q: torch.Tensor,
    drafted: torch.Tensor,
    branching: Branching | None = None,
) -> dict[tuple[int, ...], float]:
    """Every outcome (the emitted tokens) of ``verifier(p, q, drafted, generator)`` with its
    exact probability, the function itself run once per branch of its randomness. Raises
    Broken when an outcome breaks the verifier contract (the first ``accepted`` drafted tokens,
    then one token of the target's own), Contract when it does not return a Verdict."""
    if branching is None:
        with Branching() as fresh:
            return verifier_outcomes(verifier, p, q, drafted, fresh)
    vocab = p.shape[-1]
    xs = drafted.tolist()

    def run() -> tuple[int, ...]:
        verdict = verifier(p, q, drafted, torch.Generator().manual_seed(branching.seed))
        if not callable(getattr(verdict, "read", None)):
            raise Contract(f"returned {type(verdict).__name__}, not a speculative.verify.Verdict")
        outcome = verdict.read()
        tokens = getattr(outcome, "tokens", None)
        accepted = getattr(outcome, "accepted", None)
        if tokens is None or accepted is None:
            raise Contract(
                f"returned a Verdict that reads as {type(outcome).__name__}, not a "
                "speculative.verify.Verification"
            )
        tokens = [int(t) for t in tokens]
        if not (
            isinstance(accepted, int)
            and 0 <= accepted <= len(xs)
            and len(tokens) == accepted + 1
            and tokens[:accepted] == xs[:accepted]
            and all(0 <= t < vocab for t in tokens)
        ):
            raise Broken(
                f"for drafted {xs} it returned tokens {tokens} with accepted={accepted}: a verifier emits "
                "the first `accepted` drafted tokens, then one token of the target's own"
            )
        return tuple(tokens)

    return branching.enumerate(run)


def verifier_distribution(
    target: Any,
    draft: Any,
    prompt: tuple[int, ...],
    gamma: int,
    length: int,
    sampling: Sampling,
    verifier: Callable | None = None,
    branching: Branching | None = None,
) -> dict[tuple[int, ...], float]:
    """Exact P(first ``length`` emitted tokens) of speculative decoding with ``verifier``
    (default speculative.verify.verify_step) judging every iteration: every drafted chain
    (x_i ~ q_i, warped by the code's warp from ``draft.next_logits``), then every outcome of the
    verifier (verifier_outcomes) against p from ``target.next_logits``, iteration after iteration."""
    if verifier is None:
        verifier = verify_step
    if branching is None:
        with Branching() as fresh:
            return verifier_distribution(
                target, draft, prompt, gamma, length, sampling, verifier, fresh
            )
    warped: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
    rest: dict[tuple[int, ...], dict[tuple[int, ...], float]] = {}

    def probs(model: Any, name: str, context: tuple[int, ...]) -> torch.Tensor:
        if (name, context) not in warped:
            warped[name, context] = warp(model.next_logits(context), sampling)
        return warped[name, context]

    def law_after(context: tuple[int, ...]) -> dict[tuple[int, ...], float]:
        """P(the tokens still to come, up to ``length``) after ``context``."""
        left = length - (len(context) - len(prompt))
        if left <= 0:
            return {(): 1.0}
        if context in rest:
            return rest[context]
        out: dict[tuple[int, ...], float] = {}
        chains = [((), 1.0)]
        for _ in range(gamma):
            chains = [
                (xs + (x,), w * qx)
                for xs, w in chains
                for x, qx in enumerate(probs(draft, "q", context + xs).tolist())
                if qx > 0
            ]
        for xs, w in chains:
            p = torch.stack([probs(target, "p", context + xs[:i]) for i in range(gamma + 1)])
            q = p[:0]  # [0, V] when nothing is drafted
            if gamma:
                q = torch.stack([probs(draft, "q", context + xs[:i]) for i in range(gamma)])
            for tokens, v in verifier_outcomes(
                verifier, p, q, torch.tensor(xs, dtype=torch.long), branching
            ).items():
                head = tokens[:left]
                for tail, u in law_after(context + head).items():
                    out[head + tail] = out.get(head + tail, 0.0) + w * v * u
        rest[context] = out
        return out

    return law_after(tuple(prompt))
