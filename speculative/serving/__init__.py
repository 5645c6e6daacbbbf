"""The engine behind an HTTP API: the loop that owns the engine in one thread and takes requests
from others (loop.py, entry point :class:`~speculative.serving.loop.EngineLoop`), the
OpenAI-compatible app on it (app.py, :func:`~speculative.serving.app.create_app`, which is
handed a tokenizer and needs the ``serve`` extra), and text in and out of a tokenizer (text.py).
"""

from speculative.serving.loop import EngineLoop, OverloadedError, Service, Ticket

__all__ = ["EngineLoop", "OverloadedError", "Service", "Ticket"]
