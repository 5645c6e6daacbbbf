"""Who may call the API (serve.py's --api-key, --allowed-hosts, --cors-origin): :class:`Access`,
what serve.py's flags make of it (:func:`access_for`), and :class:`Guard`, the outermost
middleware that refuses a request naming another Host (400) or one to /v1 without a key (401)
before anything else reads it, and tells the rest which key a request came with (:func:`key_of`:
its number, never the key), so that what is kept of one client's requests (the suffix cache,
speculative.draft.responses) is never used for another's."""

from __future__ import annotations

import hmac
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import Headers

from speculative.serving.protocol import error_response


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
    more_keys: tuple[str, ...] = ()  # further keys (--api-key repeated), each a client of its own

    @property
    def keys(self) -> tuple[str, ...]:
        """Every key a request may come with, in the order given (key_of numbers them from 1)."""
        return ((self.api_key,) if self.api_key else ()) + self.more_keys


API_KEY_ENV = "SPECULATIVE_API_KEY"
LOOPBACK = ("127.0.0.1", "::1", "localhost")


def access_for(
    host: str,
    api_key: str | Sequence[str] | None,
    allowed_hosts: str | None,
    cors: Sequence[str],
) -> Access:
    """serve.py's access: the keys (given, one or several, else $SPECULATIVE_API_KEY), the Host
    names (given, comma-separated or *; else the address listened on, with localhost for a loopback
    one; any for 0.0.0.0, whose names are not known here), the CORS origins."""
    given = [api_key] if isinstance(api_key, str) else list(api_key or [])
    keys = list(dict.fromkeys(k for k in given if k))  # repeated ones once, in their order
    if not given:
        keys = [os.environ.get(API_KEY_ENV)] if os.environ.get(API_KEY_ENV) else []
    key = keys[0] if keys else None
    if allowed_hosts == "*" or (not allowed_hosts and host in ("0.0.0.0", "::", "")):
        hosts = None
    elif allowed_hosts:
        hosts = frozenset(h.strip().lower() for h in allowed_hosts.split(",") if h.strip())
    else:
        hosts = frozenset({host.lower(), *(LOOPBACK if host in LOOPBACK else ())})
    return Access(api_key=key, hosts=hosts, cors=tuple(cors), more_keys=tuple(keys[1:]))


def exposure_warning(host: str, access: Access) -> str | None:
    """The warning for a server that others can reach without a key."""
    if host in LOOPBACK or access.keys:
        return None
    return (
        f"warning: listening on {host} without an API key: anyone who can reach this address can use the model "
        f"(--api-key, or ${API_KEY_ENV})"
    )


def host_name(header: str) -> str:
    """The name of a Host header without its port ("[::1]:8000" -> "::1")."""
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


KEY_STATE = "api_key_number"  # where Guard leaves it in the request's scope (request.state)


def key_of(request: Any) -> int | None:
    """The number (1, 2, ... in the order of Access.keys) of the API key ``request`` came with, as
    Guard found it; None on a server without keys."""
    return request.scope.get("state", {}).get(KEY_STATE)


def matching_key(given: str, keys: tuple[str, ...]) -> int | None:
    """The number of the key ``given`` (an Authorization header) names, or None. Every key is
    compared in constant time, whatever matched before: the time says nothing of which did."""
    found = None
    for number, key in enumerate(keys, 1):
        if hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            found = number
    return found


class Guard:
    """ASGI middleware, outermost: a request naming another Host gets 400, one to /v1 without an
    API key 401, before anything else reads it (see Access); the number of a request's key goes
    into its scope (:func:`key_of`)."""

    def __init__(self, app: Any, access: Access) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            access = self.access
            if (
                access.hosts is not None
                and host_name(headers.get("host", "")).lower() not in access.hosts
            ):
                return await error_response(
                    400,
                    f"Host {headers.get('host', '')!r} is not one this server answers "
                    "to (--allowed-hosts)",
                    code="invalid_host",
                )(scope, receive, send)
            keys = access.keys
            if keys and scope["path"].startswith("/v1/"):
                number = matching_key(headers.get("authorization", ""), keys)
                scope.setdefault("state", {})[KEY_STATE] = number
                if number is None:
                    return await error_response(
                        401,
                        "a valid API key is required: Authorization: Bearer KEY",
                        "authentication_error",
                        code="invalid_api_key",
                    )(scope, receive, send)
        await self.app(scope, receive, send)
