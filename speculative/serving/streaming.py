"""One request's exchange between the event loop and the engine's thread, and the two ways to
answer it (the role of vLLM's serving_completion.py and serving_chat.py): whole, one JSON
document, or streamed as server-sent events, one per iteration that adds text, with SSE
comments to keep a quiet stream open. Each answer carries ``usage`` and ``speculation`` (the
request's drafted and accepted tokens, alpha, tau, its target calls and mean gamma), and
log-probabilities in OpenAI's shapes when asked.

A client that disconnects frees its row at once (EngineLoop.cancel); so does a stop string.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from speculative.engine.engine import RowFailedError
from speculative.inputs import NonFiniteLogitsError
from speculative.sampling import Sampling
from speculative.serving.access import key_of
from speculative.serving.connections import Limits
from speculative.serving.loop import DeadlineError, OverloadedError, Service, Ticket
from speculative.serving.protocol import ApiError, Options, error_response
from speculative.serving.text import Output
from speculative.serving.validation import max_tokens_of, stops_of

IDLE_IDS: list[int] = []  # Exchange.next's answer when no tokens came for the keep-alive interval
IDLE: tuple[str, list[int]] = ("", IDLE_IDS)  # ... and Exchange.pieces'


class ClientGoneError(Exception):
    """The client disconnected before its answer was complete."""


# ----------------------------------------------------------------------------- one request
class Exchange:
    """One request between the event loop and the engine's thread: the ticket, the queue its
    tokens arrive on, and its text."""

    def __init__(
        self,
        service: Service,
        request: Request,
        prompt: list[int],
        body: Options,
        chat: bool,
        limits: Limits | None = None,
    ) -> None:
        self.service = service
        self.request = request
        self.body = body
        self.chat = chat
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
        eager = bool(body.stream or body.stop)
        held: list[int] = []

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
        temperature = body.temperature
        if temperature is None:
            temperature = defaults.get("temperature", 1.0)
        top_p = body.top_p
        if top_p is None:
            top_p = defaults.get("top_p")
        if top_p is not None and top_p >= 1:
            top_p = None  # the whole distribution: no nucleus to cut
        top_k = body.top_k
        if top_k is None:
            top_k = defaults.get("top_k")
        self.ticket = Ticket(
            prompt,
            max_tokens_of(service, body, len(prompt), chat) or 1,  # 0: one, never shown
            Sampling(temperature, top_k, top_p),
            body.seed,
            body.speculative_gamma,
            service.stop_ids,
            on_tokens=tokens,
            on_done=done,
            logprobs=logprobs_of(body, chat),
            echo=self.echo and body.logprobs is not None,
            memory=service.memory(key_of(request)),
        )
        self.watcher: asyncio.Task | None = None

    def submit(self) -> None:
        try:
            self.service.loop.submit(self.ticket)
        except OverloadedError as error:
            raise ApiError(
                429,
                str(error),
                "rate_limit_error",
                "queue_full",
                headers={"Retry-After": str(error.retry_after)},
            ) from None
        except RuntimeError as error:
            raise ApiError(503, str(error), "server_error", "engine_stopped") from None
        self.watcher = asyncio.ensure_future(wait_for_disconnect(self.request))

    async def next(self) -> list[int] | None:
        """The next iteration's tokens, None at the end, or IDLE_IDS when none came for the
        keep-alive interval; ClientGoneError when the client left."""
        if not self.queue.empty():
            return self.queue.get_nowait()
        getting = asyncio.ensure_future(self.queue.get())
        await asyncio.wait(
            {getting, self.watcher},
            timeout=self.limits.keepalive,
            return_when=asyncio.FIRST_COMPLETED,
        )
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
                self.service.loop.cancel(self.ticket, stop_string=True)
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
            return ApiError(
                500,
                "this request's logits turned non-finite (inf or NaN) and it was stopped; the other "
                "requests go on",
                "server_error",
                "non_finite_logits",
            )
        if isinstance(error, RowFailedError):
            return ApiError(
                500,
                f"this request failed on the server ({error}); the other requests go on",
                "server_error",
                "request_failed",
            )
        if isinstance(error, DeadlineError) and error.queue:
            return ApiError(
                503,
                str(error),
                "server_error",
                "queue_timeout",
                headers={
                    "Retry-After": str(self.service.loop.retry_after(self.service.loop.waiting))
                },
            )
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
        return {
            "prompt_tokens": len(self.prompt),
            "completion_tokens": done,
            "total_tokens": len(self.prompt) + done,
        }

    def speculation(self) -> dict[str, Any]:
        """This request's speculation figures."""
        row = self.ticket.row
        stats = row.stats if row is not None else None
        used = list(stats.gamma_history) if stats else []
        tau = None
        if stats and stats.target_calls:
            tau = row.produced / stats.target_calls
        return {
            "gamma": self.gamma_shown(),
            "drafted_tokens": stats.drafted_tokens if stats else 0,
            "accepted_tokens": stats.accepted_draft_tokens if stats else 0,
            "acceptance_rate": stats.acceptance_rate if stats else None,
            "tokens_per_target_call": tau,
            "target_calls": stats.target_calls if stats else 0,
            "mean_gamma": sum(used) / len(used) if used else None,
        }

    def gamma_shown(self) -> int | str:
        """The gamma this request ran under, as its answer shows it: its own pinned gamma, else
        the server's gamma_max when speculation is on, else the server's mode (load, off, none)."""
        if self.ticket.gamma is not None:
            return self.ticket.gamma
        mode = self.service.speculation
        if mode == "on":
            return self.service.gamma_max
        return mode

    def logprobs(self, start: int, ids: list[int]) -> dict[str, Any] | None:
        """OpenAI's logprobs of the kept tokens start.. (``ids``): the target's own log-probability
        of each at temperature 1, before any warping, and its top ones (speculative.engine.logprobs.record_logprobs)."""
        if self.ticket.logprobs is None or self.ticket.row is None:
            return None
        record = self.ticket.row.logprob_record[start : start + len(ids)]

        def name(token: int) -> str:
            return token_text(self.service.tokenizer, token)

        def token_bytes(token: int) -> list[int]:
            return list(self.service.tokenizer.token_bytes(int(token)))

        if self.chat:
            return {
                "content": [
                    {
                        "token": name(t),
                        "logprob": v,
                        "bytes": token_bytes(t),
                        "top_logprobs": [
                            {"token": name(i), "logprob": w, "bytes": token_bytes(i)}
                            for i, w in tops
                        ],
                    }
                    for t, (v, tops) in zip(ids, record)
                ]
            }
        return completion_logprobs(self.service.tokenizer, ids, record)

    def echoed(self) -> tuple[str, dict[str, Any] | None]:
        """With echo: the prompt's text and, with logprobs, the prompt tokens' log-probabilities
        under the target (the first token has none, as in OpenAI's answers)."""
        prompt = self.body.prompt
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt[0], str):
            text = prompt[0]
        else:
            text = self.service.tokenizer.decode(self.prompt)  # the prompt came as token ids
        row = self.ticket.row
        if self.body.logprobs is None or row is None or len(row.prompt_record) != len(self.prompt):
            return text, None
        return text, completion_logprobs(self.service.tokenizer, self.prompt, row.prompt_record)

    def choice(
        self,
        text: str,
        ids: list[int],
        finish: str | None,
        delta: bool,
        start: int = 0,
        echo: bool = False,
    ) -> dict[str, Any]:
        logprobs = self.logprobs(start, ids)
        if echo:  # the prompt in front
            before, scored = self.echoed()
            text = before + text
            if scored is not None:
                logprobs = join_logprobs(scored, logprobs)
        if not self.chat:
            out = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        elif delta:
            out = {
                "index": 0,
                "delta": {"content": text} if text else {},
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        else:
            out = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        if self.body.return_token_ids:
            out["token_ids"] = ids
        return out

    def document(self, choices: list[dict[str, Any]], chunk: bool, **extra: Any) -> dict[str, Any]:
        if not self.chat:
            kind = "text_completion"
        elif chunk:
            kind = "chat.completion.chunk"
        else:
            kind = "chat.completion"
        if chunk and self.include_usage:
            # as OpenAI: usage null on every chunk but the last, which has it
            extra["usage"] = extra.get("usage") if not choices else None
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.service.model,
            "system_fingerprint": self.service.fingerprint,
            "choices": choices,
            **extra,
        }

    def shows(self, text: str, ids: list[int]) -> bool:
        """Whether an iteration's piece is worth a chunk of the stream: it adds text, or token ids
        or log-probabilities that the request asked for."""
        if text:
            return True
        return bool(ids and (self.body.return_token_ids or self.ticket.logprobs is not None))

    # ------------------------------------------------------------------------- the two ways to answer
    async def whole(self) -> JSONResponse:
        text: list[str] = []
        try:
            async for piece, _ in self.pieces():
                text.append(piece)
        except ClientGoneError:
            # read by nobody
            return error_response(499, "the client closed the request", code="client_closed")
        finally:
            self.close()
        failed = self.failure()
        if failed is not None:
            return failed.response()
        choice = self.choice(
            "".join(text), self.output.tokens, self.finish_reason, delta=False, echo=self.echo
        )
        return JSONResponse(
            self.document([choice], chunk=False, usage=self.usage(), speculation=self.speculation())
        )

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
                    opening = {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    yield sse(self.document([opening], chunk=True))
                piece: tuple[str, list[int]] | None = first
                sent = 0  # kept tokens handed out so far
                echoed = not self.echo  # the prompt, with echo
                while piece is not None:
                    text, ids = piece
                    if piece is IDLE:
                        # nothing to send for a while: a comment keeps the stream open
                        yield ": keep-alive\n\n"
                    elif not echoed and self.failure() is None:
                        echoed = True
                        prompt = self.choice("", [], None, delta=True, echo=True)
                        yield sse(self.document([prompt], chunk=True))
                    if piece is not IDLE and self.shows(text, ids):
                        added = self.choice(text, ids, None, delta=True, start=sent)
                        yield sse(self.document([added], chunk=True))
                    sent += len(ids)
                    try:
                        piece = await anext_or_none(pieces)
                    except ClientGoneError:
                        return
                failed = self.failure()
                if failed is not None:  # after the stream began: the stream says it, then ends
                    yield sse(
                        {
                            "error": {
                                "message": failed.message,
                                "type": failed.kind,
                                "param": None,
                                "code": failed.code,
                            }
                        }
                    )
                else:
                    extra = {"usage": self.usage(), "speculation": self.speculation()}
                    closing = self.choice("", [], self.finish_reason, delta=True)
                    yield sse(self.document([closing], chunk=True, **extra))
                    if self.include_usage:
                        yield sse(self.document([], chunk=True, **extra))
                yield "data: [DONE]\n\n"
            finally:
                self.close()

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )


async def anext_or_none(
    pieces: AsyncIterator[tuple[str, list[int]]],
) -> tuple[str, list[int]] | None:
    try:
        return await pieces.__anext__()
    except StopAsyncIteration:
        return None


def completion_logprobs(
    tokenizer: Any, ids: Sequence[int], records: Sequence[Any]
) -> dict[str, Any]:
    """A completion's logprobs in OpenAI's shape: each token's text, its log-probability and its
    top ones by text (``records``: the engine's (log p, [(id, log p)]) per token, or None where
    there is none: an echoed prompt's first token), and where each token's text begins."""
    texts = [token_text(tokenizer, t) for t in ids]
    return {
        "tokens": texts,
        "token_logprobs": [r and r[0] for r in records],
        "top_logprobs": [r and {token_text(tokenizer, i): w for i, w in r[1]} for r in records],
        "text_offset": [sum(map(len, texts[:i])) for i in range(len(texts))],
    }


def join_logprobs(first: dict[str, Any], then: dict[str, Any] | None) -> dict[str, Any]:
    """A completion's logprobs for the prompt's tokens, then the completion's (text offsets go on)."""
    if then is None:
        return first
    shift = sum(map(len, first["tokens"]))
    return {
        "tokens": first["tokens"] + then["tokens"],
        "token_logprobs": first["token_logprobs"] + then["token_logprobs"],
        "top_logprobs": first["top_logprobs"] + then["top_logprobs"],
        "text_offset": first["text_offset"] + [shift + offset for offset in then["text_offset"]],
    }


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
    """A token's own text: the bytes it stands for (weights.tokenizer.Tokenizer.token_bytes), as
    UTF-8, a character split over tokens shown as the replacement character in each (as vLLM does;
    ``token_bytes`` lists the bytes themselves)."""
    return tokenizer.token_bytes(int(token)).decode("utf-8", errors="replace")


async def answer(exchange: Exchange) -> Any:
    """Queue the request, then answer it as it asked: streamed, or whole at the end."""
    exchange.submit()
    return await (exchange.streamed() if exchange.body.stream else exchange.whole())
