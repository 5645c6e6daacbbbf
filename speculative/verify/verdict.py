"""What a verification rule returns: a :class:`Verdict` on the device, read once into a
:class:`Verification` on the host; :func:`together` reads several in one copy."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from speculative.inputs import read_host


@dataclass
class Verification:
    """The outcome of verifying one iteration's drafted tokens, on the host."""

    tokens: list[int]  # emitted: the accepted drafted tokens, then one token of the target's own
    accepted: int  # how many drafted tokens were accepted, 0..gamma
    overlap: list[float]  # expected_acceptance(p_i, q_i) for every drafted position i


@dataclass
class Verdict:
    """What a verifier decided, still on the device. Every verifier (token, block, greedy,
    tree) is pure: it takes device tensors and returns device tensors, the ``parts`` that its
    outcome is read from, and ``finish`` turns their host copies into the Verification. The
    loop reads an iteration's verdicts in ONE device -> host copy, with the target's
    finite_flag riding along (:meth:`read`, :func:`together`)."""

    parts: list[torch.Tensor]
    finish: Callable[..., Any]  # finish(*host copies of parts) -> the outcome

    def read(self, finite: torch.Tensor | None = None) -> Any:
        """The one host read (speculative.inputs.read_host, which raises NonFiniteLogitsError
        when ``finite`` is False), then the outcome."""
        return self.finish(*read_host(self.parts, finite))


def together(verdicts: Sequence[Verdict]) -> Verdict:
    """Several verdicts as one, read in one copy; its outcome is the list of theirs."""
    sizes = [len(v.parts) for v in verdicts]

    def finish(*host: list) -> list:
        out = []
        at = 0  # where this verdict's parts start in host
        for verdict, size in zip(verdicts, sizes):
            out.append(verdict.finish(*host[at : at + size]))
            at += size
        return out

    return Verdict([part for v in verdicts for part in v.parts], finish)
