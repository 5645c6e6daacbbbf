"""An OpenAI-compatible HTTP API over an EngineLoop (speculative.serving), on FastAPI, uvicorn
and pydantic, streaming with server-sent events. ``serve.py`` starts it; :func:`create_app`
builds it around a :class:`Service` for any other host (the tests start it in a thread).

* ``POST /v1/completions`` and ``POST /v1/chat/completions``, streamed or not; docs/serving.md
  has the table of every request field (applied, refused, or accepted and ignored).
* Every response has ``usage`` and ``speculation``: the request's drafted and accepted tokens,
  alpha (``acceptance_rate``), tau (``tokens_per_target_call``), its target calls and mean gamma.
* ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).

Errors are OpenAI's JSON, ``{"error": {"message", "type", "param", "code"}}``, one line, never
a traceback (docs/serving.md lists them).

This module is the server (the role of vLLM's api_server.py): the routes, the error handlers
and the middleware, in that order. Each role it joins has its own module: the request bodies
and the error document (protocol.py), their checks (validation.py), one request's exchange
with the engine and its answer, whole or streamed (streaming.py), who may call (access.py),
what one connection may take (connections.py), and the text out (text.py).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException

from speculative.serving.access import Access, Guard
from speculative.serving.connections import Bounds, Limits
from speculative.serving.loop import Service
from speculative.serving.metrics import prometheus
from speculative.serving.protocol import ApiError, ChatRequest, CompletionRequest, error_response
from speculative.serving.streaming import Exchange, answer
from speculative.serving.text import encode_dialog
from speculative.serving.validation import (
    check_common,
    prompt_ids,
    too_long,
    unicode_text,
    validation_message,
)


def create_app(
    service: Service, access: Access | None = None, limits: Limits | None = None
) -> FastAPI:
    """The HTTP API over ``service`` (see the module docstring), open to ``access``, each
    connection within ``limits`` (speculative.serving.connections). The loop must be running."""
    access = access or Access()
    limits = limits or Limits()
    app = FastAPI(title="speculative-llama", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.add_middleware(Bounds, limits=limits)  # middleware added later wraps what was added before
    if access.cors:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(access.cors),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
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
        if error.status_code == 404:
            message = f"no such path: {request.method} {request.url.path}"
        elif error.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(error.detail)
        return error_response(
            error.status_code,
            message,
            code="not_found" if error.status_code == 404 else None,
            headers=getattr(error, "headers", None),
        )

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
            # not on the event loop
            ids = await asyncio.to_thread(encode_dialog, service.tokenizer, turns)
        except ValueError as error:
            raise ApiError(400, str(error), param="messages") from None
        return await answer(Exchange(service, request, ids, body, chat=True, limits=limits))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": service.model,
                    "object": "model",
                    "created": service.created,
                    "owned_by": "speculative-llama",
                    "context_length": service.context,
                    "speculation": {
                        "draft": service.draft,
                        "gamma": service.speculation,
                        "gamma_max": service.gamma_max,
                    },
                }
            ],
        }

    @app.get("/health")
    async def health() -> JSONResponse:
        loop = service.loop
        stalled = loop.stalled
        draining = loop.drain_until is not None
        if not loop.healthy:
            status = "stopped"
        elif draining:
            status = "draining"
        elif stalled is not None:
            status = "stalled"
        else:
            status = "ok"
        ok = status == "ok"
        body = {
            "status": status,
            "model": service.model,
            "running": loop.running,
            "waiting": loop.waiting,
        }
        if not loop.healthy:
            body["error"] = str(loop.failure or "the engine loop is not running")
        elif stalled is not None:
            body["error"] = (
                f"the engine has made no progress for {stalled:.0f} s with requests in hand"
            )
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            prometheus(service.loop, responses=service.responses),
            media_type="text/plain; version=0.0.4; charset=utf-8",
        )

    return app


__all__ = ["create_app"]
