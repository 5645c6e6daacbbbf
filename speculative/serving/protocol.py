"""What the OpenAI-compatible API takes and how it refuses (the role of vLLM's protocol.py): the
request bodies of /v1/completions and /v1/chat/completions as pydantic models (strict: an
unknown field is refused, not ignored; docs/serving.md has the table of every field), and
OpenAI's error document, ``{"error": {"message", "type", "param", "code"}}``, in one line."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_TOP_LOGPROBS = 20  # as OpenAI


class ApiError(Exception):
    """An OpenAI-style error response."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code
        self.param = param
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(
            self.status, self.message, self.kind, self.code, self.param, self.headers
        )


def error_response(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {
        "error": {
            "message": message.splitlines()[0] if message else kind,
            "type": kind,
            "param": param,
            "code": code,
        }
    }
    return JSONResponse(body, status_code=status, headers=headers)


# ----------------------------------------------------------------------------- requests
class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class Options(Strict):
    """The fields both endpoints take."""

    model: str
    max_tokens: Annotated[int, Field(ge=0)] | None = (
        None  # 0: only with echo (the prompt scored, nothing made)
    )
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None  # None: OpenAI's default, 1
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=1)] | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = (
        None  # OpenAI's int64; a negative one is folded
    )
    stream: bool | None = False  # null: OpenAI's default, as for every nullable field here
    stream_options: StreamOptions | None = None
    # choices, each its own row and sample; at most validation.MAX_CHOICES and the server's --max-waiting
    n: Annotated[int, Field(ge=1)] | None = 1
    user: str | None = None

    @field_validator("seed")
    @classmethod
    def fold(cls, seed: int | None) -> int | None:
        """OpenAI's seeds are int64; the generators take 0..2^63 - 1: a negative one is folded there."""
        return None if seed is None else seed % 2**63

    # accepted at the value that changes nothing (refused otherwise, validation.py): what clients send by default
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # {} or null
    # OpenAI's fields that change nothing a server without tools or storage makes (as vLLM does):
    # accepted and ignored
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    speculative_gamma: Annotated[int, Field(ge=0)] | None = None
    return_token_ids: bool = False


class CompletionRequest(Options):
    prompt: str | list[str] | list[int]
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = (
        None  # k: each token's and its top k
    )
    echo: bool | None = (
        None  # the prompt before the completion, and its log-probabilities with logprobs
    )


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @property
    def text(self) -> str:
        return (
            self.content
            if isinstance(self.content, str)
            else "".join(part.text for part in self.content)
        )


class ChatRequest(Options):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None


def field_names(model: type[BaseModel]) -> str:
    return ", ".join(sorted(model.model_fields))
