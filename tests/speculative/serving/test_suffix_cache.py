"""serve.py's suffix cache across requests (speculative/draft/responses.py) through the HTTP API on
127.0.0.1 at a free port: kept per API key (a key's responses never reach another key's requests,
and /metrics names keys by number, never the key), bounded (--suffix-cache-tokens, shown by /metrics
and --plan), and greedy outputs equal to the target alone's with the cache warm."""

from __future__ import annotations

import contextlib
import io
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
import uvicorn

import serve
from speculative import Engine
from speculative.draft.responses import STORE_DEPTH, ResponseStore, bytes_per_node
from speculative.draft.suffix import SuffixDrafter
from speculative.engine.gamma import FixedGamma
from speculative.serving.access import Access
from speculative.serving.app import create_app
from speculative.serving.loop import EngineLoop, Service
from tests.support.toy_models import random_llama, reference_greedy

KEYS = ("key-of-alice", "key-of-bob")


class Letters:
    """Token i is the letter chr(97 + i); no EOS, so rows stop by count."""

    bos_id, eos_id = 0, None

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return [ord(c) - 97 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + int(i)) for i in ids)


@contextlib.contextmanager
def server(target, store: ResponseStore, access: Access) -> Iterator[str]:
    """A toy target with suffix decoding and ``store``, served in a thread; its base URL."""
    engine = Engine(
        target, SuffixDrafter(), gamma=4, max_rows=2, cache_len=target.config.max_seq_len
    )
    loop = EngineLoop(engine, policy=FixedGamma(4), log=lambda line: None).start()
    service = Service(
        loop, Letters(), "toy", target.config.max_seq_len, 4, "on", "suffix", responses=store
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    app = create_app(service, access)
    web = uvicorn.Server(uvicorn.Config(app, log_level="error", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=web.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not web.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert web.started, "the server did not start within 10 s"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        web.should_exit = True
        thread.join(10)
        loop.close()


def complete(url: str, key: str | None, prompt: list[int], count: int) -> list[int]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    answer = httpx.post(
        f"{url}/v1/completions",
        json={"model": "toy", "prompt": prompt, "max_tokens": count, "temperature": 0},
        headers=headers,
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    return [ord(c) - 97 for c in answer.json()["choices"][0]["text"]]


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for key in KEYS:
        assert key not in text  # a key is never shown
    return {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line.startswith("speculative_suffix_cache")
    }


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    torch.set_num_threads(1)
    return random_llama(vocab=8, dim=16, max_seq_len=96, seed=4, dtype=torch.float64)


def test_per_key_partitions_bounded_in_metrics_and_greedy_exact_with_the_cache_warm(target) -> None:
    store = ResponseStore(60)
    prompts = [[1, 2, 3, 1], [5, 6, 7], [1, 2, 3, 1]]
    with server(target, store, Access(api_key=KEYS[0], more_keys=(KEYS[1],))) as url:
        assert metrics(url)["speculative_suffix_cache_max_tokens"] == 60
        assert metrics(url)["speculative_suffix_cache_tokens"] == 0
        for prompt in prompts:  # key 1 alone: its cache warms, the outputs stay the target's
            assert complete(url, KEYS[0], prompt, 20) == reference_greedy(target, prompt, 20)
        seen = metrics(url)
        assert 'speculative_suffix_cache_key_tokens{key="1"}' in seen
        assert not any('key="2"' in name for name in seen)  # key 2 has nothing, reads nothing
        assert 0 < seen["speculative_suffix_cache_tokens"] <= 60
        assert seen["speculative_suffix_cache_bytes"] == (
            seen["speculative_suffix_cache_nodes"] * bytes_per_node()
        )
        assert store.figures().partitions.keys() == {"1"}
        # key 2: its own partition, the same exact outputs
        assert complete(url, KEYS[1], prompts[0], 20) == reference_greedy(target, prompts[0], 20)
        seen = metrics(url)
        assert seen['speculative_suffix_cache_key_tokens{key="2"}'] > 0
        assert seen["speculative_suffix_cache_keys"] == 2
        assert seen["speculative_suffix_cache_tokens"] <= 60  # the oldest responses left
        # without the key: refused, nothing kept
        no_key = httpx.post(
            f"{url}/v1/completions", json={"model": "toy", "prompt": [1]}, timeout=10
        )
        assert no_key.status_code == 401


def test_a_server_without_keys_keeps_one_anonymous_partition(target) -> None:
    store = ResponseStore(1000)
    with server(target, store, Access()) as url:
        for prompt in ([2, 3, 4], [2, 3, 4]):
            assert complete(url, None, prompt, 16) == reference_greedy(target, prompt, 16)
        assert metrics(url)['speculative_suffix_cache_key_responses{key="anonymous"}'] == 2


def test_serve_py_plan_shows_the_suffix_caches_bound_and_the_flag_is_checked(capsys) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = serve.main(["--plan", "--draft", "suffix", "--suffix-cache-tokens", "1000"])
    assert status == 0
    most = 1000 * STORE_DEPTH * bytes_per_node()
    assert (
        f"at most 1000 tokens of earlier responses, all API keys together, at most {most / 1e6:.1f} MB"
        in (out.getvalue())
    )
    assert "memory plan:" in out.getvalue()
    assert serve.main(["--suffix-cache-tokens", "-1"]) == 2
    assert "--suffix-cache-tokens must be >= 0" in capsys.readouterr().err
