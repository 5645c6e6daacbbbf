"""The production engine driven from outside, as a server drives it: rows join and leave
between iterations (``add`` / ``step`` / ``finished``), and a row's tokens do not depend on
when it joined or on what else is in the batch.

Float64 models, so that a row's logits do not depend on the shape of the batch (the
numerics policy, docs/algorithm.md): a row is then the batch of one with its seed, token
for token, greedy or sampled, with a draft model, a feature head or nothing drafted.
"""

from __future__ import annotations

import copy

import pytest
import torch

from model import ModelConfig
from model.feature_head import FeatureHead
from speculative import (
    Engine,
    FeatureDrafter,
    NonFiniteLogitsError,
    Sampling,
    autoregressive_generate,
    speculative_generate,
)
from speculative.engine import engine as engine_module
from speculative.engine.engine import RowFailedError
from speculative.engine.gamma import AutoGamma, Switch
from tests.support.proofs import proof
from tests.support.toy_models import noisy_copy, random_llama, reference_greedy

torch.set_num_threads(1)
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11]]


@pytest.fixture(scope="module")
def pair() -> dict:
    target = random_llama(vocab=16, dim=16, max_seq_len=64, seed=0, dtype=torch.float64)
    head = FeatureHead(
        ModelConfig(
            vocab_size=16,
            dim=16,
            n_layers=1,
            n_heads=2,
            n_kv_heads=1,
            hidden_dim=32,
            max_seq_len=64,
        )
    ).to(torch.float64)
    return {"target": target, "draft": noisy_copy(target, std=0.3, seed=1), "head": head}


def drafter_of(pair: dict, kind: str):
    return {
        "model": pair["draft"],
        "feature": FeatureDrafter(pair["head"], pair["target"]),
        "none": None,
    }[kind]


def alone(
    pair: dict, kind: str, prompt: list[int], seed: int, temperature: float, count: int
) -> list[int]:
    if kind == "none":
        return autoregressive_generate(
            pair["target"], prompt, count, temperature=temperature, seed=seed
        ).tokens
    return speculative_generate(
        pair["target"],
        drafter_of(pair, kind),
        prompt,
        count,
        gamma=3,
        temperature=temperature,
        seed=seed,
    ).tokens


@proof(
    "a row that joins the engine between iterations gets the tokens it would get alone",
    "exact identity, float64, greedy and sampled, three drafters",
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("kind", ["model", "feature", "none"])
def test_rows_that_join_later_get_their_own_tokens(
    pair: dict, kind: str, temperature: float
) -> None:
    """Rows added between steps, at most 2 at a time, with different lengths: each one's
    tokens are those of its prompt alone with its seed; the engine empties and the rows
    leave in the order they finished."""
    engine = Engine(
        pair["target"],
        drafter_of(pair, kind),
        gamma=3,
        temperature=temperature,
        max_rows=2,
        cache_len=64,
    )
    counts = [12, 5, 9, 7]
    rows = [engine.add(PROMPTS[0], counts[0], seed=10)]
    seen_finished = []
    for step in range(200):
        if step == 2:
            rows.append(engine.add(PROMPTS[1], counts[1], seed=11))
        if step == 3:  # waits for a place: the batch holds two rows
            rows += [
                engine.add(PROMPTS[2], counts[2], seed=12),
                engine.add(PROMPTS[3], counts[3], seed=13),
            ]
        seen_finished += engine.step()
        assert len(engine.rows) <= 2
        if step > 3 and engine.idle:
            break
    assert (
        engine.idle
        and seen_finished == engine.finished
        and set(map(id, seen_finished)) == set(map(id, rows))
    )
    for i, row in enumerate(rows):
        assert row.done and row.result().tokens == alone(
            pair, kind, PROMPTS[i], 10 + i, temperature, counts[i]
        )
        assert row.stats.stop_reason == "max_new_tokens" and row.stats.new_tokens == counts[i]


@proof("a greedy row is the target's greedy output whatever joins", "exact identity, float64")
def test_a_greedy_row_is_the_target_greedy_output_whatever_joins(pair: dict) -> None:
    engine = Engine(
        pair["target"], pair["draft"], gamma=4, temperature=0.0, max_rows=3, cache_len=64
    )
    first = engine.add(PROMPTS[2], 20)
    engine.step()
    others = [engine.add(p, 6) for p in PROMPTS[:2]]
    while not engine.idle:
        engine.step()
    assert first.result().tokens == reference_greedy(pair["target"], PROMPTS[2], 20)
    for prompt, row in zip(PROMPTS, others):
        assert row.result().tokens == reference_greedy(pair["target"], prompt, 6)


@proof(
    "a row cancelled from outside leaves before the next iteration, and the rows that stay or join keep their "
    "own tokens",
    "exact identity, float64, sampled, draft model and nothing drafted",
)
@pytest.mark.parametrize("kind", ["model", "none"])
def test_a_cancelled_row_leaves_at_once_and_the_others_go_on(pair: dict, kind: str) -> None:
    """Cancelling a row in the batch: at the next step it leaves before anything is computed
    for it (no more target calls, its tokens a prefix of its run alone), and a waiting row
    takes its place in that step. Cancelling a waiting row drops it at once; cancelling a row
    that is done changes nothing. The other rows are their runs alone, token for token."""
    engine = Engine(
        pair["target"], drafter_of(pair, kind), gamma=3, temperature=1.0, max_rows=2, cache_len=64
    )
    counts = [30, 10, 9, 7]
    going, staying, joining, dropped = (
        engine.add(PROMPTS[i], counts[i], seed=10 + i) for i in range(4)
    )
    engine.step()
    engine.step()
    # nothing drafted: its tokens may be on the device
    calls, produced = (
        going.stats.target_calls,
        going.produced,
    )
    engine.cancel(going)
    engine.cancel(dropped)  # still waiting: dropped at once
    assert (
        dropped.done and dropped.stats.stop_reason == "cancelled" and dropped.result().tokens == []
    )
    assert all(row is not dropped for row in engine.waiting) and engine.finished == [dropped]
    finished = engine.step()
    assert finished[0] is going and going.done and going.stats.stop_reason == "cancelled"
    so_far = going.result().tokens
    assert going.stats.target_calls == calls and len(so_far) == produced
    assert [row is joining or row is staying for row in engine.rows] == [True, True]
    engine.run()  # the models' caches are the engine's until then: the runs alone come after
    assert (
        so_far == alone(pair, kind, PROMPTS[0], 10, 1.0, counts[0])[: len(so_far)]
        and len(so_far) < counts[0]
    )
    for i, row in ((1, staying), (2, joining)):
        assert row.result().tokens == alone(pair, kind, PROMPTS[i], 10 + i, 1.0, counts[i])
        assert row.stats.stop_reason == "max_new_tokens"
    engine.cancel(staying)  # done already: nothing changes
    assert staying.stats.stop_reason == "max_new_tokens" and not staying.cancelled


def test_a_row_stops_at_its_eos_while_others_go_on(pair: dict) -> None:
    greedy = reference_greedy(pair["target"], PROMPTS[0], 10)
    eos = greedy[3]
    engine = Engine(pair["target"], pair["draft"], temperature=0.0, max_rows=2, cache_len=64)
    stopping = engine.add(PROMPTS[0], 10, eos_id=eos)
    going = engine.add(PROMPTS[1], 10)
    engine.run()
    assert stopping.result().tokens == greedy[: greedy.index(eos) + 1]
    assert stopping.stats.stop_reason == "eos" and going.stats.new_tokens == 10
    assert engine.finished[0] is stopping


def test_a_row_longer_than_the_cache_stops_at_its_end(pair: dict) -> None:
    """A later row that does not fit what the caches were sized for stops when they are full."""
    engine = Engine(pair["target"], pair["draft"], temperature=0.0, max_rows=1, cache_len=16)
    row = engine.add(PROMPTS[0], 40)
    engine.run()
    assert (
        len(PROMPTS[0]) + len(row.result().tokens) == 16 and row.stats.stop_reason == "max_seq_len"
    )


def test_batched_trees_are_refused_with_one_line(pair: dict) -> None:
    with pytest.raises(ValueError, match="one row at a time") as error:
        Engine(pair["target"], pair["draft"], tree=(2, 1), max_rows=2)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_rows": 0}, "max_rows"),
        ({"verify": "tree"}, "verify must be one of"),
        ({"gamma": 0}, "gamma"),
    ],
)
def test_bad_settings(pair: dict, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Engine(pair["target"], pair["draft"], **kwargs)


def test_bad_requests(pair: dict) -> None:
    engine = Engine(pair["target"], pair["draft"])
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add([1], 0)
    with pytest.raises(ValueError):
        engine.add([99], 4)  # outside the vocabulary
    assert engine.idle


@proof(
    "rows with their own temperature, top-k and top-p share a batch, each getting the tokens it would get alone",
    "exact identity, float64, greedy, T = 1 and top-k/top-p rows in one call",
)
@pytest.mark.parametrize("kind", ["model", "feature", "none"])
def test_rows_with_their_own_sampling_are_their_single_runs(pair: dict, kind: str) -> None:
    settings = [
        Sampling(temperature=0),
        Sampling(temperature=1.0),
        Sampling(temperature=0.7, top_k=5, top_p=0.9),
    ]
    engine = Engine(pair["target"], drafter_of(pair, kind), gamma=3, max_rows=3, cache_len=64)
    rows = [engine.add(PROMPTS[i], 10, seed=20 + i, sampling=s) for i, s in enumerate(settings)]
    engine.run()
    for i, (row, s) in enumerate(zip(rows, settings)):
        if kind == "none":
            single = autoregressive_generate(
                pair["target"],
                PROMPTS[i],
                10,
                temperature=s.temperature,
                top_k=s.top_k,
                top_p=s.top_p,
                seed=20 + i,
            ).tokens
        else:
            single = speculative_generate(
                pair["target"],
                drafter_of(pair, kind),
                PROMPTS[i],
                10,
                gamma=3,
                temperature=s.temperature,
                top_k=s.top_k,
                top_p=s.top_p,
                seed=20 + i,
            ).tokens
        assert row.result().tokens == single, s
    with pytest.raises(ValueError, match="Sampling"):
        engine.add([1], 4, sampling={"temperature": 1})


def test_a_row_whose_logits_turn_non_finite_fails_alone(pair: dict) -> None:
    """Token 15's embedding is NaN in a copy of the target: a row that reads it gets NaN logits
    and fails with NonFiniteLogitsError, in the iteration's one read; the other rows go on and
    stay exact (greedy, the target's own tokens), with a draft model and with nothing drafted."""
    broken = copy.deepcopy(pair["target"])
    with torch.no_grad():
        broken.embed_tokens.weight[15] = float("nan")
    healthy = reference_greedy(pair["target"], PROMPTS[1], 8)
    assert 15 not in PROMPTS[1] + healthy  # the healthy row never reads the poisoned token
    for draft in (pair["draft"], None):
        engine = Engine(broken, draft, temperature=0.0, max_rows=2, cache_len=64)
        poisoned, fine = engine.add([3, 15, 4], 8), engine.add(PROMPTS[1], 8)
        engine.run()
        assert (
            isinstance(poisoned.error, NonFiniteLogitsError)
            and poisoned.stats.stop_reason == "error"
        )
        assert poisoned.result().tokens == [] and fine.error is None
        assert fine.result().tokens == healthy


def test_a_pinned_gamma_and_the_engines_policy(pair: dict) -> None:
    """A row's pinned gamma is what it drafts (0: nothing), whatever the engine's policy; the
    policy sets the others'. A pinned row's tokens are the single call's with that gamma."""
    engine = Engine(
        pair["target"], pair["draft"], gamma=4, temperature=1.0, max_rows=3, cache_len=64
    )
    engine.policy = lambda e: 1
    off, two, free = (
        engine.add(PROMPTS[0], 12, seed=1, gamma=0),
        engine.add(PROMPTS[1], 12, seed=2, gamma=2),
        engine.add(PROMPTS[2], 12, seed=3),
    )
    engine.run()
    assert set(off.stats.gamma_history) == {0} and off.stats.drafted_tokens == 0
    assert max(two.stats.gamma_history) == 2 and set(free.stats.gamma_history) <= {0, 1}
    alone = speculative_generate(
        pair["target"], pair["draft"], PROMPTS[1], 12, gamma=2, temperature=1.0, seed=2
    )
    assert two.result().tokens == alone.tokens
    with pytest.raises(ValueError, match="gamma must be an integer in 0..4"):
        engine.add([1], 4, gamma=5)


@pytest.mark.parametrize("speculate", [False, True])
def test_logprobs_are_the_target_s_own_with_and_without_speculation(speculate: bool) -> None:
    """Each emitted token's recorded log-probability, and its top ones, are the target's own at
    temperature 1 (a no-cache forward over the final sequence), whatever was drafted and
    accepted, for rows of a batch sampled at their own temperatures."""
    target = random_llama(vocab=16, dim=16, n_layers=2, max_seq_len=64, seed=0, dtype=torch.float64)
    engine = Engine(
        target, noisy_copy(target, std=0.2, seed=1) if speculate else None, gamma=3, max_rows=2
    )
    rows = [
        engine.add([1, 2, 3], 12, seed=0, sampling=Sampling(temperature=0.7), logprobs=3),
        engine.add([4, 5], 10, seed=1, sampling=Sampling(temperature=0), logprobs=0),
        engine.add([6], 8, seed=2),
    ]
    engine.run()
    for row in rows[:2]:
        new = row.ids[len(row.prompt) :]
        assert len(row.logprob_record) == len(new) > 0
        with torch.no_grad():
            logp = torch.log_softmax(target(torch.tensor([row.ids]))[0], dim=-1)
        for j, (token, (value, tops)) in enumerate(zip(new, row.logprob_record)):
            own = logp[len(row.prompt) - 1 + j]
            assert value == pytest.approx(float(own[token]), abs=1e-9)
            best = own.topk(row.logprobs)
            assert [t for t, _ in tops] == best.indices.tolist()
            assert [v for _, v in tops] == pytest.approx(best.values.tolist(), abs=1e-9)
    assert rows[2].logprob_record == []
    if speculate:
        assert engine.stats.accepted_draft_tokens > 0


@pytest.mark.parametrize("speculate", [False, True])
def test_echo_records_the_prompt_s_logprobs_from_the_call_that_reads_it(speculate: bool) -> None:
    """With echo, each prompt token after the first gets the target's own log-probability and
    top ones given the tokens before it (a no-cache forward over the prompt), for rows of
    different lengths read in one call (each from column 0 of its own row); the first gets
    None; a one-token prompt has nothing else to record."""
    target = random_llama(vocab=16, dim=16, n_layers=2, max_seq_len=64, seed=0, dtype=torch.float64)
    engine = Engine(
        target, noisy_copy(target, std=0.2, seed=1) if speculate else None, gamma=3, max_rows=4
    )
    rows = [
        engine.add([1, 2, 3, 4, 5], 4, seed=0, logprobs=2, echo=True),
        engine.add([7, 8], 4, seed=1, echo=True),
        engine.add([9], 3, seed=2, echo=True),
        engine.add([3, 3, 3], 3, seed=3, logprobs=1),
    ]
    engine.step()  # the four are read together
    assert all(row.stats.target_calls == 1 for row in rows)
    engine.run()
    for row in rows[:2]:
        assert len(row.prompt_record) == len(row.prompt) and row.prompt_record[0] is None
        with torch.no_grad():
            logp = torch.log_softmax(target(torch.tensor([row.prompt]))[0], dim=-1)
        for i, (value, tops) in enumerate(row.prompt_record[1:]):
            assert value == pytest.approx(float(logp[i, row.prompt[i + 1]]), abs=1e-9)
            best = logp[i].topk(row.logprobs or 1)
            assert [t for t, _ in tops] == (best.indices.tolist() if row.logprobs else [])
            assert [v for _, v in tops] == pytest.approx(
                best.values.tolist() if row.logprobs else [], abs=1e-9
            )
    assert rows[2].prompt_record == [None] and rows[3].prompt_record == []


def test_a_row_whose_callback_raises_fails_alone() -> None:
    """An exception raised in one row's callback (a server's handler of its tokens) escaped the
    step and failed every row; now that row fails alone and the others' tokens are untouched."""
    target = random_llama(vocab=16, dim=16, n_layers=2, max_seq_len=64, seed=0, dtype=torch.float64)
    engine = Engine(target, noisy_copy(target, std=0.2, seed=1), gamma=3, max_rows=2)

    def broken(ids: list[int], drafted: list[bool]) -> None:
        raise KeyError("its handler failed")

    bad = engine.add([1, 2], 12, callback=broken, sampling=Sampling(temperature=0))
    good = engine.add(
        [4, 5], 12, callback=lambda ids, drafted: None, sampling=Sampling(temperature=0)
    )
    engine.run()
    assert isinstance(bad.error, RowFailedError) and "its handler failed" in str(bad.error)
    assert bad.stats.stop_reason == "error" and bad.produced < 12
    assert good.error is None and good.ids[2:] == reference_greedy(target, [4, 5], 12)


def test_auto_gamma_off_and_on_again_is_still_the_target_s_greedy_output(pair: dict) -> None:
    """gamma="auto" turned off (gamma 0: plain steps) and back on within one run, the drafter catching up
    on what the plain steps emitted: the tokens are still the target's greedy ones, and the iterations
    off drafted nothing."""
    engine = Engine(
        pair["target"], pair["draft"], gamma="auto", temperature=0.0, max_rows=1, cache_len=64
    )
    # plain steps from the start, speculating from iteration 5
    engine.gamma_policy.switch.off, engine.gamma_policy.switch.next_retry = (
        True,
        5,
    )
    row = engine.add(PROMPTS[1], 24)
    engine.run()
    history = row.stats.gamma_history
    assert history[:4] == [0, 0, 0, 0] and any(history[4:])
    assert row.result().tokens == reference_greedy(pair["target"], PROMPTS[1], 24)


@pytest.mark.parametrize("tree", [None, (2, 1)])
def test_a_guarded_gamma_or_tree_off_and_on_again_is_still_the_target_s_greedy_output(
    pair: dict, tree
) -> None:
    """guard=True: a fixed gamma (or a named tree, its depth) turned off and back on by its switch: the
    iterations draft the asked length or nothing, and the tokens are the target's greedy ones."""
    engine = Engine(
        pair["target"],
        pair["draft"],
        gamma=None if tree else 3,
        tree=tree,
        temperature=0.0,
        max_rows=1,
        cache_len=64,
        guard=True,
    )
    depth = 3 if tree is None else 2
    # plain steps from the start, a retry at iterations 5 and 6
    engine.gamma_policy.switch.off, engine.gamma_policy.switch.next_retry = (
        True,
        5,
    )
    row = engine.add(PROMPTS[1], 24)
    engine.run()
    history = row.stats.gamma_history
    assert history[:5] == [0] * 5 and history[5:7] == [depth, depth] and history[7] == 0
    # the asked depth or nothing, except where the count left fewer tokens: the last depth + 1 iterations at most
    shrunk = [i for i, g in enumerate(history) if g not in (0, depth)]
    assert all(i >= len(history) - (depth + 1) and history[i] < depth for i in shrunk)
    assert row.result().tokens == reference_greedy(pair["target"], PROMPTS[1], 24)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("kind", ["model", "feature"])
def test_plain_steps_of_a_drafter_switched_off_stay_on_the_device(
    pair: dict, kind: str, temperature: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a guarded drafter is off, rows that stop by their count keep their tokens on the device, as the
    target alone does (no host read per token); the drafter reads them when it drafts again. The tokens,
    what was drafted and what was accepted are those of the same run whose callback reads every token."""
    reads = []
    real = engine_module.read_host
    monkeypatch.setattr(engine_module, "read_host", lambda parts: reads.append(1) or real(parts))

    def run(callback) -> tuple[list[int], list[int], int, int]:
        engine = Engine(
            pair["target"],
            drafter_of(pair, kind),
            gamma=3,
            temperature=temperature,
            max_rows=1,
            cache_len=64,
            guard=True,
        )
        # the switch's answers, without its clock: plain for six iterations, then drafting again
        engine.gamma_policy.switch.choose, engine.gamma_policy.switch.observe = (
            (lambda i: 0 if i < 6 else 3),
            (lambda *args: None),
        )
        reads.clear()
        row = engine.add(PROMPTS[2], 20, seed=4, callback=callback)
        engine.run()
        return (
            row.result().tokens,
            row.stats.gamma_history,
            row.stats.accepted_draft_tokens,
            len(reads),
        )

    quiet, seen = run(None), run(lambda ids, from_draft: None)
    assert quiet[:3] == seen[:3] and quiet[1][:6] == [0] * 6 and quiet[1][6] == 3
    assert quiet[3] < seen[3] - 4  # the first six plain steps made no read of their own
    if temperature == 0:
        assert quiet[0] == reference_greedy(pair["target"], PROMPTS[2], 20)


@pytest.mark.parametrize("kind", ["model", "feature"])
def test_a_sampled_run_guarded_by_recorded_costs_does_not_follow_the_clock(
    pair: dict, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """guard=(plain seconds a token, seconds a speculating iteration): the switch reads no clock, so a sampled
    run's tokens are the same whatever the clock says, which --seed promises, and they are what the costs say:
    every iteration drafts where they pay, plain steps after the first drafting one where they lose. The timed
    guard under the same two clocks drafts differently (the test's power)."""

    # a CPU clock whose marks are 1 ms apart, or 100 ms for the first ten
    class Paced(engine_module.Clock):
        def __init__(self, device: torch.device) -> None:
            super().__init__(device)
            self.now, self.marks, self.slow_start = 0.0, 0, next(starts)

        def mark(self) -> float:
            self.marks += 1
            self.now += 0.1 if self.slow_start and self.marks <= 10 else 0.001
            return self.now

    monkeypatch.setattr(engine_module, "Clock", Paced)

    def run(guard: object, slow_start: bool) -> tuple[list[int], list[int]]:
        nonlocal starts
        starts = iter([slow_start])
        engine = Engine(
            pair["target"],
            drafter_of(pair, kind),
            gamma=3,
            temperature=1.0,
            max_rows=1,
            cache_len=64,
            guard=guard,
        )
        row = engine.add(PROMPTS[2], 40, seed=4)
        engine.run()
        return row.result().tokens, row.stats.gamma_history

    starts = iter([])
    for costs in ((1.0, 2.5), (1.0, 0.5), (1.0, 100.0)):
        assert run(costs, False) == run(costs, True)
    # a feature head drafts nothing at the prompt's iteration (it needs the target's features); the last few
    # iterations draft what the count leaves
    paying, losing = run((1.0, 0.5), False)[1], run((1.0, 100.0), False)[1]
    assert 0 not in paying[1:-4], paying
    assert sum(g > 0 for g in losing) == 1, losing  # the retry waits far past these 40 tokens
    # timed: the slow start makes its first speculating iterations look dear (a head's are later)
    if kind == "model":
        assert run(True, False)[1] != run(True, True)[1]


def test_the_guard_is_asked_for_and_not_doubled() -> None:
    """Without guard a fixed gamma has no switch; gamma="auto" always has one (AutoGamma), and a tree="auto"
    has its own plain candidate (AutoTree), so guard adds nothing to either."""
    target = random_llama(vocab=16, dim=16, max_seq_len=64, seed=0, dtype=torch.float64)
    draft = noisy_copy(target, std=0.3, seed=1)
    assert Engine(target, draft, gamma=3).gamma_policy.switch is None
    assert type(Engine(target, draft, gamma=3, guard=True).gamma_policy.switch) is Switch
    assert Engine(target, draft, gamma=3, guard=True).gamma_policy.switch.gamma == 3
    assert type(Engine(target, draft, gamma="auto", guard=True).gamma_policy.switch) is AutoGamma
    assert Engine(target, draft, tree="auto", guard=True).gamma_policy.switch is None
    assert Engine(target, None, guard=True).gamma_policy.switch is None
