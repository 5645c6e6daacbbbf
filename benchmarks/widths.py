"""What one call costs by its width, the tokens (or rows) it reads at once: the cost side of
speculative decoding, which assumes that verifying gamma + 1 tokens costs about one decode step.

    python -m benchmarks.widths --subject matmul --dtypes float32 bfloat16 float16 --threads 2
    python -m benchmarks.widths --subject pair --draft tiny-draft-undistilled --widths 1 5
    python -m benchmarks.widths --subject draft --out docs/results/draft_width.md
    python -m benchmarks.widths --subject setups --target SMOLLM2_FOLDER_OR_GGUF --out docs/results/target_setups.md
    python -m benchmarks.widths --subject setups --widths 1 5 --rounds 3      # a smoke run

Subjects:

* ``matmul``: one linear layer, with PyTorch's default matmul and with the weight reordered once
  for oneDNN (model/fast/prepack.py), in microseconds and in one-row calls. A decode step
  multiplies one row, a verification gamma + 1 rows, by the same weights. Shapes: the shipped
  target's MLP (1024 x 384) and a Llama-2-7B projection (4096 x 4096). A dtype oneDNN cannot
  prepack on this CPU (float16 without AVX-512 FP16 or AMX, bfloat16 without native bf16) gets
  "–" in the prepacked columns; int8 and int4 are weight-only with float32 inputs: int8's default
  column dequantizes per call (model.scale.quantize.Int8Linear) and its prepacked column is
  torch's int8 kernel; int4 is torch's packed int4 kernel (Int4Linear, groups of 32).
* ``pair``: the target's call and the draft's, float32, with generate.py's defaults (projections
  stacked by model/fast/fuse.py, large float32 weights prepacked by model/fast/prepack.py) and
  with each turned off: the paper's c, the cost of a draft step relative to a target step (the
  shipped pair was chosen for about 1/10).
* ``draft``: a draft's call against the target's one-token call: the cost side of a parallel
  draft (one call of gamma tokens per iteration, speculative.draft.parallel) against
  token-by-token drafting (gamma calls of one token), and of a larger draft. The drafts are the
  shipped tiny-draft and random LLaMAs of larger shapes (timing only: their weights do not
  matter), stacked and prepacked as generate.py runs them before ``--compile``.
* ``setups``: a target's call under each way it can run: as loaded (``plain``), q/k/v and
  gate/up stacked into one product each (``stacked``), stacked and prepacked (``prepacked``,
  where oneDNN computes the dtype natively), each in float32 and in bfloat16 (another target
  unless the checkpoint is stored in it: docs/compiled.md, "16 bits on a CPU"); with
  ``--compiled GAMMA`` also the compiled steps of a speculative run with the target's default
  drafter, which ``generate.py --target ... --compile --gamma GAMMA`` built into the
  compiled-step cache (``SPECULATIVE_CACHE``), at the widths they were built for (1, 2 and
  GAMMA + 1: model.fast.compile.decode_widths; a call of another width would be padded to the
  next), where they measured faster than the eager set-up.

A network's call (pair, draft, setups) reads w tokens after 100 cached ones, each call at the
next position (64 apart at most); each figure is the median of enough calls for about 0.2 s,
timed together, the lowest over ``--rounds`` rounds taken in turns (the machine's speed drifts,
and a busy moment only ever slows a call). A layer's call (matmul) is the median of many calls,
each timed alone. Prints a markdown table and the machine, and writes them as a page with
``--out``; run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.harness import (
    command_line,
    machine_line,
    markdown_table,
    page_head,
    script_parser,
    time_call,
    turn_order,
    write_page,
)
from model import Llama, ModelConfig
from model.call import CacheCall
from model.fast.compile import decode_widths
from model.fast.fuse import prepare_for_decoding
from model.fast.prepack import PrepackedLinear, prepack_supported
from model.scale.quantize import Int4Linear, Int8Linear, quantize_weight
from speculative.inputs import GAMMA_MAX
from weights import StepCache, load_model, read_pair
from weights.load import default_draft
from weights.sharded import load_model_tp

START = 100  # cache position of the timed calls: a prompt's worth of context before them
MAX_WIDTH = 64
TITLES = {
    "matmul": "One linear layer by its rows, default and prepacked",
    "pair": "The target's and the draft's call by its width, under generate.py's flags",
    "draft": "A draft's call by its width, in target steps",
    "setups": "A target's call by its width, under each set-up",
}
# The options each subject reads besides --subject, --threads and --out, with its defaults; an
# option given to a subject that does not read it is an error, not a silent no-op.
DEFAULTS: dict[str, dict[str, Any]] = {
    "matmul": {"widths": [1, 2, 5, 8], "dtypes": ["float32"]},
    "pair": {"widths": [1], "rounds": 15, "target": "tiny-target", "draft": "tiny-draft"},
    "draft": {"widths": [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13], "rounds": 3, "target": "tiny-target"},
    "setups": {
        "widths": [1, 2, 4, 6, 8, 12, 16, 24],
        "rounds": 5,
        "target": "tiny-target",
        "dtypes": ["float32", "bfloat16"],
        "compiled": None,
    },
}
DTYPES = ["float32", "bfloat16", "float16", "int8", "int4"]
SETUP_DTYPES = ["float32", "bfloat16"]  # the dtypes a whole target is timed in
# generate.py's flags (pair): name -> (stack projections, prepack weights)
FLAGS = {
    "defaults (stacked, prepacked)": (True, True),
    "--no-fuse": (False, True),
    "--no-fuse --no-prepack": (False, False),
}
# the target's set-ups (setups): name -> (stack projections, prepack weights)
SETUPS = {"plain": (False, False), "stacked": (True, False), "prepacked": (True, True)}
# the drafts (draft): name -> (layers, width, hidden width), None for the shipped tiny-draft
SHAPES = {"2 x 128 (tiny-draft)": None, "4 x 256": (4, 256, 768), "6 x 384": (6, 384, 1024)}


# ----------------------------------------------------------------------------- timing
def ms_per_call(model: torch.nn.Module, width: int, calls: int) -> float:
    """Milliseconds per call of ``width`` tokens over ``calls`` calls timed together, each at the
    next position after START (64 apart at most)."""
    tokens = torch.full((1, width), 5)
    step = iter(range(calls))

    def call() -> Any:
        positions = torch.arange(width).unsqueeze(0) + START + next(step) % MAX_WIDTH
        return model(tokens, CacheCall.of(positions))

    return time_call(call, calls, together=True).median * 1e3


def lowest_ms(
    models: dict[str, torch.nn.Module], widths: dict[str, Sequence[int]], rounds: int
) -> dict[tuple[str, int], float]:
    """Every model's call at each of its widths: the lowest over ``rounds`` rounds, taken in
    turns, of ms_per_call over enough calls for about 0.2 s (counted on two one-token calls)."""
    best: dict[tuple[str, int], float] = {}
    with torch.inference_mode():
        calls = {
            key: max(3, int(0.2 / (ms_per_call(model, 1, 2) / 1e3)))
            for key, model in models.items()
        }
        for turn in range(rounds):
            for key in turn_order(list(models), turn):
                for width in widths[key]:
                    ms = ms_per_call(models[key], width, calls[key])
                    best[key, width] = min(ms, best.get((key, width), ms))
            print(f"round {turn + 1} of {rounds}", file=sys.stderr, flush=True)
    return best


def prepared(
    name: str,
    dtype: torch.dtype,
    stack: bool,
    prepack: bool,
    widest: int,
    quantize: str | None = None,
) -> Any:
    """The model ``name`` in ``dtype``, set up for decoding, with a cache for calls up to ``widest``;
    ``quantize="file"``: a 4-bit GGUF's own codes (weights/sharded.py)."""
    if quantize is None:
        model = load_model(name, dtype=dtype).eval()
    else:
        model = load_model_tp(name, dtype=dtype, quantize=quantize).eval()
    prepare_for_decoding(model, stack=stack, prepack=prepack)
    model.setup_cache(1, START + MAX_WIDTH + widest)
    return model


# ----------------------------------------------------------------------------- the subjects
def layers(name: str, weight: torch.Tensor) -> tuple[Any, Any]:
    """The layer of ``weight`` in dtype ``name``, as (PyTorch's default, the prepacked one or None
    where it does not apply). For int8 and int4 the weight-only layers: (the project's layer,
    torch's int8 kernel or None)."""
    if name == "int4":
        return Int4Linear.from_float(weight, 32), None
    if name == "int8":
        q, scale = quantize_weight(weight)

        def int8_kernel(x: torch.Tensor) -> torch.Tensor:
            return torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), q, scale)

        return Int8Linear(q, scale), int8_kernel
    packed = PrepackedLinear(weight) if prepack_supported(weight.dtype) else None
    return partial(F.linear, weight=weight), packed


def layer_us(layer: Any, x: torch.Tensor, calls: int) -> float:
    """Median microseconds of layer(x), after a warm-up of a twentieth as many calls (3 at least)."""
    return time_call(lambda: layer(x), calls, warmup=max(3, calls // 20)).median * 1e6


def matmul(args: argparse.Namespace) -> list[str]:
    widths = sorted(set(args.widths) | {1})
    rows = []
    generator = torch.Generator().manual_seed(0)
    for out_features, in_features, calls in ((1024, 384, 2000), (4096, 4096, 60)):
        for name in args.dtypes:
            dtype = torch.float32 if name in ("int8", "int4") else getattr(torch, name)
            weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
            plain, packed = layers(name, weight)
            one_row: dict[str, float] = {}
            with torch.inference_mode():
                for width in widths:
                    x = torch.randn(1, width, in_features, generator=generator).to(dtype)
                    us = {"default": layer_us(plain, x, calls)}
                    if packed is not None:
                        us["prepacked"] = layer_us(packed, x, calls)
                    one_row = one_row or us
                    cells = [f"{us[k]:.1f}" if k in us else "–" for k in ("default", "prepacked")]
                    ratios = [
                        f"{us[k] / one_row[k]:.2f}" if k in us else "–"
                        for k in ("default", "prepacked")
                    ]
                    rows.append([f"{out_features} x {in_features}", name, width, *cells, *ratios])
    header = ["weight [out x in]", "dtype", "rows", "PyTorch default", "prepacked"]
    header += ["default / one row", "prepacked / one row"]
    return [
        f"{machine_line(args.threads)}; microseconds per call (median)",
        "",
        *markdown_table(header, rows, "llrrrrr"),
    ]


def pair(args: argparse.Namespace) -> list[str]:
    models = {}
    for flags, (stack, prepack) in FLAGS.items():
        for role in ("target", "draft"):
            name = getattr(args, role)
            models[f"{flags}: {role}"] = prepared(
                name, torch.float32, stack, prepack, max(args.widths)
            )
    best = lowest_ms(models, dict.fromkeys(models, args.widths), args.rounds)
    rows = []
    for flags in FLAGS:
        for width in args.widths:
            target = best[f"{flags}: target", width]
            draft = best[f"{flags}: draft", width]
            rows.append([flags, width, f"{target:.3f}", f"{draft:.3f}", f"{target / draft:.1f}"])
    header = ["set-up", "w", "target", "draft", "target / draft"]
    return [
        f"Target `{args.target}`, draft `{args.draft}`; {machine_line(args.threads)}. float32, "
        f"milliseconds per call of w tokens after {START} cached, the lowest of {args.rounds} "
        "rounds' medians:",
        "",
        *markdown_table(header, rows, "lrrrr"),
    ]


def random_draft(shape: tuple[int, int, int], target: Llama) -> Llama:
    """A random LLaMA of ``shape`` (layers, width, hidden width) on the target's vocabulary."""
    n_layers, dim, hidden = shape
    config = ModelConfig(
        vocab_size=target.config.vocab_size + 1,
        dim=dim,
        n_layers=n_layers,
        n_heads=dim // 32,
        n_kv_heads=dim // 64,
        hidden_dim=hidden,
        max_seq_len=target.config.max_seq_len,
        tie_word_embeddings=True,
    )
    model = Llama(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model.eval()


def draft(args: argparse.Namespace) -> list[str]:
    target = load_model(args.target).eval()
    models = {"target": target}
    for name, shape in SHAPES.items():
        if shape is None:
            models[name] = load_model("tiny-draft").eval()
        else:
            models[name] = random_draft(shape, target)
    for model in models.values():
        prepare_for_decoding(model, stack=True, prepack=True)
        model.setup_cache(1, START + MAX_WIDTH + max(args.widths))
    widths = {name: args.widths for name in SHAPES}
    widths["target"] = [1]
    best = lowest_ms(models, widths, args.rounds)
    step = best["target", 1]
    rows = [[name, *(f"{best[name, w] / step:.3f}" for w in args.widths)] for name in SHAPES]
    header = ["draft (layers x width)", *(f"w = {w}" for w in args.widths)]
    return [
        f"Target `{args.target}`; {machine_line(args.threads)}. One draft call of w tokens after "
        f"{START} cached, in target steps (the target's one-token call: {step:.3f} ms); stacked "
        f"and prepacked, the lowest of {args.rounds} rounds' medians:",
        "",
        *markdown_table(header, rows, "l" + "r" * len(args.widths)),
    ]


def compiled_targets(
    args: argparse.Namespace, widest: int
) -> tuple[dict[str, Any], tuple[int, ...]]:
    """The target's compiled steps of ``generate.py --compile --gamma args.compiled``, by dtype,
    from the compiled-step cache; the widths they were built for. A dtype whose steps are not in
    the cache is left out, with a note."""
    built = decode_widths(args.compiled, GAMMA_MAX)
    models = {}
    quantize = getattr(args, "quantize", None)
    for dtype in args.dtypes:
        loaded = read_pair(args.target, default_draft(args.target)).load(
            dtype=getattr(torch, dtype), quantize=quantize, prepare_models=False
        )
        ready, report = loaded.set_up("default", built, widest, store=StepCache())
        if report.choices and report.choices[0][1].chosen == "compiled":
            models[f"compiled, {dtype}" + (f", {quantize}" if quantize else "")] = ready.target
        else:
            print(
                f"no compiled steps in the cache for {dtype}: run generate.py --target "
                f"{args.target} --compile --gamma {args.compiled} --dtype {dtype} first",
                file=sys.stderr,
            )
    return models, built


def setups(args: argparse.Namespace) -> list[str]:
    models = {}
    for dtype in args.dtypes:
        for name, (stack, prepack) in SETUPS.items():
            if prepack and not prepack_supported(getattr(torch, dtype)):
                continue
            models[f"{name}, {dtype}"] = prepared(
                args.target, getattr(torch, dtype), stack, prepack, max(args.widths)
            )
    widths = sorted(set(args.widths) | {1})
    timed = dict.fromkeys(models, widths)
    if args.compiled is not None:
        compiled, built = compiled_targets(args, START + MAX_WIDTH + max(widths))
        models.update(compiled)
        timed.update(dict.fromkeys(compiled, built))  # the widths they were built for only
        widths = sorted(set(widths) | set(built))
    best = lowest_ms(models, timed, args.rounds)
    rows = []
    for key in models:
        cells = [
            f"{best[key, w]:.2f} ({best[key, w] / best[key, 1]:.2f})" if (key, w) in best else "–"
            for w in widths
        ]
        rows.append([key, *cells])
    return [
        f"Target `{args.target}`; {machine_line(args.threads)}. Milliseconds per call of w tokens "
        f"after {START} cached, the lowest of {args.rounds} rounds' medians (in one-token calls of "
        "the same set-up, after it):",
        "",
        *markdown_table(["set-up"] + [f"w = {w}" for w in widths], rows, "l" + "r" * len(widths)),
    ]


SUBJECTS = {"matmul": matmul, "pair": pair, "draft": draft, "setups": setups}


# ----------------------------------------------------------------------------- command line
def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with the subject's defaults filled in; an option the subject does not
    read, or a width outside 1..64, or fewer than one round or thread, is an error."""
    parser = script_parser("widths", __doc__)
    parser.add_argument("--subject", required=True, choices=list(SUBJECTS), help="what to time")
    parser.add_argument(
        "--widths",
        type=int,
        nargs="+",
        help="tokens (rows) per call (default: matmul 1 2 5 8, pair 1, draft 1 to 9 11 13, setups "
        "1 2 4 6 8 12 16 24)",
    )
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)"
    )
    parser.add_argument(
        "--rounds", type=int, help="rounds taken in turns (default: pair 15, draft 3, setups 5)"
    )
    parser.add_argument(
        "--target", help="pair, draft, setups: registry name, folder or GGUF (default tiny-target)"
    )
    parser.add_argument("--draft", help="pair: registry name or path (default tiny-draft)")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=DTYPES,
        help="matmul: weight and input dtypes (default float32); setups: float32 and bfloat16 "
        "only (default both)",
    )
    parser.add_argument(
        "--compiled",
        type=int,
        metavar="GAMMA",
        help="setups: also the compiled steps of generate.py --compile --gamma GAMMA (the "
        "default drafter's run), from the cache",
    )
    parser.add_argument(
        "--out", default="", help="write the table as a page here (default: print only)"
    )
    args = parser.parse_args(argv)
    defaults = DEFAULTS[args.subject]
    for option in ("widths", "rounds", "target", "draft", "dtypes", "compiled"):
        given = getattr(args, option)
        if option not in defaults and given is not None:
            parser.error(f"--subject {args.subject} does not read --{option}")
        if given is None:
            setattr(args, option, defaults.get(option))
    if args.subject == "setups" and not set(args.dtypes) <= set(SETUP_DTYPES):
        parser.error(f"--subject setups times --dtypes {' '.join(SETUP_DTYPES)} only")
    if any(not 1 <= w <= MAX_WIDTH for w in args.widths):
        parser.error(f"--widths must be in 1..{MAX_WIDTH}")
    if args.threads < 1 or (args.rounds is not None and args.rounds < 1):
        parser.error("--rounds and --threads must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    lines = SUBJECTS[args.subject](args)
    print("\n".join(lines))
    if args.out:
        head = page_head(TITLES[args.subject], command_line("widths", argv))
        write_page(args.out, "\n".join(head + lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
