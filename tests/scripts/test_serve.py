"""serve.py's OpenAI-compatible API through the real ``openai`` client, against servers that
listen on 127.0.0.1 at a free port: the shipped pair as serve.py starts it (speculation decided
by the load), and small float64 pairs started in-process for what needs control (the sampled
law, a request whose logits turn non-finite, a full queue, slow steps for disconnects).

Every load loop is bounded in requests and time; nothing waits without a timeout.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
import uvicorn

import generate
import serve
from speculative import Engine
from speculative.cli.options import UsageError
from speculative.engine.gamma import FixedGamma
from speculative.serving.access import Access
from speculative.serving.app import create_app
from speculative.serving.loop import EngineLoop, Service
from speculative.serving.policy import LoadGamma
from speculative.serving.text import Output
from tests.support.cli import without_progress
from tests.support.paths import ROOT
from tests.support.proofs import proof
from tests.support.toy_models import (
    chi_square_pvalue,
    llama_next_logits,
    noisy_copy,
    random_llama,
    ref_warp,
    reference_greedy,
    sequence_distribution,
)
from weights import load_tokenizer, read_pair

# Under pytest -n, the module's server and reference runs start once, on one worker (pyproject.toml: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("test_serve")

torch.set_num_threads(1)
GREEDY_PROMPTS = ["Once upon a time", "The little dog"]
NEW = 48  # tokens per reference request


# ----------------------------------------------------------------------------- servers
@contextlib.contextmanager
def listening(service: Service, access=None) -> Iterator[str]:
    """The API over ``service`` on 127.0.0.1 at a free port, in a thread; its base URL."""
    # so asyncio sets TCP_NODELAY
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(
        uvicorn.Config(create_app(service, access), log_level="error", timeout_graceful_shutdown=1)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "the server did not start within 10 s"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        service.loop.close()


def client(url: str, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=timeout)


class Letters:
    """A tokenizer for toy models: token i is the letter chr(97 + i); no EOS, so rows stop by count."""

    bos_id, eos_id = 0, None

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return [ord(c) - 97 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + int(i)) for i in ids)

    def token_bytes(self, token: int) -> bytes:
        return chr(97 + int(token)).encode()


@contextlib.contextmanager
def toy_server(
    target,
    draft,
    *,
    policy=None,
    max_rows: int = 4,
    max_waiting: int = 64,
    gamma: int = 3,
    step_delay: float = 0.0,
    stall_after: float = 60.0,
    access=None,
) -> Iterator[SimpleNamespace]:
    """A float64 toy pair served in-process; ``step_delay`` makes every engine step that slow."""
    engine = Engine(
        target, draft, gamma=gamma, max_rows=max_rows, cache_len=target.config.max_seq_len
    )
    if step_delay:
        step = engine.step
        engine.step = lambda: (time.sleep(step_delay), step())[1]
    loop = EngineLoop(
        engine,
        max_waiting=max_waiting,
        policy=policy,
        log=lambda line: None,
        stall_after=stall_after,
    ).start()
    service = Service(loop, Letters(), "toy", target.config.max_seq_len, gamma, "load")
    with listening(service, access) as url:
        yield SimpleNamespace(url=url, loop=loop, engine=engine, client=client(url))


@pytest.fixture(scope="module")
def shipped(chat_target: Path) -> Iterator[SimpleNamespace]:
    """The shipped pair as ``serve.py --max-batch 4`` starts it: speculation by load, calibrated; its
    target as a chat model of Llama-2's format (conftest's chat_target), served as tiny-target."""
    args = serve.build_parser().parse_args(
        ["--target", str(chat_target), "--name", "tiny-target", "--max-batch", "4", "--port", "0"]
    )
    serve.validate(args)
    service = serve.start(args)
    with listening(service) as url:
        yield SimpleNamespace(
            url=url, service=service, client=client(url), tokenizer=service.tokenizer
        )


def run_generate(*argv: str) -> dict:
    """generate.py's own answer (--json) for these flags."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert generate.main([*argv, "--max-new-tokens", str(NEW), "--json"]) == 0
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def references(shipped: SimpleNamespace, chat_target: Path) -> dict:
    """generate.py's tokens: greedy for each prompt, --chat greedy, and a sampled run with
    --gamma 2 --seed 7 --no-guard; the greedy ones are checked to be far from any near-tie (so that a batch's
    float32 rounding cannot flip them and equality is the test)."""
    refs = {p: run_generate("--prompt", p) for p in GREEDY_PROMPTS}
    refs["chat"] = run_generate(
        "--target", str(chat_target), "--prompt", "Tell me a story", "--chat"
    )
    # a pinned gamma drafts every iteration: so does this one
    refs["pinned"] = run_generate(
        "--prompt",
        GREEDY_PROMPTS[0],
        "--temperature",
        "1",
        "--seed",
        "7",
        "--gamma",
        "2",
        "--no-guard",
    )
    target, tokenizer = shipped.service.loop.engine.target, shipped.tokenizer
    with torch.inference_mode():
        for prompt in GREEDY_PROMPTS:
            ids = tokenizer.encode(prompt, bos=True) + refs[prompt]["tokens"]
            logits = target(torch.tensor([ids]))[0, -NEW - 1 : -1].double()
            top2 = logits.topk(2, dim=-1).values
            assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-3, (
                f"{prompt!r} meets a near-tie: choose another"
            )
    return refs


def ids_of(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def completion(shipped: SimpleNamespace, prompt: str, **options):
    extra = options.pop("extra_body", {})
    options.setdefault("max_tokens", NEW)
    return shipped.client.completions.create(
        model="tiny-target",
        prompt=prompt,
        extra_body={"return_token_ids": True, **extra},
        **options,
    )


def streamed(stream) -> tuple[str, list[int], list]:
    """The text and token ids of a stream of chunks, and the chunks."""
    chunks = list(stream)
    text, ids = "", []
    for chunk in chunks:
        for choice in chunk.choices:
            text += (
                getattr(choice, "text", None)
                or getattr(getattr(choice, "delta", None), "content", None)
                or ""
            )
            ids += (choice.model_extra or {}).get("token_ids", [])
    return text, ids, chunks


# ----------------------------------------------------------------------------- exactness
def test_greedy_completions_are_generate_pys_streamed_or_not(shipped, references) -> None:
    for prompt in GREEDY_PROMPTS:
        ref = references[prompt]
        finish = "stop" if ref["stats"]["stop_reason"] == "eos" else "length"
        whole = completion(shipped, prompt, temperature=0)
        assert ids_of(whole.choices[0]) == ref["tokens"] and whole.choices[0].text == ref["text"]
        assert whole.choices[0].finish_reason == finish and whole.usage.completion_tokens == len(
            ref["tokens"]
        )
        text, ids, chunks = streamed(
            completion(
                shipped, prompt, temperature=0, stream=True, stream_options={"include_usage": True}
            )
        )
        assert ids == ref["tokens"] and text == ref["text"]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref["tokens"])
        assert chunks[-2].choices[0].finish_reason == finish


def test_a_temperature_too_small_to_divide_by_is_greedy_and_stops_nothing(
    shipped, references
) -> None:
    """temperature 1e-300 made every warped probability NaN, a token id past the vocabulary, and
    the engine's failure ended serve.py (exit 0) for every client: it is greedy's limit now."""
    ref = references[GREEDY_PROMPTS[0]]
    tiny = completion(shipped, GREEDY_PROMPTS[0], temperature=1e-300, seed=3)
    assert ids_of(tiny.choices[0]) == ref["tokens"]
    assert ids_of(completion(shipped, GREEDY_PROMPTS[0], temperature=0).choices[0]) == ref["tokens"]


def test_a_chat_is_generate_pys_chat_streamed_or_not(shipped, references) -> None:
    ref = references["chat"]
    messages = [{"role": "user", "content": "Tell me a story"}]
    whole = shipped.client.chat.completions.create(
        model="tiny-target",
        messages=messages,
        max_tokens=NEW,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert ids_of(whole.choices[0]) == ref["tokens"]
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == shipped.tokenizer.decode(ref["tokens"])
    text, ids, chunks = streamed(
        shipped.client.chat.completions.create(
            model="tiny-target",
            messages=messages,
            max_tokens=NEW,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True},
        )
    )
    assert ids == ref["tokens"] and text == whole.choices[0].message.content
    assert (
        chunks[0].choices[0].delta.role == "assistant"
        and chunks[-1].choices[0].finish_reason == "length"
    )
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_a_pinned_seed_gets_generate_pys_tokens_alone_and_among_concurrent_requests(
    shipped, references
) -> None:
    """speculative_gamma 2 and seed 7 give generate.py --gamma 2 --seed 7's tokens, alone and while
    greedy and sampled requests share the batch; every greedy request stays generate.py's."""
    ref = references["pinned"]["tokens"]
    # serve.py's default, generate.py's for a sampled chain
    assert shipped.service.loop.engine.rule == "block"

    def pinned():
        return ids_of(
            completion(
                shipped,
                GREEDY_PROMPTS[0],
                temperature=1,
                seed=7,
                extra_body={"speculative_gamma": 2},
            ).choices[0]
        )

    assert pinned() == ref
    jobs = [pinned, pinned] + [
        lambda p=p: ids_of(completion(shipped, p, temperature=0).choices[0]) for p in GREEDY_PROMPTS
    ]
    noise = [
        lambda i=i: completion(shipped, "Lily and Tom", temperature=1.0, max_tokens=40 + 10 * i)
        for i in range(4)
    ]
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(job) for job in noise[:2] + jobs + noise[2:]]
        results = [f.result(timeout=120) for f in futures]
    assert results[2:4] == [ref, ref]
    assert results[4:6] == [references[p]["tokens"] for p in GREEDY_PROMPTS]


@proof(
    "a sampled request through the server follows the target's law while other requests share the batch "
    "and gamma follows the load",
    "chi-square (p > 1e-3) of 1,000 requests of 3 tokens at T = 0.8, top-k 4, "
    "float64, against the exact law; the draft's law is rejected (p < 1e-6)",
    rejects=("the server drops top_k", "unseeded requests seeded alike"),
)
def test_the_sampled_law_under_concurrent_traffic() -> None:
    target = random_llama(vocab=5, dim=16, max_seq_len=64, seed=3, dtype=torch.float64)
    draft = noisy_copy(target, std=0.5, seed=4)
    policy = LoadGamma(3, 4)
    engine_for_calibration = Engine(target, draft, gamma=3, max_rows=4, cache_len=64)
    policy.calibrate(engine_for_calibration, [0, 1], rounds=1)
    prompt, count = [1, 2, 0], 1000
    with toy_server(target, draft, policy=policy) as server:

        def sampled(_: int) -> tuple[int, ...]:
            answer = server.client.completions.create(
                model="toy",
                prompt=prompt,
                max_tokens=3,
                temperature=0.8,
                extra_body={"top_k": 4, "return_token_ids": True},
            )
            return tuple(ids_of(answer.choices[0]))

        def other(i: int) -> None:
            server.client.completions.create(
                model="toy",
                prompt=[i % 5, 3],
                max_tokens=5 + i % 20,
                temperature=[0, 1.0, 0.5][i % 3],
                seed=i,
            )

        with ThreadPoolExecutor(10) as pool:
            background = [pool.submit(other, i) for i in range(60)]
            samples = Counter(pool.map(sampled, range(count), timeout=300))
            for f in background:
                f.result(timeout=60)
        assert server.loop.metrics.speculating > 0
    assert sum(samples.values()) == count

    def law(model):
        logits = llama_next_logits(model)
        return sequence_distribution(
            lambda ctx: ref_warp(logits(ctx).tolist(), 0.8, top_k=4), prompt, 3
        )

    assert chi_square_pvalue(samples, law(target)) > 1e-3
    assert chi_square_pvalue(samples, law(draft)) < 1e-6  # the test tells the target from its draft


# ----------------------------------------------------------------------------- text, usage, figures
def test_stop_strings_end_the_text_before_them(shipped, references) -> None:
    ref = references[GREEDY_PROMPTS[0]]
    full = ref["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 6]
    cut = full[: full.index(stop)]
    whole = completion(shipped, GREEDY_PROMPTS[0], temperature=0, stop=[stop, "never there"])
    assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"
    kept = ids_of(whole.choices[0])
    assert kept == ref["tokens"][: len(kept)] and whole.usage.completion_tokens == len(kept) < NEW
    assert stop in shipped.tokenizer.decode(shipped.tokenizer.encode(GREEDY_PROMPTS[0]) + kept)
    text, ids, chunks = streamed(
        completion(shipped, GREEDY_PROMPTS[0], temperature=0, stop=stop, stream=True)
    )
    assert text == cut and ids == kept and chunks[-1].choices[0].finish_reason == "stop"


def test_a_stop_string_finish_is_counted_as_one(shipped, references) -> None:
    """/metrics counted a request that met a stop string as cancelled, as if its client had left."""
    outcomes = shipped.service.loop.metrics.outcomes
    before = dict(outcomes)
    full = references[GREEDY_PROMPTS[0]]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 6]
    for stream in (False, True):
        answer = completion(shipped, GREEDY_PROMPTS[0], temperature=0, stop=stop, stream=stream)
        if stream:
            streamed(answer)
    deadline = time.monotonic() + 60  # the row leaves after the answer's last chunk
    while outcomes.get("stop_string", 0) < before.get("stop_string", 0) + 2:
        assert time.monotonic() < deadline, outcomes
        time.sleep(0.02)
    assert outcomes.get("cancelled", 0) == before.get("cancelled", 0)
    assert 'outcome="stop_string"' in httpx.get(f"{shipped.url}/metrics", timeout=10).text


def test_every_answer_has_usage_and_its_speculation_figures(shipped) -> None:
    plain = completion(shipped, "Lily and Tom", temperature=0, extra_body={"speculative_gamma": 0})
    figures = plain.model_extra["speculation"]
    assert (
        figures["gamma"] == 0
        and figures["drafted_tokens"] == 0
        and figures["acceptance_rate"] is None
    )
    made = plain.usage.completion_tokens
    assert figures["target_calls"] == made and figures["tokens_per_target_call"] == 1.0
    assert plain.usage.prompt_tokens == len(shipped.tokenizer.encode("Lily and Tom"))
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + made
    spec = completion(shipped, "Lily and Tom", temperature=0, extra_body={"speculative_gamma": 3})
    figures = spec.model_extra["speculation"]
    assert figures["gamma"] == 3 and 0 < figures["accepted_tokens"] <= figures["drafted_tokens"]
    assert 0 < figures["acceptance_rate"] <= 1 and figures["mean_gamma"] <= 3
    assert figures["tokens_per_target_call"] == pytest.approx(made / figures["target_calls"])
    assert figures["tokens_per_target_call"] > 1
    assert ids_of(spec.choices[0]) == ids_of(plain.choices[0])  # greedy: the same tokens either way
    load = completion(shipped, "Lily and Tom", temperature=0).model_extra["speculation"]
    assert load["gamma"] == "load"


def test_models_health_and_metrics(shipped) -> None:
    # tokens to count, whichever tests ran before on this server
    completion(shipped, "Once upon a time", temperature=0)
    models = shipped.client.models.list()
    assert [m.id for m in models.data] == ["tiny-target"] and models.data[0].model_extra[
        "context_length"
    ] == 512
    health = httpx.get(f"{shipped.url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    metrics = httpx.get(f"{shipped.url}/metrics", timeout=10)
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    values = {}
    for line in metrics.text.splitlines():
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    for name in (
        "tokens_per_second",
        "requests_running",
        "requests_waiting",
        "batch_size",
        "alpha",
        "tau",
        "speculation_on_ratio",
        "speculating_iterations_total",
        "gamma",
        "policy_alpha",
    ):
        assert f"speculative_{name}" in values, name
    assert {f'speculative_policy_gamma{{batch="{b}"}}' for b in range(1, 5)} <= set(values)
    # the shipped server chooses gamma by the load, and says so
    assert values['speculative_gamma_policy{policy="load"}'] == 1
    assert not [
        name
        for name in values
        if name.startswith("speculative_gamma_policy{") and "load" not in name
    ]
    assert (
        values["speculative_generated_tokens_total"] > 0
        and values["speculative_iterations_total"] > 0
    )
    assert all(0 <= values[f'speculative_policy_gamma{{batch="{b}"}}'] <= 4 for b in range(1, 5))


# ----------------------------------------------------------------------------- n choices
def by_choice(chunks) -> dict[int, SimpleNamespace]:
    """Each choice's text, token ids and finish_reasons (as they came) in a stream's chunks, by index."""
    out: dict[int, SimpleNamespace] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            got = out.setdefault(choice.index, SimpleNamespace(text="", ids=[], finishes=[]))
            got.text += (
                getattr(choice, "text", None)
                or getattr(getattr(choice, "delta", None), "content", None)
                or ""
            )
            got.ids += (choice.model_extra or {}).get("token_ids", [])
            if choice.finish_reason is not None:
                got.finishes.append(choice.finish_reason)
    return out


def finish_of(ids: list[int]) -> str:
    """A request of NEW tokens without stop strings: "length" when it made them all, else it met EOS."""
    if len(ids) == NEW:
        return "length"
    return "stop"


def test_n_choices_are_samples_seeded_seed_plus_i_and_a_repeat_repeats_them(
    shipped, references
) -> None:
    """n was refused. Choice i of a request seeded s samples with seed s + i (generate.py's
    convention for prompt i of a --prompts-file): with a pinned gamma, choice 0 is generate.py
    --seed 7's tokens and choice i the single request seeded 7 + i; the same request again gives the
    same n texts; the choices differ; usage counts the prompt once and every choice's tokens; the
    speculation figures are the choices' together."""
    prompt = GREEDY_PROMPTS[0]

    def ask(seed: int, n: int):
        return completion(
            shipped, prompt, temperature=1, seed=seed, n=n, extra_body={"speculative_gamma": 2}
        )

    first = ask(7, 3)
    assert [c.index for c in first.choices] == [0, 1, 2]
    ids = [ids_of(c) for c in first.choices]
    assert ids[0] == references["pinned"]["tokens"]
    singles = [ask(7 + i, 1) for i in range(3)]
    assert ids == [ids_of(single.choices[0]) for single in singles]
    assert [c.text for c in first.choices] == [single.choices[0].text for single in singles]
    assert len({tuple(t) for t in ids}) == 3  # distinct seeds, distinct samples
    assert [c.finish_reason for c in first.choices] == [finish_of(t) for t in ids]
    again = ask(7, 3)
    assert [c.text for c in again.choices] == [c.text for c in first.choices]
    assert first.usage.prompt_tokens == len(shipped.tokenizer.encode(prompt, bos=True))
    assert first.usage.completion_tokens == sum(map(len, ids))
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    figures = first.model_extra["speculation"]
    for name in ("drafted_tokens", "accepted_tokens", "target_calls"):
        assert figures[name] == sum(single.model_extra["speculation"][name] for single in singles)
    assert figures["gamma"] == 2 and figures["mean_gamma"] <= 2
    assert 0 < figures["acceptance_rate"] <= 1 and figures["tokens_per_target_call"] > 1
    # the largest seed, folded from -1: its next choice's seed is 2^63, still a generator's seed
    edge = completion(shipped, prompt, temperature=1, seed=-1, n=2, max_tokens=4)
    assert [c.index for c in edge.choices] == [0, 1] and all(ids_of(c) for c in edge.choices)


def test_n_choices_stream_each_under_its_index_to_its_own_finish(shipped) -> None:
    """A stream of n choices: every chunk names its choice; each choice gets its own finish_reason
    chunk, once; one last chunk has the usage; the texts are those of the same request whole."""
    options = {"temperature": 1, "seed": 11, "n": 3, "extra_body": {"speculative_gamma": 2}}
    whole = completion(shipped, GREEDY_PROMPTS[1], **copy.deepcopy(options))
    chunks = list(
        completion(
            shipped,
            GREEDY_PROMPTS[1],
            stream=True,
            stream_options={"include_usage": True},
            **copy.deepcopy(options),
        )
    )
    got = by_choice(chunks)
    assert sorted(got) == [0, 1, 2]
    for choice in whole.choices:
        assert got[choice.index].text == choice.text and got[choice.index].ids == ids_of(choice)
        assert got[choice.index].finishes == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(chunk.usage is None for chunk in chunks[:-1])
    messages = [{"role": "user", "content": "Tell me a story"}]
    chat = {"model": "tiny-target", "messages": messages, "max_tokens": 24, **options}
    whole = shipped.client.chat.completions.create(**copy.deepcopy(chat))
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert len({c.message.content for c in whole.choices}) > 1
    chunks = list(shipped.client.chat.completions.create(stream=True, **copy.deepcopy(chat)))
    got = by_choice(chunks)
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    assert sorted(roles) == [0, 1, 2]
    for choice in whole.choices:
        assert got[choice.index].text == choice.message.content
        assert got[choice.index].finishes == [choice.finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n_choices_without_a_seed_differ_and_greedy_ones_are_alike(shipped, references) -> None:
    """Without a seed each choice has a generator of its own (not one seed for all); at
    temperature 0 the n choices are the same greedy text, each cut by the stop string it meets."""
    sampled = completion(shipped, "Lily and Tom", temperature=1, n=4)
    assert len({c.text for c in sampled.choices}) > 1
    ref = references[GREEDY_PROMPTS[0]]
    greedy = completion(shipped, GREEDY_PROMPTS[0], temperature=0, n=2)
    assert [ids_of(c) for c in greedy.choices] == [ref["tokens"]] * 2
    stop = ref["text"][len(ref["text"]) // 2 : len(ref["text"]) // 2 + 6]
    cut = completion(shipped, GREEDY_PROMPTS[0], temperature=0, n=2, stop=stop)
    assert [c.text for c in cut.choices] == [ref["text"][: ref["text"].index(stop)]] * 2
    assert [c.finish_reason for c in cut.choices] == ["stop", "stop"]


def test_n_choices_have_their_own_logprobs_and_echo_streamed_or_not() -> None:
    """Each choice's log-probabilities are the target's own for that choice's tokens; with echo
    each choice starts with the prompt and its scores, whole or streamed."""
    target = random_llama(vocab=16, dim=16, max_seq_len=64, seed=0, dtype=torch.float64)
    prompt = [1, 2, 3]
    with torch.no_grad():
        logp = torch.log_softmax(target(torch.tensor([prompt]))[0], dim=-1)
    scored = [float(logp[i, t]) for i, t in enumerate(prompt[1:])]

    def own(ids: list[int]) -> list[float]:
        with torch.no_grad():
            logp = torch.log_softmax(target(torch.tensor([prompt + ids]))[0], dim=-1)
        return [float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(ids)]

    with toy_server(target, noisy_copy(target, std=0.2, seed=1)) as server:
        options = {"model": "toy", "prompt": prompt, "max_tokens": 10, "temperature": 0.9}
        options |= {"seed": 4, "n": 3, "logprobs": 2, "extra_body": {"return_token_ids": True}}
        whole = server.client.completions.create(**copy.deepcopy(options))
        assert len({tuple(ids_of(c)) for c in whole.choices}) > 1
        for choice in whole.choices:
            assert choice.logprobs.token_logprobs == pytest.approx(own(ids_of(choice)), abs=1e-9)
            assert choice.logprobs.tokens == [chr(97 + t) for t in ids_of(choice)]
        echoed = server.client.completions.create(echo=True, **copy.deepcopy(options))
        for plain, choice in zip(whole.choices, echoed.choices):
            assert choice.text == "bcd" + plain.text
            assert choice.logprobs.token_logprobs[0] is None
            assert choice.logprobs.token_logprobs[1:] == pytest.approx(
                scored + own(ids_of(plain)), abs=1e-9
            )
        chunks = list(
            server.client.completions.create(stream=True, echo=True, **copy.deepcopy(options))
        )
        got = by_choice(chunks)
        values: dict[int, list] = {}
        for chunk in chunks:
            for choice in chunk.choices:
                if choice.logprobs:
                    values.setdefault(choice.index, []).extend(choice.logprobs.token_logprobs)
        for plain, choice in zip(whole.choices, echoed.choices):
            assert got[plain.index].text == choice.text
            assert values[plain.index][0] is None
            assert values[plain.index][1:] == pytest.approx(choice.logprobs.token_logprobs[1:])


def test_a_request_s_choices_count_as_rows_in_the_queue_and_in_metrics() -> None:
    """A request of n choices queues n rows, all or none: with --max-waiting 3 and one request
    waiting, n = 2 is taken and n = 3 gets 429 (counted 3 rejected); n = 4 could never wait beside
    nothing and is a 400. Each choice's end counts as a request's in /metrics."""
    target = random_llama(vocab=16, dim=16, max_seq_len=64, seed=0, dtype=torch.float64)
    with toy_server(target, None, max_rows=1, max_waiting=3) as server:
        gate, step = threading.Event(), server.engine.step
        server.engine.step = lambda: (gate.wait(10), step())[1]

        def wait_for(count: int) -> None:
            deadline = time.monotonic() + 10
            while server.loop.waiting < count:
                assert time.monotonic() < deadline, server.loop.waiting
                time.sleep(0.005)

        def ask(n: int):
            return server.client.completions.create(model="toy", prompt=[1, 2], max_tokens=4, n=n)

        with ThreadPoolExecutor(2) as pool:
            held = pool.submit(ask, 1)
            wait_for(1)
            pair = pool.submit(ask, 2)
            wait_for(3)
            code, body, headers = error_of(lambda: ask(1))
            assert code == 429 and body["code"] == "queue_full"
            code, body, headers = error_of(lambda: ask(3))
            assert (
                code == 429 and "3 choices" in body["message"] and int(headers["retry-after"]) >= 1
            )
            code, body, _ = error_of(lambda: ask(4))
            assert code == 400 and body["param"] == "n" and "at most 3" in body["message"]
            gate.set()
            assert held.result(timeout=30).usage.completion_tokens == 4
            answer = pair.result(timeout=30)
        assert [c.index for c in answer.choices] == [0, 1]
        assert answer.usage.completion_tokens == 8 and answer.usage.prompt_tokens == 2
        assert server.loop.metrics.rejected == 4
        deadline = time.monotonic() + 10
        while server.loop.metrics.outcomes.get("max_new_tokens", 0) < 3:
            assert time.monotonic() < deadline, server.loop.metrics.outcomes
            time.sleep(0.01)
        assert server.loop.metrics.outcomes == {"max_new_tokens": 3}
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert 'speculative_requests_total{outcome="rejected"} 4' in text


def test_a_client_that_leaves_a_stream_of_n_choices_frees_all_its_rows() -> None:
    target = random_llama(vocab=16, dim=16, max_seq_len=512, seed=0, dtype=torch.float64)
    with toy_server(target, None, step_delay=0.01) as server:
        stream = server.client.completions.create(
            model="toy", prompt=[1, 2], max_tokens=400, n=3, stream=True
        )
        for _, _chunk in zip(range(4), stream):
            pass
        stream.close()
        deadline = time.monotonic() + 10
        while server.loop.metrics.outcomes.get("cancelled", 0) < 3:
            assert time.monotonic() < deadline, server.loop.metrics.outcomes
            time.sleep(0.02)
        assert server.loop.metrics.outcomes == {"cancelled": 3}
        assert server.loop.running == 0 and server.loop.metrics.tokens < 600


# ----------------------------------------------------------------------------- disconnects
def test_a_client_that_disconnects_frees_its_row_at_once() -> None:
    """A streamed request closed after two chunks and a plain one whose client times out: both
    rows are cancelled (not run to their 400 tokens), and the batch empties."""
    target = random_llama(vocab=16, dim=16, max_seq_len=512, seed=0, dtype=torch.float64)
    with toy_server(
        target, noisy_copy(target, std=0.3, seed=1), policy=FixedGamma(0), step_delay=0.01
    ) as server:
        stream = server.client.completions.create(
            model="toy", prompt=[1, 2], max_tokens=400, stream=True
        )
        for _, _chunk in zip(range(2), stream):
            pass
        stream.close()
        with pytest.raises(openai.APITimeoutError):
            client(server.url, timeout=0.3).completions.create(
                model="toy", prompt=[3, 4], max_tokens=400
            )
        deadline = time.monotonic() + 10
        while server.loop.metrics.outcomes.get("cancelled", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.loop.metrics.outcomes == {"cancelled": 2}
        assert server.loop.running == 0 and server.loop.metrics.tokens < 200


# ----------------------------------------------------------------------------- errors
def error_of(call) -> tuple[int, dict, httpx.Headers]:
    with pytest.raises(openai.APIStatusError) as raised:
        call()
    return raised.value.status_code, raised.value.body, raised.value.response.headers


@pytest.mark.parametrize(
    "options, status, words",
    [
        ({"temperature": 3}, 400, "temperature"),
        ({"top_p": 0}, 400, "top_p"),
        ({"max_tokens": 0}, 400, "0 only with echo"),
        ({"n": 0}, 400, "n:"),
        (
            {"n": 65},
            400,
            "n can be at most 64",
        ),  # serve.py's --max-waiting: the choices wait together
        ({"stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
        (
            {"stop": ["x" * 1025]},
            400,
            "at most 1024 characters",
        ),  # four 1 MB stops stalled the event loop
        ({"presence_penalty": 0.5}, 400, "presence_penalty is not supported"),
        ({"logprobs": 21}, 400, "logprobs"),
        (
            {"stream_options": {"include_usage": True}},
            400,
            "only allowed with stream: true",
        ),  # it was ignored
        ({"extra_body": {"top_k": 0}}, 400, "top_k"),
        ({"extra_body": {"logit_bias": {"5": 1}}}, 400, "logit_bias is not supported"),
        ({"extra_body": {"tools": []}}, 400, "unknown or unsupported field 'tools'"),
        ({"extra_body": {"speculative_gamma": 9}}, 400, "0..4"),
        ({"prompt": [1, 5000]}, 400, "[0, 2048)"),
        ({"prompt": [1] * 600}, 400, "context is 512 tokens"),
        ({"max_tokens": 511}, 400, "max_tokens can be at most 510"),  # "Once" is 2 tokens with BOS
        ({"model": "gpt-4"}, 404, "this server serves 'tiny-target'"),
    ],
)
def test_bad_requests_get_one_line_openai_errors(shipped, options, status, words) -> None:
    extra = options.pop("extra_body", {})
    request = {"model": "tiny-target", "prompt": "Once", "max_tokens": 8, **options}
    code, body, _ = error_of(lambda: shipped.client.completions.create(**request, extra_body=extra))
    assert code == status and words in body["message"] and "\n" not in body["message"]
    assert (
        set(body) == {"message", "type", "param", "code"}
        and body["type"] == "invalid_request_error"
    )


def test_bad_bodies_paths_and_chats_get_json_errors(shipped) -> None:
    def post(path: str, content: bytes) -> httpx.Response:
        return httpx.post(
            f"{shipped.url}{path}",
            content=content,
            headers={"Content-Type": "application/json"},
            timeout=10,
        )

    for answer, status, words in [
        (post("/v1/completions", b"{not json"), 400, "not valid JSON"),
        # a lone surrogate is valid JSON and not valid Unicode text: it was a 500 from the tokenizer
        (
            post("/v1/completions", b'{"model": "tiny-target", "prompt": "Once \\ud800"}'),
            400,
            "prompt is not valid Unicode text",
        ),
        (
            post(
                "/v1/chat/completions",
                b'{"model": "tiny-target", "messages": [{"role": "user", "content": "\\udfff"}]}',
            ),
            400,
            "messages is not valid Unicode text",
        ),
        (post("/v1/completions", b'{"prompt": "x"}'), 400, "model is required"),
        (
            post(
                "/v1/chat/completions",
                b'{"model": "tiny-target", "messages": [{"role": "assistant", "content": "hi"}]}',
            ),
            400,
            "ending with a user message",
        ),
        (httpx.get(f"{shipped.url}/v2/everything", timeout=10), 404, "no such path"),
        (httpx.get(f"{shipped.url}/v1/completions", timeout=10), 405, "not allowed"),
    ]:
        assert answer.status_code == status and words in answer.json()["error"]["message"], (
            answer.text
        )
        assert "Traceback" not in answer.text


def test_a_full_queue_answers_429_with_retry_after() -> None:
    target = random_llama(vocab=16, dim=16, max_seq_len=64, seed=0, dtype=torch.float64)
    with toy_server(
        target, noisy_copy(target, std=0.3, seed=1), max_rows=1, max_waiting=1
    ) as server:
        gate, step = threading.Event(), server.engine.step
        server.engine.step = lambda: (gate.wait(10), step())[1]
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(
                server.client.completions.create, model="toy", prompt=[1, 2], max_tokens=5
            )
            deadline = time.monotonic() + 10
            while server.loop.waiting < 1 and time.monotonic() < deadline:
                time.sleep(0.005)
            code, body, headers = error_of(
                lambda: server.client.completions.create(model="toy", prompt=[3], max_tokens=5)
            )
            gate.set()
            assert held.result(timeout=30).usage.completion_tokens == 5
        assert code == 429 and int(headers["retry-after"]) >= 1 and body["code"] == "queue_full"
        assert "1 requests are waiting" in body["message"]
        assert server.loop.metrics.rejected == 1


@proof(
    "a request whose logits turn non-finite fails alone through the server, and the others keep their own "
    "tokens",
    "exact identity, float64, greedy, a NaN embedding read by one request only",
)
def test_a_request_whose_logits_turn_non_finite_fails_alone_with_500() -> None:
    target = random_llama(vocab=16, dim=16, max_seq_len=64, seed=0, dtype=torch.float64)
    draft = noisy_copy(target, std=0.3, seed=1)
    broken = copy.deepcopy(target)
    with torch.no_grad():
        broken.embed_tokens.weight[15] = float("nan")
    healthy = [4, 5]
    expected = reference_greedy(target, healthy, 20)
    assert 15 not in expected
    with toy_server(broken, draft, policy=FixedGamma(3)) as server:
        with ThreadPoolExecutor(3) as pool:
            fine = pool.submit(
                server.client.completions.create,
                model="toy",
                prompt=healthy,
                max_tokens=20,
                temperature=0,
                extra_body={"return_token_ids": True},
            )
            code, body, _ = error_of(
                lambda: server.client.completions.create(
                    model="toy", prompt=[3, 15, 4], max_tokens=20, temperature=0
                )
            )
            streamed_code, _, _ = error_of(
                lambda: list(
                    server.client.completions.create(
                        model="toy", prompt=[15], max_tokens=20, stream=True
                    )
                )
            )
            assert ids_of(fine.result(timeout=30).choices[0]) == expected
        assert (
            code == streamed_code == 500
            and body["code"] == "non_finite_logits"
            and body["type"] == "server_error"
        )
        assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok"
        assert server.loop.metrics.outcomes["error"] == 2


def test_a_stopped_engine_answers_503() -> None:
    target = random_llama(vocab=16, dim=16, max_seq_len=64, seed=0, dtype=torch.float64)
    with toy_server(target, None) as server:
        server.loop.close()
        code, body, _ = error_of(
            lambda: server.client.completions.create(model="toy", prompt=[1], max_tokens=2)
        )
        assert code == 503 and body["code"] == "engine_stopped"
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503


def test_a_stuck_engine_turns_health_to_503_and_back() -> None:
    """/health stayed 200 while the engine's thread hung in a step (it is alive): now a step that
    has not returned for --stall-after seconds while a request waits is a 503 'stalled'."""
    target = random_llama(vocab=16, dim=16, max_seq_len=64, seed=0, dtype=torch.float64)
    with toy_server(target, None, stall_after=0.3) as server:
        gate, step = threading.Event(), server.engine.step
        server.engine.step = lambda: (gate.wait(20), step())[1]
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(
                server.client.completions.create, model="toy", prompt=[1, 2], max_tokens=3
            )
            deadline, health = time.monotonic() + 10, None
            while time.monotonic() < deadline:
                health = httpx.get(f"{server.url}/health", timeout=10)
                if health.status_code == 503:
                    break
                time.sleep(0.05)
            assert health.status_code == 503 and health.json()["status"] == "stalled", health.text
            assert "no progress" in health.json()["error"]
            gate.set()
            assert held.result(timeout=30).usage.completion_tokens == 3
        assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok"


def test_an_api_key_a_host_allow_list_and_cors_only_when_asked() -> None:
    """There was no way to require a key, any Host was answered (a page on another name that
    resolves to 127.0.0.1 could use the model: DNS rebinding), and no CORS choice."""
    target = random_llama(vocab=16, dim=16, max_seq_len=64, seed=0, dtype=torch.float64)
    access = Access(
        api_key="s3cret", hosts=frozenset({"127.0.0.1", "localhost"}), cors=("http://app.example",)
    )
    with toy_server(target, None, access=access) as server:
        code, body, _ = error_of(
            lambda: server.client.completions.create(model="toy", prompt=[1], max_tokens=2)
        )
        assert (
            code == 401
            and body["code"] == "invalid_api_key"
            and body["type"] == "authentication_error"
        )
        keyed = openai.OpenAI(
            base_url=f"{server.url}/v1", api_key="s3cret", max_retries=0, timeout=30
        )
        assert (
            keyed.completions.create(model="toy", prompt=[1], max_tokens=2).usage.completion_tokens
            == 2
        )
        # probes need no key
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        rebound = httpx.get(f"{server.url}/health", headers={"Host": "evil.example:80"}, timeout=10)
        assert rebound.status_code == 400 and rebound.json()["error"]["code"] == "invalid_host"
        asked = httpx.get(
            f"{server.url}/health", headers={"Origin": "http://app.example"}, timeout=10
        )
        other = httpx.get(
            f"{server.url}/health", headers={"Origin": "http://evil.example"}, timeout=10
        )
        assert asked.headers.get("access-control-allow-origin") == "http://app.example"
        assert "access-control-allow-origin" not in other.headers
    with toy_server(target, None) as server:  # the default: no key, any Host, no CORS headers
        assert (
            httpx.get(
                f"{server.url}/health", headers={"Origin": "http://app.example"}, timeout=10
            ).headers.get("access-control-allow-origin")
            is None
        )


def test_serve_py_s_access_defaults_and_its_warning(monkeypatch) -> None:
    from speculative.serving.access import API_KEY_ENV, access_for, exposure_warning

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    local = access_for("127.0.0.1", None, None, [])
    assert (
        local.api_key is None
        and local.hosts == {"127.0.0.1", "::1", "localhost"}
        and local.cors == ()
    )
    assert exposure_warning("127.0.0.1", local) is None
    everywhere = access_for("0.0.0.0", None, None, [])
    assert everywhere.hosts is None and "without an API key" in exposure_warning(
        "0.0.0.0", everywhere
    )
    monkeypatch.setenv(API_KEY_ENV, "k")
    keyed = access_for("10.0.0.5", None, "api.example, 10.0.0.5", [])
    assert keyed.api_key == "k" and keyed.hosts == {"api.example", "10.0.0.5"}
    assert exposure_warning("10.0.0.5", keyed) is None
    assert access_for("127.0.0.1", None, "*", []).hosts is None
    assert serve.build_parser().parse_args(
        ["--cors-origin", "http://a", "--cors-origin", "http://b"]
    ).cors_origin == ["http://a", "http://b"]


def test_bodies_past_the_limit_get_413_and_text_too_long_for_the_context_400_before_tokenizing(
    shipped,
) -> None:
    """There was no limit on the body, and the whole prompt was tokenized on the event loop before
    its length was checked."""
    url = f"{shipped.url}/v1/completions"
    big = b'{"model": "tiny-target", "prompt": "' + b"a" * (5 << 20) + b'"}'
    whole = httpx.post(url, content=big, headers={"Content-Type": "application/json"}, timeout=30)
    assert whole.status_code == 413 and whole.json()["error"]["code"] == "body_too_large"

    def chunks():  # no Content-Length: refused as the chunks pass the limit
        yield b'{"model": "tiny-target", "prompt": "'
        for _ in range(80):
            yield b"a" * (64 << 10)
        yield b'"}'

    streamed = httpx.post(
        url, content=chunks(), headers={"Content-Type": "application/json"}, timeout=30
    )
    assert streamed.status_code == 413 and streamed.json()["error"]["code"] == "body_too_large"
    longest = max(len(shipped.tokenizer.piece(i)) for i in range(shipped.tokenizer.vocab_size))
    code, body, _ = error_of(lambda: completion(shipped, "a" * (512 * longest + 1)))
    assert (
        code == 400
        and body["code"] == "context_length_exceeded"
        and "characters" in body["message"]
    )
    assert httpx.get(f"{shipped.url}/health", timeout=10).status_code == 200


def test_fields_that_change_nothing_here_are_accepted_and_ignored(shipped) -> None:
    """SDKs and agent frameworks send parallel_tool_calls, an empty logit_bias, user, store, metadata
    and service_tier by default; each was a 400 that broke them. They change nothing a server without
    tools or storage makes: the answer is the one without them, token for token."""
    lenient = {
        "parallel_tool_calls": True,
        "logit_bias": {},
        "user": "ann",
        "store": False,
        "metadata": {"run": "7"},
        "service_tier": "auto",
    }
    for path, body in (
        ("completions", {"prompt": "Once"}),
        ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        request = {"model": "tiny-target", "max_tokens": 6, "temperature": 0, **body}
        plain = httpx.post(f"{shipped.url}/v1/{path}", json=request, timeout=30)
        both = httpx.post(f"{shipped.url}/v1/{path}", json={**request, **lenient}, timeout=30)
        assert plain.status_code == both.status_code == 200, both.text
        assert plain.json()["choices"] == both.json()["choices"]


def test_the_openai_client_s_lenient_fields_are_accepted(shipped) -> None:
    """The same fields as above, as the openai client sends them (its own parameters where it has
    them): the answers are those without them, token for token."""
    lenient = {"logit_bias": {}, "user": "ann"}
    extra = {"parallel_tool_calls": True, "store": False, "metadata": {"run": "7"}}
    plain = completion(shipped, "Once", temperature=0, max_tokens=6)
    both = completion(shipped, "Once", temperature=0, max_tokens=6, extra_body=extra, **lenient)
    assert ids_of(both.choices[0]) == ids_of(plain.choices[0]) and both.choices[0].text
    chat = {
        "model": "tiny-target",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 6,
        "temperature": 0,
    }
    plain = shipped.client.chat.completions.create(**chat)
    both = shipped.client.chat.completions.create(
        **chat, **lenient, parallel_tool_calls=True, store=False, metadata={"run": "7"}
    )
    assert both.choices[0].message.content == plain.choices[0].message.content
    assert both.usage.completion_tokens == plain.usage.completion_tokens == 6


def test_openai_valid_nulls_and_negative_seeds_are_accepted_with_a_system_fingerprint(
    shipped,
) -> None:
    """null for n, stream, logprobs and the penalties, penalties of 0 and negative seeds (all valid
    OpenAI requests, what some clients send by default) got 400."""
    url = f"{shipped.url}/v1/completions"
    body = {
        "model": "tiny-target",
        "prompt": "Once",
        "max_tokens": 6,
        "n": None,
        "stream": None,
        "logprobs": None,
        "echo": False,
        "presence_penalty": 0,
        "frequency_penalty": None,
        "seed": -5,
        "temperature": 1,
        "speculative_gamma": 2,
    }  # a pinned seed reproduces with a pinned gamma (docs/serving.md, Exactness)
    first, again = (httpx.post(url, json=body, timeout=30) for _ in range(2))
    assert first.status_code == 200, first.text
    # a pinned seed, folded
    assert first.json()["choices"][0]["text"] == again.json()["choices"][0]["text"]
    assert first.json()["system_fingerprint"].startswith("fp_")
    chat = httpx.post(
        f"{shipped.url}/v1/chat/completions",
        timeout=30,
        json={
            "model": "tiny-target",
            "messages": [{"role": "user", "content": "Hi", "name": "ann"}],
            "max_tokens": 4,
            "max_completion_tokens": 4,
            "logprobs": False,
            "top_logprobs": None,
            "n": 1,
        },
    )
    assert (
        chat.status_code == 200
        and chat.json()["system_fingerprint"] == first.json()["system_fingerprint"]
    )
    both = httpx.post(
        f"{shipped.url}/v1/chat/completions",
        timeout=30,
        json={
            "model": "tiny-target",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            "max_completion_tokens": 5,
        },
    )
    assert both.status_code == 400 and "differ" in both.json()["error"]["message"]


def test_metrics_have_latency_histograms_and_token_counters() -> None:
    """/metrics had no latency histograms: time to first token, between tokens, in the queue and
    end to end, with the prompt tokens read and the latest iteration's time."""
    target = random_llama(vocab=16, dim=16, max_seq_len=64, seed=0, dtype=torch.float64)
    with toy_server(target, None) as server:  # the target alone: one token per iteration
        prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
        for prompt in prompts:
            server.client.completions.create(model="toy", prompt=prompt, max_tokens=6)
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if not line.startswith("#")
    }
    assert values["speculative_prompt_tokens_total"] == sum(map(len, prompts))
    assert values["speculative_last_step_seconds"] > 0
    for name in ("time_to_first_token_seconds", "queue_seconds", "request_seconds"):
        assert values[f"speculative_{name}_count"] == len(prompts), name
        buckets = [v for k, v in values.items() if k.startswith(f"speculative_{name}_bucket")]
        assert buckets == sorted(buckets) and buckets[-1] == len(prompts)
        assert f"# TYPE speculative_{name} histogram" in text
    # 6 tokens each: the first closes the time to first token, the other 5 an inter-token gap each
    assert values["speculative_inter_token_seconds_count"] == 5 * len(prompts)


@pytest.mark.parametrize("speculate", [False, True])
def test_logprobs_are_the_target_s_own_streamed_or_not(speculate: bool) -> None:
    """logprobs were refused, so harnesses that score with them could not use the server. Each
    returned token's log-probability and top ones are the target's own at temperature 1 (a
    no-cache forward over prompt + output), with a draft or without, for completions and chats,
    whole or streamed; a stop string's cut keeps them aligned with the tokens kept."""
    target = random_llama(vocab=16, dim=16, max_seq_len=64, seed=0, dtype=torch.float64)
    draft = noisy_copy(target, std=0.2, seed=1) if speculate else None
    with toy_server(target, draft) as server:

        def own(prompt: list[int], ids: list[int]) -> torch.Tensor:
            with torch.no_grad():
                logp = torch.log_softmax(target(torch.tensor([prompt + ids]))[0], dim=-1)
            return logp[len(prompt) - 1 : len(prompt) - 1 + len(ids)]

        prompt = [1, 2, 3]
        whole = server.client.completions.create(
            model="toy",
            prompt=prompt,
            max_tokens=10,
            temperature=0.8,
            seed=4,
            logprobs=3,
            extra_body={"return_token_ids": True},
        )
        ids = whole.choices[0].model_extra["token_ids"]
        expected = own(prompt, ids)
        lp = whole.choices[0].logprobs
        assert lp.tokens == [chr(97 + t) for t in ids]
        assert lp.token_logprobs == pytest.approx(
            [float(expected[j, t]) for j, t in enumerate(ids)], abs=1e-6
        )
        for j, tops in enumerate(lp.top_logprobs):
            best = expected[j].topk(3)
            assert list(tops) == [chr(97 + t) for t in best.indices.tolist()]
            assert list(tops.values()) == pytest.approx(best.values.tolist(), abs=1e-6)
        stream = server.client.completions.create(
            model="toy",
            prompt=prompt,
            max_tokens=10,
            temperature=0.8,
            seed=4,
            logprobs=3,
            stream=True,
            extra_body={"return_token_ids": True},
        )
        pieces = [c.choices[0] for c in stream if c.choices]
        streamed = [t for p in pieces for t in (p.model_extra or {}).get("token_ids", [])]
        values = [v for p in pieces if p.logprobs for v in p.logprobs.token_logprobs]
        expected = own(prompt, streamed)
        assert values == pytest.approx(
            [float(expected[j, t]) for j, t in enumerate(streamed)], abs=1e-6
        )


@pytest.mark.parametrize("speculate", [False, True])
def test_echo_scores_the_prompt_with_the_target_s_own_logprobs(speculate: bool) -> None:
    """echo was refused, so evaluation harnesses (which score a text as echo, logprobs and
    max_tokens 0) could not use the server. The prompt comes back in front of the completion,
    and each prompt token after the first has the target's own log-probability given the ones
    before it (the first has none, as in OpenAI's answers), whole or streamed."""
    target = random_llama(vocab=16, dim=16, max_seq_len=64, seed=0, dtype=torch.float64)
    draft = noisy_copy(target, std=0.2, seed=1) if speculate else None
    prompt = [1, 2, 3, 7, 5]
    with torch.no_grad():
        own = torch.log_softmax(target(torch.tensor([prompt]))[0], dim=-1)
    expected = [None] + [float(own[i, t]) for i, t in enumerate(prompt[1:])]
    with toy_server(target, draft) as server:
        scored = server.client.completions.create(
            model="toy", prompt=prompt, max_tokens=0, echo=True, logprobs=2
        )
        choice = scored.choices[0]
        assert (
            choice.text == "bcdhf"
            and scored.usage.completion_tokens == 0
            and choice.finish_reason == "length"
        )
        assert choice.logprobs.tokens == list("bcdhf")
        assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected[1:], abs=1e-9)
        for i, tops in enumerate(choice.logprobs.top_logprobs[1:]):
            assert list(tops) == [chr(97 + t) for t in own[i].topk(2).indices.tolist()]
        plain = server.client.completions.create(
            model="toy", prompt=prompt, max_tokens=6, temperature=0, logprobs=1
        )
        both = server.client.completions.create(
            model="toy", prompt=prompt, max_tokens=6, temperature=0, logprobs=1, echo=True
        )
        assert both.choices[0].text == "bcdhf" + plain.choices[0].text
        assert both.choices[0].logprobs.token_logprobs == pytest.approx(
            expected + plain.choices[0].logprobs.token_logprobs, abs=1e-9
        )
        assert both.choices[0].logprobs.text_offset == list(range(11))
        chunks = list(
            server.client.completions.create(
                model="toy",
                prompt=prompt,
                max_tokens=6,
                temperature=0,
                logprobs=1,
                echo=True,
                stream=True,
            )
        )
        assert chunks[0].choices[0].text == "bcdhf"
        assert chunks[0].choices[0].logprobs.token_logprobs[1:] == pytest.approx(
            expected[1:], abs=1e-9
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == both.choices[0].text
        unscored = server.client.completions.create(
            model="toy", prompt="bcd", max_tokens=2, temperature=0, echo=True
        )
        assert unscored.choices[0].text.startswith("bcd") and unscored.choices[0].logprobs is None


def test_stream_usage_comes_as_openai_sends_it() -> None:
    """With stream_options.include_usage OpenAI sends "usage": null on every chunk and the
    usage in one last chunk without choices; the chunks had no usage field but the last two."""
    target = random_llama(vocab=16, dim=16, max_seq_len=64, seed=0, dtype=torch.float64)
    with toy_server(target, None) as server:
        body = {
            "model": "toy",
            "prompt": [1, 2],
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json=body, timeout=30
        ) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: {")]
        chunks = [json.loads(line[6:]) for line in lines]
        assert all("usage" in c and c["usage"] is None for c in chunks[:-1]), chunks
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_chat_logprobs_in_openai_s_shape_are_the_shipped_target_s_own(shipped) -> None:
    from speculative.serving.text import encode_dialog
    from weights import load_model

    chunks = list(
        shipped.client.chat.completions.create(
            model="tiny-target",
            messages=[{"role": "user", "content": "Tell me a story"}],
            max_tokens=12,
            temperature=0,
            stream=True,
            logprobs=True,
            top_logprobs=2,
            extra_body={"return_token_ids": True},
        )
    )
    ids = [
        t
        for c in chunks
        if c.choices
        for t in (c.choices[0].model_extra or {}).get("token_ids", [])
    ]
    content = [
        item
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for item in c.choices[0].logprobs.content
    ]
    assert len(content) == len(ids) == 12
    prompt = encode_dialog(shipped.tokenizer, [("user", "Tell me a story")])
    with torch.no_grad():
        logp = torch.log_softmax(
            load_model("tiny-target")(torch.tensor([prompt + ids]))[0].double(), dim=-1
        )
    for j, (item, token) in enumerate(zip(content, ids)):
        assert item.logprob == pytest.approx(float(logp[len(prompt) - 1 + j, token]), abs=1e-4)
        assert item.top_logprobs[0].token == item.token  # greedy: the emitted token is the best one
        assert bytes(item.bytes).decode() == item.token and len(item.top_logprobs) == 2


# ----------------------------------------------------------------------------- text pieces
def test_output_holds_back_what_may_start_a_stop_string_and_cuts_at_its_token() -> None:
    """Fed token by token or in blocks, the text handed out adds up to the continuation, up to a
    stop string; text that could begin a stop string waits until the next tokens settle it; the
    token that completes a stop string is the last one kept."""
    tokenizer = load_tokenizer("tiny-target")
    prompt = tokenizer.encode("Once upon a time")
    new = tokenizer.encode(" there was a little girl named Lily. She loved to play.", bos=False)
    shown = len(tokenizer.decode(prompt))
    full = tokenizer.decode(prompt + new)[shown:]
    for block in (1, 3, len(new)):
        output, handed, held = Output(tokenizer, prompt, ["girl named X"]), "", set()
        for i in range(0, len(new), block):
            handed += output.add(new[i : i + block])
            seen = tokenizer.decode(prompt + output.tokens)[shown:]
            assert seen.startswith(handed) and "girl named X".startswith(seen[len(handed) :])
            held.add(seen[len(handed) :])
        assert handed + output.finish() == full and not output.stopped and output.tokens == new
        assert block > 1 or {"g", "girl", "girl named"} & held  # something waited on the way
        output, handed = Output(tokenizer, prompt, ["Lily.", "never"]), ""
        for i in range(0, len(new), block):
            handed += output.add(new[i : i + block])
        assert handed + output.finish() == full[: full.index("Lily.")] and output.stopped
        assert "Lily." in tokenizer.decode(prompt + output.tokens)
        assert "Lily." not in tokenizer.decode(prompt + output.tokens[:-1])


# ----------------------------------------------------------------------------- the script
def test_serve_py_says_what_its_start_does_unless_quiet(capsys) -> None:
    """A start's progress line (load:) comes before anything else it says, here an error found once
    loading has begun (int4 layers in float16); --quiet leaves the error alone."""
    argv = ["--quantize", "int4", "--dtype", "float16"]
    assert serve.main(argv) == 2
    said = capsys.readouterr().err.splitlines()
    assert said[0] == "load: tiny-target ..."
    assert said[-1].startswith("error: ") and "--quantize int4" in said[-1]
    assert serve.main([*argv, "--quiet"]) == 2
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and said[0].startswith("error: ") and "--quantize int4" in said[0]


def test_serve_py_refuses_bad_flags_in_one_line(capsys) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    for argv, words in [
        (["--max-batch", "0"], "--max-batch must be >= 1"),
        (["--gamma", "40"], "at most 16"),
        (["--max-waiting", "0"], "--max-waiting must be >= 1"),  # it refused every request
        (["--stall-after", "0"], "--stall-after must be > 0"),
        (["--max-connections", "0"], "--max-connections must be >= 1"),
        (["--compile", "--setup", "plain"], "both choose"),
        (
            ["--quantize", "int4", "--dtype", "float16"],
            "--quantize int4 runs on a CPU in float32 or",
        ),
        (["--port", str(taken.getsockname()[1])], "cannot listen on 127.0.0.1"),
    ]:
        assert serve.main(argv) == 2
        err = capsys.readouterr().err
        lines = without_progress(err)
        assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], err
    taken.close()


def test_serve_py_starts_on_127_0_0_1_and_answers_the_openai_client() -> None:
    """The README's two lines: start it, query it; Ctrl-C ends it with status 0, even in a process
    that inherited SIGINT ignored (as the workers of some test runners start theirs). Until the
    models are ready the port refuses connections (it listened before they loaded, and early
    clients hung)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    process = subprocess.Popen(
        [
            sys.executable,
            "serve.py",
            "--port",
            str(port),
            "--max-batch",
            "2",
            "--speculation",
            "on",
        ],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        refused: list[bool] = []

        def knock() -> None:  # until the start-up line: every connection must be refused
            while not lines or not lines[-1].startswith("serving "):
                with socket.socket() as early:
                    early.settimeout(1)
                    refused.append(early.connect_ex(("127.0.0.1", port)) != 0)
                time.sleep(0.05)

        lines: list[str] = []
        knocker = threading.Thread(target=knock, daemon=True)
        knocker.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = process.stderr.readline()
            lines.append(line)
            if not line or line.startswith("serving "):
                break
        knocker.join(10)
        # the last knocks may meet the ready server, between its listening and our reading its line
        assert len(refused) >= 3 and refused[0] and sum(refused) >= len(refused) - 2, refused
        assert lines[-1].startswith(
            "serving tiny-target (draft tiny-draft, speculation on, gamma 4"
        ), lines
        assert "http://127.0.0.1:" in lines[-1] and "no authentication" in lines[-1]
        url = lines[-1].split(" on ")[1].split()[0]
        answer = client(url).completions.create(
            model="tiny-target", prompt="Once upon a time", max_tokens=8, temperature=0
        )
        assert answer.usage.completion_tokens == 8 and answer.choices[0].text
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
        rest = process.stderr.read()
        assert "Traceback" not in rest and "ERROR" not in rest, rest
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        process.stderr.close()


def test_the_retry_after_estimate_is_bounded() -> None:
    target = random_llama(vocab=16, dim=16, max_seq_len=64, seed=0, dtype=torch.float64)
    loop = EngineLoop(Engine(target, None, max_rows=1, cache_len=64))
    assert loop.retry_after(5) == 1  # nothing finished lately
    now = time.perf_counter()
    loop.metrics.ends.extend([now] * 3)  # 0.3 requests per second over the window
    assert loop.retry_after(6) == math.ceil(6 / 0.3) and loop.retry_after(600) == 60


def test_max_model_len_sizes_the_context_and_is_checked(chat_target) -> None:
    """-c/--max-model-len: the positions a request may hold (vLLM's --max-model-len, llama.cpp's -c);
    longer than the model's context is one line and status 2, before anything is loaded."""
    args = serve.build_parser().parse_args(["--target", str(chat_target), "-c", "128"])
    serve.validate(args)
    spec = read_pair(str(chat_target), "tiny-draft")
    context, note = serve.serving_context(args, spec, torch.device("cpu"), torch.float32)
    assert context == 128 and "context 128 positions a request (--max-model-len)" in note
    args.max_model_len = spec.context + 1
    with pytest.raises(UsageError, match=f"longer than the model's context, {spec.context}"):
        serve.serving_context(args, spec, torch.device("cpu"), torch.float32)
    args.max_model_len = None
    assert serve.serving_context(args, spec, torch.device("cpu"), torch.float32)[0] == spec.context
    with pytest.raises(UsageError, match="--max-model-len must be >= 2"):
        serve.validate(serve.build_parser().parse_args(["-c", "1"]))


def test_finish_reason_at_the_max_tokens_boundary(shipped, references) -> None:
    """A stop string completed by the max_tokens-th token is a "stop"; with one token fewer allowed,
    the same request runs out first and is a "length". Streamed and not."""
    prompt = GREEDY_PROMPTS[0]
    tokens = references[prompt]["tokens"]
    prefix = shipped.tokenizer.encode(prompt, bos=True)

    def text(count: int) -> str:  # the answer's text after ``count`` tokens
        whole = shipped.tokenizer.decode(prefix + tokens[:count])
        return whole[len(shipped.tokenizer.decode(prefix)) :]

    # a token k whose last characters first appear in the answer there
    k, stop = next(
        (k, text(k)[-4:])
        for k in range(8, NEW)
        if len(text(k)) >= 4 and text(k)[-4:] not in text(k - 1) and text(k)[-4:].strip()
    )
    for stream in (False, True):
        for allowed, reason in ((k, "stop"), (k - 1, "length")):
            answer = completion(
                shipped, prompt, temperature=0, stop=[stop], max_tokens=allowed, stream=stream
            )
            if stream:
                chunks = list(answer)
                finish = chunks[-1].choices[0].finish_reason
            else:
                finish = answer.choices[0].finish_reason
            assert finish == reason, (stream, allowed, stop)


def test_finish_reason_when_the_end_of_text_is_the_max_tokens_th_token(shipped) -> None:
    """The shipped target ends "Once upon a time" with its end-of-text id (generate.py: stopped by eos).
    Allowed exactly as many tokens, the answer is a "stop"; one fewer, a "length". Streamed and not."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert generate.main(["--prompt", GREEDY_PROMPTS[0], "-n", "400", "--json"]) == 0
    done = json.loads(out.getvalue())
    assert done["stats"]["stop_reason"] == "eos"
    count = len(done["tokens"])  # the end-of-text id last among them
    for stream in (False, True):
        for allowed, reason in ((count, "stop"), (count - 1, "length")):
            answer = completion(
                shipped, GREEDY_PROMPTS[0], temperature=0, max_tokens=allowed, stream=stream
            )
            if stream:
                finish = list(answer)[-1].choices[0].finish_reason
            else:
                finish = answer.choices[0].finish_reason
            assert finish == reason, (stream, allowed)
