"""A bounded, closed-loop load test of serve.py on 127.0.0.1: speculation always on (gamma 4),
always off, and decided by the load, at 1, 2, 4, 8 and 16 concurrent clients.

    python -m benchmarks.serve_load                              # the shipped pair, greedy
    python -m benchmarks.serve_load --concurrency 1 4 --modes load off --max-tokens 64
    python -m benchmarks.serve_load --repeats 9 --repeats-levels 3 --out docs/results/serving_load.json \\
        --plot-prefix docs/results/serving_load --markdown     # docs/serving.md's run

A server is started for every mode (``serve.py --speculation MODE --port 0``) and warmed up;
for every concurrency c the modes take turns, --repeats-levels times in rotating order (each
keeps its best repeat: a shared machine only ever slows a run), and c clients each send their
share of a fixed number of requests one after another (closed loop: the next when the
previous has ended), streamed, greedy, each with its own story opening.

Per request: the time to the first token (TTFT), the end-to-end time, and the inter-token
latency (ITL) of every token after the first chunk: a chunk of n tokens that arrives dt after
the previous chunk counts n tokens of dt / n each (a speculative iteration sends its accepted
tokens together). Per level: p50 and p99 of those, and the total tokens/s (all tokens over the
level's wall time). From /metrics, before and after each level: the share of iterations that
speculated.

Then the server's own cost: one client, non-streamed requests against the call generate.py
makes on the same prompt and settings (gamma 4, and the target alone), on the pair loaded as
generate.py loads it, warm as the server is, the two in turns, medians of --repeats; and
generate.py as a command, for the record (its ``wall_time_s``: loading excluded, but a fresh
process's first calls included).

Every request has a timeout (--timeout) and every level a deadline; the counts are fixed.
Writes the figures as JSON (--out) and the plots (--plot-prefix): latency and throughput
against concurrency (PREFIX.png). docs/serving.md shows a run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from benchmarks.benchmark_prompts import STORY_OPENINGS
from benchmarks.harness import (
    ROOT,
    command_line,
    load_average,
    median,
    pyplot,
    save_figure,
    script_parser,
    time_call,
    turn_order,
)

MODES = ("on", "off", "load")


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def server_specs(args: argparse.Namespace) -> dict[str, tuple[Path, list[str]]]:
    """Every server to measure by label: its checkout and its serve.py flags. --modes gives one
    per speculation mode; --server LABEL[@CHECKOUT]=FLAGS adds any other (another commit's
    serve.py from its own checkout, say, to compare before and after in one run)."""
    threads = ["--threads", str(args.threads)] if args.threads else []
    specs = {mode: (ROOT, ["--speculation", mode, *threads]) for mode in args.modes}
    for spec in args.server:
        label, _, flags = spec.partition("=")
        label, _, root = label.partition("@")
        specs[label] = (Path(root).resolve() if root else ROOT, shlex.split(flags))
    return specs


class Neighbour:
    """Another process that keeps one core busy (a pure-Python loop), as a sidecar, a gateway
    or a load generator on the same machine would."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", "while True: pass"])

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(10)


class Server:
    """serve.py in a subprocess, on a free port of 127.0.0.1."""

    def __init__(
        self, mode: str, args: argparse.Namespace, root: Path = ROOT, flags: list[str] | None = None
    ) -> None:
        if flags is None:
            flags = ["--speculation", mode]
            if args.threads:
                flags += ["--threads", str(args.threads)]
        command = [
            sys.executable,
            str(root / "serve.py"),
            "--port",
            "0",
            "--max-batch",
            str(args.max_batch),
            "--gamma",
            str(args.gamma),
            "--max-waiting",
            "256",
            *flags,
        ]
        env = {**os.environ, "PYTHONPATH": str(root)}
        self.process = subprocess.Popen(
            command, cwd=root, env=env, stderr=subprocess.PIPE, text=True
        )
        self.log: list[str] = []
        deadline = time.monotonic() + args.start_timeout
        while time.monotonic() < deadline:
            line = self.process.stderr.readline()
            if not line:
                break
            self.log.append(line.rstrip())
            if line.startswith("serving "):
                self.url = line.split(" on ")[1].split()[0]
                self.model = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0][
                    "id"
                ]  # its name
                return
        self.stop()
        raise SystemExit(
            f"error: serve.py --speculation {mode} did not start: {' | '.join(self.log[-3:])}"
        )

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    prompt: str,
    args: argparse.Namespace,
    model: str = "tiny-target",
) -> dict[str, Any]:
    """One streamed greedy completion: its arrival times and token counts per chunk."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "return_token_ids": True,
        "seed": 0,
    }
    chunks: list[tuple[float, int]] = []
    # The client's clock at each chunk's arrival, not a call's duration (harness.time_call times those)
    start = time.perf_counter()
    async with client.stream(
        "POST", f"{url}/v1/completions", json=body, timeout=args.timeout
    ) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            document = json.loads(line[6:])
            count = sum(len(choice.get("token_ids", [])) for choice in document.get("choices", []))
            if count:
                chunks.append((time.perf_counter(), count))
    end = time.perf_counter()
    itl = [(t - before) / n for (before, _), (t, n) in zip(chunks, chunks[1:]) for _ in range(n)]
    return {
        "ttft": chunks[0][0] - start if chunks else None,
        "e2e": end - start,
        "itl": itl,
        "tokens": sum(n for _, n in chunks),
    }


async def level(
    url: str, concurrency: int, requests: int, args: argparse.Namespace, model: str = "tiny-target"
) -> dict[str, Any]:
    """``requests`` requests from ``concurrency`` closed-loop clients; the level's figures."""
    shares = [requests // concurrency + (i < requests % concurrency) for i in range(concurrency)]
    results: list[dict[str, Any]] = []

    async def client_loop(index: int, client: httpx.AsyncClient) -> None:
        for k in range(shares[index]):
            prompt = STORY_OPENINGS[(index * 7 + k) % len(STORY_OPENINGS)]
            results.append(await one_request(client, url, prompt, args, model))

    limits = httpx.Limits(
        max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2
    )
    async with httpx.AsyncClient(limits=limits) as client:
        # the level's wall time, every client at once (awaited: not a call)
        start = time.perf_counter()
        await asyncio.wait_for(
            asyncio.gather(*(client_loop(i, client) for i in range(concurrency))),
            timeout=args.level_timeout,
        )
        wall = time.perf_counter() - start
    itl = [x for r in results for x in r["itl"]]
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    e2e = [r["e2e"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "itl_p50": percentile(itl, 50),
        "itl_p99": percentile(itl, 99),
        "e2e_p50": percentile(e2e, 50),
        "e2e_p99": percentile(e2e, 99),
    }


def measured_level(server: Server, concurrency: int, args: argparse.Namespace) -> dict[str, Any]:
    """One level against one server, with the share of its iterations that speculated (/metrics)."""
    before = server.metrics()
    figures = asyncio.run(
        level(server.url, concurrency, max(args.requests, 2 * concurrency), args, server.model)
    )
    after = server.metrics()
    iterations = after["speculative_iterations_total"] - before["speculative_iterations_total"]
    speculating = (
        after["speculative_speculating_iterations_total"]
        - before["speculative_speculating_iterations_total"]
    )
    made = (
        after["speculative_generated_tokens_total"] - before["speculative_generated_tokens_total"]
    )
    figures.update(
        speculation_on=speculating / iterations if iterations else None,
        iterations=iterations,
        tokens_per_iteration=made / iterations if iterations else None,
    )
    return figures


def run_modes(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every mode's server at once (idle ones cost nothing), every level run for each mode in
    turns, --repeats-levels times in rotating order: a slow moment of a shared machine falls on
    every mode alike, and each mode keeps its best repeat (load only ever slows a run)."""
    servers = {
        label: Server(label, args, root, flags)
        for label, (root, flags) in server_specs(args).items()
    }
    neighbour = None
    try:
        for (
            server
        ) in servers.values():  # warm-up: first calls, the allocator, the policy's first updates
            asyncio.run(level(server.url, 1, 2, args, server.model))
        # after start-up: the servers calibrated alone, and meet it while serving
        if args.neighbour:
            neighbour = Neighbour()
        runs: dict[str, list[list[dict[str, Any]]]] = {mode: [] for mode in servers}
        for concurrency in args.concurrency:
            for repeat in range(args.repeats_levels):
                for mode in turn_order(list(servers), repeat):
                    figures = measured_level(servers[mode], concurrency, args)
                    runs[mode].append([figures]) if repeat == 0 else runs[mode][-1].append(figures)
                    print(
                        f"{mode:>8} c={concurrency:<2} {figures['tokens_per_s']:7.1f} tok/s  TTFT p50 "
                        f"{1e3 * figures['ttft_p50']:6.1f} ms  ITL p50 {1e3 * figures['itl_p50']:5.2f} p99 "
                        f"{1e3 * figures['itl_p99']:6.2f} ms  e2e p50 {figures['e2e_p50']:5.2f} s  speculating "
                        f"{figures['speculation_on'] or 0:.2f}",
                        file=sys.stderr,
                        flush=True,
                    )
        results = []
        for mode, server in servers.items():
            best = [max(repeats, key=lambda f: f["tokens_per_s"]) for repeats in runs[mode]]
            policy = {
                k: v
                for k, v in server.metrics().items()
                if k.startswith("speculative_policy_gamma")
            }
            results.append(
                {
                    "mode": mode,
                    "levels": best,
                    "repeats": runs[mode],
                    "startup": server.log,
                    "policy_gamma": policy,
                }
            )
        return results
    finally:
        if neighbour is not None:
            neighbour.stop()
        for server in servers.values():
            server.stop()


def generate_time(args: argparse.Namespace, prompt: str, extra: list[str]) -> float:
    """generate.py's own time for one prompt, as a command: wall_time_s of its --json (the
    generation call, loading excluded, but a fresh process's first calls included)."""
    command = [
        sys.executable,
        str(ROOT / "generate.py"),
        "--prompt",
        prompt,
        "--max-new-tokens",
        str(args.max_tokens),
        *(["--threads", str(args.threads)] if args.threads else []),
        "--json",
        *extra,
    ]
    out = subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=args.timeout,
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return json.loads(out.stdout)["stats"]["wall_time_s"]


def warm_call(args: argparse.Namespace, prompt: str, speculative: bool) -> Any:
    """The call generate.py makes for that prompt (speculative_generate with gamma 4, or
    autoregressive_generate), on the pair loaded as generate.py loads it, in this process: a
    function that runs it once, in this thread or (``thread=True``) in another as the server's
    engine runs, and returns its wall_time_s. (On a CPU that other processes keep busy, 2 torch
    threads have run 3-5 times slower from the main thread than from another one.)"""
    import torch  # deferred: the load client itself never loads torch or a model

    from speculative import autoregressive_generate, speculative_generate
    from speculative.serving.text import encode_prompt
    from weights import load_pair

    if args.threads:
        torch.set_num_threads(args.threads)
    target, draft, tokenizer = load_pair("tiny-target", "tiny-draft" if speculative else None)
    ids = encode_prompt(tokenizer, prompt)

    def once() -> float:
        with torch.inference_mode():
            if speculative:
                result = speculative_generate(
                    target,
                    draft,
                    ids,
                    args.max_tokens,
                    gamma=args.gamma,
                    temperature=0,
                    eos_id=tokenizer.eos_id,
                )
            else:
                result = autoregressive_generate(
                    target, ids, args.max_tokens, temperature=0, eos_id=tokenizer.eos_id
                )
        return result.stats.wall_time_s

    def run(thread: bool = False) -> float:
        if not thread:
            return once()
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(once).result()

    return run


def overhead(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One client, non-streamed, the same prompt: the server's end-to-end time against the call
    generate.py makes, warm, in turns (server, call, server, call, ...), for gamma 4 and for the
    target alone; and generate.py as a command, for the record."""
    prompt = STORY_OPENINGS[0]
    body = {
        "model": "tiny-target",
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "temperature": 0,
    }
    out = []
    for mode, flags in (("on", ["--gamma", str(args.gamma)]), ("off", ["--no-draft"])):
        server = Server(mode, args)
        try:
            served, warm, warm_thread = [], [], []
            call = warm_call(args, prompt, speculative=mode == "on")
            with httpx.Client() as client:
                for _ in range(args.repeats + 1):  # the first of each warms up
                    timing = time_call(
                        lambda url=f"{server.url}/v1/completions": client.post(
                            url, json=body, timeout=args.timeout
                        )
                    )
                    answer = timing.result
                    answer.raise_for_status()
                    served.append(timing.median)
                    warm.append(call())
                    warm_thread.append(call(thread=True))
            tokens = answer.json()["usage"]["completion_tokens"]
        finally:
            server.stop()
        command = [generate_time(args, prompt, flags) for _ in range(2)]
        server_s, warm_s, thread_s = median(served[1:]), median(warm[1:]), median(warm_thread[1:])
        best_server, best_warm = min(served[1:]), min(warm[1:])
        out.append(
            {
                "mode": mode,
                "generate_flags": flags,
                "tokens": tokens,
                "server_e2e_s": server_s,
                "generate_warm_s": warm_s,
                "overhead_vs_warm": server_s / warm_s - 1,
                "generate_warm_thread_s": thread_s,
                "overhead_vs_warm_thread": server_s / thread_s - 1,
                "best_server_e2e_s": best_server,
                "best_generate_warm_s": best_warm,
                "best_overhead_vs_warm": best_server / best_warm - 1,
                "generate_command_s": min(command),
                "server_runs": served[1:],
                "warm_runs": warm[1:],
                "warm_thread_runs": warm_thread[1:],
                "command_runs": command,
            }
        )
    return out


def plot(results: list[dict[str, Any]], prefix: str) -> list[str]:
    plt = pyplot()
    styles = {
        "on": ("tab:green", "always on (γ 4)"),
        "off": ("tab:gray", "always off"),
        "load": ("tab:blue", "decided by load"),
    }
    others = iter(["tab:orange", "tab:red", "tab:purple", "tab:brown", "tab:olive", "tab:cyan"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for result in results:
        color, label = styles.get(result["mode"]) or (next(others, "black"), result["mode"])
        c = [row["concurrency"] for row in result["levels"]]
        axes[0].plot(
            c,
            [1e3 * row["itl_p50"] for row in result["levels"]],
            "o-",
            color=color,
            label=f"{label} p50",
        )
        axes[0].plot(
            c,
            [1e3 * row["itl_p99"] for row in result["levels"]],
            "o--",
            color=color,
            alpha=0.5,
            label=f"{label} p99",
        )
        axes[1].plot(
            c,
            [1e3 * row["ttft_p50"] for row in result["levels"]],
            "o-",
            color=color,
            label=f"{label} TTFT",
        )
        axes[1].plot(
            c,
            [1e3 * row["e2e_p50"] for row in result["levels"]],
            "s:",
            color=color,
            label=f"{label} e2e",
        )
        axes[2].plot(
            c, [row["tokens_per_s"] for row in result["levels"]], "o-", color=color, label=label
        )
    titles = ["inter-token latency (ms)", "TTFT and end-to-end, p50 (ms)", "total tokens/s"]
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8, 16], ["1", "2", "4", "8", "16"])
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[1].set_yscale("log")
    path = f"{prefix}.png"
    save_figure(fig, path)
    return [path]


def repeats_of(document: dict[str, Any], mode: str, concurrency: int) -> list[dict[str, Any]]:
    """Every repeat of one server's level (the tables show the best; the medians beside them)."""
    result = next(r for r in document["results"] if r["mode"] == mode)
    return next(
        repeats for repeats in result["repeats"] if repeats[0]["concurrency"] == concurrency
    )


def markdown(document: dict[str, Any]) -> str:
    """The run as the tables of docs/serving.md: every mode by concurrency, then the goals."""
    by_mode = {
        result["mode"]: {row["concurrency"]: row for row in result["levels"]}
        for result in document["results"]
    }
    lines = []
    for mode, rows in by_mode.items():
        lines += [
            f"**{mode}**",
            "",
            "| clients | tokens/s | TTFT p50 | ITL p50 | ITL p99 | end to end p50 | p99 | "
            "iterations speculating |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for c, row in rows.items():
            share = "" if row["speculation_on"] is None else f"{100 * row['speculation_on']:.0f}%"
            lines.append(
                f"| {c} | {row['tokens_per_s']:.0f} | {1e3 * row['ttft_p50']:.0f} ms | "
                f"{1e3 * row['itl_p50']:.2f} ms | {1e3 * row['itl_p99']:.1f} ms | {row['e2e_p50']:.2f} s | "
                f"{row['e2e_p99']:.2f} s | {share} |"
            )
        lines.append("")
    if {"on", "off", "load"} <= set(by_mode):
        lines += [
            "| clients | ITL p50, load / off | tokens/s, load / best of on and off |",
            "|---:|---:|---:|",
        ]
        for c in by_mode["load"]:
            load, on, off = by_mode["load"][c], by_mode["on"][c], by_mode["off"][c]
            best = max(on["tokens_per_s"], off["tokens_per_s"])
            lines.append(
                f"| {c} | {load['itl_p50'] / off['itl_p50']:.3f} (1/{off['itl_p50'] / load['itl_p50']:.2f}) | "
                f"{load['tokens_per_s'] / best:.3f} |"
            )
        lines.append("")
    labels = list(by_mode)
    # servers compared: tokens/s side by side
    if len(labels) > 1 and not {"on", "off", "load"} <= set(labels):
        lines += [
            "| clients | "
            + " | ".join(f"{label} tokens/s" for label in labels)
            + " | "
            + " | ".join(f"{label} / {labels[0]}" for label in labels[1:])
            + " |",
            "|---:|" + "---:|" * (2 * len(labels) - 1),
        ]
        for c in by_mode[labels[0]]:
            rates = [by_mode[label][c]["tokens_per_s"] for label in labels]
            medians = [
                median([r["tokens_per_s"] for r in repeats_of(document, label, c)])
                for label in labels
            ]
            lines.append(
                f"| {c} | "
                + " | ".join(f"{rate:.0f} (median {m:.0f})" for rate, m in zip(rates, medians))
                + " | "
                + " | ".join(
                    f"{rate / rates[0]:.3f} (median {m / medians[0]:.3f})"
                    for rate, m in zip(rates[1:], medians[1:])
                )
                + " |"
            )
        lines.append("")
    for cost in document.get("overhead", []):
        lines.append(
            f"- {cost['mode']}: server {1e3 * cost['server_e2e_s']:.0f} ms end to end, generate.py's call "
            f"{1e3 * cost['generate_warm_s']:.0f} ms ({100 * cost['overhead_vs_warm']:+.1f}%), from another "
            f"thread {1e3 * cost['generate_warm_thread_s']:.0f} ms "
            f"({100 * cost['overhead_vs_warm_thread']:+.1f}%), {cost['tokens']} tokens"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = script_parser("serve_load", __doc__)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--modes", nargs="*", choices=MODES, default=list(MODES))
    parser.add_argument(
        "--requests",
        type=int,
        default=8,
        help="requests per level at least (2 per client at least)",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="the --modes servers' --threads (default 0: none given, serve.py's own choice)",
    )
    parser.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="LABEL[@CHECKOUT]=FLAGS",
        help="another server to measure: serve.py FLAGS, from CHECKOUT's serve.py if given",
    )
    parser.add_argument(
        "--neighbour",
        action="store_true",
        help="a process keeping one core busy runs beside the servers while they are measured",
    )
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument(
        "--repeats", type=int, default=7, help="runs of each side of the overhead comparison"
    )
    parser.add_argument(
        "--repeats-levels", type=int, default=2, help="runs of every level for every mode"
    )
    parser.add_argument(
        "--no-overhead", action="store_true", help="skip the comparison with generate.py"
    )
    parser.add_argument("--timeout", type=float, default=120, help="seconds per request")
    parser.add_argument("--level-timeout", type=float, default=600, help="seconds per level")
    parser.add_argument(
        "--start-timeout", type=float, default=300, help="seconds for a server to start"
    )
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    parser.add_argument("--plot-prefix", default=None, help="write PREFIX.png")
    parser.add_argument(
        "--markdown", action="store_true", help="print the tables of docs/serving.md on stdout"
    )
    parser.add_argument(
        "--from-json", default=None, help="print the tables of a run written by --out"
    )
    args = parser.parse_args(argv)
    if args.from_json:
        print(markdown(json.loads(Path(args.from_json).read_text())), end="")
        return 0
    started = time.time()  # the run's duration, for the record
    load = load_average()
    results = run_modes(args) if args.modes or args.server else []
    costs = [] if args.no_overhead else overhead(args)
    for cost in costs:
        print(
            f"server cost ({cost['mode']}): {cost['server_e2e_s']:.3f} s end to end against generate.py's call, "
            f"warm, {cost['generate_warm_s']:.3f} s: {100 * cost['overhead_vs_warm']:+.1f}% (medians; best of "
            f"each {100 * cost['best_overhead_vs_warm']:+.1f}%; the call from another thread "
            f"{cost['generate_warm_thread_s']:.3f} s: {100 * cost['overhead_vs_warm_thread']:+.1f}%); generate.py "
            f"as a command {cost['generate_command_s']:.3f} s",
            file=sys.stderr,
        )
    document = {
        "command": command_line("serve_load", argv),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_before": load,
        "load_average_after": load_average(),
        "seconds": time.time() - started,
        "settings": vars(args),
        "results": results,
        "overhead": costs,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(document, indent=1) + "\n")
    if args.plot_prefix:
        print("plots: " + ", ".join(plot(results, args.plot_prefix)), file=sys.stderr)
    if args.markdown:
        print(markdown(document), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
