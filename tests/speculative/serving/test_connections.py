"""Bounds, the ASGI side of a connection's limits, driven with ASGI messages directly: bodies past
the limit (413), bodies that do not arrive (408), and answers the client does not read (the
write waits at most the write timeout, then the request ends). serve.py's process meets them
in tests/scripts/test_serve_faults.py."""

from __future__ import annotations

import asyncio
import json
import time

from speculative.serving.connections import Bounds, Limits

LIMITS = Limits(body_bytes=100, read_timeout=0.2, write_timeout=0.2)


def run(
    messages: list[dict], send_blocks: bool = False, headers=()
) -> tuple[list[dict], list[bytes], float]:
    """Call Bounds(an app that reads and answers) with ``messages`` to receive (then nothing, forever); returns what it
    sent, the bodies the app read, and the seconds it took."""
    sent: list[dict] = []
    read: list[bytes] = []

    async def inner(scope, receive, send) -> None:
        message = await receive()
        read.append(message["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"x" * 10, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def main() -> float:
        queue = list(messages)

        async def receive() -> dict:
            if queue:
                return queue.pop(0)
            await asyncio.sleep(3600)

        async def send(message: dict) -> None:
            if send_blocks and message["type"] == "http.response.body":
                await asyncio.sleep(3600)  # a client that reads nothing
            sent.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/completions",
            "headers": list(headers),
        }
        start = time.perf_counter()
        await asyncio.wait_for(Bounds(inner, LIMITS)(scope, receive, send), 5)
        return time.perf_counter() - start

    seconds = asyncio.run(main())
    return sent, read, seconds


def status_and_code(sent: list[dict]) -> tuple[int, str]:
    return sent[0]["status"], json.loads(sent[1]["body"])["error"]["code"]


def test_a_body_within_the_limit_reaches_the_app_whole_however_it_was_sent() -> None:
    chunks = [
        {"type": "http.request", "body": b"ab", "more_body": True},
        {"type": "http.request", "body": b"cd", "more_body": False},
    ]
    sent, read, _ = run(chunks)
    assert read == [b"abcd"] and sent[0]["status"] == 200


def test_bodies_past_the_limit_get_413_by_length_or_as_their_chunks_pass_it() -> None:
    sent, read, _ = run([], headers=[(b"content-length", b"101")])
    assert status_and_code(sent) == (413, "body_too_large") and read == []
    chunks = [{"type": "http.request", "body": b"x" * 60, "more_body": True}] * 2
    sent, read, _ = run(chunks)
    assert status_and_code(sent) == (413, "body_too_large") and read == []


def test_a_body_that_does_not_arrive_within_the_read_timeout_gets_408() -> None:
    sent, read, seconds = run([{"type": "http.request", "body": b"{", "more_body": True}])
    assert status_and_code(sent) == (408, "request_timeout") and read == []
    assert seconds < 2


def test_an_answer_nobody_reads_ends_after_the_write_timeout(capsys) -> None:
    """Without the bound the app's write waits as long as the client does (here an hour)."""
    sent, read, seconds = run([{"type": "http.request", "body": b"{}"}], send_blocks=True)
    assert read == [b"{}"] and [m["type"] for m in sent] == ["http.response.start"]
    assert seconds < 2
    assert "read nothing for 0.2 s" in capsys.readouterr().err
