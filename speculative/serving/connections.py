"""What one connection may take from the server: bytes and time.

A client that sends a huge body, sends its headers or body a byte at a time, or stops reading
its answer would otherwise hold a socket, memory and a task for as long as it likes. Here:

* :class:`Bounds` (ASGI middleware, outermost): a body larger than ``Limits.body_bytes`` gets
  413 before anything parses it (by its Content-Length at once, or as its chunks pass the
  limit); a body not received within ``Limits.read_timeout`` seconds gets 408; a write of the
  answer that waits more than ``Limits.write_timeout`` seconds for the client to read drops
  the connection (the request's row is freed as for a client that left).
* :func:`header_deadline` (the HTTP protocol, below ASGI, where headers are parsed): a
  connection that has not sent a whole request's headers within ``read_timeout`` seconds of
  connecting, or of starting the next request on a kept-alive connection, is closed.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from typing import Any

# a request body's size at most (the longest context's text fits many times over)
MAX_BODY_BYTES = 4 << 20


@dataclass(frozen=True)
class Limits:
    """A connection's bounds (see the module docstring); ``keepalive``: a stream that has had
    nothing to send for this many seconds sends an SSE comment, so that proxies and clients
    with read timeouts keep it open while it waits in the queue."""

    body_bytes: int = MAX_BODY_BYTES
    read_timeout: float = 10.0
    write_timeout: float = 30.0
    keepalive: float = 15.0


class BodyTooLargeError(Exception):
    pass


async def refuse(send: Any, status: int, message: str, code: str) -> None:
    """An OpenAI-style JSON error, sent as plain ASGI messages (nothing below parsed the request)."""
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": code,
            }
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class Bounds:
    """The ASGI side of :class:`Limits` (see the module docstring)."""

    def __init__(self, app: Any, limits: Limits = Limits()) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limits.body_bytes
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await refuse(
                send, 413, f"the request body is larger than {limit} bytes", "body_too_large"
            )
        try:
            body = await asyncio.wait_for(self.read(receive), self.limits.read_timeout)
        except BodyTooLargeError:
            return await refuse(
                send, 413, f"the request body is larger than {limit} bytes", "body_too_large"
            )
        except TimeoutError:
            return await refuse(
                send,
                408,
                f"the request body did not arrive within {self.limits.read_timeout:g} s",
                "request_timeout",
            )
        if body is None:  # the client left while sending it
            return
        replayed = False

        # the body, once; then the connection's own messages (a disconnect)
        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        # The write deadline: one timer per request looks at the write in progress, if any,
        # every half deadline (a timeout around every write would cost a task per SSE chunk).
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        timeout = self.limits.write_timeout
        writing: list[float] = []  # when the write in progress began
        slow = False

        async def bounded(message: dict) -> None:
            writing.append(loop.time())
            try:
                await send(message)
            finally:
                writing.pop()

        def watch() -> None:
            nonlocal slow, timer
            if writing and loop.time() - writing[0] > timeout:
                slow = True
                task.cancel()
            else:
                timer = loop.call_later(timeout / 2, watch)

        timer = loop.call_later(timeout / 2, watch)
        try:
            await self.app(scope, replay, bounded)
        except asyncio.CancelledError:
            if not slow:
                raise
            task.uncancel()
            print(
                f"error: {scope.get('method')} {scope.get('path')}: the client read nothing for "
                f"{timeout:g} s: its connection is dropped",
                file=sys.stderr,
                flush=True,
            )
        finally:
            timer.cancel()

    async def read(self, receive: Any) -> bytes | None:
        body = b""
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limits.body_bytes:
                raise BodyTooLargeError()
        return body


def http_protocol() -> type:
    """The HTTP protocol class uvicorn would choose: httptools' where it is installed, else h11's."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # needs httptools

        return HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol


def header_deadline(protocol: type, seconds: float) -> type:
    """``protocol`` (uvicorn's h11 or httptools protocol class) with a deadline on headers: a
    connection is closed when a request's headers have not all arrived ``seconds`` after it
    opened, or after the first bytes of a further request on it. Both protocols keep the
    request being answered in ``cycle`` (None before the first)."""

    class HeaderDeadline(protocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.header_timer: asyncio.TimerHandle | None = None
            self.arm()

        def arm(self) -> None:
            if self.header_timer is None:
                self.header_timer = self.loop.call_later(seconds, self.too_slow)

        def disarm(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def data_received(self, data: bytes) -> None:
            before = self.cycle
            super().data_received(data)
            if self.cycle is not before and not self.between_requests():
                self.disarm()  # a request's headers are complete: it is being answered
            elif self.between_requests():
                self.arm()  # the first bytes of a request whose headers are not complete yet

        def too_slow(self) -> None:
            self.header_timer = None
            if self.between_requests():
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self.disarm()
            super().connection_lost(exc)

    HeaderDeadline.__name__ = f"HeaderDeadline{protocol.__name__}"
    return HeaderDeadline


__all__ = ["MAX_BODY_BYTES", "Bounds", "Limits", "header_deadline", "http_protocol"]
