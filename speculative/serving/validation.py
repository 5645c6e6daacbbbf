"""A request's fields checked against the server before anything is queued: the model's name,
the fields accepted only at the value that changes nothing, max_tokens against the context, the
stop strings, Unicode text, a prompt's token ids; and a body pydantic refused, said in one line
(:func:`validation_message`). Every refusal is an :class:`~speculative.serving.protocol.ApiError`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi.exceptions import RequestValidationError

from speculative.serving.loop import Service
from speculative.serving.protocol import ApiError, Options

MAX_STOP_CHARS = (
    1024  # a stop string's length at most (matching is linear in the text, the table in the stop)
)
MAX_STOPS = 4  # as OpenAI
COMPLETION_MAX_TOKENS = (
    16  # OpenAI's default for /v1/completions; a chat's is what the context leaves
)
MAX_CHOICES = 128  # n at most, as OpenAI; a server's --max-waiting may bound it lower (choices_of)


def validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """The first problem of a request body, in one line, and the field it concerns."""
    first = error.errors()[0]
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(where) or None
    if first.get("type") == "json_invalid":
        return (
            f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}",
            None,
        )
    if first.get("type") == "extra_forbidden":
        return f"unknown or unsupported field {param!r}", param
    if first.get("type") == "missing":
        return f"{param} is required", param
    return f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param


def stops_of(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS:
        raise ApiError(
            400, f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", param="stop"
        )
    if any(not s for s in stops):
        raise ApiError(400, "stop strings must not be empty", param="stop")
    if max(map(len, stops), default=0) > MAX_STOP_CHARS:
        raise ApiError(
            400,
            f"stop strings can be at most {MAX_STOP_CHARS} characters, got one of "
            f"{max(map(len, stops))}",
            param="stop",
        )
    return [unicode_text(s, "stop") for s in stops]


def choices_of(service: Service, body: Options) -> int:
    """The request's n, checked: at most MAX_CHOICES, and at most the server's --max-waiting,
    since a request's n rows are queued together and each counts as a waiting request (more would
    be refused with 429 even by an idle server)."""
    n = body.n or 1
    bound = service.loop.max_waiting
    if MAX_CHOICES <= bound:
        limit, why = MAX_CHOICES, "as OpenAI's"
    else:
        limit, why = bound, "the server's --max-waiting: a request's choices wait for rows together"
    if n > limit:
        raise ApiError(400, f"n can be at most {limit} here ({why}), got {n}", param="n")
    return n


def max_tokens_of(service: Service, body: Options, prompt_tokens: int, chat: bool) -> int:
    """The request's max_tokens, checked against what the context leaves after the prompt."""
    room = service.context - prompt_tokens
    if room < 1:
        raise ApiError(
            400,
            f"the prompt is {prompt_tokens} tokens and {service.model}'s context is {service.context} "
            "tokens: it must hold the prompt and at least one new token",
            code="context_length_exceeded",
            param="messages" if chat else "prompt",
        )
    asked = getattr(body, "max_completion_tokens", None) or body.max_tokens
    if asked is None:
        default = service.defaults.get("max_new_tokens") or (
            None if chat else COMPLETION_MAX_TOKENS
        )
        return room if default is None else min(default, room)
    if asked > room:
        raise ApiError(
            400,
            f"the prompt ({prompt_tokens} tokens) and max_tokens ({asked}) exceed {service.model}'s "
            f"{service.context}-token context: max_tokens can be at most {room} here",
            code="context_length_exceeded",
            param="max_tokens",
        )
    return asked


def check_common(service: Service, body: Options) -> None:
    if body.model != service.model:
        raise ApiError(
            404,
            f"the model {body.model!r} does not exist here; this server serves {service.model!r}",
            code="model_not_found",
            param="model",
        )
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0):
            raise ApiError(
                400,
                f"{name} is not supported (it would change the target's distribution, which "
                "speculation reproduces exactly); only 0 or null",
                param=name,
            )
    if body.logit_bias:
        raise ApiError(
            400,
            "logit_bias is not supported (it would change the target's distribution, which "
            "speculation reproduces exactly); only {} or null",
            param="logit_bias",
        )
    if body.max_tokens == 0 and not getattr(body, "echo", None):
        raise ApiError(
            400,
            "max_tokens must be >= 1 (0 only with echo: true, to score the prompt)",
            param="max_tokens",
        )
    if getattr(body, "top_logprobs", None) and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if body.stream_options is not None and not body.stream:
        raise ApiError(
            400, "stream_options is only allowed with stream: true", param="stream_options"
        )
    chat_max = getattr(body, "max_completion_tokens", None)
    if chat_max is not None and body.max_tokens is not None and chat_max != body.max_tokens:
        raise ApiError(
            400,
            f"max_tokens ({body.max_tokens}) and max_completion_tokens ({chat_max}) differ: give one",
            param="max_completion_tokens",
        )
    choices_of(service, body)
    gamma = body.speculative_gamma
    if gamma is not None and gamma > service.gamma_max:
        limit = (
            "this server has no drafter, so only 0"
            if service.gamma_max == 0
            else f"it must lie in 0..{service.gamma_max} (the server's --gamma)"
        )
        raise ApiError(400, f"speculative_gamma {gamma}: {limit}", param="speculative_gamma")


def unicode_text(text: str, param: str) -> str:
    """``text`` as it came, or 400 when it cannot be UTF-8 (a lone surrogate such as "\\ud800",
    which JSON allows and which the tokenizer would fail on as an internal error)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ApiError(
            400,
            f"{param} is not valid Unicode text ({error.reason} at character {error.start})",
            param=param,
        ) from None
    return text


def too_long(service: Service, texts: Sequence[Any], param: str) -> None:
    """400 before tokenizing when the text cannot fit the context whatever its tokens: a token
    covers at most ``service.longest_piece`` characters, so a text of more characters than that
    many times the context has more tokens than the context holds."""
    chars = sum(len(t) for t in texts if isinstance(t, str))
    if chars > service.context * service.longest_piece:
        raise ApiError(
            400,
            f"the {param} is {chars} characters, more than {service.model}'s context of "
            f"{service.context} tokens can hold",
            code="context_length_exceeded",
            param=param,
        )


def prompt_ids(service: Service, prompt: str | list[str] | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return service.tokenizer.encode(unicode_text(prompt, "prompt"), bos=True)
    if not prompt:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise ApiError(
                400,
                f"one prompt per request, got a list of {len(prompt)} (n asks for several choices "
                "of one prompt)",
                param="prompt",
            )
        return service.tokenizer.encode(unicode_text(prompt[0], "prompt"), bos=True)
    vocab = service.vocab_size
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise ApiError(
            400,
            f"prompt token ids must lie in [0, {vocab}), got {min(prompt)}..{max(prompt)}",
            param="prompt",
        )
    return list(prompt)
