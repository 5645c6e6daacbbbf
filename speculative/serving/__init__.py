"""The engine behind an HTTP API: the loop that owns the engine in one thread and takes requests
from others (loop.py, entry point :class:`~speculative.serving.loop.EngineLoop`), a server's
gamma by the load (policy.py), the OpenAI-compatible app on it (app.py,
:func:`~speculative.serving.app.create_app`, which is handed a tokenizer and needs the ``serve``
extra) with one module per role (protocol.py, validation.py, streaming.py, access.py,
connections.py), and text in and out of a tokenizer (text.py).
"""

from speculative.serving.loop import EngineLoop, OverloadedError, Service, Ticket

__all__ = ["EngineLoop", "OverloadedError", "Service", "Ticket"]
