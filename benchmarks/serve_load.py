"""A bounded, closed-loop load test of serve.py on 127.0.0.1: speculation always on (gamma 4),
always off, and decided by the load, at 1, 2, 4, 8 and 16 concurrent clients.

    python benchmarks/serve_load.py                              # the shipped pair, 2 threads, greedy
    python benchmarks/serve_load.py --concurrency 1 4 --modes load off --max-tokens 64

For every mode a server is started (``serve.py --speculation MODE --port 0``), warmed up, and
for every concurrency c, c clients each send their share of a fixed number of requests one
after another (closed loop: the next when the previous has ended), streamed, greedy, each
with its own story opening. Per request: the time to the first token (TTFT), the end-to-end
time, and the inter-token latency (ITL) of every token after the first chunk: a chunk of n
tokens that arrives dt after the previous chunk counts n tokens of dt / n each (a speculative
iteration sends its accepted tokens together). Per level: p50 and p99 of those, and the
total tokens/s (all tokens over the level's wall time). From /metrics, before and after each
level: the share of iterations that speculated and the mean batch.

Then the server's own cost: one client, non-streamed requests against generate.py on the same
prompt and settings (gamma 4, and the target alone), medians of --repeats: as a command
(``generate.py --json``'s ``wall_time_s``: the generation call, loading excluded, a fresh
process's first calls included) and as the call it makes, warm (the pair loaded as generate.py
loads it, timed after a first run): the second is the fair measure of what the server adds.

Every request has a timeout (--timeout) and every level a deadline; the counts are fixed.
Writes the figures as JSON (--out) and the plots (--plot-prefix): latency and throughput
against concurrency. docs/serving.md shows a run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from benchmark_prompts import STORY_OPENINGS  # noqa: E402

MODES = ("on", "off", "load")


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


class Server:
    """serve.py in a subprocess, on a free port of 127.0.0.1."""

    def __init__(self, mode: str, args: argparse.Namespace) -> None:
        command = [sys.executable, str(ROOT / "serve.py"), "--port", "0", "--speculation", mode,
                   "--max-batch", str(args.max_batch), "--threads", str(args.threads), "--gamma", str(args.gamma),
                   "--max-waiting", "256"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        deadline = time.monotonic() + args.start_timeout
        while time.monotonic() < deadline:
            line = self.process.stderr.readline()
            if not line:
                break
            self.log.append(line.rstrip())
            if line.startswith("serving "):
                self.url = line.split(" on ")[1].split()[0]
                return
        self.stop()
        raise SystemExit(f"error: serve.py --speculation {mode} did not start: {' | '.join(self.log[-3:])}")

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


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, args: argparse.Namespace) -> dict[str, Any]:
    """One streamed greedy completion: its arrival times and token counts per chunk."""
    body = {"model": "tiny-target", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "stream": True, "return_token_ids": True, "seed": 0}
    chunks: list[tuple[float, int]] = []
    start = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=args.timeout) as response:
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
    return {"ttft": chunks[0][0] - start if chunks else None, "e2e": end - start, "itl": itl,
            "tokens": sum(n for _, n in chunks)}


async def level(url: str, concurrency: int, requests: int, args: argparse.Namespace) -> dict[str, Any]:
    """``requests`` requests from ``concurrency`` closed-loop clients; the level's figures."""
    shares = [requests // concurrency + (i < requests % concurrency) for i in range(concurrency)]
    results: list[dict[str, Any]] = []

    async def client_loop(index: int, client: httpx.AsyncClient) -> None:
        for k in range(shares[index]):
            prompt = STORY_OPENINGS[(index * 7 + k) % len(STORY_OPENINGS)]
            results.append(await one_request(client, url, prompt, args))

    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(limits=limits) as client:
        start = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(client_loop(i, client) for i in range(concurrency))),
                               timeout=args.level_timeout)
        wall = time.perf_counter() - start
    itl = [x for r in results for x in r["itl"]]
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    e2e = [r["e2e"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99), "e2e_p50": percentile(e2e, 50),
            "e2e_p99": percentile(e2e, 99)}


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    server = Server(mode, args)
    try:
        asyncio.run(level(server.url, 1, 2, args))  # warm-up: first calls, allocator, the policy's first updates
        rows = []
        for concurrency in args.concurrency:
            before = server.metrics()
            figures = asyncio.run(level(server.url, concurrency, max(args.requests, 2 * concurrency), args))
            after = server.metrics()
            iterations = after["speculative_iterations_total"] - before["speculative_iterations_total"]
            speculating = after["speculative_speculating_iterations_total"] - \
                before["speculative_speculating_iterations_total"]
            made = after["speculative_generated_tokens_total"] - before["speculative_generated_tokens_total"]
            figures.update(speculation_on=speculating / iterations if iterations else None,
                           iterations=iterations, tokens_per_iteration=made / iterations if iterations else None)
            rows.append(figures)
            print(f"{mode:>4} c={concurrency:<2} {figures['tokens_per_s']:7.1f} tok/s  TTFT p50 "
                  f"{1e3 * figures['ttft_p50']:6.1f} ms  ITL p50 {1e3 * figures['itl_p50']:5.2f} p99 "
                  f"{1e3 * figures['itl_p99']:6.2f} ms  e2e p50 {figures['e2e_p50']:5.2f} s  speculating "
                  f"{figures['speculation_on'] or 0:.2f}", file=sys.stderr, flush=True)
        policy = {k: v for k, v in server.metrics().items() if k.startswith("speculative_policy_gamma")}
        return {"mode": mode, "levels": rows, "startup": server.log, "policy_gamma": policy}
    finally:
        server.stop()


def generate_time(args: argparse.Namespace, prompt: str, extra: list[str]) -> float:
    """generate.py's own time for one prompt, as a command: wall_time_s of its --json (the
    generation call, loading excluded, but a fresh process's first calls included)."""
    command = [sys.executable, str(ROOT / "generate.py"), "--prompt", prompt, "--max-new-tokens",
               str(args.max_tokens), "--threads", str(args.threads), "--json", *extra]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(out.stdout)["stats"]["wall_time_s"]


def warm_generate_times(args: argparse.Namespace, prompt: str, speculative: bool) -> list[float]:
    """The call generate.py makes for that prompt (speculative_generate with gamma 4, or
    autoregressive_generate), on the pair loaded as generate.py loads it, in one process after
    a first run: what a request costs without the server, warm as the server is."""
    import torch

    from speculative import autoregressive_generate, speculative_generate
    from weights import load_pair
    from weights.text import encode_prompt

    torch.set_num_threads(args.threads)
    target, draft, tokenizer = load_pair("tiny-target", "tiny-draft" if speculative else None)
    ids = encode_prompt(tokenizer, prompt)
    times = []
    for _ in range(args.repeats + 1):
        with torch.inference_mode():
            if speculative:
                result = speculative_generate(target, draft, ids, args.max_tokens, gamma=args.gamma, temperature=0,
                                              eos_id=tokenizer.eos_id)
            else:
                result = autoregressive_generate(target, ids, args.max_tokens, temperature=0, eos_id=tokenizer.eos_id)
        times.append(result.stats.wall_time_s)
    return times[1:]


def overhead(mode: str, flags: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """One client, non-streamed, the same prompt: the server's end-to-end time against
    generate.py's, as a command and as its call made warm."""
    prompt = STORY_OPENINGS[0]
    server = Server(mode, args)
    body = {"model": "tiny-target", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
    try:
        with httpx.Client() as client:
            served = []
            for _ in range(args.repeats + 1):  # the first warms up
                start = time.perf_counter()
                answer = client.post(f"{server.url}/v1/completions", json=body, timeout=args.timeout)
                served.append(time.perf_counter() - start)
                answer.raise_for_status()
            tokens = answer.json()["usage"]["completion_tokens"]
    finally:
        server.stop()
    command = [generate_time(args, prompt, flags) for _ in range(args.repeats)]
    warm = warm_generate_times(args, prompt, speculative=mode == "on")
    server_s, command_s, warm_s = statistics.median(served[1:]), statistics.median(command), statistics.median(warm)
    return {"mode": mode, "generate_flags": flags, "tokens": tokens, "server_e2e_s": server_s,
            "generate_command_s": command_s, "generate_warm_s": warm_s, "overhead_vs_warm": server_s / warm_s - 1,
            "overhead_vs_command": server_s / command_s - 1, "server_runs": served[1:], "command_runs": command,
            "warm_runs": warm}


def plot(results: list[dict[str, Any]], prefix: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"on": ("tab:green", "always on (γ 4)"), "off": ("tab:gray", "always off"),
              "load": ("tab:blue", "decided by load")}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for result in results:
        color, label = styles[result["mode"]]
        c = [row["concurrency"] for row in result["levels"]]
        axes[0].plot(c, [1e3 * row["itl_p50"] for row in result["levels"]], "o-", color=color, label=f"{label} p50")
        axes[0].plot(c, [1e3 * row["itl_p99"] for row in result["levels"]], "o--", color=color, alpha=0.5,
                     label=f"{label} p99")
        axes[1].plot(c, [1e3 * row["ttft_p50"] for row in result["levels"]], "o-", color=color, label=f"{label} TTFT")
        axes[1].plot(c, [1e3 * row["e2e_p50"] for row in result["levels"]], "s:", color=color, label=f"{label} e2e")
        axes[2].plot(c, [row["tokens_per_s"] for row in result["levels"]], "o-", color=color, label=label)
    titles = ["inter-token latency (ms)", "TTFT and end-to-end, p50 (ms)", "total tokens/s"]
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8, 16], ["1", "2", "4", "8", "16"])
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[1].set_yscale("log")
    fig.tight_layout()
    path = f"{prefix}.png"
    fig.savefig(path, dpi=110)
    return [path]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--modes", nargs="*", choices=MODES, default=list(MODES))
    parser.add_argument("--requests", type=int, default=8, help="requests per level at least (2 per client at least)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each side of the overhead comparison")
    parser.add_argument("--no-overhead", action="store_true", help="skip the comparison with generate.py")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per request")
    parser.add_argument("--level-timeout", type=float, default=600, help="seconds per level")
    parser.add_argument("--start-timeout", type=float, default=300, help="seconds for a server to start")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    parser.add_argument("--plot-prefix", default=None, help="write PREFIX.png")
    args = parser.parse_args(argv)
    started = time.time()
    load = os.getloadavg()
    results = [run_mode(mode, args) for mode in args.modes]
    costs = [] if args.no_overhead else [overhead("on", ["--gamma", str(args.gamma)], args),
                                         overhead("off", ["--no-draft"], args)]
    for cost in costs:
        print(f"server cost ({cost['mode']}): {cost['server_e2e_s']:.3f} s end to end; generate.py's call warm "
              f"{cost['generate_warm_s']:.3f} s ({100 * cost['overhead_vs_warm']:+.1f}%), as a command "
              f"{cost['generate_command_s']:.3f} s ({100 * cost['overhead_vs_command']:+.1f}%)", file=sys.stderr)
    document = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
                "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                "load_average_before": load, "load_average_after": os.getloadavg(),
                "seconds": time.time() - started, "settings": vars(args), "results": results, "overhead": costs}
    if args.out:
        Path(args.out).write_text(json.dumps(document, indent=1) + "\n")
    if args.plot_prefix:
        print("plots: " + ", ".join(plot(results, args.plot_prefix)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
