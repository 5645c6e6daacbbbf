"""An OpenAI-compatible HTTP API over an EngineLoop (speculative.serving), on FastAPI, uvicorn
and pydantic, streaming with server-sent events. ``serve.py`` starts it; :func:`create_app`
builds it around a :class:`Service` for any other host (the tests start it in a thread).

* ``POST /v1/completions`` and ``POST /v1/chat/completions``, streamed or not; docs/serving.md
  has the table of every request field (applied, refused, or accepted and ignored).
* Every response has ``usage`` and ``speculation``: the request's drafted and accepted tokens,
  alpha (``acceptance_rate``), tau (``tokens_per_target_call``), its target calls and mean gamma.
* ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).

Errors are OpenAI's JSON, ``{"error": {"message", "type", "param", "code"}}``, one line, never
a traceback (docs/serving.md lists them). :class:`Access` decides who may call; each
connection's bytes and time are bounded by speculative.serving.connections.

A client that disconnects frees its row at once (EngineLoop.cancel); so does a stop string.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from speculative.engine.engine import RowFailedError
from speculative.inputs import NonFiniteLogitsError
from speculative.sampling import Sampling
from speculative.serving.connections import Bounds, Limits
from speculative.serving.loop import DeadlineError, OverloadedError, Service, Ticket, prometheus
from speculative.serving.text import StopStrings, TextStream, encode_dialog

MAX_STOP_CHARS = 1024  # a stop string's length at most (matching is linear in the text, the table in the stop)
MAX_TOP_LOGPROBS = 20  # as OpenAI
MAX_STOPS = 4  # as OpenAI
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; a chat's is what the context leaves


IDLE_IDS: list[int] = []  # Exchange.next's answer when no tokens came for the keep-alive interval
IDLE: tuple[str, list[int]] = ("", IDLE_IDS)  # ... and Exchange.pieces'


class ClientGoneError(Exception):
    """The client disconnected before its answer was complete."""


class ApiError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.kind, self.code, self.param, self.headers)


def error_response(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                   param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message.splitlines()[0] if message else kind, "type": kind, "param": param,
                      "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


# ----------------------------------------------------------------------------- requests
class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class Options(Strict):
    """The fields both endpoints take."""

    model: str
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0: only with echo (the prompt scored, nothing made)
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None  # None: OpenAI's default, 1
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=1)] | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=-2 ** 63, lt=2 ** 63)] | None = None  # OpenAI's int64; a negative one is folded
    stream: bool | None = False  # null: OpenAI's default, as for every nullable field here
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] | None = 1
    user: str | None = None

    @field_validator("seed")
    @classmethod
    def fold(cls, seed: int | None) -> int | None:
        """OpenAI's seeds are int64; the generators take 0..2^63 - 1: a negative one is folded there."""
        return None if seed is None else seed % 2 ** 63

    # accepted at the value that changes nothing (refused otherwise, below): what clients send by default
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    speculative_gamma: Annotated[int, Field(ge=0)] | None = None
    return_token_ids: bool = False


class CompletionRequest(Options):
    prompt: str | list[str] | list[int]
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # k: each token's and its top k
    echo: bool | None = None  # the prompt before the completion, and its log-probabilities with logprobs


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatRequest(Options):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None


def field_names(model: type[BaseModel]) -> str:
    return ", ".join(sorted(model.model_fields))


def validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """The first problem of a request body, in one line, and the field it concerns."""
    first = error.errors()[0]
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(where) or None
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    if first.get("type") == "extra_forbidden":
        return f"unknown or unsupported field {param!r}", param
    if first.get("type") == "missing":
        return f"{param} is required", param
    return f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param


# ----------------------------------------------------------------------------- text out
class Output:
    """A request's text as its tokens come: incremental detokenisation (speculative.serving.text.TextStream)
    and stop strings. Text that could be the start of a stop string is held back until the
    next tokens show it is not; a stop string ends the output before it, at the token that
    completed it (``tokens`` are the ones kept)."""

    def __init__(self, tokenizer: Any, shown: Sequence[int], stops: Sequence[str]) -> None:
        self.stream, self.stops = TextStream(tokenizer, shown), StopStrings(stops)
        self.text, self.sent = "", 0
        self.tokens: list[int] = []
        self.stopped = False

    def add(self, ids: Sequence[int]) -> str:
        """The text ready to hand out after ``ids``."""
        for token in ids:
            if self.stopped:
                break
            self.tokens.append(int(token))
            piece = self.stream.add(token)
            found = self.stops.feed(piece, len(self.text)) if self.stops.stops else None
            self.text += piece
            if found is not None:
                self.text, self.stopped = self.text[:found], True
        return self.release(self.stopped)

    def release(self, everything: bool) -> str:
        end = len(self.text) if everything else len(self.text) - self.held()
        piece = self.text[self.sent:max(end, self.sent)]
        self.sent = max(end, self.sent)
        return piece

    def held(self) -> int:
        """How much of the end of the text could begin a stop string."""
        return self.stops.held

    def finish(self) -> str:
        """The rest: held-back text, and any incomplete character at the end."""
        if not self.stopped:
            self.text += self.stream.finish()
        return self.release(True)


# ----------------------------------------------------------------------------- one request
class Exchange:
    """One request between the event loop and the engine's thread: the ticket, the queue its
    tokens arrive on, and its text."""

    def __init__(self, service: Service, request: Request, prompt: list[int], body: Options, chat: bool,
                 limits: Limits | None = None) -> None:
        self.service, self.request, self.body, self.chat = service, request, body, chat
        self.limits = limits or Limits()
        self.prompt = prompt
        self.echo = bool(getattr(body, "echo", None))
        self.scoring = body.max_tokens == 0  # echo alone: the prompt scored, no token handed out
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.queue: asyncio.Queue[list[int] | None] = asyncio.Queue()
        self.output = Output(service.tokenizer, [] if chat else prompt, stops_of(body.stop))
        loop = asyncio.get_running_loop()

        def put(item: list[int] | None) -> None:
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, item)
            except RuntimeError:  # the event loop is closed: nobody is listening
                pass

        # A streamed request, or one with stop strings, reads every iteration's tokens as they
        # come; any other waits for the end, so its tokens are handed over once, and the event
        # loop is not woken (taking a core from the engine's threads) at every iteration.
        eager, held = bool(body.stream or body.stop), []

        def tokens(ids: list[int]) -> None:
            if eager:
                put(ids)
            else:
                held.extend(ids)

        def done(ticket: Ticket) -> None:
            if held:
                put(list(held))
            put(None)

        # a field the request leaves out takes the model's default (generation_config.json), else OpenAI's
        defaults = service.defaults
        temperature = defaults.get("temperature", 1.0) if body.temperature is None else body.temperature
        top_p = defaults.get("top_p") if body.top_p is None else body.top_p
        top_p = None if top_p is None or top_p >= 1 else top_p
        top_k = defaults.get("top_k") if body.top_k is None else body.top_k
        self.ticket = Ticket(prompt, max_tokens_of(service, body, len(prompt), chat) or 1,  # 0: one, never shown
                             Sampling(temperature, top_k, top_p), body.seed, body.speculative_gamma,
                             service.stop_ids, on_tokens=tokens, on_done=done, logprobs=logprobs_of(body, chat),
                             echo=self.echo and body.logprobs is not None)
        self.watcher: asyncio.Task | None = None

    def submit(self) -> None:
        try:
            self.service.loop.submit(self.ticket)
        except OverloadedError as error:
            raise ApiError(429, str(error), "rate_limit_error", "queue_full",
                           headers={"Retry-After": str(error.retry_after)}) from None
        except RuntimeError as error:
            raise ApiError(503, str(error), "server_error", "engine_stopped") from None
        self.watcher = asyncio.ensure_future(wait_for_disconnect(self.request))

    async def next(self) -> list[int] | None:
        """The next iteration's tokens, None at the end, or IDLE_IDS when none came for the
        keep-alive interval; ClientGoneError when the client left."""
        if not self.queue.empty():
            return self.queue.get_nowait()
        getting = asyncio.ensure_future(self.queue.get())
        await asyncio.wait({getting, self.watcher}, timeout=self.limits.keepalive,
                           return_when=asyncio.FIRST_COMPLETED)
        if getting.done():
            return getting.result()
        getting.cancel()
        if self.watcher.done():
            raise ClientGoneError()
        return IDLE_IDS

    async def pieces(self) -> AsyncIterator[tuple[str, list[int]]]:
        """(text, token ids) per iteration until the request ends, and IDLE for every keep-alive
        interval in which nothing came; a stop string cancels the row."""
        while (ids := await self.next()) is not None:
            if ids is IDLE_IDS:
                yield IDLE
                continue
            kept = len(self.output.tokens)
            if self.output.stopped or self.scoring:
                continue  # tokens of the iteration that was running when the stop string was met
            text = self.output.add(ids)
            if self.output.stopped:
                self.service.loop.cancel(self.ticket)
            yield text, self.output.tokens[kept:]
        yield self.output.finish(), []

    def close(self) -> None:
        """The request is over (or its client left): its row leaves the batch if it is still there."""
        self.service.loop.cancel(self.ticket)
        if self.watcher is not None:
            self.watcher.cancel()

    def failure(self) -> ApiError | None:
        error = self.ticket.error
        if error is None:
            return None
        if isinstance(error, NonFiniteLogitsError):
            return ApiError(500, "this request's logits turned non-finite (inf or NaN) and it was stopped; the other "
                            "requests go on", "server_error", "non_finite_logits")
        if isinstance(error, RowFailedError):
            return ApiError(500, f"this request failed on the server ({error}); the other requests go on",
                            "server_error", "request_failed")
        if isinstance(error, DeadlineError) and error.queue:
            return ApiError(503, str(error), "server_error", "queue_timeout",
                            headers={"Retry-After": str(self.service.loop.retry_after(self.service.loop.waiting))})
        if isinstance(error, DeadlineError):
            return ApiError(504, str(error), "server_error", "request_timeout")
        if isinstance(error, ValueError):
            return ApiError(400, str(error))
        return ApiError(503, str(error), "server_error", "engine_stopped")

    @property
    def include_usage(self) -> bool:
        return self.body.stream_options is not None and self.body.stream_options.include_usage

    @property
    def finish_reason(self) -> str:
        return "stop" if self.output.stopped or self.ticket.stop_reason == "eos" else "length"

    def usage(self) -> dict[str, int]:
        done = len(self.output.tokens)
        return {"prompt_tokens": len(self.prompt), "completion_tokens": done, "total_tokens": len(self.prompt) + done}

    def speculation(self) -> dict[str, Any]:
        """This request's speculation figures."""
        row = self.ticket.row
        stats = row.stats if row is not None else None
        pinned = self.ticket.gamma
        used = list(stats.gamma_history) if stats else []
        mode = self.service.speculation
        return {"gamma": pinned if pinned is not None else self.service.gamma_max if mode == "on" else mode,
                "drafted_tokens": stats.drafted_tokens if stats else 0,
                "accepted_tokens": stats.accepted_draft_tokens if stats else 0,
                "acceptance_rate": stats.acceptance_rate if stats else None,
                "tokens_per_target_call": row.produced / stats.target_calls if stats and stats.target_calls else None,
                "target_calls": stats.target_calls if stats else 0,
                "mean_gamma": sum(used) / len(used) if used else None}

    def logprobs(self, start: int, ids: list[int]) -> dict[str, Any] | None:
        """OpenAI's logprobs of the kept tokens start.. (``ids``): the target's own log-probability
        of each at temperature 1, before any warping, and its top ones (speculative.engine.logprobs.record_logprobs)."""
        if self.ticket.logprobs is None or self.ticket.row is None:
            return None
        record = self.ticket.row.logprob_record[start:start + len(ids)]
        name = lambda token: token_text(self.service.tokenizer, token)  # noqa: E731
        if self.chat:
            return {"content": [{"token": name(t), "logprob": v, "bytes": list(name(t).encode()),
                                 "top_logprobs": [{"token": name(i), "logprob": w, "bytes": list(name(i).encode())}
                                                  for i, w in tops]}
                                for t, (v, tops) in zip(ids, record)]}
        return completion_logprobs(self.service.tokenizer, ids, record)

    def echoed(self) -> tuple[str, dict[str, Any] | None]:
        """With echo: the prompt's text and, with logprobs, the prompt tokens' log-probabilities
        under the target (the first token has none, as in OpenAI's answers)."""
        text = self.body.prompt if isinstance(self.body.prompt, str) else \
            self.body.prompt[0] if isinstance(self.body.prompt[0], str) else self.service.tokenizer.decode(self.prompt)
        row = self.ticket.row
        if self.body.logprobs is None or row is None or len(row.prompt_record) != len(self.prompt):
            return text, None
        return text, completion_logprobs(self.service.tokenizer, self.prompt, row.prompt_record)

    def choice(self, text: str, ids: list[int], finish: str | None, delta: bool, start: int = 0,
               echo: bool = False) -> dict[str, Any]:
        logprobs = self.logprobs(start, ids)
        if echo:  # the prompt in front
            before, scored = self.echoed()
            text = before + text
            if scored is not None:
                logprobs = join_logprobs(scored, logprobs)
        if not self.chat:
            out = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        elif delta:
            out = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                   "finish_reason": finish}
        else:
            out = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                   "finish_reason": finish}
        if self.body.return_token_ids:
            out["token_ids"] = ids
        return out

    def document(self, choices: list[dict[str, Any]], chunk: bool, **extra: Any) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        if chunk and self.include_usage:  # as OpenAI: usage null on every chunk but the last, which has it
            extra["usage"] = extra.get("usage") if not choices else None
        return {"id": self.id, "object": kind, "created": self.created, "model": self.service.model,
                "system_fingerprint": self.service.fingerprint, "choices": choices, **extra}

    # ------------------------------------------------------------------------- the two ways to answer
    async def whole(self) -> JSONResponse:
        text: list[str] = []
        try:
            async for piece, _ in self.pieces():
                text.append(piece)
        except ClientGoneError:
            return error_response(499, "the client closed the request", code="client_closed")  # read by nobody
        finally:
            self.close()
        failed = self.failure()
        if failed is not None:
            return failed.response()
        choice = self.choice("".join(text), self.output.tokens, self.finish_reason, delta=False, echo=self.echo)
        return JSONResponse(self.document([choice], chunk=False, usage=self.usage(), speculation=self.speculation()))

    async def streamed(self) -> JSONResponse | StreamingResponse:
        """Server-sent events, one per iteration that adds text. The response waits for the first
        iteration (for up to the keep-alive interval), so that a request that fails at once
        still gets its status code; one still waiting for a row after that starts its stream,
        with an SSE comment for every interval in which nothing came (so do long gaps later)."""
        pieces = self.pieces()
        try:
            first = await pieces.__anext__()
        except ClientGoneError:
            self.close()
            return error_response(499, "the client closed the request", code="client_closed")
        except BaseException:
            self.close()
            raise
        failed = self.failure() if first is not IDLE else None
        if failed is not None:
            self.close()
            return failed.response()

        async def events() -> AsyncIterator[str]:
            try:
                if self.chat:
                    opening = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}
                    yield sse(self.document([opening], chunk=True))
                piece: tuple[str, list[int]] | None = first
                sent, echoed = 0, not self.echo  # kept tokens handed out so far; the prompt, with echo
                while piece is not None:
                    text, ids = piece
                    if piece is IDLE:  # nothing to send for a while: a comment keeps the stream open
                        yield ": keep-alive\n\n"
                    elif not echoed and self.failure() is None:
                        echoed = True
                        yield sse(self.document([self.choice("", [], None, delta=True, echo=True)], chunk=True))
                    if piece is not IDLE and (text or (ids and (self.body.return_token_ids
                                                                or self.ticket.logprobs is not None))):
                        yield sse(self.document([self.choice(text, ids, None, delta=True, start=sent)], chunk=True))
                    sent += len(ids)
                    try:
                        piece = await anext_or_none(pieces)
                    except ClientGoneError:
                        return
                failed = self.failure()
                if failed is not None:  # after the stream began: the stream says it, then ends
                    yield sse({"error": {"message": failed.message, "type": failed.kind, "param": None,
                                         "code": failed.code}})
                else:
                    extra = {"usage": self.usage(), "speculation": self.speculation()}
                    yield sse(self.document([self.choice("", [], self.finish_reason, delta=True)], chunk=True,
                                            **extra))
                    if self.include_usage:
                        yield sse(self.document([], chunk=True, **extra))
                yield "data: [DONE]\n\n"
            finally:
                self.close()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def anext_or_none(pieces: AsyncIterator[tuple[str, list[int]]]) -> tuple[str, list[int]] | None:
    try:
        return await pieces.__anext__()
    except StopAsyncIteration:
        return None


def completion_logprobs(tokenizer: Any, ids: Sequence[int], records: Sequence[Any]) -> dict[str, Any]:
    """A completion's logprobs in OpenAI's shape: each token's text, its log-probability and its
    top ones by text (``records``: the engine's (log p, [(id, log p)]) per token, or None where
    there is none: an echoed prompt's first token), and where each token's text begins."""
    texts = [token_text(tokenizer, t) for t in ids]
    return {"tokens": texts, "token_logprobs": [r and r[0] for r in records],
            "top_logprobs": [r and {token_text(tokenizer, i): w for i, w in r[1]} for r in records],
            "text_offset": [sum(map(len, texts[:i])) for i in range(len(texts))]}


def join_logprobs(first: dict[str, Any], then: dict[str, Any] | None) -> dict[str, Any]:
    """A completion's logprobs for the prompt's tokens, then the completion's (text offsets go on)."""
    if then is None:
        return first
    shift = sum(map(len, first["tokens"]))
    return {"tokens": first["tokens"] + then["tokens"], "token_logprobs": first["token_logprobs"] +
            then["token_logprobs"], "top_logprobs": first["top_logprobs"] + then["top_logprobs"],
            "text_offset": first["text_offset"] + [shift + offset for offset in then["text_offset"]]}


def sse(document: dict[str, Any]) -> str:
    return f"data: {json.dumps(document, separators=(',', ':'))}\n\n"


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client has gone (the server's receive says http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def logprobs_of(body: Options, chat: bool) -> int | None:
    """How many top log-probabilities to record per token (None: none): chat's top_logprobs when
    logprobs is true, a completion's logprobs."""
    if chat:
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


def token_text(tokenizer: Any, token: int) -> str:
    """A token's own text: its SentencePiece piece with the word-boundary mark as a space."""
    piece = getattr(tokenizer, "piece", None)
    return piece(int(token)).replace("\u2581", " ") if piece is not None else tokenizer.decode([int(token)])


def stops_of(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", param="stop")
    if any(not s for s in stops):
        raise ApiError(400, "stop strings must not be empty", param="stop")
    if max(map(len, stops), default=0) > MAX_STOP_CHARS:
        raise ApiError(400, f"stop strings can be at most {MAX_STOP_CHARS} characters, got one of "
                       f"{max(map(len, stops))}", param="stop")
    return [unicode_text(s, "stop") for s in stops]


def max_tokens_of(service: Service, body: Options, prompt_tokens: int, chat: bool) -> int:
    """The request's max_tokens, checked against what the context leaves after the prompt."""
    room = service.context - prompt_tokens
    if room < 1:
        raise ApiError(400, f"the prompt is {prompt_tokens} tokens and {service.model}'s context is {service.context} "
                       "tokens: it must hold the prompt and at least one new token", code="context_length_exceeded",
                       param="messages" if chat else "prompt")
    asked = getattr(body, "max_completion_tokens", None) or body.max_tokens
    if asked is None:
        default = service.defaults.get("max_new_tokens") or (None if chat else COMPLETION_MAX_TOKENS)
        return room if default is None else min(default, room)
    if asked > room:
        raise ApiError(400, f"the prompt ({prompt_tokens} tokens) and max_tokens ({asked}) exceed {service.model}'s "
                       f"{service.context}-token context: max_tokens can be at most {room} here",
                       code="context_length_exceeded", param="max_tokens")
    return asked


def check_common(service: Service, body: Options) -> None:
    if body.model != service.model:
        raise ApiError(404, f"the model {body.model!r} does not exist here; this server serves {service.model!r}",
                       code="model_not_found", param="model")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0):
            raise ApiError(400, f"{name} is not supported (it would change the target's distribution, which "
                                "speculation reproduces exactly); only 0 or null", param=name)
    if body.max_tokens == 0 and not getattr(body, "echo", None):
        raise ApiError(400, "max_tokens must be >= 1 (0 only with echo: true, to score the prompt)",
                       param="max_tokens")
    if getattr(body, "top_logprobs", None) and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
    chat_max = getattr(body, "max_completion_tokens", None)
    if chat_max is not None and body.max_tokens is not None and chat_max != body.max_tokens:
        raise ApiError(400, f"max_tokens ({body.max_tokens}) and max_completion_tokens ({chat_max}) differ: give one",
                       param="max_completion_tokens")
    gamma = body.speculative_gamma
    if gamma is not None and gamma > service.gamma_max:
        limit = "this server has no drafter, so only 0" if service.gamma_max == 0 else \
            f"it must lie in 0..{service.gamma_max} (the server's --gamma)"
        raise ApiError(400, f"speculative_gamma {gamma}: {limit}", param="speculative_gamma")


def unicode_text(text: str, param: str) -> str:
    """``text`` as it came, or 400 when it cannot be UTF-8 (a lone surrogate such as "\\ud800",
    which JSON allows and which the tokenizer would fail on as an internal error)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ApiError(400, f"{param} is not valid Unicode text ({error.reason} at character {error.start})",
                       param=param) from None
    return text


def too_long(service: Service, texts: Sequence[Any], param: str) -> None:
    """400 before tokenizing when the text cannot fit the context whatever its tokens: a token
    covers at most ``service.longest_piece`` characters, so a text of more characters than that
    many times the context has more tokens than the context holds."""
    chars = sum(len(t) for t in texts if isinstance(t, str))
    if chars > service.context * service.longest_piece:
        raise ApiError(400, f"the {param} is {chars} characters, more than {service.model}'s context of "
                            f"{service.context} tokens can hold", code="context_length_exceeded", param=param)


def prompt_ids(service: Service, prompt: str | list[str] | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return service.tokenizer.encode(unicode_text(prompt, "prompt"), bos=True)
    if not prompt:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise ApiError(400, f"one prompt per request (n = 1), got a list of {len(prompt)}", param="prompt")
        return service.tokenizer.encode(unicode_text(prompt[0], "prompt"), bos=True)
    vocab = service.vocab_size
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise ApiError(400, f"prompt token ids must lie in [0, {vocab}), got {min(prompt)}..{max(prompt)}",
                       param="prompt")
    return list(prompt)


# ----------------------------------------------------------------------------- the app
@dataclass(frozen=True)
class Access:
    """Who may call the API. ``api_key``: the /v1 paths require ``Authorization: Bearer KEY``
    (as OpenAI clients send it; /health and /metrics stay open to probes). ``hosts``: the Host
    names a request may name (None: any), so that a web page on another name that resolves to
    this address (DNS rebinding) is refused. ``cors``: origins allowed to read answers from a
    browser (none by default: no CORS headers at all)."""

    api_key: str | None = None
    hosts: frozenset[str] | None = None
    cors: tuple[str, ...] = ()


API_KEY_ENV = "SPECULATIVE_API_KEY"
LOOPBACK = ("127.0.0.1", "::1", "localhost")


def access_for(host: str, api_key: str | None, allowed_hosts: str | None, cors: Sequence[str]) -> Access:
    """serve.py's access: the key (given, else $SPECULATIVE_API_KEY), the Host names (given,
    comma-separated or *; else the address listened on, with localhost for a loopback one; any
    for 0.0.0.0, whose names are not known here), the CORS origins."""
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    if allowed_hosts == "*" or (not allowed_hosts and host in ("0.0.0.0", "::", "")):
        hosts = None
    elif allowed_hosts:
        hosts = frozenset(h.strip().lower() for h in allowed_hosts.split(",") if h.strip())
    else:
        hosts = frozenset({host.lower(), *(LOOPBACK if host in LOOPBACK else ())})
    return Access(api_key=key, hosts=hosts, cors=tuple(cors))


def exposure_warning(host: str, access: Access) -> str | None:
    """The warning for a server that others can reach without a key."""
    if host in LOOPBACK or access.api_key:
        return None
    return (f"warning: listening on {host} without an API key: anyone who can reach this address can use the model "
            f"(--api-key, or ${API_KEY_ENV})")


def host_name(header: str) -> str:
    """The name of a Host header without its port ("[::1]:8000" -> "::1")."""
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class Guard:
    """ASGI middleware, outermost: a request naming another Host gets 400, one to /v1 without the
    API key 401, before anything else reads it (see Access)."""

    def __init__(self, app: Any, access: Access) -> None:
        self.app, self.access = app, access

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers, access = Headers(scope=scope), self.access
            if access.hosts is not None and host_name(headers.get("host", "")).lower() not in access.hosts:
                return await error_response(400, f"Host {headers.get('host', '')!r} is not one this server answers "
                                                 "to (--allowed-hosts)", code="invalid_host")(scope, receive, send)
            if access.api_key is not None and scope["path"].startswith("/v1/"):
                given = headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {access.api_key}".encode()):
                    return await error_response(401, "a valid API key is required: Authorization: Bearer KEY",
                                                "authentication_error", code="invalid_api_key")(scope, receive, send)
        await self.app(scope, receive, send)


def create_app(service: Service, access: Access | None = None, limits: Limits | None = None) -> FastAPI:
    """The HTTP API over ``service`` (see the module docstring), open to ``access``, each
    connection within ``limits`` (speculative.serving.connections). The loop must be running."""
    access, limits = access or Access(), limits or Limits()
    app = FastAPI(title="speculative-llama", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.add_middleware(Bounds, limits=limits)  # middleware added later wraps what was added before
    if access.cors:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(access.cors), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(Guard, access=access)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        message, param = validation_message(error)
        return error_response(400, message, param=param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        message = f"no such path: {request.method} {request.url.path}" if error.status_code == 404 else \
            f"{request.method} is not allowed on {request.url.path}" if error.status_code == 405 else str(error.detail)
        return error_response(error.status_code, message, code="not_found" if error.status_code == 404 else None,
                              headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def internal(request: Request, error: Exception) -> JSONResponse:
        line = f"{type(error).__name__}: {error}".splitlines()[0]
        print(f"error: {request.method} {request.url.path}: {line}", file=sys.stderr)
        return error_response(500, f"internal error: {line}", "server_error")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        check_common(service, body)
        too_long(service, [body.prompt] if isinstance(body.prompt, str) else body.prompt, "prompt")
        ids = await asyncio.to_thread(prompt_ids, service, body.prompt)  # not on the event loop
        return await answer(Exchange(service, request, ids, body, chat=False, limits=limits))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Any:
        check_common(service, body)
        try:
            too_long(service, [m.text for m in body.messages], "messages")
            turns = [(m.role, unicode_text(m.text, "messages")) for m in body.messages]
            ids = await asyncio.to_thread(encode_dialog, service.tokenizer, turns)  # not on the event loop
        except ValueError as error:
            raise ApiError(400, str(error), param="messages") from None
        return await answer(Exchange(service, request, ids, body, chat=True, limits=limits))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": service.model, "object": "model", "created": service.created, "owned_by": "speculative-llama",
            "context_length": service.context,
            "speculation": {"draft": service.draft, "gamma": service.speculation, "gamma_max": service.gamma_max}}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        loop = service.loop
        stalled, draining = loop.stalled, loop.drain_until is not None
        ok = loop.healthy and stalled is None and not draining
        status = "ok" if ok else "stopped" if not loop.healthy else "draining" if draining else "stalled"
        body = {"status": status, "model": service.model, "running": loop.running, "waiting": loop.waiting}
        if not loop.healthy:
            body["error"] = str(loop.failure or "the engine loop is not running")
        elif stalled is not None:
            body["error"] = f"the engine has made no progress for {stalled:.0f} s with requests in hand"
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(prometheus(service.loop), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


async def answer(exchange: Exchange) -> Any:
    exchange.submit()
    return await (exchange.streamed() if exchange.body.stream else exchange.whole())


__all__ = ["Access", "ApiError", "Output", "create_app"]
