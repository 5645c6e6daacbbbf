"""Serve a pair with an OpenAI-compatible HTTP API: requests that arrive over time share one
engine, and speculation is decided by the load.

    python serve.py                                   # the shipped tiny pair on http://127.0.0.1:8000
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "tiny-target", "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0}'
    python serve.py --speculation off                 # the target alone, batched
    python serve.py --port 0 --max-batch 8            # any free port (printed), at most 8 rows per call

Endpoints: POST /v1/completions and /v1/chat/completions (streamed with "stream": true), GET /v1/models, /health
and /metrics (Prometheus text). Every answer carries usage and the request's speculation figures (drafted,
accepted, alpha, tau). docs/serving.md is the reference.

--speculation load (the default) picks gamma, 0 included, before every iteration from the cost model at the
current batch size, with the live alpha and step costs measured at start-up and while serving; "on" always
drafts --gamma tokens, "off" never drafts. A request can pin its own gamma ("speculative_gamma"): a seeded
request with a pinned gamma gets generate.py's tokens for that gamma and seed whatever the load.

It listens on 127.0.0.1 unless --host says otherwise, with no key unless --api-key is given (repeat it for
several clients: what the server keeps of one client's requests, the suffix cache, is never used for another's).
With --draft suffix, earlier responses are indexed too, per API key, within --suffix-cache-tokens tokens in all
(speculative/draft/responses.py); --plan prints the memory the server would hold, that cache's bound included,
and exits. Exit status: 0 after Ctrl-C or a SIGTERM whose requests all finished within --grace (or a plan that
fits), 1 when the engine failed (or the plan does not fit), 2 for bad input (one ``error: ...`` line), 3 when
SIGTERM's grace cut requests.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

import torch

from model.fast.setup import SETUPS, Setups
from model.scale.memory import (
    DEVICES,
    available_bytes,
    default_context,
    gb,
    kv_bytes_per_position,
    plan,
    plan_suggestion,
)
from speculative import Engine
from speculative.cli import calibration, costs
from speculative.cli import options as cmdline
from speculative.cli.options import (
    DTYPES,
    UsageError,
    add_dtype_flags,
    pick_device,
    pick_dtype,
    rules_help,
)
from speculative.draft.protocol import trait
from speculative.draft.responses import STORE_TOKENS, ResponseStore, bytes_per_node
from speculative.engine import DEFAULT_GAMMA
from speculative.engine.gamma import FixedGamma
from speculative.inputs import GAMMA_MAX
from speculative.serving.loop import EngineLoop, Service
from speculative.serving.policy import LoadGamma
from speculative.serving.threads import ThreadTuner, openmp_threads
from speculative.verify import RULES
from weights import NonFiniteWeightsError, Pair, PairSpec, StepCache
from weights.load import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    load_named_pair,
    named_draft,
    plan_configs,
    read_named_pair,
    stored_dtype,
)
from weights.reading import settle_reading
from weights.step_cache import ENV, default_dir

CALIBRATION_TEXT = "Once upon a time, there was a little girl named Lily. She liked to play"


def build_parser() -> cmdline.ArgumentParser:
    parser = cmdline.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument_group("models").add_argument
    add(
        "--target",
        default=DEFAULT_TARGET,
        help="7b, 70b, 7b-chat, ..., or a folder (default %(default)s)",
    )
    add(
        "--draft",
        default=None,
        help=f"a draft model, a head or lookup (default: the target's own, {DEFAULT_DRAFT})",
    )
    add("--no-draft", action="store_true", help="the target alone: no speculation at all")
    add("--name", default=None, help="the model name clients ask for (default: --target)")
    add(
        "--device",
        default=None,
        help="cpu, cuda or cuda:N (default: cuda when available, else cpu)",
    )
    add_dtype_flags(add)
    add(
        "--quantize",
        choices=["int8", "int4", "file", "none"],
        default=None,
        help="int8 or (a CPU) int4 block weights; file: a 4-bit GGUF's own codes; none: read as floats (default: "
        "a 4-bit GGUF on a CPU as measured faster here, of its codes and float32; else none)",
    )
    add(
        "--no-prepack", action="store_true", help="no float32 weights prepacked for oneDNN on a CPU"
    )
    add(
        "--setup",
        choices=("default", "measure", *SETUPS),
        default="default",
        help="a decode step's set-up",
    )
    add(
        "--compile",
        nargs="?",
        const="auto",
        choices=("auto", "force"),
        default=None,
        help="compiled decode steps, compiled once at start-up",
    )
    add(
        "--cache-dir",
        default=None,
        help=f"compiled steps' cache (default: ${ENV}, else {default_dir()})",
    )
    add("--no-fuse", action="store_true", help="no stacked q/k/v and gate/up products")
    add(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads, fixed (default: up to torch's choice, fewer while they measure faster: another "
        "process on the cores)",
    )
    add = parser.add_argument_group("serving").add_argument
    add("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    add(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1; repeatable, one key per client, whose suffix caches "
        "are kept apart (default: $SPECULATIVE_API_KEY if set, else no key)",
    )
    add(
        "--allowed-hosts",
        default=None,
        help="Host names a request may name, comma-separated, or * for any (default: the address listened on, "
        "and localhost for a loopback one)",
    )
    add(
        "--cors-origin",
        action="append",
        default=[],
        help="a web origin allowed to read answers from a browser, repeatable (default: none, no CORS)",
    )
    add("--port", type=int, default=8000, help="0 picks a free port (default %(default)s)")
    add(
        "--max-batch",
        type=int,
        default=16,
        help="rows per target call at most (default %(default)s)",
    )
    add(
        "-c",
        "--max-model-len",
        type=int,
        default=None,
        help="positions a request may hold, prompt and answer (default: the model's context, at most "
        "4096 and at most what a KV cache of 1 GiB for --max-batch rows holds; printed at start)",
    )
    add(
        "--max-connections",
        type=int,
        default=256,
        help="open connections at most; beyond, 503 at once (default %(default)s)",
    )
    add(
        "--max-waiting",
        type=int,
        default=64,
        help="requests waiting for a row at most; more get 429 with Retry-After (default %(default)s)",
    )
    add(
        "--grace",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds the requests in hand have to finish before they are cut (default %(default)s)",
    )
    for flag, default, text in (
        (
            "--queue-timeout",
            60.0,
            "a request may wait for a row, then 503 with Retry-After (0: no limit)",
        ),
        (
            "--request-timeout",
            600.0,
            "a request may take in all, then 504 and its row is freed (0: no limit)",
        ),
        ("--read-timeout", 10.0, "a client has to send a request's headers, and then its body"),
        (
            "--write-timeout",
            30.0,
            "a write of an answer may wait for the client to read, then it is dropped",
        ),
        (
            "--keepalive",
            15.0,
            "a stream with nothing to send waits before an SSE comment keeps it open",
        ),
    ):
        add(flag, type=float, default=default, help=f"seconds {text} (default %(default)s)")
    add(
        "--stall-after",
        type=float,
        default=60.0,
        help="seconds without an engine step while requests wait or run after which /health answers 503 "
        "(default %(default)s)",
    )
    add(
        "--speculation",
        choices=("load", "on", "off"),
        default="load",
        help="gamma by the cost model at the current load, always --gamma, or never (default %(default)s)",
    )
    add(
        "--gamma",
        type=int,
        default=DEFAULT_GAMMA,
        help="draft length with --speculation on; the largest otherwise (default %(default)s)",
    )
    add(
        "--verify",
        choices=list(RULES),
        default=cmdline.SAMPLED_RULE,
        help=f"{rules_help()} (default %(default)s)",
    )
    add(
        "--generation-config",
        choices=("auto", "none"),
        default="auto",
        help="auto: the target's generation_config.json gives the sampling defaults (temperature, top_k, top_p, "
        "max tokens) of the fields a request leaves out; none: OpenAI's defaults (default %(default)s)",
    )
    add(
        "--suffix-cache-tokens",
        type=int,
        default=STORE_TOKENS,
        help="tokens of earlier responses a drafter that keeps them (--draft suffix) indexes, all API keys "
        "together, the oldest evicted first; each key reads only its own; 0: none (default %(default)s)",
    )
    add("--access-log", action="store_true", help="log every request on stderr")
    add(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress lines at start-up (load:, the cost model's batch sizes); notes and errors stay",
    )
    add(
        "--recalibrate",
        action="store_true",
        help="measure the cost model of --speculation load again, and record it (default: read what an "
        "earlier start on this machine and set-up recorded)",
    )
    add = parser.add_argument_group("plan").add_argument
    add(
        "--plan",
        action="store_true",
        help="print the memory the server would hold (weights, KV caches for --max-batch rows, the suffix "
        "cache's bound) and exit: 0 when it fits, 1 when not; no weights read",
    )
    add(
        "--plan-device",
        default=None,
        help=f"--plan's GPU: {', '.join(DEVICES)} or auto (default: auto, or h200)",
    )
    return parser


def validate(args: argparse.Namespace) -> None:
    for name in ("threads", "max_batch", "gamma"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.gamma > GAMMA_MAX:
        raise UsageError(f"--gamma must be at most {GAMMA_MAX}, got {args.gamma}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise UsageError(f"--max-model-len must be >= 2 positions, got {args.max_model_len}")
    if args.max_connections < 1:
        raise UsageError(f"--max-connections must be >= 1, got {args.max_connections}")
    if not args.grace >= 0:
        raise UsageError(f"--grace must be >= 0 seconds, got {args.grace}")
    for name in (
        "stall_after",
        "read_timeout",
        "write_timeout",
        "keepalive",
        "queue_timeout",
        "request_timeout",
    ):
        least = 1e-9
        if name in ("queue_timeout", "request_timeout"):  # 0: no limit
            least = 0
        if not getattr(args, name) >= least:
            raise UsageError(
                f"--{name.replace('_', '-')} must be {'>= 0' if least == 0 else '> 0'} seconds, got "
                f"{getattr(args, name)}"
            )
    if args.max_waiting < 1:  # every request waits for the loop to take it: 0 would refuse them all
        raise UsageError(
            f"--max-waiting must be >= 1 (a request waits for the engine's loop to take it), got "
            f"{args.max_waiting}"
        )
    if args.suffix_cache_tokens < 0:
        raise UsageError(
            f"--suffix-cache-tokens must be >= 0 (0: none), got {args.suffix_cache_tokens}"
        )
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must lie in 0..65535, got {args.port}")
    if args.compile and args.setup != "default":
        raise UsageError(f"--compile and --setup {args.setup} both choose the set-up: give one")
    if args.compile:
        args.setup = "compiled" if args.compile == "force" else "measure-all"
    if args.setup != "default" and (args.quantize == "int8" or args.no_fuse or args.no_prepack):
        raise UsageError(
            "--setup and --compile choose among the set-ups themselves: drop --quantize, --no-fuse and "
            "--no-prepack, or the set-up flag"
        )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError(
            "serve.py runs in one process: tensor parallelism (torchrun) is not supported"
        )


def suffix_cache_line(tokens: int) -> str:
    """The suffix cache's bound, as --plan and the start-up note say it."""
    if not tokens:
        return "suffix cache across requests: none (--suffix-cache-tokens 0)"
    store = ResponseStore(tokens)
    return (
        f"suffix cache across requests (host memory): at most {tokens} tokens of earlier responses, all API keys together, "
        f"at most {store.most_bytes() / 1e6:.1f} MB (estimated: {store.max_depth} trie nodes a token, "
        f"{bytes_per_node()} bytes a node as measured here); held only by a drafter that keeps earlier "
        "responses (--draft suffix)"
    )


def print_plan(args: argparse.Namespace) -> int:
    """--plan: generate.py's memory plan (model/scale/memory.py, configs only) for --max-batch rows over
    the whole context, and the suffix cache's bound."""
    args.draft = named_draft(args.target, args.draft, args.no_draft)
    target, draft = plan_configs(args.target, args.draft)
    device = args.plan_device or ("auto" if torch.cuda.is_available() else "h200")
    dtype = DTYPES[args.dtype] if args.dtype else torch.bfloat16
    result = plan(
        target,
        draft,
        dtype,
        quantize=args.quantize,
        device_name=device,
        batch=args.max_batch,
        target_name=args.target,
        draft_name=args.draft,
    )
    print(result.render())
    suggestion = plan_suggestion(target, draft, dtype, 1, args.quantize, device)
    if suggestion:
        print(f"  {suggestion}")
    print(suffix_cache_line(args.suffix_cache_tokens))
    return 0 if result.fits else 1


def serving_context(
    args: argparse.Namespace, spec: PairSpec, device: torch.device, dtype: torch.dtype
) -> tuple[int, str]:
    """The positions a row may hold: --max-model-len, else the default that model.scale.memory
    sizes to the KV cache of --max-batch rows; and a note of it with what the cache takes."""
    per_position = kv_bytes_per_position(spec.target_config, dtype, 1, args.max_batch)
    if spec.planned_draft is not None:
        per_position += kv_bytes_per_position(spec.planned_draft, dtype, 1, args.max_batch)
    if args.max_model_len is not None:
        if args.max_model_len > spec.context:
            raise UsageError(
                f"--max-model-len {args.max_model_len} is longer than the model's context, "
                f"{spec.context} positions"
            )
        context, how = args.max_model_len, "--max-model-len"
    else:
        context = default_context(spec.context, per_position, available_bytes(device))
        how = f"the default; --max-model-len up to {spec.context}"
    note = (
        f"context {context} positions a request ({how}): a KV cache of "
        f"{gb(context * per_position)} for {args.max_batch} rows"
    )
    return context, note


def load(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> tuple[Pair, int, Setups, PairSpec]:
    """The pair as generate.py loads it (weights.load.read_named_pair and load_named_pair: the same
    set-up and compile choices, compiled steps kept in the same cache), for batches of up to
    --max-batch rows over the whole context. Returns it, the context, its set-up and what read_pair read."""
    named = read_named_pair(args.target, args.draft, args.gamma, no_draft=args.no_draft)
    args.draft = named.draft  # the default draft, when none was named
    spec = named.spec
    context, args.context_note = serving_context(args, spec, device, dtype)  # printed once loaded
    # The set-up: cached compiled steps for every batch size and width, else stacked and prepacked; or --setup's.
    gamma = "auto" if args.speculation == "load" else args.gamma  # the widths the engine will call
    pair, setups = load_named_pair(
        named,
        device,
        dtype,
        positions=context,
        rows=args.max_batch,
        gamma=gamma,
        gamma_max=args.gamma,
        flag=f"--setup {args.setup}",
        draft_dtype=pick_dtype(args.draft_dtype, device) if args.draft_dtype else None,
        quantize=args.quantize,
        setup=args.setup,
        stack=not args.no_fuse,
        prepack=not args.no_prepack,
        cache_dir=args.cache_dir,
    )
    return pair, context, setups, spec


def start(args: argparse.Namespace, here: bool = False) -> Service:
    """Load the pair, build the engine and its gamma policy (calibrated at start-up for "load"),
    start the engine's thread (or, ``here``, leave its loop to the calling thread), and return
    what the API serves."""

    # a start takes seconds (minutes for a first --compile): say what it is doing, unless --quiet
    def say(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    say(f"load: {args.target} ...")
    began = time.perf_counter()
    device = pick_device(args.device)
    args.quantize, args.dtype, reading = settle_reading(
        args.target, args.quantize, args.dtype, device, args.cache_dir
    )
    dtype = pick_dtype(args.dtype, device, None if args.quantize else stored_dtype(args.target))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    most = torch.get_num_threads()
    pair, context, setups, spec = load(args, device, dtype)
    say(f"load: done in {time.perf_counter() - began:.1f}s")
    for line in setups.lines:
        print(f"setup: {line}", file=sys.stderr)
    defaults = spec.sampling_defaults if args.generation_config == "auto" else {}
    for line in [
        args.context_note,
        *[reading] * bool(reading),
        *spec.notes,
        *setups.notes,
        *[setups.hint] * bool(setups.hint),
        defaults_note(args, defaults),
    ]:
        print(f"note: {line}", file=sys.stderr)
    speculative = pair.draft is not None
    engine = Engine(
        pair.target,
        pair.draft,
        gamma=args.gamma,
        verify=args.verify,
        max_rows=args.max_batch,
        cache_len=context,
    )
    policy = None
    if speculative and args.speculation == "off":
        policy = FixedGamma(0)
    elif speculative and args.speculation == "load":
        policy = LoadGamma(args.gamma, args.max_batch)
        # measured once per machine and set-up, then read (speculative.cli.calibration)
        line = calibration.calibrated(
            policy,
            engine,
            pair.draft,
            pair.tokenizer.encode(CALIBRATION_TEXT),
            StepCache(args.cache_dir),
            costs.chosen_setups(setups),
            fresh=args.recalibrate,
            say=say,
        )
        chosen = ", ".join(f"{b}: {g}" for b, g, _ in policy.table())
        print(
            f"{line}; gamma by batch size now {chosen} (it follows the live alpha and step costs)",
            file=sys.stderr,
        )
    # A drafter that keeps earlier responses (the protocol's joined hook) gets the per-key store.
    responses = None
    if args.suffix_cache_tokens and trait(engine.drafter, "joined") is not None:
        responses = ResponseStore(args.suffix_cache_tokens)
        print(f"note: {suffix_cache_line(args.suffix_cache_tokens)}", file=sys.stderr)
    # Fewer threads when they measure faster (a neighbour on the cores), on a CPU with threads to spare.
    tuner = None
    if args.threads is None and device.type == "cpu":
        tuner = ThreadTuner(
            most, openmp_threads(), log=lambda line: print(line, file=sys.stderr, flush=True)
        )
    loop = EngineLoop(
        engine,
        max_waiting=args.max_waiting,
        policy=policy,
        stall_after=args.stall_after,
        tuner=tuner,
        queue_timeout=args.queue_timeout or None,
        request_timeout=args.request_timeout or None,
    )
    if here:
        loop.here()
    else:
        loop.start()
    mode = args.speculation if speculative else "none"
    return Service(
        loop,
        pair.tokenizer,
        args.name or args.target,
        context,
        args.gamma if speculative else 0,
        mode,
        args.draft if speculative else None,
        stop_ids=frozenset(pair.stop_ids),
        defaults=defaults,
        responses=responses,
    )


def defaults_note(args: argparse.Namespace, defaults: dict[str, Any]) -> str:
    """What a request that leaves the sampling fields out gets (said once at start-up)."""
    if args.generation_config == "none":
        return "sampling defaults: OpenAI's (temperature 1, no top-k or top-p), --generation-config none"
    if not defaults:
        return (
            f"sampling defaults: OpenAI's (temperature 1, no top-k or top-p): {args.target} has no "
            "generation_config.json sampling fields"
        )
    named = ", ".join(f"{key} {value:g}" for key, value in defaults.items())
    return (
        f"sampling defaults from {args.target}'s generation_config.json for the fields a request leaves out: "
        f"{named} (--generation-config none: OpenAI's)"
    )


def run(args: argparse.Namespace) -> int:
    validate(args)
    if args.plan:
        return print_plan(args)
    import uvicorn  # the serve extra: pip install -e ".[serve]"

    from speculative.serving.app import create_app  # FastAPI and pydantic: the serve extra too

    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    # IPPROTO_TCP named, so that asyncio sets TCP_NODELAY on the connections.
    listener = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((args.host, args.port))
    except OSError as err:
        raise UsageError(
            f"cannot listen on {args.host}:{args.port}: {err.strerror or err}"
        ) from None
    service = start(args, here=True)  # the engine runs in this thread, below
    # Bound before the models load (a port in use is said at once), listening only now: a client
    # that comes early is refused at once instead of hanging until the models are ready.
    listener.listen(2048)
    host, port = listener.getsockname()[:2]
    how = f"on, gamma {service.gamma_max}" if service.speculation == "on" else service.speculation
    from speculative.serving.access import access_for, exposure_warning
    from speculative.serving.connections import Limits, header_deadline, http_protocol

    access = access_for(args.host, args.api_key, args.allowed_hosts, args.cors_origin)
    print(
        f"serving {service.model} (draft {service.draft or 'none'}, speculation {how}, at most {args.max_batch} "
        f"rows) on http://{host}:{port} -- {keys_said(len(access.keys))}",
        file=sys.stderr,
        flush=True,
    )
    if (warning := exposure_warning(args.host, access)) is not None:
        print(warning, file=sys.stderr, flush=True)
    # a named rule at T = 0
    if service.draft and args.verify != cmdline.SAMPLED_RULE and RULES[args.verify].greedy:
        print(
            f"note: --verify {args.verify} judges sampled requests; at temperature 0 a request gets "
            f"{RULES[args.verify].at_temperature_0}",
            file=sys.stderr,
            flush=True,
        )
    limits = Limits(
        read_timeout=args.read_timeout, write_timeout=args.write_timeout, keepalive=args.keepalive
    )
    config = uvicorn.Config(
        create_app(service, access, limits),
        log_level="warning",
        access_log=args.access_log,
        lifespan="off",
        timeout_graceful_shutdown=2,
        limit_concurrency=args.max_connections,
        timeout_keep_alive=5,
        http=header_deadline(http_protocol(), args.read_timeout),
    )
    if args.access_log:
        # log_level="warning" keeps uvicorn's own start-up lines quiet, and Config sets every uvicorn
        # logger to it, access lines (logged at INFO) included: lift that one back, and send its
        # lines to stderr with the server's others (uvicorn's own configuration writes them to stdout)
        access_logger = logging.getLogger("uvicorn.access")
        access_logger.setLevel(logging.INFO)
        for handler in access_logger.handlers:
            if isinstance(handler, logging.StreamHandler):
                handler.setStream(sys.stderr)
    server = uvicorn.Server(config)

    def http() -> None:  # uvicorn in a thread of its own; when it stops, so does the engine
        try:
            server.run(sockets=[listener])
        finally:
            service.loop.close()

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    def terminate(
        signum: int, frame: object
    ) -> None:  # a supervisor's stop: finish what is in hand first
        print(
            f"stopping: no new requests; those in hand have {args.grace:g} s to finish",
            file=sys.stderr,
            flush=True,
        )
        service.loop.drain(args.grace)

    # Ctrl-C ends the engine loop in this thread at once, then the server; SIGTERM drains it first.
    # Installed here, not left to Python's default: a process started with SIGINT ignored (a test
    # runner's worker) inherits that, and uvicorn installs its handlers only in the main thread.
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, terminate)
    web = threading.Thread(target=http, name="http", daemon=True)
    web.start()
    try:
        service.loop.run()  # the engine in this thread, the one that loaded the models
    finally:
        server.should_exit = True
        web.join(5)
    if service.loop.failure is not None:  # a supervisor must see a failure, not a clean stop
        print(
            "error: serve.py stops because its engine failed (every request in flight was answered 503)",
            file=sys.stderr,
        )
        return 1
    if service.loop.cut:
        print(
            f"error: the grace period ended with {service.loop.cut} requests unfinished (answered 503)",
            file=sys.stderr,
        )
        return 3
    return 0


def keys_said(count: int) -> str:
    """How the start-up line says the keys."""
    if count == 0:
        return "no authentication"
    if count == 1:
        return "API key required"
    return f"API key required ({count} keys, each with its own suffix cache)"


def main(argv: list[str] | None = None) -> int:
    try:
        return run(build_parser().parse_args(argv))
    except ModuleNotFoundError as err:
        if err.name not in ("fastapi", "uvicorn", "pydantic", "starlette"):
            raise
        print(
            f'error: {err.name} is missing: install the serve extra (pip install -e ".[serve]")',
            file=sys.stderr,
        )
        return 2
    except (
        ValueError,
        NonFiniteWeightsError,
    ) as err:  # UsageError, UnknownCheckpointError, PairMismatchError, ...
        print(f"error: {err}".splitlines()[0], file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
