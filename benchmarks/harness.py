"""What every benchmark script shares: timing, set-ups taken in turns, the machine, and the pages.

Every script runs from the repository root as ``python -m benchmarks.NAME`` and imports this
module as ``benchmarks.harness``. It imports nothing heavy itself (torch only inside the
functions that need it), so that a parent process that only starts others, or a start-up
timed from the process's birth, pays nothing for it.

* Timing: one timer of a call, :func:`time_call`: model.fast.timing's, the same with which
  generate.py chooses its set-up (runtime code imports nothing from here, so the timer lives
  there); one :func:`median` of figures; :func:`copy_bandwidth` (a large copy, timed by it),
  :class:`Progress`. No script times a call of its own: those that read a clock for something
  else (a process's start-up, a server's stream, a section's duration) say so where they read
  it. One step of a set-up (compiled.py, startup.py, llama_cpp.py) is timed by
  model.fast.setup.step_ms, the set-up choice's own measurement on that timer, so that a page's
  step time is the one that choice saw.
* Turns: set-ups that take turns, so that a machine whose speed drifts slows them all alike:
  :func:`turn_order`; warm processes, one per checkout, that answer one round at a time
  (:class:`WarmProcess`, :func:`answer_rounds`, :func:`take_turns`), run on another checkout's
  code by :func:`checkout_env`; and the figures of rounds, :func:`per_prompt`.
* The machine: :func:`describe_machine` (CPU model and flags: model.host.describe_cpu,
  cores, torch threads and version, load average), :func:`machine_lines`, :func:`machine_line`.
* A script's command line and its pages: :func:`script_parser`, :func:`command_line`,
  :func:`page_head`, :func:`markdown_table`, :func:`link`, :func:`replace_block`,
  :func:`write_page`, :func:`pyplot`,
  :func:`save_figure`; the pages and images generated live in :data:`RESULTS` (docs/results).
* Set-ups: :func:`network`, :func:`prepare_networks` (the decoding set-up of generate.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent
ROOT = BENCHMARKS.parent
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"  # every page and image a script here generates


# ----------------------------------------------------------------------------- timing
def median(values: Iterable[float], default: Any = None) -> Any:
    """The median, or ``default`` when there is nothing to take it of (a script whose tables show
    a missing figure as nan passes ``NAN``). The only median of benchmarks/."""
    values = list(values)
    return statistics.median(values) if values else default


NAN = float("nan")


def time_call(
    fn: Callable[[], Any],
    repeats: int = 1,
    *,
    warmup: int = 0,
    together: bool = False,
    device: Any = None,
) -> Any:
    """The one timer of a call, model.fast.timing.time_call, which the set-up choice of
    generate.py times with too (its docstring says what the options do): imported when first
    called, as this module imports no package of the checkout at its top (see the module
    docstring). Returns its Timing: ``.seconds``, ``.median``, ``.result``."""
    from model.fast.timing import time_call as timer

    return timer(fn, repeats, warmup=warmup, together=together, device=device)


def copy_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second of a large copy in memory (bytes read + written), median of ``repeats``
    after one untimed copy: what bounds a decode step that reads every weight once."""
    import torch  # deferred: see the module docstring

    src = torch.ones(int(gib * 2**30) // 4)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / time_call(lambda: dst.copy_(src), repeats, warmup=1).median


class Progress:
    """``[done/total] elapsed, about N s left; what`` on one line of stderr, rewritten per step."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.start = time.perf_counter()

    def step(self, what: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.start
        left = elapsed / self.done * (self.total - self.done)
        print(
            f"\r[{self.done}/{self.total}] {elapsed:.0f}s, about {left:.0f}s left; {what}      ",
            end="",
            file=sys.stderr,
            flush=True,
        )

    def end(self) -> None:
        print(file=sys.stderr)


# ----------------------------------------------------------------------------- turns
def turn_order(names: Sequence[Any], turn: int) -> list[Any]:
    """``names`` rotated by ``turn``: each goes first in its turn, so that the machine's drift
    falls on all alike (two names alternate)."""
    k = turn % len(names) if names else 0
    return list(names[k:]) + list(names[:k])


def per_prompt(
    rounds: Sequence[Sequence[float]], pick: Callable[[Iterable[float]], float] = max
) -> float:
    """The median over prompts of ``pick`` over the rounds of each prompt's figure. With ``max``
    (tokens/s): the fastest round per prompt, as a busy machine only ever slows a run down."""
    return median(pick(figures[i] for figures in rounds) for i in range(len(rounds[0])))


@contextmanager
def checkout_env(root: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """A working folder and an environment in which ``python -m benchmarks.NAME`` runs this
    checkout's benchmarks on ``root``'s packages (model, speculative, weights). ``-m`` puts the
    working folder first on the module path, and it holds only a link to this benchmarks/;
    PYTHONPATH names ``root``, which comes before the installed (editable) packages."""
    with tempfile.TemporaryDirectory(prefix="checkout-") as work:
        (Path(work) / "benchmarks").symlink_to(BENCHMARKS, target_is_directory=True)
        yield Path(work), {**os.environ, "PYTHONPATH": str(Path(root).resolve())}


class WarmProcess:
    """A child process that set itself up once (loading and warm-up are not measured) and then
    measures one round each time it is asked: the parent's side of :func:`answer_rounds`."""

    def __init__(self, name: str, command: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=cwd, env=env
        )
        if self.proc.stdout.readline().strip() != "ready":
            self.proc.wait()
            raise SystemExit(
                f"error: the {name} process did not start ({' '.join(command)} in {cwd})"
            )

    def round(self) -> Any:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(
                f"error: the {self.name} process stopped (exit status {self.proc.wait()})"
            )
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()


def answer_rounds(one_round: Callable[[], Any]) -> None:
    """The child's side of :class:`WarmProcess`: ``ready``, then one JSON line of
    ``one_round()`` per ``go`` on stdin (anything else, or the end of stdin, ends it). Nothing
    else may print to stdout meanwhile."""
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        print(json.dumps(one_round()), flush=True)


def take_turns(
    processes: dict[str, WarmProcess],
    rounds: int,
    progress: Callable[[int, dict[str, list[Any]]], None] | None = None,
) -> dict[str, list[Any]]:
    """``rounds`` rounds of every process, one at a time (the others wait on their input) and
    in rotating order; every process's answers, by name."""
    got: dict[str, list[Any]] = {name: [] for name in processes}
    for r in range(rounds):
        for name in turn_order(list(processes), r):
            got[name].append(processes[name].round())
        if progress:
            progress(r, got)
    return got


# ----------------------------------------------------------------------------- the machine
# CPU flags that decide which kernels run (vector width, fused multiply-add, low-precision dot products)
SIMD_FLAGS = ("sse", "ssse3", "avx", "fma", "f16c", "amx", "vnni", "bf16", "fp16")


def load_average() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:  # not on every platform
        return None


def describe_machine(threads: int | Sequence[int] | None = None) -> tuple[dict[str, str], str]:
    """The machine as a page's table shows it (name -> value), and the CPU's whole flag list."""
    import torch  # deferred: see the module docstring

    from model.host import describe_cpu  # deferred: the model package imports torch

    cpu = describe_cpu(lscpu=True)
    ls, flags = cpu.lscpu, cpu.flags
    info = {"host": platform.node(), "CPU": cpu.name + (f" ({cpu.ident})" if cpu.ident else "")}
    if ls.get("Hypervisor vendor"):
        info["virtualisation"] = (
            f"{ls['Hypervisor vendor']} guest ({ls.get('Virtualization type', '?')})"
        )
    info["cores"] = str(os.cpu_count())
    caches = [
        f"{level} {ls[level]}" for level in ("L1d cache", "L2 cache", "L3 cache") if ls.get(level)
    ]
    if caches:
        info["caches"] = "; ".join(caches)
    if flags:
        info["SIMD flags"] = " ".join(
            f for f in flags if f.startswith(SIMD_FLAGS) or f in SIMD_FLAGS
        )
    info["PyTorch CPU kernels"] = torch.backends.cpu.get_cpu_capability()
    if threads is None:
        threads = torch.get_num_threads()
    counts = [threads] if isinstance(threads, int) else list(threads)
    info["torch threads"] = ", ".join(map(str, counts)) + (
        " (each table names its own)" if len(counts) > 1 else ""
    )
    info.update(
        {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "OS": platform.platform(),
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        }
    )
    load = load_average()
    if load is not None:
        info["load average"] = (
            " / ".join(f"{x:.2f}" for x in load) + " (1 / 5 / 15 min, at the end of the run)"
        )
    try:
        import transformers  # optional: only a reference of benchmark.py

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info, " ".join(flags)


def machine_lines(info: dict[str, str], flags: str = "") -> list[str]:
    """A page's machine table, and the whole flag list folded away under it."""
    lines = markdown_table(["machine", ""], info.items())
    if flags:
        lines += ["", "<details><summary>all CPU flags</summary>", "", flags, "", "</details>"]
    return lines


def machine_line(threads: int | None = None) -> str:
    """The machine in one line, for a table printed on stdout."""
    info, _ = describe_machine(threads)
    load = info.get("load average", "?").split(" (")[0]
    return (
        f"{info['CPU']}, {info['cores']} cores, {info['torch threads']} torch threads, torch {info['torch']}, "
        f"load average {load}, {info['date']}"
    )


# ----------------------------------------------------------------------------- pages
def script_parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """A script's parser: its usage as ``python -m benchmarks.NAME``, its docstring as the help."""
    return argparse.ArgumentParser(
        prog=f"python -m benchmarks.{name}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def command_line(name: str, argv: Sequence[str] | None = None) -> str:
    """The command that ran ``benchmarks.NAME`` with ``argv`` (default: this process's), as a page names it."""
    args = sys.argv[1:] if argv is None else list(argv)
    return f"python -m benchmarks.{name} {shlex.join(args)}".rstrip()


def page_head(title: str, command: str) -> list[str]:
    """A generated page's first lines: its title and the exact command that made it."""
    module = " ".join(command.split()[:3])
    return [
        f"# {title}",
        "",
        f"Generated by `{module}`; do not edit by hand. Command:",
        "",
        f"    {command}",
        "",
    ]


def markdown_table(
    header: Sequence[str], rows: Iterable[Sequence[Any]], align: str = ""
) -> list[str]:
    """A markdown table; ``align`` has one letter per column, ``r`` for right-aligned (numbers)."""
    rule = ["---:" if align[i : i + 1] == "r" else "---" for i in range(len(header))]
    return ["| " + " | ".join(map(str, header)) + " |", "|" + "|".join(rule) + "|"] + [
        "| " + " | ".join(map(str, row)) + " |" for row in rows
    ]


def link(page: str | Path, target: str | Path) -> str:
    """``target`` as a relative link from ``page`` (both paths, wherever the page is written)."""
    return Path(os.path.relpath(Path(target).resolve(), Path(page).resolve().parent)).as_posix()


def write_page(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text if text.endswith("\n") else text + "\n")


def pyplot() -> Any:
    """matplotlib's pyplot, drawing to files only."""
    import matplotlib  # optional: the train and test extras have it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path) -> None:
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


# ----------------------------------------------------------------------------- set-ups
def network(drafter: Any) -> Any:
    """The network a drafter runs (a draft model, a feature head), for the decoding set-up; None for a lookup."""
    import torch  # deferred: see the module docstring

    try:  # deferred too: a warm child of before_after.py imports the packages of the checkout it measures
        from speculative.draft.protocol import trait

        networks = [trait(drafter, name) for name in ("model", "head")]
    except ImportError:
        # a checkout from before the protocol's defaults (trait): its drafters' attributes as they are
        networks = [getattr(drafter, name, None) for name in ("model", "head")]
    for net in networks:
        if isinstance(net, torch.nn.Module):
            return net
    return None


def prepare_networks(target: Any, drafters: Iterable[Any] = (), **options: Any) -> tuple[int, int]:
    """generate.py's decoding set-up (projections stacked, float32 CPU weights prepacked; ``options``:
    prepare_for_decoding's ``stack`` and ``prepack``) on the target and every drafter's network:
    the stacked groups and the prepacked layers, counted."""
    try:  # deferred: a warm child of before_after.py imports the packages of the checkout it measures
        from model.fast.fuse import prepare_for_decoding
    except ImportError:  # a checkout from before model/fast (compared by before_after.py)
        from model.fuse import prepare_for_decoding
    networks = [target] + [n for n in map(network, drafters) if n is not None]
    counts = [prepare_for_decoding(n, **options) for n in networks]
    stacked, prepacked = (sum(column) for column in zip(*counts))
    return stacked, prepacked
