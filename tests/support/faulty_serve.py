"""serve.py with faults planted, for the fault suite (tests/scripts/test_serve_faults.py):

    python -m tests.support.faulty_serve [serve.py's flags]

It is serve.py itself (its main, its flags, its process), with three faults that a request
sets off by holding a marker token id in its prompt (given as token ids):

* ROW_FAULT: the handler of that request's tokens raises, in the engine's step (a fault of
  one row: it must fail that request alone);
* ENGINE_FAULT: the engine's step raises before it begins (a fault of no row: every request in
  flight gets 503, /health says so, and serve.py exits 1);
* STALL: the engine's step hangs for STALL_S seconds, once per such request (a stuck engine:
  /health turns 503, deadlines pass);
* $FAULTY_SERVE_LOAD_GATE: loading the models (serve.start) waits, after one line "gate: loading
  waits" on stderr, until that file exists (at most a minute): a test sees serve.py held in the
  middle of loading for as long as it needs;
* GATE: the engine's step waits until the file named by $FAULTY_SERVE_GATE exists (at most a
  minute): a test holds the engine busy for as long as it needs, whatever the machine's speed,
  and releases it with an event of its own (the file).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import serve
from speculative.engine.engine import Engine
from speculative.serving.loop import EngineLoop

# token ids (the shipped pair has 2048)
ROW_FAULT, ENGINE_FAULT, STALL, GATE = (
    2001,
    2002,
    2003,
    2004,
)
GATE_FILE = "FAULTY_SERVE_GATE"  # the environment variable naming the gate's file
LOAD_GATE_FILE = "FAULTY_SERVE_LOAD_GATE"  # the one naming the file that lets loading go on
STALL_S = 2.5

real_step, real_tokens_out = Engine.step, EngineLoop.tokens_out
stalled: set[int] = set()


def step(self: Engine) -> list:
    rows = [*self.rows, *self.waiting]
    if any(ENGINE_FAULT in row.prompt for row in rows):
        raise RuntimeError("planted: the device failed outside any row")
    for row in rows:
        if STALL in row.prompt and id(row) not in stalled:
            stalled.add(id(row))
            time.sleep(STALL_S)
    if any(GATE in row.prompt for row in self.rows) and os.environ.get(GATE_FILE):
        gate, deadline = Path(os.environ[GATE_FILE]), time.monotonic() + 60
        while not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    return real_step(self)


def tokens_out(self: EngineLoop, ticket, ids: list[int]) -> None:
    if ROW_FAULT in ticket.prompt:
        raise RuntimeError("planted: this request's handler failed")
    real_tokens_out(self, ticket, ids)


real_start = serve.start


def start(args, here: bool = False):
    if os.environ.get(LOAD_GATE_FILE):
        print("gate: loading waits", file=sys.stderr, flush=True)
        gate, deadline = Path(os.environ[LOAD_GATE_FILE]), time.monotonic() + 60
        while not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    return real_start(args, here)


def plant() -> None:
    """The faults in place: only in the server's own process (``python -m tests.support.faulty_serve``).
    A test that imports this module for its marker ids must not get them: under pytest every test
    module is imported by every worker, and a planted step would fail any later test whose prompt
    happens to hold a marker id."""
    Engine.step = step
    EngineLoop.tokens_out = tokens_out
    serve.start = start


if __name__ == "__main__":
    plant()
    sys.exit(serve.main(sys.argv[1:]))
