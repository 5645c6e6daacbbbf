"""What /metrics shows: counters since start, rates over the last WINDOW_S seconds and histograms of
the times an operator watches (to the first token, between tokens, in the queue, in all), kept by
the engine loop (speculative.serving.loop) and written in Prometheus' text format."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from speculative.serving.policy import Iteration, LoadGamma

WINDOW_S = 10.0  # /metrics' rates are over the last this many seconds


class Histogram:
    """A Prometheus histogram: cumulative counts of observations at most each bound, their sum and count."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = list(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        at = next((i for i, bound in enumerate(self.bounds) if value <= bound), len(self.bounds))
        self.counts[at] += times
        self.sum += value * times
        self.count += times

    def samples(self) -> list[tuple[str, float]]:
        out = []
        running = 0
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts):
            running += count
            out.append((f'_bucket{{le="{bound}"}}', running))
        return out + [("_sum", self.sum), ("_count", self.count)]


SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """Counters since start, and rates over the last WINDOW_S seconds (written by the loop's
    thread, read by any)."""

    def __init__(self) -> None:
        self.started = time.time()
        self.first_token = Histogram(SECONDS)
        self.inter_token = Histogram(SECONDS)
        self.queue = Histogram(SECONDS)
        self.latency = Histogram(SECONDS)
        self.prompt_tokens = 0
        self.last_step_s = 0.0
        self.iterations = 0
        self.speculating = 0  # iterations in which some row drafted
        self.tokens = 0
        self.row_iterations = 0
        self.overlap = 0.0
        self.positions = 0
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
        return {
            "tokens_per_second": sum(it.tokens for it in recent) / WINDOW_S,
            "busy": busy / WINDOW_S,
            "speculation_on": sum(it.gamma > 0 for it in recent) / len(recent) if recent else 0.0,
            "batch": rows / len(recent) if recent else 0.0,
            "tau": sum(it.tokens for it in recent) / rows if rows else 0.0,
            "alpha": sum(it.overlap for it in recent) / positions if positions else math.nan,
        }


def prometheus(loop: Any, prefix: str = "speculative_", responses: Any = None) -> str:
    """/metrics in the Prometheus text format (version 0.0.4); with ``responses`` (a
    speculative.draft.responses.ResponseStore, the suffix cache), its size too."""
    m = loop.metrics
    window = m.window()
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: Sequence[tuple[str, float]]) -> None:
        lines.append(f"# HELP {prefix}{name} {help_text}")
        lines.append(f"# TYPE {prefix}{name} {kind}")
        for labels, value in samples:
            lines.append(
                f"{prefix}{name}{labels} {value:.6g}"
                if isinstance(value, float)
                else f"{prefix}{name}{labels} {value}"
            )

    metric("requests_running", "gauge", "Requests in the batch now.", [("", loop.running)])
    metric(
        "requests_waiting",
        "gauge",
        "Requests waiting for a place in the batch.",
        [("", loop.waiting)],
    )
    metric(
        "requests_total",
        "counter",
        "Requests that ended, by how (eos, max_new_tokens, max_seq_len, stop_string, "
        "cancelled, error) or were refused (rejected, queue full); each of a request's n choices "
        "counts as one.",
        [
            (f'{{outcome="{k}"}}', v)
            for k, v in sorted({**m.outcomes, "rejected": m.rejected}.items())
        ],
    )
    metric("batch_size", "gauge", "Rows in the batch now.", [("", loop.running)])
    metric(
        "batch_size_mean",
        "gauge",
        f"Mean rows per iteration over the last {WINDOW_S:g} s.",
        [("", window["batch"])],
    )
    metric(
        "tokens_per_second",
        "gauge",
        f"Tokens emitted per second, all requests, over the last {WINDOW_S:g} s.",
        [("", window["tokens_per_second"])],
    )
    metric(
        "busy_ratio",
        "gauge",
        f"Share of the last {WINDOW_S:g} s the engine spent stepping.",
        [("", window["busy"])],
    )
    metric("generated_tokens_total", "counter", "Tokens emitted since start.", [("", m.tokens)])
    metric(
        "prompt_tokens_total", "counter", "Prompt tokens read since start.", [("", m.prompt_tokens)]
    )
    metric(
        "last_step_seconds",
        "gauge",
        "Seconds the engine's latest iteration took.",
        [("", m.last_step_s)],
    )
    if loop.tuner is not None:
        tuner = loop.tuner
        metric(
            "threads",
            "gauge",
            "Threads the engine's operators use now (chosen by measuring them).",
            [("", tuner.probing or tuner.threads)],
        )
        metric(
            "thread_probes_total",
            "counter",
            "Times another thread count was tried for a few iterations.",
            [("", tuner.probes)],
        )
        metric(
            "thread_switches_total",
            "counter",
            "Times a tried thread count measured faster and was kept.",
            [("", tuner.switches)],
        )
    for name, histogram, help_text in (
        (
            "time_to_first_token_seconds",
            m.first_token,
            "From a request's arrival to its first tokens.",
        ),
        (
            "inter_token_seconds",
            m.inter_token,
            "Between a request's tokens (an iteration's tokens share its gap).",
        ),
        ("queue_seconds", m.queue, "From a request's arrival to its first iteration in the batch."),
        ("request_seconds", m.latency, "From a request's arrival to its end."),
    ):
        metric(name, "histogram", help_text, histogram.samples())
    metric(
        "iterations_total",
        "counter",
        "Engine iterations (one target call each) since start.",
        [("", m.iterations)],
    )
    metric(
        "speculating_iterations_total",
        "counter",
        "Iterations in which speculation was on (some row drafted).",
        [("", m.speculating)],
    )
    metric(
        "speculation_on_ratio",
        "gauge",
        f"Share of iterations with speculation on, last {WINDOW_S:g} s.",
        [("", window["speculation_on"])],
    )
    metric(
        "alpha",
        "gauge",
        f"Acceptance rate (the paper's alpha) over the last {WINDOW_S:g} s (NaN: nothing "
        "verified).",
        [("", window["alpha"])],
    )
    metric(
        "alpha_total",
        "gauge",
        "Acceptance rate since start.",
        [("", m.overlap / m.positions if m.positions else math.nan)],
    )
    metric(
        "tau",
        "gauge",
        f"Tokens per row and iteration (tau) over the last {WINDOW_S:g} s.",
        [("", window["tau"])],
    )
    metric(
        "gamma",
        "gauge",
        "Gamma of the last iteration (0: speculation off).",
        [("", loop.last_gamma)],
    )
    metric(
        "gamma_policy",
        "gauge",
        "How gamma is chosen when a request does not pin it (speculative.engine.gamma_policy): "
        "1 for the policy in use.",
        [(f'{{policy="{loop.engine.gamma_policy.name}"}}', 1)],
    )
    policy = loop.policy
    if isinstance(policy, LoadGamma):
        metric(
            "policy_alpha", "gauge", "The live alpha the gamma policy uses.", [("", policy.alpha)]
        )
        table = policy.table()
        metric(
            "policy_gamma",
            "gauge",
            "Gamma the cost model chooses now at each batch size (0: off).",
            [(f'{{batch="{b}"}}', g) for b, g, _ in table],
        )
        metric(
            "policy_speedup",
            "gauge",
            "The cost model's predicted speedup of that gamma over no speculation.",
            [(f'{{batch="{b}"}}', s if s is not None else math.nan) for b, _, s in table],
        )
        cells = sorted(dict(policy.cells).items())
        metric(
            "step_seconds",
            "gauge",
            "Measured seconds of one iteration by batch size, gamma and part "
            "(draft steps, target call, the rest).",
            [
                (f'{{batch="{b}",gamma="{g}",part="{part}"}}', value)
                for (b, g), parts in cells
                for part, value in zip(("draft", "target", "rest"), parts)
            ],
        )
    if responses is not None:
        figures = responses.figures()
        for name, help_text, value in (
            (
                "max_tokens",
                "The suffix cache's budget in tokens, all API keys together.",
                figures.max_tokens,
            ),
            ("tokens", "Tokens of earlier responses in the suffix cache now.", figures.tokens),
            ("nodes", "Nodes of the suffix cache's tries now.", figures.nodes),
            (
                "bytes",
                "The suffix cache's size now, estimated: its nodes x the bytes one took when measured.",
                figures.bytes,
            ),
            ("keys", "API keys with responses in the suffix cache now.", len(figures.partitions)),
        ):
            metric(f"suffix_cache_{name}", "gauge", help_text, [("", value)])
        held = sorted(figures.partitions.items())
        metric(
            "suffix_cache_key_tokens",
            "gauge",
            "Tokens in the suffix cache by API key, named by its number (1: the first --api-key), "
            "never the key itself; anonymous on a server without keys.",
            [(f'{{key="{key}"}}', tokens) for key, (_, tokens) in held],
        )
        metric(
            "suffix_cache_key_responses",
            "gauge",
            "Responses in the suffix cache by API key, named as above.",
            [(f'{{key="{key}"}}', count) for key, (count, _) in held],
        )
    return "\n".join(lines) + "\n"


__all__ = ["Histogram", "Metrics", "WINDOW_S", "prometheus"]
