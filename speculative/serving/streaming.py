"""One request's exchange between the event loop and the engine's thread, and the two ways to
answer it (the role of vLLM's serving_completion.py and serving_chat.py): whole, one JSON
document, or streamed as server-sent events, one per iteration that adds text, with SSE
comments to keep a quiet stream open. Each answer carries ``usage`` and ``speculation`` (the
request's drafted and accepted tokens, alpha, tau, its target calls and mean gamma), and
log-probabilities in OpenAI's shapes when asked.

A request's n choices are n rows of the engine (choice i seeded seed + i), batched like any
others; its answer has a choice per row, and its stream names each chunk's choice by its index.
A client that disconnects frees its rows at once (EngineLoop.cancel); a stop string frees the
row of the choice that met it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
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
from speculative.serving.validation import choices_of, max_tokens_of, stops_of


class ClientGoneError(Exception):
    """The client disconnected before its answer was complete."""


@dataclass(frozen=True)
class Piece:
    """What an iteration added to one of a request's choices: its text and token ids; ``last``:
    the choice has ended (this is its text's tail, and its finish_reason follows)."""

    index: int
    text: str
    ids: list[int]
    last: bool = False


IDLE = Piece(-1, "", [])  # Exchange.pieces' item when nothing came for the keep-alive interval


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of a request's choice ``index``: seed + index, as generate.py gives prompt i of a
    --prompts-file, so that a repeated request repeats every choice, and the choices of one request
    differ; None (no seed): each choice from a fresh generator of its own."""
    return None if seed is None else seed + index


class Sample:
    """One of a request's n choices: its row's ticket, its text, and how far its stream has gone."""

    def __init__(self, index: int, ticket: Ticket, output: Output, echoed: bool) -> None:
        self.index = index
        self.ticket = ticket
        self.output = output
        self.sent = 0  # kept tokens handed out so far
        self.echoed = echoed  # the prompt sent in front, with echo (True without echo)
        self.ended = False  # its last piece handed out

    @property
    def finish_reason(self) -> str:
        return "stop" if self.output.stopped or self.ticket.stop_reason == "eos" else "length"


# ----------------------------------------------------------------------------- one request
class Exchange:
    """One request between the event loop and the engine's thread: a ticket per choice, the
    queue their tokens arrive on, and each choice's text."""

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
        # (the choice, its iteration's tokens), or (the choice, None) at its end
        self.queue: asyncio.Queue[tuple[int, list[int] | None]] = asyncio.Queue()
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
        # every choice's ticket is this one with its own seed and callbacks (Exchange.sample)
        template = Ticket(
            prompt,
            max_tokens_of(service, body, len(prompt), chat) or 1,  # 0: one, never shown
            Sampling(temperature, top_k, top_p),
            body.seed,
            body.speculative_gamma,
            service.stop_ids,
            logprobs=logprobs_of(body, chat),
            echo=self.echo and body.logprobs is not None,
            memory=service.memory(key_of(request)),
        )
        stops = stops_of(body.stop)
        self.samples = [self.sample(i, template, stops) for i in range(choices_of(service, body))]
        self.watcher: asyncio.Task | None = None

    def sample(self, index: int, template: Ticket, stops: list[str]) -> Sample:
        """Choice ``index``: its own row (seeded choice_seed(seed, index)), whose tokens arrive on
        the exchange's queue under its index."""
        loop = asyncio.get_running_loop()

        def put(item: list[int] | None) -> None:
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, (index, item))
            except RuntimeError:  # the event loop is closed: nobody is listening
                pass

        # A streamed request, or one with stop strings, reads every iteration's tokens as they
        # come; any other waits for the end, so its tokens are handed over once, and the event
        # loop is not woken (taking a core from the engine's threads) at every iteration.
        eager = bool(self.body.stream or self.body.stop)
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

        ticket = replace(
            template,
            seed=choice_seed(template.seed, index),
            on_tokens=tokens,
            on_done=done,
        )
        output = Output(self.service.tokenizer, [] if self.chat else self.prompt, stops)
        return Sample(index, ticket, output, echoed=not self.echo)

    def submit(self) -> None:
        try:
            self.service.loop.submit_all([sample.ticket for sample in self.samples])
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

    async def next(self) -> tuple[int, list[int] | None] | None:
        """The next (choice, its iteration's tokens; None at its end), or None when nothing came
        for the keep-alive interval; ClientGoneError when the client left."""
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
        return None

    async def pieces(self) -> AsyncIterator[Piece]:
        """Each choice's pieces, one per iteration, then its last one at its end, and IDLE for
        every keep-alive interval in which nothing came; a stop string cancels its choice's row.
        It ends when every choice has ended, or at once when one failed: the request fails whole
        (:meth:`failure`), so the others need not go on."""
        while not all(sample.ended for sample in self.samples):
            item = await self.next()
            if item is None:
                yield IDLE
                continue
            index, ids = item
            sample = self.samples[index]
            output = sample.output
            if ids is None:
                if sample.ticket.error is not None:
                    return
                sample.ended = True
                yield Piece(index, output.finish(), [], last=True)
                continue
            kept = len(output.tokens)
            if output.stopped or self.scoring:
                continue  # tokens of the iteration that was running when the stop string was met
            text = output.add(ids)
            if output.stopped:
                self.service.loop.cancel(sample.ticket, stop_string=True)
            yield Piece(index, text, output.tokens[kept:])

    def close(self) -> None:
        """The request is over (or its client left): its rows leave the batch if they are still there."""
        for sample in self.samples:
            self.service.loop.cancel(sample.ticket)
        if self.watcher is not None:
            self.watcher.cancel()

    def failure(self) -> ApiError | None:
        """The request's failure: the first of its choices' (one failed choice fails the request,
        as one answer with a missing choice would mislead), or None."""
        for sample in self.samples:
            if sample.ticket.error is not None:
                return self.api_error(sample.ticket.error)
        return None

    def api_error(self, error: Exception) -> ApiError:
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

    def usage(self) -> dict[str, int]:
        """OpenAI's usage: the prompt once, the tokens of every choice."""
        done = sum(len(sample.output.tokens) for sample in self.samples)
        return {
            "prompt_tokens": len(self.prompt),
            "completion_tokens": done,
            "total_tokens": len(self.prompt) + done,
        }

    def speculation(self) -> dict[str, Any]:
        """This request's speculation figures, over its choices together: their drafted and
        accepted tokens and target calls summed, alpha over all their verified positions, tau
        over all their iterations (with one choice, that choice's own)."""
        stats = [s.ticket.row.stats for s in self.samples if s.ticket.row is not None]
        produced = sum(s.ticket.row.produced for s in self.samples if s.ticket.row is not None)
        calls = sum(st.target_calls for st in stats)
        positions = sum(st.verified_positions for st in stats)
        used = [g for st in stats for g in st.gamma_history]
        return {
            "gamma": self.gamma_shown(),
            "drafted_tokens": sum(st.drafted_tokens for st in stats),
            "accepted_tokens": sum(st.accepted_draft_tokens for st in stats),
            "acceptance_rate": (
                sum(st.overlap_sum for st in stats) / positions if positions else None
            ),
            "tokens_per_target_call": produced / calls if calls else None,
            "target_calls": calls,
            "mean_gamma": sum(used) / len(used) if used else None,
        }

    def gamma_shown(self) -> int | str:
        """The gamma this request ran under, as its answer shows it: its own pinned gamma, else
        the server's gamma_max when speculation is on, else the server's mode (load, off, none)."""
        if self.body.speculative_gamma is not None:
            return self.body.speculative_gamma
        mode = self.service.speculation
        if mode == "on":
            return self.service.gamma_max
        return mode

    def logprobs(self, sample: Sample, start: int, ids: list[int]) -> dict[str, Any] | None:
        """OpenAI's logprobs of a choice's kept tokens start.. (``ids``): the target's own
        log-probability of each at temperature 1, before any warping, and its top ones
        (speculative.engine.logprobs.record_logprobs)."""
        if sample.ticket.logprobs is None or sample.ticket.row is None:
            return None
        record = sample.ticket.row.logprob_record[start : start + len(ids)]

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

    def echoed(self, sample: Sample) -> tuple[str, dict[str, Any] | None]:
        """With echo: the prompt's text and, with logprobs, the prompt tokens' log-probabilities
        under the target, read by the choice's own row (the first token has none, as in OpenAI's
        answers)."""
        prompt = self.body.prompt
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt[0], str):
            text = prompt[0]
        else:
            text = self.service.tokenizer.decode(self.prompt)  # the prompt came as token ids
        row = sample.ticket.row
        if self.body.logprobs is None or row is None or len(row.prompt_record) != len(self.prompt):
            return text, None
        return text, completion_logprobs(self.service.tokenizer, self.prompt, row.prompt_record)

    def choice(
        self,
        sample: Sample,
        text: str,
        ids: list[int],
        finish: str | None,
        delta: bool,
        start: int = 0,
        echo: bool = False,
    ) -> dict[str, Any]:
        logprobs = self.logprobs(sample, start, ids)
        if echo:  # the prompt in front
            before, scored = self.echoed(sample)
            text = before + text
            if scored is not None:
                logprobs = join_logprobs(scored, logprobs)
        index = sample.index
        if not self.chat:
            out = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        elif delta:
            out = {
                "index": index,
                "delta": {"content": text} if text else {},
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        else:
            out = {
                "index": index,
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

    def shows(self, sample: Sample, piece: Piece) -> bool:
        """Whether a piece is worth a chunk of the stream: it adds text, or token ids or
        log-probabilities that the request asked for."""
        if piece.text:
            return True
        asked = self.body.return_token_ids or sample.ticket.logprobs is not None
        return bool(piece.ids and asked)

    # ------------------------------------------------------------------------- the two ways to answer
    async def whole(self) -> JSONResponse:
        texts: list[list[str]] = [[] for _ in self.samples]
        try:
            async for piece in self.pieces():
                if piece is not IDLE:
                    texts[piece.index].append(piece.text)
        except ClientGoneError:
            # read by nobody
            return error_response(499, "the client closed the request", code="client_closed")
        finally:
            self.close()
        failed = self.failure()
        if failed is not None:
            return failed.response()
        choices = [
            self.choice(
                sample,
                "".join(text),
                sample.output.tokens,
                sample.finish_reason,
                delta=False,
                echo=self.echo,
            )
            for sample, text in zip(self.samples, texts)
        ]
        return JSONResponse(
            self.document(choices, chunk=False, usage=self.usage(), speculation=self.speculation())
        )

    async def streamed(self) -> JSONResponse | StreamingResponse:
        """Server-sent events, one per iteration that adds text to a choice, each naming its
        choice's index; a choice's end is a chunk with its finish_reason, and the last choice's
        carries the usage and speculation figures. The response waits for the first iteration
        (for up to the keep-alive interval), so that a request that fails at once still gets its
        status code; one still waiting for a row after that starts its stream, with an SSE
        comment for every interval in which nothing came (so do long gaps later)."""
        pieces = self.pieces()
        try:
            first = await anext_or_none(pieces)
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
                    for sample in self.samples:
                        opening = {
                            "index": sample.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                        yield sse(self.document([opening], chunk=True))
                piece = first
                while piece is not None:
                    if piece is IDLE:
                        # nothing to send for a while: a comment keeps the stream open
                        yield ": keep-alive\n\n"
                    else:
                        for event in self.events_of(piece):
                            yield event
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
                elif self.include_usage:
                    extra = {"usage": self.usage(), "speculation": self.speculation()}
                    yield sse(self.document([], chunk=True, **extra))
                yield "data: [DONE]\n\n"
            finally:
                self.close()

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    def events_of(self, piece: Piece) -> list[str]:
        """The chunks of one piece of a stream: its choice's prompt first, with echo; its text;
        at the choice's end its finish_reason, and with the last choice's the usage and
        speculation figures."""
        sample = self.samples[piece.index]
        events = []
        if not sample.echoed and self.failure() is None:
            sample.echoed = True
            prompt = self.choice(sample, "", [], None, delta=True, echo=True)
            events.append(sse(self.document([prompt], chunk=True)))
        if self.shows(sample, piece):
            added = self.choice(sample, piece.text, piece.ids, None, delta=True, start=sample.sent)
            events.append(sse(self.document([added], chunk=True)))
        sample.sent += len(piece.ids)
        if piece.last:
            extra = {}
            if all(other.ended for other in self.samples):
                extra = {"usage": self.usage(), "speculation": self.speculation()}
            closing = self.choice(sample, "", [], sample.finish_reason, delta=True)
            events.append(sse(self.document([closing], chunk=True, **extra)))
        return events


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
