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

:class:`~speculative.serving.policy.LoadGamma` (speculative.serving.policy) decides the gamma of
every iteration from the load.

Exactness: every row samples from its own generator, so a request's tokens do not depend on
the other requests; a row's gamma only changes which tokens a seed gives, never their
distribution (speculative.engine.gamma). A pinned gamma (``Ticket.gamma``) keeps a seed's tokens
those of generate.py with that gamma, whatever the load.
"""

from __future__ import annotations

import hashlib
import math
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from speculative.engine.engine import Engine, Row, RowFailedError
from speculative.engine.gamma import FixedGamma
from speculative.sampling import Sampling
from speculative.serving.metrics import Metrics
from speculative.serving.policy import Iteration, LoadGamma, settle
from speculative.serving.threads import ThreadTuner

GREEDY = Sampling(temperature=0.0)


# ----------------------------------------------------------------------------- requests
class OverloadedError(Exception):
    """The waiting queue is full (for ``rows`` more: a request's n choices); ``retry_after`` is the
    estimated wait in whole seconds."""

    def __init__(self, waiting: int, retry_after: int, rows: int = 1) -> None:
        message = f"the server is at capacity: {waiting} requests are waiting already"
        if rows > 1:
            message += f", and this request's {rows} choices would wait beside them"
        super().__init__(f"{message}; retry in {retry_after} s")
        self.waiting = waiting
        self.retry_after = retry_after


class DeadlineError(Exception):
    """A request passed one of the loop's deadlines: ``queue`` (it waited that long for a row)
    or not (it ran that long); ``seconds`` is the deadline."""

    def __init__(self, queue: bool, seconds: float) -> None:
        if queue:
            message = f"the request waited more than {seconds:g} s for a place in the batch (--queue-timeout)"
        else:
            message = f"the request ran longer than {seconds:g} s (--request-timeout)"
        super().__init__(message)
        self.queue = queue
        self.seconds = seconds


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
    eos_id: int | frozenset[int] | None = None  # the ids that end the request (Engine.add's eos_id)
    logprobs: int | None = (
        None  # record the tokens' log-probabilities and this many top ones (None: not)
    )
    echo: bool = False  # and the prompt's (Engine.add)
    # what the drafter reads of earlier requests and keeps of this one: the partition of the
    # suffix cache for the request's API key (Engine.add's memory; None: nothing)
    memory: Any = None
    on_tokens: Callable[[list[int]], None] = lambda ids: None
    on_done: Callable[[Ticket], None] = lambda ticket: None
    row: Row | None = None
    error: Exception | None = None
    cancelled: bool = False
    stop_string: bool = False  # cancelled because its text met a stop string
    done: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    last_token: float | None = None  # when its latest tokens came (None: none yet)
    # the row's target calls, overlap, verified, produced
    seen: tuple[int, float, int, int] = (0, 0.0, 0, 0)

    @property
    def stop_reason(self) -> str | None:
        """eos, max_new_tokens, max_seq_len, stop_string, cancelled or error (None while it runs)."""
        if self.error is not None:
            return "error"
        if self.stop_string:
            return "stop_string"
        if self.row is None:
            return "cancelled" if self.done else None
        return self.row.stats.stop_reason


def chooser_name(policy: Callable[[Engine], int] | None) -> str:
    """How a server chooses gamma, as the engine's gamma policy and /metrics name it: "load"
    (LoadGamma), "off" or "fixed" (FixedGamma), or "outside" for any other chooser."""
    if isinstance(policy, LoadGamma):
        return "load"
    if isinstance(policy, FixedGamma) and policy.gamma == 0:
        return "off"
    if isinstance(policy, FixedGamma):
        return "fixed"
    return "outside"


class EngineLoop:
    """An engine driven by one thread (see the module docstring). ``max_waiting``:
    requests admitted but not yet in the batch, at most (further ones raise OverloadedError);
    ``policy``: the engine's gamma policy (LoadGamma, FixedGamma, or None for the engine's
    own gamma); ``queue_timeout``, ``request_timeout``: seconds a request may wait for a row,
    and in all (None: no limit), after which it ends with a DeadlineError; ``tuner``: chooses
    the operators' thread count (speculative.serving.threads)."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_waiting: int = 64,
        policy: Callable[[Engine], int] | None = None,
        log: Callable[[str], None] | None = None,
        stall_after: float = 60.0,
        queue_timeout: float | None = None,
        request_timeout: float | None = None,
        tuner: ThreadTuner | None = None,
    ) -> None:
        if max_waiting < 1:  # a request waits for the loop to take it: 0 would refuse every request
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.policy = policy
        # the operators' thread count, chosen by measuring (speculative.serving.threads)
        self.tuner = tuner
        self.queue_timeout = queue_timeout
        self.request_timeout = request_timeout
        engine.gamma_policy.steer(policy, chooser_name(policy))
        self.log = log or (lambda line: print(line, file=sys.stderr))
        self.lock = threading.Condition()
        self.inbox: deque[Ticket] = deque()
        self.cancels: deque[Ticket] = deque()
        self.tickets: dict[Row, Ticket] = {}
        self.metrics = Metrics()
        self.closing = False
        self.failure: BaseException | None = None
        # A step that has not returned for stall_after seconds while requests wait or run is a
        # hang (a device, a deadlock): /health says so, since the thread itself looks alive.
        self.stall_after = stall_after
        self.step_started = time.perf_counter()
        self.beat = time.monotonic()  # the last time the loop was seen working or idle
        self.drain_until: float | None = (
            None  # draining (SIGTERM): new requests refused, this deadline for the rest
        )
        self.cut = 0  # requests still held when the drain's deadline passed
        self.last_gamma = 0
        self.clean = (
            False  # whether the previous iteration drafted (then the draft has nothing to catch up)
        )
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

    def drain(self, grace: float) -> None:
        """Graceful shutdown: refuse new requests from now on, let those in hand finish for up to
        ``grace`` seconds, then stop (the ones still held end with an error, counted in ``cut``)."""
        with self.lock:
            self.drain_until = time.monotonic() + grace
            self.lock.notify()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the loop after its current step; requests still held end with an error."""
        with self.lock:
            self.closing = True
            self.lock.notify()
        if (
            self.thread.is_alive()
            and self.thread is not threading.current_thread()
            and self.thread is not threading.main_thread()
        ):
            self.thread.join(timeout)

    @property
    def stalled(self) -> float | None:
        """Seconds since the loop last made progress, when that is longer than ``stall_after``
        while there is work; else None."""
        quiet = time.monotonic() - self.beat
        busy = self.waiting or self.running
        return quiet if busy and quiet > self.stall_after else None

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
        self.submit_all([ticket])
        return ticket

    def submit_all(self, tickets: Sequence[Ticket]) -> None:
        """Queue a request's rows (its n choices) together: all of them, or none with
        OverloadedError when they would take the waiting requests past max_waiting. Each row waits
        for a place in the batch as a request of its own does, so each counts as one, in the bound
        and in /metrics (a request of n rows refused counts n rejected)."""
        with self.lock:
            if not self.healthy or self.drain_until is not None:
                raise RuntimeError(
                    f"the engine loop is not running ({self.failure or 'closed'})"
                    if self.drain_until is None
                    else "the server is shutting down"
                )
            waiting = self.waiting
            if waiting + len(tickets) > self.max_waiting:
                self.metrics.rejected += len(tickets)
                raise OverloadedError(waiting, self.retry_after(waiting), len(tickets))
            self.inbox.extend(tickets)
            self.lock.notify()

    def cancel(self, ticket: Ticket, stop_string: bool = False) -> None:
        """Stop a request (its client left, or, ``stop_string``, its text met a stop string): its row
        leaves the batch before the next iteration. Nothing happens to a request that is done."""
        if ticket.done:
            return
        with self.lock:
            ticket.cancelled = True
            ticket.stop_string = stop_string
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
                    while (
                        not (self.inbox or self.cancels or self.closing or self.drain_until)
                        and self.engine.idle
                    ):
                        # Not forever: a process's SIGINT may be delivered to another thread, and
                        # the main thread (serve.py runs the loop there) only runs Python's
                        # handler, which raises KeyboardInterrupt, once it wakes.
                        self.beat = time.monotonic()
                        self.lock.wait(0.25)
                    self.beat = time.monotonic()
                    if self.closing:
                        break
                    if self.drain_until is not None and (
                        time.monotonic() > self.drain_until or (self.engine.idle and not self.inbox)
                    ):
                        self.cut = len(self.inbox) + len(self.tickets)
                        break
                    new = list(self.inbox)
                    cancels = list(self.cancels)
                    self.inbox.clear()
                    self.cancels.clear()
                for ticket in new:
                    self.add(ticket)
                for ticket in cancels:
                    if ticket.row is not None:
                        self.engine.cancel(ticket.row)
                self.expire()
                if not self.engine.idle:
                    self.step()
                    self.beat = time.monotonic()
                self.deliver()
        except KeyboardInterrupt:  # run in the main thread (here): Ctrl-C stops the server
            self.closing = True
            raise
        except BaseException as error:  # a bug or the device failing: every request is told
            self.failure = error
            self.log(
                f"error: the engine loop stopped: {type(error).__name__}: {error}".splitlines()[0]
            )
        finally:
            self.fail_all(self.failure or RuntimeError("the server is shutting down"))

    def add(self, ticket: Ticket) -> None:
        if ticket.cancelled:
            self.end(ticket)
            return
        try:
            ticket.row = self.engine.add(
                ticket.prompt,
                ticket.max_new_tokens,
                eos_id=ticket.eos_id,
                seed=ticket.seed,
                sampling=ticket.sampling,
                gamma=ticket.gamma,
                logprobs=ticket.logprobs,
                echo=ticket.echo,
                memory=ticket.memory,
                callback=lambda ids, drafted: self.tokens_out(ticket, ids),
            )
        except (
            Exception
        ) as error:  # its own: a ValueError for bad input, anything else fails it alone too
            ticket.error = (
                error
                if isinstance(error, ValueError)
                else RowFailedError(f"{type(error).__name__}: {error}".splitlines()[0])
            )
            self.end(ticket)
            return
        self.tickets[ticket.row] = ticket

    def expire(self) -> None:
        """Requests past a deadline leave (as cancelled rows do) with a DeadlineError: those still
        waiting for a row after queue_timeout seconds, and any after request_timeout."""
        if self.queue_timeout is None and self.request_timeout is None:
            return
        now = time.perf_counter()
        waiting = {id(row) for row in self.engine.waiting}
        for ticket in list(self.tickets.values()):
            age = now - ticket.submitted
            if ticket.cancelled or ticket.error is not None:
                continue
            if (
                self.queue_timeout is not None
                and age > self.queue_timeout
                and id(ticket.row) in waiting
            ):
                ticket.error = DeadlineError(True, self.queue_timeout)
            elif self.request_timeout is not None and age > self.request_timeout:
                ticket.error = DeadlineError(False, self.request_timeout)
            else:
                continue
            self.engine.cancel(ticket.row)

    def step(self) -> None:
        engine = self.engine
        stats = engine.stats
        before = (stats.iterations, stats.draft_time_s, stats.target_time_s)
        probe = self.tuner is not None and self.tuner.probing is not None
        start = self.step_started = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
        self.metrics.last_step_s = seconds
        settle(engine)
        if stats.iterations == before[0]:
            return  # only cancelled rows left
        rows = list(engine.rows) + [row for row in engine.finished if row.stats.target_calls]
        # this iteration's figures, summed over the rows that took part in it
        took_part = 0
        prompt_read = False
        tokens = 0
        overlap = 0.0
        positions = 0
        gamma = 0
        for row in rows:
            ticket = self.tickets.get(row)
            if ticket is None:
                continue
            now = (
                row.stats.target_calls,
                row.stats.overlap_sum,
                row.stats.verified_positions,
                row.produced,
            )
            if now[0] > ticket.seen[0]:
                took_part += 1
                prompt_read |= ticket.seen[0] == 0
                if ticket.seen[0] == 0:
                    self.metrics.prompt_tokens += len(ticket.prompt)
                gamma = max(gamma, row.stats.gamma_history[-1])
                overlap += now[1] - ticket.seen[1]
                positions += now[2] - ticket.seen[2]
                tokens += now[3] - ticket.seen[3]
            ticket.seen = now
        it = Iteration(
            took_part,
            gamma,
            seconds,
            stats.draft_time_s - before[1],
            stats.target_time_s - before[2],
            tokens,
            overlap,
            positions,
            clean=not prompt_read and (gamma == 0 or self.last_gamma > 0),
        )
        self.last_gamma = gamma
        self.metrics.observe(it)
        if self.tuner is not None and it.clean:
            self.tuner.observe((took_part, gamma), seconds)
        # a probe's times are not the chosen count's
        if isinstance(self.policy, LoadGamma) and not probe:
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

    def tokens_out(self, ticket: Ticket, ids: list[int]) -> None:
        """A row's tokens of this iteration: the latencies they close, then to its ticket."""
        now = time.perf_counter()
        m = self.metrics
        if ticket.last_token is None:  # its first iteration: it waited until this step began
            m.queue.observe(max(0.0, self.step_started - ticket.submitted))
            m.first_token.observe(now - ticket.submitted)
        elif ids:
            m.inter_token.observe((now - ticket.last_token) / len(ids), len(ids))
        ticket.last_token = now
        ticket.on_tokens(ids)

    def end(self, ticket: Ticket) -> None:
        self.metrics.latency.observe(time.perf_counter() - ticket.submitted)
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
                ticket.error = RuntimeError(
                    f"the engine loop stopped: {type(error).__name__}: {error}"
                )
                self.end(ticket)


@dataclass
class Service:
    """What the API serves: the loop and its engine's limits. ``speculation`` says how gamma is
    chosen ("load", "on": always gamma_max, "off"; "none" without a drafter), ``gamma_max`` the
    largest gamma a request may pin (0 without a drafter)."""

    loop: EngineLoop
    tokenizer: Any  # weights.Tokenizer: encode, decode, eos_id, chat
    model: str
    context: int
    gamma_max: int
    speculation: str
    draft: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    stop_ids: frozenset[int] | None = (
        None  # the ids that end a request (None: the tokenizer's eos_id alone)
    )
    # the model's sampling defaults for the fields a request leaves out (temperature, top_k, top_p,
    # max_new_tokens: weights.checkpoint.sampling_defaults); empty: OpenAI's
    defaults: dict[str, Any] = field(default_factory=dict)
    # suffix decoding's store of earlier responses, one partition per API key (a
    # speculative.draft.responses.ResponseStore); None: none (--suffix-cache-tokens 0, or a drafter
    # without the protocol's joined hook)
    responses: Any = None

    def __post_init__(self) -> None:
        if self.stop_ids is None:
            eos = getattr(self.tokenizer, "eos_id", None)
            self.stop_ids = frozenset() if eos is None else frozenset([eos])

    @cached_property
    def fingerprint(self) -> str:
        """OpenAI's ``system_fingerprint``: what, besides the request, decides the output here (the
        model served, its drafter and how gamma is chosen; the output's law is the target's either
        way, but greedy near-ties can fall otherwise with another set-up)."""
        digest = hashlib.sha256(
            f"{self.model}|{self.draft}|{self.speculation}|{self.gamma_max}".encode()
        )
        return "fp_" + digest.hexdigest()[:12]

    @cached_property
    def longest_piece(self) -> int:
        """The most characters one token stands for (its piece's length; a tokenizer without
        pieces: 64), so that a text of more than context x this many characters is too long
        before it is tokenized."""
        piece = getattr(self.tokenizer, "piece", None)
        size = getattr(self.tokenizer, "vocab_size", None)
        if piece is None or not size:
            return 64
        return max(1, max(len(piece(i)) for i in range(size)))

    @property
    def vocab_size(self) -> int:
        return self.loop.engine.target.config.vocab_size

    def memory(self, key: int | None) -> Any:
        """The partition of the suffix cache for API key number ``key`` (access.Guard's; None: a
        server without keys, whose requests share one), or None without a cache."""
        if self.responses is None:
            return None
        return self.responses.partition(key)


__all__ = ["DeadlineError", "EngineLoop", "OverloadedError", "Service", "Ticket"]
