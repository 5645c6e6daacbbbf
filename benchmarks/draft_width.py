"""What one call of a draft costs against a step of the target, by the call's width: the cost
side of a parallel draft (one call of gamma tokens per iteration, speculative.draft.parallel)
against token-by-token drafting (gamma calls of one token), and of a larger parallel draft.

    python -m benchmarks.draft_width --out docs/results/draft_width.md

The target is the shipped one; the drafts are the shipped tiny-draft and random LLaMAs of
larger shapes (timing only: their weights do not matter). Every network in the fixed eager
set-up generate.py takes by default before ``--compile`` (stacked and prepacked). A call of
width w reads w tokens after 64 cached ones; each figure is the median of ``--calls`` calls,
the lowest over ``--rounds`` rounds taken in turns, in target steps (the target's one-token
call in the same round).

Do not run it while anything else loads the machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks.harness import (
    command_line,
    machine_line,
    markdown_table,
    script_parser,
    time_call,
    turn_order,
)
from model import Llama, ModelConfig
from model import call as calls
from model.fast.fuse import prepare_for_decoding
from weights import load_model

SHAPES = {"2 x 128 (tiny-draft)": None, "4 x 256": (4, 256, 768), "6 x 384": (6, 384, 1024)}


def network(name: str, target: Llama) -> Llama:
    if SHAPES[name] is None:
        return load_model("tiny-draft")
    layers, dim, hidden = SHAPES[name]
    config = ModelConfig(
        vocab_size=target.config.vocab_size + 1,
        dim=dim,
        n_layers=layers,
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
    return model


def call_seconds(model: Llama, width: int, calls_n: int) -> float:
    tokens = torch.zeros(1, width, dtype=torch.long)
    call = calls.chain(64, width, "cpu")
    return time_call(lambda: model(tokens, call), calls_n, warmup=3).median


def main(argv: list[str] | None = None) -> int:
    parser = script_parser("draft_width", __doc__)
    parser.add_argument(
        "--widths", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13]
    )
    parser.add_argument("--calls", type=int, default=50, help="calls per median (default 50)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds in turns (default 3)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default=None, help="write the table (markdown) here too")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_model("tiny-target").eval()
    models = {"target": target, **{name: network(name, target).eval() for name in SHAPES}}
    for model in models.values():
        prepare_for_decoding(model, stack=True, prepack=True)
        model.setup_cache(1, 128)
    best: dict[tuple[str, int], float] = {}
    with torch.inference_mode():
        for r in range(args.rounds):
            for name in turn_order(list(models), r):
                for width in [1] if name == "target" else args.widths:
                    seconds = call_seconds(models[name], width, args.calls)
                    best[name, width] = min(best.get((name, width), seconds), seconds)
    step = best["target", 1]
    rows, figures = [], {"target_step_ms": step * 1e3}
    for name in SHAPES:
        ratios = [best[name, w] / step for w in args.widths]
        figures[name] = dict(zip(map(str, args.widths), ratios))
        rows.append([name, *(f"{x:.3f}" for x in ratios)])
    header = ["draft (layers x width)", *(f"w = {w}" for w in args.widths)]
    text = (
        "\n".join(
            [
                f"Command: `{command_line('draft_width', argv)}`",
                "",
                f"Machine: {machine_line(args.threads)}",
                "",
                f"One draft call of w tokens after 64 cached, in target steps (the target's one-token call: "
                f"{step * 1e3:.3f} ms); stacked and prepacked, the lowest of {args.rounds} rounds' medians of "
                f"{args.calls} calls.",
                "",
                *markdown_table(header, rows, "l" + "r" * len(args.widths)),
            ]
        )
        + "\n"
    )
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
