"""The fault and abuse suite: serve.py in a process of its own on a free 127.0.0.1 port (with
faults planted where a test needs one, tests/support/faulty_serve.py), met by what a careless
or hostile client does and by faults of its own. After each, the server still answers
correctly, or has exited non-zero when it must.

Every test is bounded in requests and in time; every socket and request has a timeout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from speculative.engine.engine import Engine
from speculative.serving.loop import EngineLoop
from tests.support import faulty_serve
from tests.support.faulty_serve import (
    ENGINE_FAULT,
    GATE,
    GATE_FILE,
    LOAD_GATE_FILE,
    ROW_FAULT,
    STALL,
    STALL_S,
)
from tests.support.paths import ROOT

# Under pytest -n, the module's server starts once, on one worker (pyproject.toml: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("test_serve_faults")

MODEL = "tiny-target"
PROMPT = [1, 432, 443, 261, 404]  # "Once upon a time", as the shipped tokenizer's ids


@dataclass
class Served:
    """A serve.py process: its URL, its stderr lines (read as they come), its process."""

    process: subprocess.Popen
    url: str = ""
    log: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None  # drains stderr into log until the pipe closes

    def post(self, prompt=PROMPT, timeout: float = 30, **fields) -> httpx.Response:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **fields}
        return httpx.post(f"{self.url}/v1/completions", json=body, timeout=timeout)

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health", timeout=10)

    def metric(self, name: str, default: float | None = None) -> float:
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(f"speculative_{name} "):
                return float(line.split()[-1])
        assert default is not None, f"no metric {name}"
        return default

    def answers_correctly(self) -> None:
        """The check after every fault: healthy, and a greedy request gets its 8 tokens."""
        assert self.health().status_code == 200, self.health().text
        answer = self.post()
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 8, (
            answer.text
        )

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.kill()
        return self.process.wait(30)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(
    *flags: str,
    port: int | None = None,
    faults: bool = True,
    wait: bool = True,
    gate: Path | None = None,
    load_gate: Path | None = None,
) -> Served:
    """serve.py (with the faults' launcher) in its own process; with ``wait``, once it serves;
    ``gate``: the file whose creation releases a request that holds the GATE marker."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        **({GATE_FILE: str(gate)} if gate else {}),
        **({LOAD_GATE_FILE: str(load_gate)} if load_gate else {}),
    }
    program = ["-m", "tests.support.faulty_serve"] if faults else ["serve.py"]
    process = subprocess.Popen(
        [
            sys.executable,
            *program,
            "--port",
            str(port or 0),
            "--speculation",
            "off",
            "--threads",
            "1",
            *flags,
        ],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    served = Served(process)
    started = threading.Event()

    def read() -> None:  # stderr is drained all along: a full pipe would block the server
        for line in process.stderr:
            served.log.append(line.rstrip())
            if line.startswith("serving "):
                served.url = line.split(" on ")[1].split()[0]
                started.set()
        started.set()

    served.reader = threading.Thread(target=read, daemon=True)
    served.reader.start()
    if wait:
        assert started.wait(120) and served.url, served.log
    return served


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    """One process for the tests that leave it running: one row, three waiting at most, short
    deadlines, a keep-alive comment every 0.3 s, 8 connections at most."""
    served = launch(
        "--max-batch",
        "1",
        "--max-waiting",
        "3",
        "--queue-timeout",
        "1",
        "--request-timeout",
        "2",
        "--read-timeout",
        "1",
        "--write-timeout",
        "1",
        "--stall-after",
        "1",
        "--keepalive",
        "0.3",
        "--max-connections",
        "8",
    )
    try:
        yield served
    finally:
        served.stop()
        served.process.stderr.close()


# ----------------------------------------------------------------------------- start and stop
def test_nothing_listens_until_the_models_are_loaded(tmp_path: Path) -> None:
    """The socket listened before the models loaded, so an early client hung; now a client is refused
    while serve.py loads (held there by a gate the test opens: no race with the machine's speed), then
    answered once it says it serves."""
    port = free_port()
    served = launch(port=port, wait=False, load_gate=tmp_path / "loaded")
    try:
        until(lambda: "gate: loading waits" in served.log or served.process.poll() is not None)
        assert served.process.poll() is None, served.log
        for _ in range(20):  # the port is bound, the models not loaded: nothing may accept
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
        (tmp_path / "loaded").touch()
        until(lambda: bool(served.url) or served.process.poll() is not None, limit=120)
        served.answers_correctly()
    finally:
        served.stop()


def test_a_queue_of_zero_is_refused_at_start_up_in_one_line() -> None:
    served = launch("--max-waiting", "0", wait=False)
    assert served.process.wait(60) == 2
    time.sleep(0.1)
    assert [line for line in served.log if line.startswith("error:")] == [
        "error: --max-waiting must be >= 1 (a request waits for the engine's loop to take it), got 0"
    ], served.log


def test_an_exception_outside_any_row_fails_what_is_in_flight_turns_health_and_exits_1() -> None:
    served = launch("--max-batch", "2")
    try:
        answer = served.post([1, ENGINE_FAULT, 261])
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "engine_stopped"
        assert served.process.wait(30) == 1
        assert any("engine failed" in line for line in served.log) and not any(
            "Traceback" in line for line in served.log
        )
    finally:
        served.stop()


@pytest.mark.parametrize("grace, status", [(60.0, 0), (0.3, 3)])
def test_sigterm_lets_requests_in_hand_finish_within_the_grace_then_cuts_them(
    grace: float, status: int
) -> None:
    """SIGTERM ended the loop at once with status 0, cutting every request in flight. Now: no new
    requests (503, /health 503 'draining'), those in hand finish within --grace, and the status
    says whether they all did (0) or some were cut (3)."""
    served = launch("--grace", str(grace), faults=False)
    try:
        with ThreadPoolExecutor(1) as pool:
            long = pool.submit(served.post, "Once", 60, max_tokens=400)
            deadline = time.monotonic() + 30
            while served.health().json()["running"] < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            served.process.send_signal(signal.SIGTERM)
            time.sleep(0.1)
            if grace > 1:
                health = served.health()
                assert health.status_code == 503 and health.json()["status"] == "draining"
                late = served.post("Hi", 10, max_tokens=2)
                assert (
                    late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
                )
            answer = long.result(timeout=60)
        if status == 0:
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] > 0
        else:
            assert answer.status_code == 503
        assert served.process.wait(timeout=60) == status
        time.sleep(0.1)
        assert not any("Traceback" in line for line in served.log)
        assert any("unfinished" in line for line in served.log) == (status == 3), served.log
    finally:
        served.stop()


# ----------------------------------------------------------------------------- one process, many faults
def test_bad_input_is_a_4xx_and_stops_nothing(server: Served) -> None:
    """Each of these once stopped the server, froze its event loop, or answered 500."""
    tiny = server.post(temperature=1e-300)  # stopped the server, exit 0
    assert tiny.status_code == 200
    assert tiny.json()["choices"][0]["text"] == server.post().json()["choices"][0]["text"]
    # JSON allows it
    surrogate = httpx.post(
        f"{server.url}/v1/completions",
        timeout=30,
        headers={"Content-Type": "application/json"},
        content='{"model": "tiny-target", "prompt": "\\ud800"}',
    )
    # was a 500
    assert surrogate.status_code == 400 and surrogate.json()["error"]["param"] == "prompt"
    cases = [
        (
            {"stop": ["x" * 1_000_000] * 4},
            400,
            None,
        ),  # four 1 MB stops: quadratic work on the event loop
        ({"prompt": "a" * (3 << 20)}, 400, "context_length_exceeded"),  # refused before tokenizing
        ({"prompt": "a" * (5 << 20)}, 413, "body_too_large"),  # no limit on the body
        ({"presence_penalty": 0.5}, 400, None),
        ({"max_tokens": 0}, 400, None),
    ]
    for fields, status, code in cases:
        answer = server.post(**fields)
        assert answer.status_code == status, (fields.keys(), answer.text[:200])
        error = answer.json()["error"]
        assert (
            error["message"]
            and "\n" not in error["message"]
            and (code is None or error["code"] == code)
        )
    server.answers_correctly()


def test_a_burst_beyond_the_queue_gets_429s_with_retry_after_and_no_5xx(tmp_path: Path) -> None:
    """One row, three places to wait: while a request holds the row (held by the GATE until the test
    lets it go, so that no deadline or speed decides anything), five more come; three wait, two are
    refused at once with Retry-After; once the row is free, all four are answered."""
    served = launch(
        "--max-batch",
        "1",
        "--max-waiting",
        "3",
        "--queue-timeout",
        "0",
        "--request-timeout",
        "0",
        gate=tmp_path / "open",
    )
    try:
        with ThreadPoolExecutor(6) as pool:
            held = pool.submit(served.post, [1, GATE, 261], max_tokens=40)
            until(lambda: served.health().json()["running"] == 1)
            burst = [pool.submit(served.post, max_tokens=40) for _ in range(5)]
            until(
                lambda: sum(f.done() for f in burst) == 2 and served.health().json()["waiting"] == 3
            )
            refused = [f.result() for f in burst if f.done()]
            waiting = [f for f in burst if not f.done()]
            (tmp_path / "open").touch()
            answers = [f.result(timeout=120) for f in [held, *waiting]]
        assert [a.status_code for a in refused] == [429, 429]
        assert all(a.headers["retry-after"].isdigit() for a in refused)
        assert [a.status_code for a in answers] == [200] * 4
        served.answers_correctly()
    finally:
        served.stop()
        served.process.stderr.close()


def until(condition, limit: float = 60) -> None:
    """Wait for an event the test can see (bounded: a minute at most)."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, "the event never came"
        time.sleep(0.01)


def test_a_stream_abandoned_midway_frees_its_row(server: Served) -> None:
    cancelled = server.metric('requests_total{outcome="cancelled"}', 0)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 500, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    # the request timeout (2 s) would call it an error, not a cancel
    deadline = time.monotonic() + 1.5
    while server.metric("requests_running") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.metric("requests_running") == 0
    assert server.metric('requests_total{outcome="cancelled"}') == cancelled + 1
    server.answers_correctly()


def test_slow_headers_and_slow_bodies_are_cut_off_so_idle_sockets_cannot_lock_everyone_out(
    server: Served,
) -> None:
    """Slow headers held a socket forever (with a connection limit, eight such sockets locked
    everyone out) and a slow body held its task; now each gets --read-timeout (1 s)."""
    host, port = server.url.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(8)]
    idle[0].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the rest
    try:
        # a ninth connection: --max-connections answers at once
        assert server.health().status_code == 503
        started = time.monotonic()
        for sock in idle:
            assert sock.recv(1024) == b""  # closed by the server
        assert time.monotonic() - started < 3
    finally:
        for sock in idle:
            sock.close()
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        # 8 of 100 bytes
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model"'
        )
        reply = b""
        while chunk := sock.recv(4096):  # to the end: the server closes the connection
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply, reply
    server.answers_correctly()


def test_a_slow_reader_holds_up_no_one(tmp_path: Path) -> None:
    """A client that reads nothing of its stream holds its own row and no one else's: another request
    is answered meanwhile. Two rows and no queue deadline, so that a slow machine only makes it slower."""
    served = launch("--max-batch", "2", "--queue-timeout", "0", "--write-timeout", "30")
    try:
        host, port = served.url.removeprefix("http://").split(":")
        body = json.dumps(
            {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "stream": True}
        ).encode()
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )
            until(lambda: served.health().json()["running"] == 1)
            served.answers_correctly()  # while the slow reader has read nothing
            received = b""
            while b"data: [DONE]" not in received:
                chunk = sock.recv(65536)
                assert chunk, received[-200:]
                received += chunk
        assert received.startswith(b"HTTP/1.1 200")
        served.answers_correctly()
    finally:
        served.stop()
        served.process.stderr.close()


def test_importing_the_faults_plants_none_of_them() -> None:
    """This module imports the marker ids, and every pytest worker imports this module: the faults
    are planted only in the server's own process, never in the tests' engines."""
    assert Engine.step is not faulty_serve.step
    assert EngineLoop.tokens_out is not faulty_serve.tokens_out


def test_an_exception_in_one_row_fails_that_request_alone() -> None:
    """An exception raised for one row (here its tokens' handler) escaped the engine's step and
    stopped the loop: every request failed and serve.py exited. Now that request gets a 500 and
    the others go on. Two rows and no deadlines, so that a slow machine only makes it slower (with
    the module's server, one row and a 1 s queue deadline, the faulty request could time out
    waiting behind the other on a busy machine)."""
    served = launch("--max-batch", "2", "--queue-timeout", "0")
    try:
        with ThreadPoolExecutor(2) as pool:
            fine = pool.submit(served.post, max_tokens=40)
            failed = served.post([1, ROW_FAULT, 261], max_tokens=40)
            fine = fine.result(timeout=60)
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "request_failed", (
            failed.text
        )
        assert "planted" in failed.json()["error"]["message"]
        assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] == 40
        served.answers_correctly()
    finally:
        served.stop()
        served.process.stderr.close()


def read_stream(server: Served) -> list[str]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        return [line for line in response.iter_lines() if line]


def test_a_stuck_engine_shows_in_health_and_the_deadlines_answer_for_it(server: Served) -> None:
    """A hang was invisible (/health 200) and nothing bounded a wait. Now, while a step hangs
    (2.5 s): /health 503 'stalled' after --stall-after (1 s); the request in the step passes
    --request-timeout (2 s, 504); those waiting pass --queue-timeout (1 s, 503 with
    Retry-After); a stream waiting for a row is sent keep-alive comments meanwhile."""
    with ThreadPoolExecutor(3) as pool:
        stuck = pool.submit(server.post, [1, STALL, 261], 30, max_tokens=4)
        time.sleep(0.2)
        waiting = pool.submit(server.post)
        streamed = pool.submit(read_stream, server)
        deadline, health = time.monotonic() + STALL_S, server.health()
        while health.status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
            health = server.health()
        assert health.status_code == 503 and health.json()["status"] == "stalled", health.text
        stuck, waiting, lines = (
            stuck.result(timeout=30),
            waiting.result(timeout=30),
            streamed.result(timeout=30),
        )
    assert stuck.status_code == 504 and stuck.json()["error"]["code"] == "request_timeout", (
        stuck.text
    )
    assert waiting.status_code == 503 and waiting.json()["error"]["code"] == "queue_timeout", (
        waiting.text
    )
    assert waiting.headers["retry-after"].isdigit()
    assert lines.count(": keep-alive") >= 2 and lines[-1] == "data: [DONE]", lines
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "queue_timeout"
    server.answers_correctly()


@pytest.mark.parametrize("flag", [True, False], ids=["access-log", "no-access-log"])
def test_access_log_prints_a_line_per_request(flag: bool) -> None:
    """--access-log printed nothing (uvicorn's access logger was held at WARNING with the rest): a
    line per request on stderr with it, none without, read to the end of the process's stderr."""
    served = launch(*(["--access-log"] if flag else []), faults=False)
    try:
        assert served.health().status_code == 200
        assert served.post().status_code == 200
    finally:
        served.stop()
    served.reader.join(60)  # every line the process wrote has been read
    lines = [line for line in served.log if "/v1/completions" in line or "/health" in line]
    if flag:
        assert any("POST /v1/completions" in line and "200" in line for line in lines), served.log
        assert any("GET /health" in line for line in lines), served.log
    else:
        assert lines == [], served.log
