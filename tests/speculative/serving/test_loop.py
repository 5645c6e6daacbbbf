"""The serving library without HTTP (speculative/serving/loop.py): the gamma policy decided by the
load (the cost model at the current batch size), its calibration on the engine itself, and
the engine loop's thread (tickets, cancels, the bounded queue, a failing engine).

Float64 toy pairs, so that a row's tokens do not depend on the batch (the numerics policy).
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from speculative import Engine, Sampling, speculative_generate
from speculative.engine.gamma import FixedGamma
from speculative.serving.loop import EngineLoop, OverloadedError, Ticket
from speculative.serving.metrics import prometheus
from speculative.serving.policy import Iteration, LoadGamma
from speculative.serving.text import LLAMA2_CHAT, encode_dialog, encode_prompt
from tests.support.toy_models import noisy_copy, random_llama
from weights import load_tokenizer

torch.set_num_threads(1)
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11]]


@pytest.fixture(scope="module")
def pair() -> dict:
    target = random_llama(vocab=16, dim=16, max_seq_len=160, seed=0, dtype=torch.float64)
    return {"target": target, "draft": noisy_copy(target, std=0.3, seed=1)}


def tau(alpha: float, gamma: int) -> float:
    """Expected tokens per iteration, written out: 1 + alpha + ... + alpha^gamma."""
    return sum(alpha**i for i in range(gamma + 1))


def policy_with(
    costs: dict[tuple[int, int], float], alpha: float, gamma_max: int = 4, max_rows: int = 16
) -> LoadGamma:
    """A policy with these iteration costs (all in the target call) and this alpha, as if measured."""
    policy = LoadGamma(gamma_max, max_rows)
    for (rows, gamma), seconds in costs.items():
        policy.record(rows, gamma, [0.0, seconds, 0.0], weight=1.0)
    policy.accepted_mass, policy.positions = alpha * 1e6 - 1, 1e6 - 2  # (S + 1) / (N + 2) = alpha
    return policy


def batching_costs() -> dict[tuple[int, int], float]:
    """Iteration costs shaped as docs/batching.md measured them on 2 CPU cores: a plain step
    costs about the same up to 4 rows; a verification of B rows x (g + 1) tokens grows towards
    g + 1 steps as B grows; each draft step costs c(B) = 0.12..0.28 of a plain step."""
    costs = {}
    for rows, step, verify_slope, c in [
        (1, 5.3, 0.03, 0.12),
        (2, 5.3, 0.08, 0.14),
        (4, 5.4, 0.19, 0.21),
        (8, 7.5, 0.45, 0.25),
        (16, 12.0, 0.7, 0.28),
    ]:
        for gamma in range(5):
            costs[rows, gamma] = (
                step * (1 + verify_slope * gamma) + gamma * c * step if gamma else step
            )
    return costs


def test_the_policy_picks_the_cost_models_best_gamma_at_each_batch_size() -> None:
    """gamma*(B) = argmax tau(alpha, g) / cost(B, g) over g in 0..4, checked against the formula
    written out here; with batching.md's shape of costs speculation pays at batch 1 and not at 16."""
    costs, alpha = batching_costs(), 0.8
    policy = policy_with(costs, alpha)
    for rows in (1, 2, 4, 8, 16):
        expected = max(range(5), key=lambda g: (tau(alpha, g) / costs[rows, g], -g))
        assert policy.best(rows) == expected
    assert policy.best(1) >= 3 and policy.best(16) == 0
    assert policy.speedup(1, policy.best(1)) == pytest.approx(
        tau(alpha, policy.best(1)) * costs[1, 0] / costs[1, policy.best(1)]
    )


def test_the_crossover_moves_with_alpha_no_threshold_is_set() -> None:
    """The same costs with a better draft keep speculation on at batch sizes where a worse one
    turns it off: the crossover is the cost model's, not a number set by hand."""
    costs = batching_costs()
    off_at = {
        alpha: min(
            (b for b in (1, 2, 4, 8, 16) if policy_with(costs, alpha).best(b) == 0), default=None
        )
        for alpha in (0.5, 0.8, 0.97)
    }
    assert off_at[0.5] is not None and off_at[0.5] < (off_at[0.8] or 99) <= (off_at[0.97] or 99)
    assert off_at[0.97] is None or off_at[0.97] > off_at[0.5]


def test_two_iterations_in_32_re_measure_a_neighbouring_gamma() -> None:
    """The policy's choice, except the first two iterations of every 32: the gamma above, then
    the one below (0 included: speculation off is re-measured too, and from off, gamma 1)."""
    policy = policy_with(batching_costs(), 0.7)
    best = policy.best(2)
    assert 1 < best < 4
    chosen = [policy.choose(2, i) for i in range(128)]
    assert [chosen[i] for i in (0, 1, 32, 33, 64, 96)] == [
        best + 1,
        best + 1,
        best - 1,
        best - 1,
        best + 1,
        best - 1,
    ]
    assert all(g == best for i, g in enumerate(chosen) if i % 32 > 1)
    assert policy.best(16) == 0 and {policy.choose(16, i) for i in range(64)} == {0, 1}
    assert [policy.choose(16, i) for i in (0, 1, 2, 32, 33)] == [1, 1, 0, 1, 1]
    assert {LoadGamma(4, 4, explore_every=0).choose(1, i) for i in range(64)} == {4}


def test_costs_between_measured_batch_sizes_are_interpolated() -> None:
    policy = policy_with({(4, 2): 10.0, (8, 2): 18.0}, 0.7)
    assert policy.cost(4, 2) == 10.0 and policy.cost(6, 2) == pytest.approx(14.0)
    assert policy.cost(2, 2) == 10.0  # below the smallest measured: the smallest's cost
    assert policy.cost(16, 2) == pytest.approx(36.0)  # above: scaled with the rows
    assert policy.cost(4, 3) is None and policy.rate(4, 3) is None
    assert LoadGamma(4, 8).best(3) == 4  # nothing measured: the largest gamma, until calibrated


def test_observe_updates_alpha_and_only_clean_iterations_update_costs() -> None:
    policy = policy_with({(2, 3): 10.0}, 0.5)
    policy.accepted_mass = policy.positions = 0.0
    assert policy.alpha == 0.5  # (0 + 1) / (0 + 2): nothing verified yet
    policy.observe(
        Iteration(
            rows=2,
            gamma=3,
            seconds=20.0,
            draft_s=2.0,
            target_s=16.0,
            tokens=6,
            overlap=5.4,
            positions=6,
            clean=True,
        )
    )
    assert policy.alpha == pytest.approx((5.4 + 1) / (6 + 2))
    assert policy.cost(2, 3) == pytest.approx(0.8 * 10.0 + 0.2 * 20.0)
    # a prompt was read: not an iteration's cost
    policy.observe(
        Iteration(
            rows=2,
            gamma=3,
            seconds=90.0,
            draft_s=50.0,
            target_s=30.0,
            tokens=6,
            overlap=0.0,
            positions=0,
            clean=False,
        )
    )
    assert policy.cost(2, 3) == pytest.approx(0.8 * 10.0 + 0.2 * 20.0)


def test_calibration_measures_every_gamma_and_leaves_the_engine_as_new(pair: dict) -> None:
    """Calibration steps the engine itself at each batch size with each gamma; afterwards the
    engine is idle, its policy installed, and a row served next gets the tokens it gets alone."""
    engine = Engine(pair["target"], pair["draft"], gamma=3, max_rows=4, cache_len=160)
    policy = LoadGamma(3, 4)
    seconds = policy.calibrate(engine, PROMPTS[2], rounds=2)
    assert seconds > 0 and engine.idle and engine.policy is policy and not engine.finished
    assert set(policy.cells) == {(b, g) for b in (1, 2, 4) for g in range(4)}
    assert all(sum(parts) > 0 for parts in policy.cells.values())
    # drafting was timed
    assert all(policy.cells[b, g][0] > 0 for b in (1, 2, 4) for g in (1, 2, 3))
    row = engine.add(PROMPTS[0], 12, seed=5, sampling=Sampling(1.0), gamma=2)
    engine.run()
    alone = speculative_generate(
        pair["target"], pair["draft"], PROMPTS[0], 12, gamma=2, temperature=1.0, seed=5
    )
    assert row.result().tokens == alone.tokens
    with pytest.raises(ValueError, match="calibration needs"):
        LoadGamma(3, 1).calibrate(
            Engine(pair["target"], pair["draft"], gamma=3, cache_len=24), PROMPTS[0]
        )


def test_calibration_seeds_alpha_from_what_it_verified(pair: dict) -> None:
    """Before traffic, alpha comes from the calibration's own verifications, not the prior 1/2
    (which chose too small a gamma for the first requests), weighted as at most the last
    1 / (1 - fade) positions: a draft identical to the target gives alpha near 1."""
    twin = copy.deepcopy(pair["target"])
    policy = LoadGamma(3, 2)
    policy.calibrate(
        Engine(pair["target"], twin, gamma=3, max_rows=2, cache_len=160), PROMPTS[2], rounds=2
    )
    assert 0 < policy.positions <= 1 / (1 - policy.fade) and policy.alpha > 0.95
    policy = LoadGamma(3, 4)
    policy.calibrate(
        Engine(pair["target"], pair["draft"], gamma=3, max_rows=4, cache_len=160),
        PROMPTS[2],
        rounds=5,
    )
    # more than the window
    assert policy.positions == pytest.approx(1 / (1 - policy.fade)) and policy.alpha != 0.5


class Collector:
    """A ticket's callbacks: its tokens by iteration and the moment it ended."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.ended = threading.Event()

    def ticket(self, prompt: list[int], count: int, **options) -> Ticket:
        return Ticket(
            prompt,
            count,
            on_tokens=self.tokens.extend,
            on_done=lambda t: self.ended.set(),
            **options,
        )


def gated(engine: Engine) -> threading.Event:
    """Make the engine's step wait for the returned event (so that a test decides when it runs)."""
    gate, step = threading.Event(), engine.step

    def waiting_step() -> list:
        assert gate.wait(10), "the test never opened the gate"
        return step()

    engine.step = waiting_step
    return gate


def test_the_loop_serves_tickets_exactly_and_counts_them(pair: dict) -> None:
    """Tickets from another thread, with their own sampling, seeds and pinned gammas, get the
    tokens of their runs alone; the callbacks see every token; /metrics' counts add up."""
    engine = Engine(pair["target"], pair["draft"], gamma=3, max_rows=2, cache_len=160)
    loop = EngineLoop(engine, policy=FixedGamma(3)).start()
    try:
        collectors = [Collector() for _ in PROMPTS]
        tickets = [
            loop.submit(c.ticket(p, 10, sampling=Sampling(1.0), seed=30 + i, gamma=i % 4))
            for i, (c, p) in enumerate(zip(collectors, PROMPTS))
        ]
        assert all(c.ended.wait(20) for c in collectors)
    finally:
        loop.close()
    for i, (collector, ticket) in enumerate(zip(collectors, tickets)):
        alone = (
            speculative_generate(
                pair["target"],
                pair["draft"],
                PROMPTS[i],
                10,
                gamma=max(i % 4, 1),
                temperature=1.0,
                seed=30 + i,
            )
            if i % 4
            else None
        )
        assert ticket.done and ticket.stop_reason == "max_new_tokens" and ticket.error is None
        assert collector.tokens == ticket.row.result().tokens
        if alone is not None:
            assert collector.tokens == alone.tokens
    assert loop.metrics.tokens == 40 and loop.metrics.outcomes == {"max_new_tokens": 4}
    assert 'speculative_requests_total{outcome="max_new_tokens"} 4' in prometheus(loop)


def test_a_full_queue_refuses_with_retry_after_and_a_cancel_frees_a_row(pair: dict) -> None:
    engine = Engine(pair["target"], pair["draft"], gamma=3, max_rows=1, cache_len=160)
    gate = gated(engine)
    loop = EngineLoop(engine, max_waiting=2, policy=FixedGamma(2)).start()
    try:
        first, second, third = Collector(), Collector(), Collector()
        running = loop.submit(first.ticket(PROMPTS[0], 100))
        deadline = time.monotonic() + 5
        # the loop takes it, then waits at the gate
        while loop.inbox and time.monotonic() < deadline:
            time.sleep(0.001)
        waiting = loop.submit(second.ticket(PROMPTS[1], 5))
        assert loop.waiting == 2
        with pytest.raises(OverloadedError, match="2 requests are waiting") as refused:
            loop.submit(third.ticket(PROMPTS[2], 5))
        assert refused.value.retry_after >= 1 and loop.metrics.rejected == 1
        gate.set()
        while not first.tokens and time.monotonic() < deadline:
            time.sleep(0.001)
        loop.cancel(running)  # its row leaves; the waiting one takes its place
        assert first.ended.wait(5) and second.ended.wait(5)
        assert running.stop_reason == "cancelled" and len(first.tokens) < 100
        assert waiting.stop_reason == "max_new_tokens" and len(second.tokens) == 5
        never = loop.submit(third.ticket(PROMPTS[2], 5))
        loop.cancel(never)
        assert third.ended.wait(5) and never.stop_reason == "cancelled"
    finally:
        gate.set()
        loop.close()


def test_a_failing_engine_ends_every_request_with_an_error(pair: dict) -> None:
    engine = Engine(pair["target"], pair["draft"], gamma=3, max_rows=2, cache_len=160)

    def broken_step() -> list:
        raise RuntimeError("device lost")

    engine.step = broken_step
    loop = EngineLoop(engine, log=lambda line: None).start()
    collector = Collector()
    ticket = loop.submit(collector.ticket(PROMPTS[0], 5))
    assert (
        collector.ended.wait(5)
        and ticket.stop_reason == "error"
        and "device lost" in str(ticket.error)
    )
    loop.thread.join(5)
    assert not loop.healthy
    with pytest.raises(RuntimeError, match="not running"):
        loop.submit(Collector().ticket(PROMPTS[0], 5))


def test_a_dialog_in_the_llama2_chat_template() -> None:
    """One user turn (with a system prompt) is generate.py --chat's prompt; answered turns are
    closed by EOS and each turn opens with BOS; roles out of turn are refused in one line."""
    tokenizer = load_tokenizer("tiny-target")
    tokenizer.chat = LLAMA2_CHAT  # what a Llama-2 chat model without a template gets
    assert encode_dialog(tokenizer, [("user", "Hi there")]) == encode_prompt(
        tokenizer, "Hi there", chat=True
    )
    assert encode_dialog(tokenizer, [("system", "Be brief."), ("user", " Hi ")]) == encode_prompt(
        tokenizer, "Hi", chat=True, system="Be brief."
    )
    ids = encode_dialog(tokenizer, [("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye")])
    first = tokenizer.encode("[INST] Hi [/INST] Hello! ", bos=True, eos=True)
    assert ids == first + tokenizer.encode("[INST] Bye [/INST]", bos=True)
    for roles in (["assistant"], ["user", "user"], ["user", "assistant"], []):
        with pytest.raises(ValueError, match="in turn") as error:
            encode_dialog(tokenizer, [(role, "x") for role in roles])
        assert "\n" not in str(error.value)
