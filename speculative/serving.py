"""Requests that arrive over time, on the one production engine (speculative.engine), with
speculation decided by the load.

:class:`EngineLoop` owns an :class:`~speculative.engine.Engine` in one thread: a thread of
its own (:meth:`~EngineLoop.start`), or the caller's (:meth:`~EngineLoop.here`, then
:meth:`~EngineLoop.run`; serve.py runs it in the thread that loaded the models, see
:meth:`~EngineLoop.here`). Other threads (a server's event loop) :meth:`~EngineLoop.submit` a
:class:`Ticket` and may :meth:`~EngineLoop.cancel` it; the loop adds new requests and cancels rows between
iterations, steps the engine while it holds rows, and reports every iteration's tokens and
each request's end through the ticket's callbacks. The waiting queue is bounded: a request
beyond it is refused with :class:`OverloadedError`, which says when to come back.

:class:`LoadGamma` is the engine's policy (``engine.policy``): before every iteration it
picks the gamma, 0 (no speculation) included, that maximises the cost model's tokens per
second at the current batch size B (docs/batching.md)::

    gamma*(B) = argmax_g  tau(alpha, g) / cost(B, g),   tau(alpha, g) = (1 - alpha^(g+1)) / (1 - alpha)
    cost(B, g) = g D(B) + T(B, g + 1) + V(B)            (tau(alpha, 0) = 1: a plain target step)

with alpha the live acceptance rate (faded over the last few hundred verified positions, as
gamma="auto" estimates it) and the iteration's parts measured on this machine as functions
of B: D the draft steps, T the target call of B rows x (g + 1) tokens, V the rest (verifying,
committing, the rows moving, and whatever the server's own work takes from the CPU).
:meth:`LoadGamma.calibrate` measures every (B, g) at start-up on the engine itself (B = 1, 2,
4, ... max_rows; sizes between are interpolated); every iteration served updates its own cell,
and two in every 32 try a gamma next to the choice, so that both sides of it stay measured. No
threshold is set by hand: the crossover where speculation stops paying is where the measured
costs put it.

Exactness: every row samples from its own generator, so a request's tokens do not depend on
the other requests; a row's gamma only changes which tokens a seed gives, never their
distribution (speculative.gamma). A pinned gamma (``Ticket.gamma``) keeps a seed's tokens
those of generate.py with that gamma, whatever the load.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from speculative.engine import Engine, Row
from speculative.gamma import expected_tokens_per_iteration
from speculative.sampling import Sampling

GREEDY = Sampling(temperature=0.0)
WINDOW_S = 10.0  # /metrics' rates are over the last this many seconds


# ----------------------------------------------------------------------------- the policy
@dataclass
class Iteration:
    """What one engine step did, as the loop saw it."""

    rows: int  # B: rows that took part
    gamma: int  # the most any of them drafted (0: nobody speculated)
    seconds: float  # the whole step
    draft_s: float
    target_s: float
    tokens: int  # emitted, all rows
    overlap: float  # sum over verified positions of sum_x min(p, q)
    positions: int  # verified draft positions
    clean: bool  # no prompt read and no draft catching up: its times are an iteration's cost


class LoadGamma:
    """The engine's gamma for the next iteration, from the cost model at the current batch size
    (see the module docstring). Call it as ``engine.policy``; feed it every iteration with
    :meth:`observe`."""

    def __init__(self, gamma_max: int, max_rows: int, decay: float = 0.8, fade: float = 0.99,
                 explore_every: int = 32) -> None:
        if gamma_max < 1 or max_rows < 1:
            raise ValueError(f"gamma_max and max_rows must be >= 1, got {gamma_max} and {max_rows}")
        self.gamma_max, self.max_rows = gamma_max, max_rows
        self.decay, self.fade = decay, fade  # the costs' moving average; alpha's counts, per position
        self.explore_every = explore_every  # two iterations in this many re-measure a neighbour of the choice
        self.cells: dict[tuple[int, int], list[float]] = {}  # (B, g) -> [draft, target, rest] seconds
        self.accepted_mass, self.positions = 0.0, 0.0  # faded sum of acceptance probabilities, and count
        self.chosen: tuple[int, int] = (-1, 0)  # (iteration, gamma): decided once per iteration
        self.last_gamma = gamma_max

    @property
    def alpha(self) -> float:
        """(S + 1) / (N + 2) over the faded counts: 1/2 before anything is verified."""
        return (self.accepted_mass + 1) / (self.positions + 2)

    def __call__(self, engine: Engine) -> int:
        iteration = engine.stats.iterations
        if self.chosen[0] != iteration:  # the engine asks once per row
            self.chosen = (iteration, self.choose(len(engine.rows), iteration))
        return self.chosen[1]

    def choose(self, rows: int, iteration: int) -> int:
        """best(rows); but two iterations in every explore_every speculate with a neighbouring
        gamma (0..gamma_max, alternately above and below the choice), so that the costs on both
        sides of the choice stay measured live, as the server's own work and the machine change
        them, not only at start-up. Two in a row, because the first iteration after plain steps
        lets the draft catch up and is not an iteration's cost."""
        gamma = self.best(rows)
        if not self.explore_every or iteration % self.explore_every > 1:
            return gamma
        neighbours = [g for g in (gamma + 1, gamma - 1) if 0 <= g <= self.gamma_max]
        return neighbours[(iteration // self.explore_every) % len(neighbours)]

    def cost(self, rows: int, gamma: int) -> float | None:
        """Seconds of one iteration of ``rows`` rows drafting ``gamma``: measured at this B, else
        interpolated linearly between the nearest measured sizes (scaled from the largest above
        them); None when nothing is known for this gamma."""
        known = sorted(b for b, g in list(self.cells) if g == gamma)  # a copy: the loop's thread may add a cell
        if not known:
            return None
        if rows in known:
            return sum(self.cells[rows, gamma])
        below, above = [b for b in known if b < rows], [b for b in known if b > rows]
        if below and above:
            lo, hi = below[-1], above[0]
            w = (rows - lo) / (hi - lo)
            return (1 - w) * sum(self.cells[lo, gamma]) + w * sum(self.cells[hi, gamma])
        nearest = above[0] if above else below[-1]
        return sum(self.cells[nearest, gamma]) * (1 if above else rows / nearest)

    def rate(self, rows: int, gamma: int, alpha: float | None = None) -> float | None:
        """Expected tokens per second per row: tau(alpha, gamma) / cost(B, gamma)."""
        seconds = self.cost(rows, gamma)
        if seconds is None or seconds <= 0:
            return None
        return expected_tokens_per_iteration(self.alpha if alpha is None else alpha, gamma) / seconds

    def best(self, rows: int) -> int:
        """The gamma with the highest expected rate at ``rows`` rows (the smaller on a tie); the
        largest gamma until anything is measured."""
        rates = [(r, -g) for g in range(self.gamma_max + 1) if (r := self.rate(max(rows, 1), g)) is not None]
        return -max(rates)[1] if rates else self.gamma_max

    def speedup(self, rows: int, gamma: int) -> float | None:
        """The cost model's speedup of ``gamma`` over no speculation at ``rows`` rows."""
        on, off = self.rate(rows, gamma), self.rate(rows, 0)
        return on / off if on is not None and off else None

    def observe(self, it: Iteration) -> None:
        """One iteration: its verified positions into alpha, its clean times into its (B, g) cell."""
        if it.positions:
            faded = self.fade ** it.positions
            self.accepted_mass = faded * self.accepted_mass + it.overlap
            self.positions = faded * self.positions + it.positions
        if it.clean and it.rows:
            self.record(it.rows, it.gamma, [it.draft_s, it.target_s, max(0.0, it.seconds - it.draft_s - it.target_s)])
        self.last_gamma = it.gamma

    def record(self, rows: int, gamma: int, parts: Sequence[float], weight: float | None = None) -> None:
        """Fold measured [draft, target, rest] seconds into the (rows, gamma) cell."""
        old = self.cells.get((rows, gamma))
        keep = self.decay if weight is None else 1 - weight
        self.cells[rows, gamma] = list(parts) if old is None else [keep * o + (1 - keep) * p for o, p in
                                                                   zip(old, parts)]

    def calibrate(self, engine: Engine, prompt: Sequence[int], sizes: Sequence[int] | None = None,
                  rounds: int = 5) -> float:
        """Measure every gamma's iteration at each batch size in ``sizes`` (default 1, 2, 4, ...,
        max_rows) on ``engine`` itself, before it serves: B greedy rows of ``prompt`` step with
        gamma 0, 1, ..., gamma_max in turn, ``rounds`` times (so that a slow moment of a shared
        machine falls on every gamma alike), and each cell keeps its median. The positions it
        verified seed alpha (weighted as the last 1 / (1 - fade) of them at most, so that live
        traffic soon outweighs them). Leaves the engine idle with this policy installed, and
        returns the seconds it took."""
        start = time.perf_counter()
        sizes = sorted(set(sizes or [*(2 ** k for k in range(max_rows_log(self.max_rows) + 1)), self.max_rows]))
        per_row = rounds * sum(g + 2 for g in range(self.gamma_max + 1)) + 2
        count = min(per_row, engine.row_limit - len(prompt) - 1)
        if count < per_row:
            raise ValueError(f"calibration needs {per_row} tokens after a {len(prompt)}-token prompt; the context "
                             f"holds {engine.row_limit}")
        fixed = engine.policy = FixedGamma(0)
        try:
            for size in sizes:
                rows = [engine.add(prompt, count, sampling=GREEDY, seed=0) for _ in range(size)]
                engine.step()  # reads the prompts
                times: dict[int, list[list[float]]] = {g: [] for g in range(self.gamma_max + 1)}
                for _ in range(rounds):
                    for fixed.gamma in range(self.gamma_max + 1):
                        if fixed.gamma == 1:
                            engine.step()  # the draft catches up on what the plain steps emitted
                        times[fixed.gamma].append(timed_step(engine))
                for gamma, parts in times.items():
                    self.record(size, gamma, [sorted(column)[len(column) // 2] for column in zip(*parts)], weight=1.0)
                for row in rows:  # what the calibration verified seeds alpha (else 1/2 until traffic comes)
                    self.accepted_mass += row.stats.overlap_sum
                    self.positions += row.stats.verified_positions
                for row in rows:
                    engine.cancel(row)
                engine.step()  # they leave
        finally:
            engine.policy = self
            engine.finished.clear()
        window = 1 / (1 - self.fade)  # live traffic outweighs the calibration after about this many positions
        if self.positions > window:
            self.accepted_mass, self.positions = self.accepted_mass * window / self.positions, window
        return time.perf_counter() - start

    def table(self) -> list[tuple[int, int, float | None]]:
        """For every batch size, the gamma the policy would choose now and its predicted speedup."""
        out = []
        for rows in range(1, self.max_rows + 1):
            gamma = self.best(rows)
            out.append((rows, gamma, self.speedup(rows, gamma) if gamma else 1.0))
        return out


def max_rows_log(max_rows: int) -> int:
    return max(0, int(math.floor(math.log2(max_rows))))


def timed_step(engine: Engine) -> list[float]:
    """One engine step's [draft, target, rest] seconds (the engine's own marks, on a CPU)."""
    stats = engine.stats
    before = (stats.draft_time_s, stats.target_time_s)
    start = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - start
    settle(engine)
    draft, target = stats.draft_time_s - before[0], stats.target_time_s - before[1]
    return [draft, target, max(0.0, seconds - draft - target)]


def settle(engine: Engine) -> None:
    """On CUDA the engine's times wait in its clock until settled: settle them (one wait)."""
    if engine.clock is not None and engine.clock.events:
        engine.clock.settle()


class FixedGamma:
    """A policy that always answers one gamma: ``FixedGamma(0)`` turns speculation off."""

    def __init__(self, gamma: int) -> None:
        self.gamma = gamma

    def __call__(self, engine: Engine) -> int:
        return self.gamma


# ----------------------------------------------------------------------------- requests
class OverloadedError(Exception):
    """The waiting queue is full; ``retry_after`` is the estimated wait in whole seconds."""

    def __init__(self, waiting: int, retry_after: int) -> None:
        super().__init__(f"the server is at capacity: {waiting} requests are waiting already; retry in "
                         f"{retry_after} s")
        self.waiting, self.retry_after = waiting, retry_after


@dataclass(eq=False)
class Ticket:
    """One request through an EngineLoop. ``on_tokens(ids)`` gets each iteration's tokens and
    ``on_done(ticket)`` the end, once; both are called in the loop's thread and must be quick
    (a server hands them to its event loop). At the end ``row`` holds the tokens and stats, or
    ``error`` says why there are none (a refused request, a non-finite row, a failed loop)."""

    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling = GREEDY
    seed: int | None = None
    gamma: int | None = None  # pinned gamma, or None: the policy's
    eos_id: int | None = None
    on_tokens: Callable[[list[int]], None] = lambda ids: None
    on_done: Callable[[Ticket], None] = lambda ticket: None
    row: Row | None = None
    error: Exception | None = None
    cancelled: bool = False
    done: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    seen: tuple[int, float, int, int] = (0, 0.0, 0, 0)  # the row's target calls, overlap, verified, produced

    @property
    def stop_reason(self) -> str | None:
        """eos, max_new_tokens, max_seq_len, cancelled or error (None while it runs)."""
        if self.error is not None:
            return "error"
        if self.row is None:
            return "cancelled" if self.done else None
        return self.row.stats.stop_reason


class EngineLoop:
    """An engine driven by one thread (see the module docstring). ``max_waiting``:
    requests admitted but not yet in the batch, at most (further ones raise OverloadedError);
    ``policy``: the engine's gamma policy (LoadGamma, FixedGamma, or None for the engine's
    own gamma)."""

    def __init__(self, engine: Engine, *, max_waiting: int = 64, policy: Callable[[Engine], int] | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.engine, self.max_waiting, self.policy = engine, max_waiting, policy
        engine.policy = policy
        self.log = log or (lambda line: print(line, file=sys.stderr))
        self.lock = threading.Condition()
        self.inbox: deque[Ticket] = deque()
        self.cancels: deque[Ticket] = deque()
        self.tickets: dict[Row, Ticket] = {}
        self.metrics = Metrics()
        self.closing = False
        self.failure: BaseException | None = None
        self.last_gamma = 0
        self.clean = False  # whether the previous iteration drafted (then the draft has nothing to catch up)
        self.thread = threading.Thread(target=self.run, name="engine-loop", daemon=True)

    # ------------------------------------------------------------------------- any thread
    def start(self) -> EngineLoop:
        """Run the loop in a thread of its own (tests, or an embedding application)."""
        self.thread.start()
        return self

    def here(self) -> EngineLoop:
        """Make the calling thread the loop's, which then calls :meth:`run` (until :meth:`close`,
        or Ctrl-C in the main thread). serve.py runs the loop in the thread that loaded the
        models, and the HTTP server beside it: PyTorch's CPU operators keep one OpenMP team per
        thread that calls them, and a second live team on the same cores made every step
        1.4-1.7 times slower (docs/serving.md)."""
        self.thread = threading.current_thread()
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Stop the loop after its current step; requests still held end with an error."""
        with self.lock:
            self.closing = True
            self.lock.notify()
        if self.thread.is_alive() and self.thread is not threading.current_thread() \
                and self.thread is not threading.main_thread():
            self.thread.join(timeout)

    @property
    def waiting(self) -> int:
        """Requests submitted and not in the batch yet."""
        return len(self.inbox) + len(self.engine.waiting)

    @property
    def running(self) -> int:
        return len(self.engine.rows)

    @property
    def healthy(self) -> bool:
        return self.failure is None and self.thread.is_alive() and not self.closing

    def submit(self, ticket: Ticket) -> Ticket:
        """Queue a request; raises OverloadedError when max_waiting requests wait already, and
        RuntimeError when the loop is not running."""
        with self.lock:
            if not self.healthy:
                raise RuntimeError(f"the engine loop is not running ({self.failure or 'closed'})")
            waiting = self.waiting
            if waiting >= self.max_waiting:
                self.metrics.rejected += 1
                raise OverloadedError(waiting, self.retry_after(waiting))
            self.inbox.append(ticket)
            self.lock.notify()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Stop a request (its client left, or it met a stop string): its row leaves the batch
        before the next iteration. Nothing happens to a request that is done."""
        if ticket.done:
            return
        with self.lock:
            ticket.cancelled = True
            self.cancels.append(ticket)
            self.lock.notify()

    def retry_after(self, waiting: int) -> int:
        """Seconds until the requests ahead are likely through: the waiting ones at the rate
        requests finished lately (1 s when nothing finished lately)."""
        rate = self.metrics.finish_rate()
        return max(1, min(60, math.ceil(waiting / rate))) if rate else 1

    # ------------------------------------------------------------------------- the loop's thread
    def run(self) -> None:
        try:
            while True:
                with self.lock:
                    while not (self.inbox or self.cancels or self.closing) and self.engine.idle:
                        # Not forever: a process's SIGINT may be delivered to another thread, and
                        # the main thread (serve.py runs the loop there) only runs Python's
                        # handler, which raises KeyboardInterrupt, once it wakes.
                        self.lock.wait(0.25)
                    if self.closing:
                        break
                    new, cancels = list(self.inbox), list(self.cancels)
                    self.inbox.clear()
                    self.cancels.clear()
                for ticket in new:
                    self.add(ticket)
                for ticket in cancels:
                    if ticket.row is not None:
                        self.engine.cancel(ticket.row)
                if not self.engine.idle:
                    self.step()
                self.deliver()
        except KeyboardInterrupt:  # run in the main thread (here): Ctrl-C stops the server
            self.closing = True
            raise
        except BaseException as error:  # a bug or the device failing: every request is told
            self.failure = error
            self.log(f"error: the engine loop stopped: {type(error).__name__}: {error}".splitlines()[0])
        finally:
            self.fail_all(self.failure or RuntimeError("the server is shutting down"))

    def add(self, ticket: Ticket) -> None:
        if ticket.cancelled:
            self.end(ticket)
            return
        try:
            ticket.row = self.engine.add(ticket.prompt, ticket.max_new_tokens, eos_id=ticket.eos_id, seed=ticket.seed,
                                         sampling=ticket.sampling, gamma=ticket.gamma,
                                         callback=lambda ids, drafted: ticket.on_tokens(ids))
        except ValueError as error:
            ticket.error = error
            self.end(ticket)
            return
        self.tickets[ticket.row] = ticket

    def step(self) -> None:
        engine, stats = self.engine, self.engine.stats
        before = (stats.iterations, stats.draft_time_s, stats.target_time_s)
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
        settle(engine)
        if stats.iterations == before[0]:
            return  # only cancelled rows left
        rows = list(engine.rows) + [row for row in engine.finished if row.stats.target_calls]
        took_part, prompt_read, tokens, overlap, positions, gamma = 0, False, 0, 0.0, 0, 0
        for row in rows:
            ticket = self.tickets.get(row)
            if ticket is None:
                continue
            now = (row.stats.target_calls, row.stats.overlap_sum, row.stats.verified_positions, row.produced)
            if now[0] > ticket.seen[0]:
                took_part += 1
                prompt_read |= ticket.seen[0] == 0
                gamma = max(gamma, row.stats.gamma_history[-1])
                overlap += now[1] - ticket.seen[1]
                positions += now[2] - ticket.seen[2]
                tokens += now[3] - ticket.seen[3]
            ticket.seen = now
        it = Iteration(took_part, gamma, seconds, stats.draft_time_s - before[1], stats.target_time_s - before[2],
                       tokens, overlap, positions, clean=not prompt_read and (gamma == 0 or self.last_gamma > 0))
        self.last_gamma = gamma
        self.metrics.observe(it)
        if hasattr(self.policy, "observe"):
            self.policy.observe(it)
        if stats.iterations % 256 == 0:  # the engine's records of rows long gone
            stats.rows = [row.stats for row in [*engine.rows, *engine.waiting]]
            stats.rows_history.clear()

    def deliver(self) -> None:
        """Every row that finished (or was cancelled while waiting) to its ticket."""
        for row in self.engine.finished:
            ticket = self.tickets.pop(row, None)
            if ticket is not None:
                if row.error is not None:
                    ticket.error = row.error
                self.end(ticket)
        self.engine.finished.clear()

    def end(self, ticket: Ticket) -> None:
        ticket.done = True
        self.metrics.count(ticket.stop_reason or "cancelled")
        ticket.on_done(ticket)

    def fail_all(self, error: BaseException) -> None:
        with self.lock:
            pending = list(self.inbox) + list(self.tickets.values())
            self.inbox.clear()
            self.tickets.clear()
        for ticket in pending:
            if not ticket.done:
                ticket.error = RuntimeError(f"the engine loop stopped: {type(error).__name__}: {error}")
                self.end(ticket)


@dataclass
class Service:
    """What the API serves: the loop and its engine's limits. ``speculation`` says how gamma is
    chosen ("load", "on": always gamma_max, "off"; "none" without a drafter), ``gamma_max`` the
    largest gamma a request may pin (0 without a drafter)."""

    loop: EngineLoop
    tokenizer: Any  # weights.Tokenizer: encode, decode, eos_id
    model: str
    context: int
    gamma_max: int
    speculation: str
    draft: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def vocab_size(self) -> int:
        return self.loop.engine.target.config.vocab_size


# ----------------------------------------------------------------------------- what /metrics shows
class Metrics:
    """Counters since start, and rates over the last WINDOW_S seconds (written by the loop's
    thread, read by any)."""

    def __init__(self) -> None:
        self.started = time.time()
        self.iterations = 0
        self.speculating = 0  # iterations in which some row drafted
        self.tokens = 0
        self.row_iterations = 0
        self.overlap, self.positions = 0.0, 0
        self.outcomes: dict[str, int] = {}
        self.rejected = 0
        self.recent: deque[tuple[float, Iteration]] = deque()
        self.ends: deque[float] = deque()  # when requests finished lately

    def observe(self, it: Iteration) -> None:
        now = time.perf_counter()
        self.iterations += 1
        self.speculating += it.gamma > 0
        self.tokens += it.tokens
        self.row_iterations += it.rows
        self.overlap += it.overlap
        self.positions += it.positions
        self.recent.append((now, it))
        while self.recent and self.recent[0][0] < now - WINDOW_S:
            self.recent.popleft()

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        now = time.perf_counter()
        self.ends.append(now)
        while self.ends and self.ends[0] < now - WINDOW_S:
            self.ends.popleft()

    def finish_rate(self) -> float:
        """Requests finished per second over the window."""
        now = time.perf_counter()
        ends = [t for t in list(self.ends) if t >= now - WINDOW_S]
        return len(ends) / WINDOW_S

    def window(self) -> dict[str, float]:
        """Rates over the last WINDOW_S seconds: tokens/s, the share of iterations that
        speculated, the mean batch, tau (tokens per row and iteration) and alpha."""
        now = time.perf_counter()
        recent = [it for t, it in list(self.recent) if t >= now - WINDOW_S]
        rows = sum(it.rows for it in recent)
        positions = sum(it.positions for it in recent)
        busy = sum(it.seconds for it in recent)
        return {"tokens_per_second": sum(it.tokens for it in recent) / WINDOW_S,
                "busy": busy / WINDOW_S,
                "speculation_on": sum(it.gamma > 0 for it in recent) / len(recent) if recent else 0.0,
                "batch": rows / len(recent) if recent else 0.0,
                "tau": sum(it.tokens for it in recent) / rows if rows else 0.0,
                "alpha": sum(it.overlap for it in recent) / positions if positions else math.nan}


def prometheus(loop: EngineLoop, prefix: str = "speculative_") -> str:
    """/metrics in the Prometheus text format (version 0.0.4)."""
    m, window = loop.metrics, loop.metrics.window()
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: Sequence[tuple[str, float]]) -> None:
        lines.append(f"# HELP {prefix}{name} {help_text}")
        lines.append(f"# TYPE {prefix}{name} {kind}")
        for labels, value in samples:
            lines.append(f"{prefix}{name}{labels} {value:.6g}" if isinstance(value, float) else
                         f"{prefix}{name}{labels} {value}")

    metric("requests_running", "gauge", "Requests in the batch now.", [("", loop.running)])
    metric("requests_waiting", "gauge", "Requests waiting for a place in the batch.", [("", loop.waiting)])
    metric("requests_total", "counter", "Requests that ended, by how (eos, max_new_tokens, max_seq_len, "
           "cancelled, error) or were refused (rejected, queue full).",
           [(f'{{outcome="{k}"}}', v) for k, v in sorted({**m.outcomes, "rejected": m.rejected}.items())])
    metric("batch_size", "gauge", "Rows in the batch now.", [("", loop.running)])
    metric("batch_size_mean", "gauge", f"Mean rows per iteration over the last {WINDOW_S:g} s.",
           [("", window["batch"])])
    metric("tokens_per_second", "gauge", f"Tokens emitted per second, all requests, over the last {WINDOW_S:g} s.",
           [("", window["tokens_per_second"])])
    metric("busy_ratio", "gauge", f"Share of the last {WINDOW_S:g} s the engine spent stepping.",
           [("", window["busy"])])
    metric("generated_tokens_total", "counter", "Tokens emitted since start.", [("", m.tokens)])
    metric("iterations_total", "counter", "Engine iterations (one target call each) since start.",
           [("", m.iterations)])
    metric("speculating_iterations_total", "counter", "Iterations in which speculation was on (some row drafted).",
           [("", m.speculating)])
    metric("speculation_on_ratio", "gauge", f"Share of iterations with speculation on, last {WINDOW_S:g} s.",
           [("", window["speculation_on"])])
    metric("alpha", "gauge", f"Acceptance rate (the paper's alpha) over the last {WINDOW_S:g} s (NaN: nothing "
           "verified).", [("", window["alpha"])])
    metric("alpha_total", "gauge", "Acceptance rate since start.",
           [("", m.overlap / m.positions if m.positions else math.nan)])
    metric("tau", "gauge", f"Tokens per row and iteration (tau) over the last {WINDOW_S:g} s.", [("", window["tau"])])
    metric("gamma", "gauge", "Gamma of the last iteration (0: speculation off).", [("", loop.last_gamma)])
    policy = loop.policy
    if isinstance(policy, LoadGamma):
        metric("policy_alpha", "gauge", "The live alpha the gamma policy uses.", [("", policy.alpha)])
        table = policy.table()
        metric("policy_gamma", "gauge", "Gamma the cost model chooses now at each batch size (0: off).",
               [(f'{{batch="{b}"}}', g) for b, g, _ in table])
        metric("policy_speedup", "gauge", "The cost model's predicted speedup of that gamma over no speculation.",
               [(f'{{batch="{b}"}}', s if s is not None else math.nan) for b, _, s in table])
        cells = sorted(dict(policy.cells).items())
        metric("step_seconds", "gauge", "Measured seconds of one iteration by batch size, gamma and part "
               "(draft steps, target call, the rest).",
               [(f'{{batch="{b}",gamma="{g}",part="{part}"}}', value) for (b, g), parts in cells
                for part, value in zip(("draft", "target", "rest"), parts)])
    return "\n".join(lines) + "\n"


__all__ = ["EngineLoop", "FixedGamma", "Iteration", "LoadGamma", "Metrics", "OverloadedError", "Service", "Ticket",
           "prometheus"]
