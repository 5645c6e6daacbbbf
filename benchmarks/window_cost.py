"""What attending over unused cache slots costs: the measurement behind one build for every run.

    python -m benchmarks.window_cost                      # the shipped target, and one 7B-shaped layer
    python -m benchmarks.window_cost --skip-7b --rounds 3

A compiled step needs static shapes, and the KV cache is one of them. Three ways to serve every
run length from one build (docs/compiled.md): one static cache at the model's whole context
(every step attends over every slot, used or not), a set of length classes built together (a
build each), or a package whose cache length and window are dynamic (model/fast/aot.py: a step
attends over the slots its call can see). This script measures the first against the third:

1. **The shipped target** (tiny-target, float32, stacked), as packages of the one-token and the
   verification (5-token) step: static at a 64-slot cache, static at the whole 512-slot context,
   and dynamic, timed at windows 16 to 512. Rounds take turns; each figure is the lowest of the
   rounds' medians (the VM's speed drifts).
2. **One Llama-2-7B-shaped layer** (4096 wide, 32 heads of 128, 11008 hidden; float32, eager):
   the layer's weight products for one token against its attention over 256 to 4096 slots
   (the context of Llama-2). A whole step is 32 such layers, so the ratio holds for it.

Builds in a temporary folder (minutes, with the autotuned kernels of the CPU default); nothing
is kept.
"""

from __future__ import annotations

import os
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.harness import machine_line, script_parser, time_call


def static_package(model: Any, width: int, slots: int, path: Path) -> None:
    """The step at one width with the window the whole static cache of ``slots``: what packages
    were before their window was dynamic (model/fast/aot.py exports the same program, dynamic)."""
    import torch

    from model.fast import aot

    model.setup_cache(1, slots - 1)  # the rotary table, for the static cache's positions
    program = aot.StepProgram(model, hidden=False)
    caches = [
        torch.zeros(1, model.layers[0].self_attn.local_kv_heads, slots, model.config.head_dim)
        for _ in range(2 * len(model.layers))
    ]
    saved = [layer.self_attn.cache for layer in model.layers]
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.cache = None
        try:
            exported = torch.export.export(
                program, (*aot.example_call(model, 1, width, slots), *caches), strict=False
            )
        finally:
            for layer, cache in zip(model.layers, saved):
                layer.self_attn.cache = cache
        torch._inductor.aoti_compile_and_package(
            exported, package_path=str(path), inductor_configs=dict(aot.PACKAGE_OPTIONS["autotune"])
        )


def time_package(model: Any, runner: Any, width: int, slots: int, window: int, calls: int) -> float:
    """Median seconds of one call at ``window`` (the call's tokens at the window's last slots)."""
    import torch

    from model.fast import aot

    model.setup_cache(1, slots - 1)
    where = (torch.arange(width) + window - width).unsqueeze(0).contiguous()
    visible = (torch.arange(window) <= where.unsqueeze(-1)).contiguous()
    args = [
        torch.ones(1, width, dtype=torch.long),
        where,
        where.clone(),
        visible,
        *aot.cache_tensors(model),
    ]
    return time_call(lambda: runner.boxed_run(list(args)), calls, warmup=10).median


def shipped_target(rounds: int, calls: int) -> None:
    import torch

    from model.fast import aot
    from model.fast.fuse import prepare_for_decoding
    from weights import load_model

    model = load_model("tiny-target")
    prepare_for_decoding(model, stack=True, prepack=False)
    model.requires_grad_(False)
    context = model.config.max_seq_len
    with tempfile.TemporaryDirectory() as folder:
        runners, cases = {}, []
        for width in (1, 5):
            for name, slots in (("static 64", 65), (f"static {context}", context + 1)):
                path = Path(folder) / f"{name.replace(' ', '')}-{width}.pt2"
                built = time_call(partial(static_package, model, width, slots, path)).median
                print(f"built {name}, {width} tokens, in {built:.0f}s", flush=True)
                runners[name, width] = aot.load_package(path)
                cases.append((name, width, slots, slots))
            path = Path(folder) / f"dynamic-{width}.pt2"
            model.setup_cache(1, 64)
            built = time_call(
                partial(aot.build_package, model, 1, width, False, "autotune", path)
            ).median
            print(f"built dynamic, {width} tokens, in {built:.0f}s", flush=True)
            runners["dynamic", width] = aot.load_package(path)
            cases += [
                ("dynamic", width, context + 1, window) for window in (16, 64, 128, 256, context)
            ]
        seen: dict[Any, list[float]] = {case: [] for case in cases}
        with torch.inference_mode():
            for _ in range(rounds):
                for case in cases:
                    name, width, slots, window = case
                    seen[case].append(
                        time_package(model, runners[name, width], width, slots, window, calls)
                    )
    print(
        f"\ntiny-target, float32, packages (lowest of {rounds} rounds' medians of {calls} calls):"
    )
    print("| package | tokens | cache slots | window | ms a call |")
    print("|---|---:|---:|---:|---:|")
    for (name, width, slots, window), times in seen.items():
        print(
            f"| {name} | {width} | {slots - 1} | {window if name == 'dynamic' else slots - 1} | "
            f"{1e3 * min(times):.3f} |"
        )


def seven_b_layer(rounds: int, calls: int) -> None:
    """One 7B-shaped layer, eagerly: its products for one token against its attention by window."""
    import torch
    import torch.nn.functional as F

    dim, heads, head_dim, hidden = 4096, 32, 128, 11008
    weights = {
        "qkv": torch.randn(3 * dim, dim) * 0.01,
        "o": torch.randn(dim, dim) * 0.01,
        "gate_up": torch.randn(2 * hidden, dim) * 0.01,
        "down": torch.randn(dim, hidden) * 0.01,
    }
    x = torch.randn(1, 1, dim)

    def products() -> None:
        y = F.linear(x, weights["qkv"])[..., :dim]
        y = F.linear(y, weights["o"])
        g = F.linear(y, weights["gate_up"])[..., :hidden]
        F.linear(g, weights["down"])

    cache = torch.randn(1, heads, 4096, head_dim), torch.randn(1, heads, 4096, head_dim)
    q = torch.randn(1, heads, 1, head_dim)

    def attention(window: int) -> None:
        F.scaled_dot_product_attention(q, cache[0][:, :, :window], cache[1][:, :, :window])

    def best(fn: Any) -> float:
        """The lowest of ``rounds`` medians of ``calls`` calls, each after 3 untimed calls."""
        return min(time_call(fn, calls, warmup=3).median for _ in range(rounds))

    with torch.inference_mode():
        base = best(products)
        print("\nOne Llama-2-7B-shaped layer, float32, eager, one token:")
        print(f"weight products: {1e3 * base:.2f} ms")
        print("| attention window | ms | share of the layer's products |")
        print("|---:|---:|---:|")
        for window in (256, 1024, 2048, 4096):
            ms = best(lambda w=window: attention(w))
            print(f"| {window} | {1e3 * ms:.3f} | {ms / base:.1%} |")


def main(argv: list[str] | None = None) -> int:
    parser = script_parser("window_cost", __doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-7b", action="store_true", help="the shipped target only")
    parser.add_argument("--skip-target", action="store_true", help="the 7B-shaped layer only")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="window-cost-inductor-")
    )
    print(machine_line(args.threads))
    if not args.skip_target:
        shipped_target(args.rounds, args.calls)
    if not args.skip_7b:
        seven_b_layer(args.rounds, max(10, args.calls // 10))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
