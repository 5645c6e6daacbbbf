"""The one gamma policy: every way the engine decides how much to draft, asked once an iteration.

The engine drafts at most ``gamma_max`` tokens a row, or grows a token tree of a named shape. Before
each iteration something must say how many it drafts this time, and with a tree, which shape. That
decision has one owner, :class:`GammaPolicy`, which the engine asks once an iteration
(:meth:`GammaPolicy.choose`) and tells what happened once an iteration (:meth:`GammaPolicy.observe`).
For each row, in this order:

1. the row's own pinned gamma (``Engine.add(gamma=...)``; a server request's ``speculative_gamma``);
2. a chooser installed from outside (:meth:`GammaPolicy.steer`): a server's gamma by the load
   (speculative.serving.policy.LoadGamma), FixedGamma, or a measurement's schedule;
3. gamma="auto" (speculative.engine.gamma.AutoGamma: the cost model on live estimates of alpha and
   of the two calls' times, and off where whole iterations say it loses);
4. the guard over a fixed gamma or a named tree (speculative.engine.gamma.Switch: the gamma, or 0
   where this run's clock, or costs recorded once on this machine, say speculating loses);
5. the fixed gamma.

A tree's shape is the named one, or with tree="auto" the one this run measures fastest
(speculative.engine.trees.AutoTree). The engine then shrinks each row's gamma to the room the row
has left (its max_new_tokens and its context).

The guard's setting is one type along the whole path from the command line to the engine,
:class:`Guard`: off, timed by the run's clock, or by recorded costs.

The last choice is kept (:attr:`GammaPolicy.last`) and named (:attr:`GammaPolicy.name`), so that
``generate.py --json`` (``stats.gamma_policy``) and a server's metrics can say how gamma was chosen.

Changing gamma from one iteration to the next does not change the output's law: each emitted
token has the target's distribution given everything before it, whatever gamma the history led to.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from speculative.engine.gamma import AutoGamma, Switch
from speculative.engine.trees import AutoTree

GUARD_MODES = ("off", "timed", "recorded")


@dataclass(frozen=True)
class Guard:
    """Whether a fixed gamma or a named tree is turned off (plain target steps) where speculating
    loses, and by what measure: ``"off"`` never; ``"timed"`` by this run's own clock; ``"recorded"``
    by ``costs`` measured once on this machine and set-up (speculative.cli.costs): the seconds of a
    plain step and of a speculating iteration, and optionally what the first iteration after plain
    steps costs more. A recorded guard whose costs are not known yet (the command line, before it
    has read or measured them) has ``costs`` None; the engine needs them."""

    mode: str = "off"
    costs: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.mode not in GUARD_MODES:
            raise ValueError(f"a guard is one of {', '.join(GUARD_MODES)}, got {self.mode!r}")
        if self.costs is not None and self.mode != "recorded":
            raise ValueError(f"a {self.mode} guard takes no recorded costs")

    @classmethod
    def of(cls, value: Guard | bool | Sequence[float] | None) -> Guard:
        """The library's shorter forms: False or None (off), True (timed by the clock), or the
        recorded costs themselves (a tuple of seconds; an empty one is off)."""
        if isinstance(value, Guard):
            return value
        if value is None or value is False:
            return OFF
        if value is True:
            return TIMED
        costs = tuple(float(seconds) for seconds in value)
        if not costs:
            return OFF
        return cls("recorded", costs)

    @property
    def on(self) -> bool:
        return self.mode != "off"


OFF = Guard("off")
TIMED = Guard("timed")
RECORDED = Guard("recorded")  # costs not read yet: the command line's default before it reads them


@dataclass(frozen=True)
class Choice:
    """One iteration's decision: each row's gamma (before the engine's limits) and, for a tree,
    its shape (None for a chain, or when nothing is drafted)."""

    gammas: list[int]
    shape: tuple[int, ...] | None = None


class GammaPolicy:
    """Every way gamma is chosen, in one place (the module docstring gives the order).

    ``gamma_max``: the most a row drafts (a tree: its depth); 0 when there is no drafter.
    ``auto``: gamma="auto". ``guard``: a :class:`Guard` over a fixed gamma or a named tree.
    ``tree``: the named shape; ``tree_auto``: the shape by measurement. ``parallel``: the drafter
    drafts a whole chain in one call (AutoGamma models its cost so)."""

    def __init__(
        self,
        gamma_max: int,
        *,
        auto: bool = False,
        guard: Guard = OFF,
        tree: tuple[int, ...] | None = None,
        tree_auto: bool = False,
        parallel: bool = False,
    ) -> None:
        if guard.mode == "recorded" and guard.costs is None:
            raise ValueError("a recorded guard needs its costs (speculative.cli.costs reads them)")
        self.gamma_max = gamma_max
        self.tree = tree
        self.tree_auto = AutoTree() if tree_auto else None
        self.guard = guard
        self.switch = self._switch(auto, guard, parallel)
        self.outside: Callable[[Any], int] | None = None
        self.outside_name: str | None = None
        self.last: Choice | None = None

    def _switch(self, auto: bool, guard: Guard, parallel: bool) -> Switch | None:
        """The mechanism that times the run, if any: AutoGamma for gamma="auto", the guard's Switch
        over a fixed gamma or a named tree (tree="auto" measures its shapes itself)."""
        if self.gamma_max == 0:
            return None
        if auto:
            return AutoGamma(gamma_max=self.gamma_max, parallel=parallel)
        if guard.on and self.tree_auto is None:
            return Switch(self.gamma_max, recorded=guard.costs)
        return None

    # ------------------------------------------------------------------------- what it is
    @property
    def auto(self) -> bool:
        return isinstance(self.switch, AutoGamma)

    @property
    def setting(self) -> int | str:
        """What was asked for, as the statistics report it: "auto", or the fixed gamma."""
        if self.auto:
            return "auto"
        return self.gamma_max

    @property
    def name(self) -> str:
        """How gamma is chosen when a row does not pin its own: "none" (nothing drafts), the name
        given with :meth:`steer`, "auto", "tree auto", "guard (recorded costs)", "guard (timed)",
        "tree" or "fixed"."""
        if self.gamma_max == 0:
            return "none"
        if self.outside is not None:
            return self.outside_name or "outside"
        if self.auto:
            return "auto"
        if self.tree_auto is not None:
            return "tree auto"
        if self.switch is not None and self.guard.mode == "recorded":
            return "guard (recorded costs)"
        if self.switch is not None:
            return "guard (timed)"
        if self.tree is not None:
            return "tree"
        return "fixed"

    def steer(self, chooser: Callable[[Any], int] | None, name: str = "outside") -> None:
        """Hand the choice to ``chooser(engine) -> gamma`` from outside (None: take it back).
        It is asked at most once per row per iteration and must answer the same for all of them."""
        self.outside = chooser
        self.outside_name = None if chooser is None else name

    # ------------------------------------------------------------------------- the choice
    def choose(self, engine: Any, rows: Sequence[Any]) -> Choice:
        """This iteration's gamma for every row, within the room each row has left
        (``engine.room(row)``), and a tree's shape where it drafts."""
        gammas = [max(0, min(self._wanted(engine, row), engine.room(row))) for row in rows]
        shape = None
        if self.tree is not None and gammas and max(gammas) > 0:
            shape = self.tree
            if self.tree_auto is not None:
                shape = self.tree_auto.choose(engine.stats.iterations, rows[0].stats.tree_shapes)
        self.last = Choice(gammas, shape)
        return self.last

    def _wanted(self, engine: Any, row: Any) -> int:
        """The row's pinned gamma, or the engine's choice for every row (the module docstring)."""
        if self.gamma_max == 0:
            return 0
        if row.gamma is not None:
            return min(row.gamma, self.gamma_max)
        if self.outside is not None:
            return min(self.outside(engine), self.gamma_max)
        if self.switch is not None:
            return min(self.switch.choose(engine.stats.iterations), self.gamma_max)
        return self.gamma_max

    # ------------------------------------------------------------------------- what happened
    def observe(
        self, engine: Any, rows: Sequence[Any], draft: Any, steps: Sequence[Any], marks: tuple
    ) -> None:
        """One iteration's outcome: whole iterations timed start to start for the switch and the
        tree's shapes (``marks``: before proposing, scoring, verifying, after committing), and
        gamma="auto"'s alpha and call times."""
        t0, t1, t2, _ = marks
        clock = engine.clock
        iteration = engine.stats.iterations - 1
        depth = max(draft.depth(b) for b in range(len(rows)))
        tokens = sum(len(step.tokens) for step in steps) or len(rows)
        for timed in (self.switch, self.tree_auto):
            if timed is not None:
                timed.observe(iteration, depth, tokens, t0, clock)
        if not self.auto or depth == 0:
            return
        # The first iteration also read the prompts: its call times are not an iteration's.
        measured = engine.stats.iterations > 1
        verified = [
            (j + 1, overlap)
            for step in steps
            for j, overlap in enumerate(step.overlap[: step.accepted + 1])
        ]
        draft_call_s = None
        target_call_s = None
        if measured:
            draft_call_s = clock.seconds(t0, t1) / (draft.calls or depth)
            target_call_s = clock.seconds(t1, t2)
        self.switch.update(
            [overlap for _, overlap in verified],
            draft_call_s,
            target_call_s,
            positions=[position for position, _ in verified],
            width=depth + 1,
        )


__all__ = ["GUARD_MODES", "OFF", "RECORDED", "TIMED", "Choice", "GammaPolicy", "Guard"]
