"""Against llama.cpp, on this machine, in one run: the shipped pair's decode speed, ours and theirs.

    python -m benchmarks.llama_cpp --bin LLAMA_CPP/build/bin --gguf GGUF_DIR
    python -m benchmarks.llama_cpp --bin ... --gguf ... --rounds 3 --out ''      # print only
    python -m benchmarks.llama_cpp --bin ... --gguf . --target SmolLM2-135M-Instruct.Q4_1.gguf \
        --steps-only f32=smollm2-f32.gguf Q4_1=SmolLM2-135M-Instruct.Q4_1.gguf --out docs/results/llama_cpp_smollm2.md

Optional and for developers only (never in CI): llama.cpp is not a dependency. Build it from
llama-cpp-python's sdist (CPU only, a few minutes on 2 cores)::

    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: && tar xzf llama_cpp_python-0.3.36.tar.gz
    cd llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
    cmake --build build -j2 --target llama-bench llama-completion llama-speculative-simple

and convert the shipped pair with its own converter, in float32 and float16, into GGUF_DIR::

    python convert_hf_to_gguf.py weights/tiny-target --outtype f32 --outfile GGUF_DIR/tiny-target-f32.gguf
    (likewise tiny-target f16, tiny-draft f32 and f16)

What runs, per story opening (the first ``--prompts`` of benchmarks/benchmark_prompts.py), for
``--max-new-tokens`` tokens, greedy and at T = 1 (seed i for prompt i), at ``--threads``:

* ours: ``generate.py --json``, the target alone (``--no-draft``) and with the default draft,
  in three set-ups: eager (an empty compiled-step cache: what a first run gets), the default
  after one ``--compile`` (the cache given by ``--cache-dir``, default the user's; build it
  first with ``python generate.py --compile``), and ``--dtype bfloat16`` after one
  ``--compile`` in bfloat16 (another target, asked for by name: ``python generate.py --dtype
  bfloat16 --compile``). Decode tokens/s as generate.py reports them
  (the prompt's pass excluded);
* llama.cpp: ``llama-completion`` (the target alone) and ``llama-speculative-simple`` (draft
  of the same type, ``--spec-type draft-simple``, ``--spec-draft-n-max`` gamma, every draft
  kept: ``--spec-draft-p-min 0``), f32 and f16; decode tokens/s as they report them
  (eval time over eval runs; "decoded ... speed").

With ``--chat``, a real model instead of the shipped pair (and with ``--transformers HF_FOLDER
--transformers-draft DRAFT_FOLDER`` transformers' assisted generation beside them: a draft model, since it takes
no EAGLE-3 head): ``--target`` (ours: a folder or GGUF, with its
default drafter or ``--draft``) in each of ``--dtypes``, against llama.cpp on each ``--pairs`` file with
the same EAGLE-3 head converted to GGUF (``--draft-gguf``; llama.cpp's converter takes it with
``--target-model-dir``), ``--spec-type draft-eagle3``; the prompts are held-out chat requests
(weights.corpus.chat_requests about TinyStories validation stories, seed 0, as benchmarks.drafters
--chat takes them), in the target's chat template, ``--ignore-eos`` on both sides::

    python convert_hf_to_gguf.py weights/smollm2-eagle3 --target-model-dir SMOLLM2_FOLDER --outtype f32 \
        --outfile GGUF_DIR/smollm2-eagle3-f32.gguf
    python -m benchmarks.llama_cpp --bin ... --chat --target SmolLM2-135M-Instruct.Q4_1.gguf \
        --pairs f32=GGUF_DIR/smollm2-f32.gguf Q4_1=SmolLM2-135M-Instruct.Q4_1.gguf \
        --draft-gguf GGUF_DIR/smollm2-eagle3-f32.gguf --out docs/results/llama_cpp_smollm2_decode.md

Every configuration is a process of its own; the rounds take turns in rotated order so that
the VM's drift falls on all alike; per prompt the fastest round, then the median over the
prompts. Then one step of each: ``llama-bench`` tg (one token) and pp5 (a 5-token batch, what
a gamma = 4 verification costs), and ours from model.fast.setup.step_ms on each set-up.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

from benchmarks.benchmark_prompts import STORY_OPENINGS
from benchmarks.harness import (
    RESULTS,
    ROOT,
    command_line,
    machine_line,
    median,
    page_head,
    script_parser,
    turn_order,
    write_page,
)

TITLE = "Against llama.cpp"
# --chat's requests
VALID = ROOT.parent / "shared" / "data" / "tinystories" / "tinystories_v1_valid_head.txt"

GAMMA = 4


def ours(
    prompt: str, seed: int, temperature: float, draft: bool, setup: tuple[str, str], args: Any
) -> float:
    cache, dtype = setup
    cmd = [
        sys.executable,
        str(ROOT / "generate.py"),
        "--dtype",
        dtype,
        "--prompt",
        prompt,
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--temperature",
        str(temperature),
        "--seed",
        str(seed),
        "--threads",
        str(args.threads),
        "--json",
        "--gamma",
        str(GAMMA),
        "--cache-dir",
        cache,
    ]
    if not draft:
        cmd.append("--no-draft")
    return generate_speed(cmd)


def generate_speed(cmd: list[str]) -> float:
    """Decode tokens/s as generate.py --json reports it (the prompt's pass excluded)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    if proc.returncode:
        raise SystemExit(f"generate.py failed: {proc.stderr.strip().splitlines()[-1:]}")
    return float(json.loads(proc.stdout)["stats"]["tokens_per_second"])


def ours_chat(
    request: str, seed: int, temperature: float, draft: bool, setup: tuple[str, str], args: Any
) -> float:
    """generate.py on a real target: one chat request, every token decoded (--ignore-eos), in ``setup`` (the
    compiled-step cache, an empty one for eager; the dtype)."""
    cache, dtype = setup
    # a dtype, or int4-DTYPE: int4 block weights computing in DTYPE
    quantized, _, compute = dtype.rpartition("-")
    cmd = [
        sys.executable,
        str(ROOT / "generate.py"),
        "--target",
        args.target,
        "--dtype",
        compute,
        "--chat",
        *(["--quantize", quantized] if quantized else []),
        "--prompt",
        request,
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--ignore-eos",
        "--temperature",
        str(temperature),
        "--seed",
        str(seed),
        "--threads",
        str(args.threads),
        "--json",
        "--gamma",
        str(args.gamma),
        "--cache-dir",
        cache,
    ]
    if not draft:
        cmd.append("--no-draft")
    elif args.draft:
        cmd += ["--draft", args.draft]
    return generate_speed(cmd)


def theirs_chat(
    text: str, seed: int, temperature: float, draft: bool, target: str, args: Any
) -> float:
    """llama.cpp on ``target`` (a GGUF), the request rendered in the chat template as ``text`` (its special tokens
    parsed as such); speculative with the EAGLE-3 head of --draft-gguf."""
    return llama_decode(
        args,
        target,
        str(args.draft_gguf) if draft else None,
        "draft-eagle3",
        args.gamma,
        text,
        2048,
        ["--ignore-eos", *sampling(temperature, seed)],
    )


# transformers' assisted generation (Leviathan et al.'s speculative sampling when it samples), timed from the
# first new token to the last as the others report decoding: a streamer sees each chunk of tokens as it comes.
TRANSFORMERS = """
import json, sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
torch.set_num_threads({threads})
target = AutoModelForCausalLM.from_pretrained({target!r}, dtype=torch.float32).eval()
draft = AutoModelForCausalLM.from_pretrained({draft!r}, dtype=torch.float32).eval() if {draft!r} else None
ids = AutoTokenizer.from_pretrained({target!r})({text!r}, add_special_tokens=False, return_tensors="pt").input_ids
if draft is not None:  # gamma drafted every time, as llama.cpp's --spec-draft-p-min 0
    draft.generation_config.num_assistant_tokens = {gamma}
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
class Clock:
    marks = []
    def put(self, value):
        self.marks.append((time.perf_counter(), value.numel()))
    def end(self):
        pass
sample = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if {temperature} else dict(do_sample=False)
torch.manual_seed({seed})
with torch.inference_mode():
    target.generate(ids, max_new_tokens={new}, min_new_tokens={new}, assistant_model=draft, streamer=Clock(),
                    **sample)
(first, _), *rest = Clock.marks[1:]  # [0] is the prompt; from the first new token on
print(json.dumps(sum(n for _, n in rest) / (rest[-1][0] - first)))
"""


def transformers_chat(text: str, seed: int, temperature: float, draft: bool, args: Any) -> float:
    """transformers on --transformers (an HF folder of the same model), alone or assisted by
    --transformers-draft (a draft model of its vocabulary: it cannot run an EAGLE-3 head); decode tokens/s."""
    code = TRANSFORMERS.format(
        threads=args.threads,
        target=str(args.transformers),
        draft=str(args.transformers_draft) if draft else "",
        text=text,
        gamma=args.gamma,
        temperature=temperature,
        seed=seed,
        new=args.max_new_tokens,
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    if proc.returncode:
        raise SystemExit(f"transformers failed: {proc.stderr.strip().splitlines()[-1:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def sampling(temperature: float, seed: int) -> list[str]:
    if temperature == 0:
        return ["--temp", "0"]
    return [
        "--temp",
        str(temperature),
        "--top-k",
        "0",
        "--top-p",
        "1",
        "--min-p",
        "0",
        "--seed",
        str(seed),
    ]


def theirs(prompt: str, seed: int, temperature: float, draft: bool, dtype: str, args: Any) -> float:
    target, draft_file = (
        str(args.gguf / f"tiny-{name}-{dtype}.gguf") for name in ("target", "draft")
    )
    return llama_decode(
        args,
        target,
        draft_file if draft else None,
        "draft-simple",
        GAMMA,
        prompt,
        512,
        sampling(temperature, seed),
    )


def llama_decode(
    args: Any,
    target: str,
    draft_file: str | None,
    spec_type: str,
    gamma: int,
    prompt: str,
    context: int,
    options: list[str],
) -> float:
    """Decode tokens/s as llama.cpp reports them: llama-completion on ``target`` alone, or with ``draft_file``
    llama-speculative-simple (``spec_type``, ``gamma`` drafted, every draft kept); ``options``: the sampling
    flags."""
    cmd = llama_command(args, target, draft_file, spec_type, gamma, prompt, context, options)
    pattern = COMPLETION_SPEED if draft_file is None else SPECULATIVE_SPEED
    proc = run_llama(cmd, pattern)
    # llama-completion prints the prompt's eval line first ("prompt eval time"), then the decode's
    return float(re.findall(pattern, proc.stderr + proc.stdout)[-1])


SPECULATIVE_SPEED = r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+) t/s"
COMPLETION_SPEED = r"eval time =\s+[\d.]+ ms /\s+\d+ runs\s+\(\s*[\d.]+ ms per token,\s+([\d.]+) tokens per second\)"


def llama_command(
    args: Any,
    target: str,
    draft_file: str | None,
    spec_type: str,
    gamma: int,
    prompt: str,
    context: int,
    options: list[str],
) -> list[str]:
    """llama-completion's command line on ``target`` alone (``draft_file`` None), else
    llama-speculative-simple's with ``draft_file`` (``spec_type``, ``gamma`` drafted, every draft kept);
    ``args``: ``bin``, ``max_new_tokens`` and ``threads``."""
    common = [
        "-p",
        prompt,
        "-n",
        str(args.max_new_tokens),
        "-t",
        str(args.threads),
        "-c",
        str(context),
        *options,
    ]
    if draft_file is not None:
        return [
            str(args.bin / "llama-speculative-simple"),
            "-m",
            target,
            "-md",
            draft_file,
            "--spec-type",
            spec_type,
            "--spec-draft-n-max",
            str(gamma),
            "--spec-draft-n-min",
            "0",
            "--spec-draft-p-min",
            "0",
            "-td",
            str(args.threads),
            *common,
        ]
    return [
        str(args.bin / "llama-completion"),
        "-m",
        target,
        "-no-cnv",
        "--no-display-prompt",
        *common,
    ]


def run_llama(cmd: list[str], pattern: str) -> subprocess.CompletedProcess:
    """A llama.cpp tool run to its end, its log holding ``pattern``; SystemExit with its last lines if it
    fails."""
    # now and then the log's last lines are lost at exit (its writer is a thread of its own)
    for _ in range(3):
        # errors="replace": a token may end inside a UTF-8 character, and llama.cpp prints its bytes as they come
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=600,
            stdin=subprocess.DEVNULL,
        )
        found = re.findall(pattern, proc.stderr + proc.stdout)
        if found or proc.returncode:
            break
    if proc.returncode or not found:
        raise SystemExit(
            f"{Path(cmd[0]).name} failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-3:]}"
        )
    return proc


def bench_steps(gguf: Path, args: Any) -> tuple[float, float]:
    """llama-bench on ``gguf``: ms of one token (tg) and of a 5-token batch (pp5), in one process."""
    cmd = [
        str(args.bin / "llama-bench"),
        "-m",
        str(gguf),
        "-t",
        str(args.threads),
        "-p",
        "5",
        "-n",
        "128",
        "-r",
        "10",
        "-o",
        "json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    rows = json.loads(proc.stdout)
    speed = {(r["n_prompt"], r["n_gen"]): r["avg_ts"] for r in rows}
    return 1e3 / speed[0, 128], 5e3 / speed[5, 0]


def our_steps(
    setup: tuple[str, str], threads: int, target: str = "tiny-target"
) -> tuple[float, float]:
    """ms of one target call of 1 and of 5 tokens, in the set-up a default run in ``dtype`` gets from ``cache``
    (a dtype, or QUANTIZE-DTYPE as --dtypes takes it)."""
    cache, dtype = setup
    quantized, _, compute = dtype.rpartition("-")
    quantized = quantized or None
    code = f"""
import json, torch
torch.set_num_threads({threads})
from model.fast.setup import step_ms
from weights import StepCache, read_pair
from model.fast.compile import decode_widths
spec = read_pair({target!r}, "lookup")
pair = spec.load(dtype=getattr(torch, {compute!r}), quantize={quantized!r}, prepare_models=False)
pair, _ = pair.set_up("default", decode_widths({GAMMA}, {GAMMA}), 512, store=StepCache({cache!r}))
pair.target.setup_cache(1, 256)
best = [min(step_ms(pair.target, (w,), False) for _ in range(5)) for w in (1, {GAMMA + 1})]
print(json.dumps(best))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    if proc.returncode:
        raise SystemExit(f"step timing failed: {proc.stderr.strip().splitlines()[-1:]}")
    one, five = json.loads(proc.stdout.strip().splitlines()[-1])
    return one, five


def main(argv: list[str] | None = None) -> int:
    parser = script_parser("llama_cpp", __doc__)
    parser.add_argument("--bin", type=Path, required=True, help="llama.cpp's build/bin")
    parser.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help="the folder of tiny-{target,draft}-{f32,f16}.gguf (the shipped pair's run)",
    )
    parser.add_argument(
        "--cache-dir", default=None, help="our compiled-step cache (default: the user's)"
    )
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--out",
        default=None,
        help="page to write ('' for none; default: the shipped pair's "
        "benchmarks_llama_cpp.md, with --chat llama_cpp_chat.md)",
    )
    parser.add_argument(
        "--steps-only",
        nargs="+",
        metavar="LABEL=GGUF",
        default=None,
        help="only one step and a 5-token call: llama-bench on each file, ours on --target",
    )
    parser.add_argument(
        "--target", default="tiny-target", help="ours, with --steps-only (a folder or a GGUF)"
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="a real model (--target) on held-out chat requests, "
        "against llama.cpp on each --pairs file with --draft-gguf",
    )
    parser.add_argument(
        "--pairs",
        nargs="+",
        metavar="LABEL=GGUF",
        default=[],
        help="with --chat: llama.cpp's targets",
    )
    parser.add_argument(
        "--draft-gguf", type=Path, default=None, help="with --chat: the EAGLE-3 head in GGUF"
    )
    parser.add_argument(
        "--draft", default=None, help="with --chat: ours (default: the target's default drafter)"
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32", "bfloat16"],
        help="ours, each a dtype, int4-DTYPE (generate.py --quantize int4 --dtype DTYPE) or file-DTYPE (a 4-bit "
        "file's own codes, --quantize file), the last two compared with llama.cpp's Q4_1 row",
    )
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="with --chat or --steps-only: ours also after one --compile in each "
        "dtype (the steps of --cache-dir: build them first with generate.py --target ... --compile, "
        "with the drafter and with --no-draft)",
    )
    parser.add_argument(
        "--gamma", type=int, default=3, help="with --chat: the draft length of all (default 3)"
    )
    parser.add_argument(
        "--transformers",
        type=Path,
        default=None,
        help="with --chat: also transformers on this HF "
        "folder of the target (float32), alone and assisted by --transformers-draft",
    )
    parser.add_argument(
        "--transformers-draft",
        type=Path,
        default=None,
        help="with --transformers: a draft model "
        "folder of the target's vocabulary (assisted generation takes no EAGLE-3 head)",
    )
    args = parser.parse_args(argv)
    if args.steps_only:
        return steps_only(args, argv)
    if args.chat:
        if not args.pairs or args.draft_gguf is None:
            parser.error("--chat needs --pairs and --draft-gguf")
        args.out = str(RESULTS / "llama_cpp_chat.md") if args.out is None else args.out
        return chat_decode(args, argv)
    if args.gguf is None:
        parser.error("the shipped pair's run needs --gguf (or give --steps-only or --chat)")
    args.out = str(RESULTS / "benchmarks_llama_cpp.md") if args.out is None else args.out
    from weights.step_cache import default_dir

    cache = args.cache_dir or str(default_dir())
    empty = tempfile.mkdtemp(prefix="llama-cpp-bench-empty-cache-")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    rows = [
        ("this project, eager f32", "ours", (empty, "float32")),
        ("this project, default after --compile (f32)", "ours", (cache, "float32")),
        ("this project, --dtype bfloat16 after --compile", "ours", (cache, "bfloat16")),
        ("llama.cpp f32", "theirs", "f32"),
        ("llama.cpp f16", "theirs", "f16"),
    ]
    cells = [
        (row, draft, temperature)
        for row in rows
        for draft in (False, True)
        for temperature in (0.0, 1.0)
    ]
    prompts = STORY_OPENINGS[: args.prompts]
    seen = in_turns(
        cells,
        len(prompts),
        args.rounds,
        lambda cell, i: (ours if cell[0][1] == "ours" else theirs)(
            prompts[i], i, cell[2], cell[1], cell[0][2], args
        ),
    )
    steps = {
        name: our_steps(setup, args.threads)
        if who == "ours"
        else bench_steps(args.gguf / f"tiny-target-{setup}.gguf", args)
        for name, who, setup in rows
    }

    def speed(cell: Any) -> float:
        return median(max(r) for r in seen[cell])

    def spread(cell: Any) -> str:
        best = sorted(max(r) for r in seen[cell])
        return f"{best[0]:.0f}–{best[-1]:.0f}"

    command = command_line("llama_cpp", argv)
    lines = [
        "llama.cpp built from llama-cpp-python 0.3.36's sources, the pair converted by its "
        f"convert_hf_to_gguf.py (how: the script's docstring); run on {machine_line(args.threads)}.",
        "",
        f"{len(prompts)} story openings, {args.max_new_tokens} new tokens, gamma {GAMMA}, {args.threads} threads, "
        f"{args.rounds} rounds in turns; tokens/s: per prompt the fastest round, median over the prompts "
        "(the range over the prompts after it).",
        "",
        "| | target alone, greedy | target alone, T=1 | speculative, greedy | speculative, T=1 | one step | "
        "5-token verification |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, _, _ in rows:
        one, five = steps[name]
        cols = [
            f"{speed(((name, w, s), d, t)):.0f} ({spread(((name, w, s), d, t))})"
            for (n, w, s) in rows
            if n == name
            for d in (False, True)
            for t in (0.0, 1.0)
        ]
        lines.append(f"| {name} | {' | '.join(cols)} | {one:.2f} ms | {five / one:.2f} steps |")
    best = max(speed(c) for c in cells if c[0][1] == "theirs" and c[2] == 0.0)
    best_t1 = max(speed(c) for c in cells if c[0][1] == "theirs" and c[2] == 1.0)
    default = next(c for c in cells if c[0][0] == rows[1][0] and c[1] and c[2] == 0.0)
    default_t1 = next(c for c in cells if c[0][0] == rows[1][0] and c[1] and c[2] == 1.0)
    lines += [
        "",
        f"The default run (speculative, after one --compile) against the fastest llama.cpp configuration: "
        f"greedy {speed(default) / best:.2f}x ({speed(default):.0f} against {best:.0f} tokens/s), T=1 "
        f"{speed(default_t1) / best_t1:.2f}x ({speed(default_t1):.0f} against {best_t1:.0f}).",
    ]
    print("\n".join(lines))
    if args.out:
        write_page(args.out, "\n".join(page_head(TITLE, command) + lines))
    return 0


def in_turns(
    cells: list[Any], prompts: int, rounds: int, measure: Callable[[Any, int], float]
) -> dict[Any, list]:
    """``measure(cell, i)`` (tokens/s) of every cell ((name, who, setup), speculative, temperature) on every prompt
    i, ``rounds`` times, the cells in turns; per cell and prompt, each round's figure."""
    seen: dict[Any, list[list[float]]] = {cell: [[] for _ in range(prompts)] for cell in cells}
    for turn in range(rounds):
        for cell in turn_order(cells, turn):
            for i in range(prompts):
                seen[cell][i].append(measure(cell, i))
            (name, _, _), draft, temperature = cell
            print(
                f"round {turn + 1}: {name}, {'speculative' if draft else 'target alone'}, T={temperature:g}: "
                f"{median(max(r) for r in seen[cell]):.1f} tokens/s",
                file=sys.stderr,
                flush=True,
            )
    return seen


def chat_requests_for(target: str, count: int) -> list[tuple[str, str]]:
    """The first ``count`` held-out chat requests (benchmarks.drafters --chat's: weights.corpus.chat_prompts of the
    TinyStories validation head, seed 0), each with its text in ``target``'s chat template."""
    from weights import load_tokenizer
    from weights.corpus import chat_requests

    tokenizer = load_tokenizer(target)
    return [
        (r, tokenizer.chat.render([{"role": "user", "content": r}]))
        for r in chat_requests([VALID], count, 0)
    ]


def chat_decode(args: Any, argv: list[str] | None) -> int:
    """--chat: ours in each dtype and llama.cpp on each file, target alone and with the same EAGLE-3 head, greedy and
    at T = 1, in turns; per configuration the median over the prompts of each prompt's fastest round."""
    args.empty_cache = tempfile.mkdtemp(prefix="llama-cpp-bench-empty-cache-")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    prompts = chat_requests_for(args.target, args.prompts)
    from weights.step_cache import default_dir

    compiled = (
        [
            (
                f"this project, {d} (after --compile)",
                "ours",
                (args.cache_dir or str(default_dir()), d),
            )
            for d in args.dtypes
        ]
        if args.compiled
        else []
    )
    rows = (
        [(f"this project, {d} (eager)", "ours", (args.empty_cache, d)) for d in args.dtypes]
        + compiled
        + [
            (f"llama.cpp {label}", "theirs", path)
            for label, path in (p.split("=", 1) for p in args.pairs)
        ]
        + ([("transformers f32", "transformers", None)] if args.transformers else [])
    )
    cells = [
        (row, draft, t)
        for row in rows
        for draft in (False, True)
        for t in (0.0, 1.0)
        if draft is False or row[1] != "transformers" or args.transformers_draft
    ]

    def measure(cell: Any, i: int) -> float:
        (_, who, setup), draft, t = cell
        if who == "transformers":
            return transformers_chat(prompts[i][1], i, t, draft, args)
        return (ours_chat if who == "ours" else theirs_chat)(
            prompts[i][0 if who == "ours" else 1], i, t, draft, setup, args
        )

    seen = in_turns(cells, len(prompts), args.rounds, measure)

    def speed(cell: Any) -> float:
        return median(max(r) for r in seen[cell])

    peer = (
        ""
        if args.transformers is None
        else (
            f"; transformers {version('transformers')} on `{args.transformers.name}` (float32, eager), with assisted "
            f"generation from `{args.transformers_draft or '-'}` (gamma fixed, every "
            "draft kept: confidence threshold 0)"
        )
    )
    lines = [
        f"llama.cpp built from llama-cpp-python 0.3.36's sources; ours on `{Path(args.target).name}` with "
        f"{args.draft or 'its default drafter'}, llama.cpp with `{args.draft_gguf.name}` ("
        f"{'the EAGLE-3 head' if args.draft else 'the same head'}, converted by its convert_hf_to_gguf.py){peer}; "
        f"run on {machine_line(args.threads)}.",
        "",
        f"{len(prompts)} held-out chat requests, {args.max_new_tokens} new tokens (end of sequence ignored), "
        f"gamma {args.gamma}, {args.threads} threads, {args.rounds} rounds in turns; tokens/s: per prompt the "
        "fastest round, median over the prompts; speed-up over the same row's target alone.",
        "",
        "| | target alone, greedy | target alone, T=1 | speculative, greedy | speculative, T=1 |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        alone = {t: speed((row, False, t)) for t in (0.0, 1.0)}
        cols = [f"{alone[t]:.1f}" for t in (0.0, 1.0)] + [
            f"{speed((row, True, t)):.1f} ({speed((row, True, t)) / alone[t]:.2f}x)"
            if (row, True, t) in seen
            else "–"
            for t in (0.0, 1.0)
        ]
        lines.append(f"| {row[0]} | {' | '.join(cols)} |")
    short = {
        "float32": "f32",
        "bfloat16": "bf16",
        "float16": "f16",  # ours' dtypes as llama.cpp's labels name them
        "int4-float32": "Q4_1",
        "int4-bfloat16": "Q4_1",
        "file-float32": "Q4_1",
        "file-bfloat16": "Q4_1",
    }  # groups of 32 codes with a scale and an offset each
    for t in (0.0, 1.0):

        def best(who: str, label: str | None = None, t: float = t) -> float:
            return max(
                speed(c)
                for c in cells
                if c[0][1] == who and c[2] == t and (label is None or c[0][0].startswith(label))
            )

        same = [
            f"{d} {best('ours', f'this project, {d} (') / best('theirs', f'llama.cpp {short[d]}'):.2f}x"
            for d in args.dtypes
            if f"llama.cpp {short.get(d)}" in (r[0] for r in rows)
        ]
        lines += [
            "",
            f"T={t:g}: our fastest configuration against llama.cpp's fastest: "
            f"{best('ours') / best('theirs'):.2f}x ({best('ours'):.1f} against {best('theirs'):.1f} tokens/s)"
            + (
                f"; at the same precision (each side's faster of target alone and speculative): {', '.join(same)}"
                if same
                else ""
            )
            + ".",
        ]
    print("\n".join(lines))
    if args.out:
        write_page(args.out, "\n".join(page_head(TITLE, command_line("llama_cpp", argv)) + lines))
    return 0


def steps_only(args: Any, argv: list[str] | None) -> int:
    """--steps-only: a real model's one-token step and 5-token call, ours in each of --dtypes (its default
    set-up without compiled steps, and with --compiled the one it gets from the compiled-step cache)
    beside llama.cpp's on each GGUF file, in turns, the fastest of --rounds."""
    from weights.step_cache import default_dir

    empty = tempfile.mkdtemp(prefix="llama-cpp-bench-empty-cache-")
    cache = args.cache_dir or str(default_dir())
    ours = [(f"this project, {d} (eager)", (empty, d)) for d in args.dtypes]
    if args.compiled:
        ours += [(f"this project, {d} (after --compile)", (cache, d)) for d in args.dtypes]
    files = [
        (f"llama.cpp {label}", path)
        for label, path in (item.split("=", 1) for item in args.steps_only)
    ]
    rows: dict[str, list[tuple[float, float]]] = {}
    for turn in range(args.rounds):
        for label, where in turn_order([*ours, *files], turn):
            rows.setdefault(label, []).append(
                our_steps(where, args.threads, args.target)
                if isinstance(where, tuple)
                else bench_steps(Path(where), args)
            )
    lines = [
        f"llama.cpp built from llama-cpp-python 0.3.36's sources; ours on `{Path(args.target).name}`; run on "
        f"{machine_line(args.threads)}.",
        "",
        f"{args.threads} threads, {args.rounds} rounds in turns, the "
        "fastest of each (llama-bench: tg128 and pp5, 10 repetitions each; ours: model.fast.setup.step_ms, best "
        "of 5).",
        "",
        "| | one step | tokens/s of one step | 5-token call |",
        "|---|---:|---:|---:|",
    ]
    for label, seen in rows.items():
        one, five = min(s[0] for s in seen), min(s[1] for s in seen)
        lines.append(
            f"| {label} | {one:.2f} ms | {1e3 / one:.1f} | {five:.2f} ms ({five / one:.2f} steps) |"
        )
    print("\n".join(lines))
    if args.out:
        write_page(args.out, "\n".join(page_head(TITLE, command_line("llama_cpp", argv)) + lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
