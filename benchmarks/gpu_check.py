"""The checks that need a CUDA GPU, in one run of at most about five minutes.

    python -m benchmarks.gpu_check --out gpu_check.json

1. ``pytest -m cuda``: the CUDA variants of the tensor-parallel and int8 tests.
2. Memory bandwidth, measured with a large device-to-device copy (read + write bytes / time).
3. Decode tokens/s of a Llama-2-7B-shaped model with random weights in bfloat16, built
   directly on the GPU (no download), against the memory-bandwidth bound: a decode step
   must read every weight once (the embedding table excepted: one row), so tokens/s can
   not exceed bandwidth / bytes per token. Then the same model with int8 weights.
4. The same 7B-shaped model eager against compiled (model/fast/compile.py: CUDA graphs through
   torch.compile's "reduce-overhead"): tokens/s and the fraction of the bandwidth bound.
5. A 7B-shaped target with a 1B-shaped draft (random weights; the draft is the target's
   embedding, first layers, norm and head, so that it agrees with the target often enough):
   speculative against the target alone, eager and compiled, greedy, identical tokens.
6. Speculative decoding against the target alone on the shipped pair (tiny-draft ->
   tiny-target), on the GPU, greedy: tokens/s of each, acceptance rate, identical output.

Every figure goes into one JSON file (``--out``); a section that fails or runs past its
timeout records its error and the others still run. Exit status: 0 when every section ran
and pytest passed, 1 otherwise, 2 without a CUDA GPU.

``--dry-run`` runs sections 4-6 on the CPU with tiny shapes in float32 (no pytest, no
bandwidth), so that CI knows the script runs.
"""

from __future__ import annotations

import copy
import json
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import ROOT, describe_machine, script_parser, time_call
from model import Llama, ModelConfig
from model.call import chain
from model.scale.memory import DEVICES, LLAMA2_CONFIGS
from model.scale.quantize import quantize_int8
from model.scale.tensor_parallel import weight_bytes

# The dry run's shapes: a "7B" and a "1B" small enough to compile and run on a CPU in seconds.
DRY_CONFIG = ModelConfig(
    vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=128, max_seq_len=256
)


def sync(device: str = "cuda") -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_pytest(timeout: float) -> dict[str, Any]:
    """``pytest -m cuda`` in a subprocess, so that a crash there cannot take this script down."""
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rs", "tests"]
    start = time.perf_counter()  # how long the tests took, for the report: not a measurement
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"passed": False, "error": f"timed out after {timeout:.0f}s"}
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return {
        "passed": proc.returncode == 0,
        "returncode": proc.returncode,
        "summary": lines[-1] if lines else "",
        "tail": lines[-15:],
        "seconds": round(time.perf_counter() - start, 1),
    }


def measure_bandwidth(gib: float = 2.0, repeats: int = 10) -> dict[str, Any]:
    """Bytes read + written per second by ``dst.copy_(src)`` of a ``gib`` GiB buffer. Timed on the
    device by CUDA events, not by the harness's wall clock (harness.time_call): a copy, not a
    model call, and what the GPU itself took, without the launches' host time."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    sync()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    sync()
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes_per_second": 2 * n * repeats / seconds, "buffer_gib": gib, "repeats": repeats}


def nominal_bandwidth() -> float | None:
    """The datasheet bandwidth of the GPU, when its name is one we know."""
    name = torch.cuda.get_device_name().lower()
    for key, spec in DEVICES.items():
        family, _, size = key.partition("-")
        if family in name and (not size or size.removesuffix("gb") in name):
            return spec.bandwidth
    return None


def decode_tokens_per_second(
    model: Llama, prompt_len: int = 32, steps: int = 64, warmup: int = 8
) -> float:
    """Greedy one-token steps with the KV cache, timed together after a warm-up."""
    vocab, device = model.config.vocab_size, model.device
    model.setup_cache(1, prompt_len + warmup + steps + 1)
    tokens = torch.randint(0, vocab, (1, prompt_len), device=device)
    with torch.inference_mode():
        nxt = model(tokens, chain(0, prompt_len, device))[:, -1:].argmax(-1)
        pos = prompt_len

        def step() -> None:
            nonlocal nxt, pos
            nxt = model(nxt, chain(pos, 1, device))[:, -1:].argmax(-1)
            pos += 1

        seconds = time_call(step, steps, warmup=warmup, together=True, device=device).median
    return 1 / seconds


def bytes_read_per_token(model: Llama) -> int:
    """Every weight once, except the embedding table, of which a decode step reads one row."""
    embed = model.embed_tokens.weight
    return (
        weight_bytes(model)
        - embed.numel() * embed.element_size()
        + embed.shape[1] * embed.element_size()
    )


def check_7b_decode(
    bandwidth: float | None,
    config: ModelConfig = LLAMA2_CONFIGS["7b"],
    device: str = "cuda",
    steps: int = 64,
) -> dict[str, Any]:
    """A random-weight Llama-2-7B in bfloat16 built on the GPU, then quantized to int8.

    ``config``, ``device`` and ``steps`` exist for a smoke test on the CPU with a tiny model.
    """
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    # built in bf16 directly: no float32 copy of 7B ever exists
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Llama(config).eval()
    finally:
        torch.set_default_dtype(previous)
    out: dict[str, Any] = {}
    for label in ("bfloat16", "int8"):
        if label == "int8":
            with torch.no_grad():
                quantize_int8(model)
            if device == "cuda":
                torch.cuda.empty_cache()
        per_token = bytes_read_per_token(model)
        tps = decode_tokens_per_second(model, steps=steps)
        entry = {
            "tokens_per_second": tps,
            "weight_bytes_read_per_token": per_token,
            "weight_bytes": weight_bytes(model),
        }
        if device == "cuda":
            entry["gpu_memory_allocated"] = torch.cuda.memory_allocated()
        if bandwidth:
            bound = bandwidth / per_token
            entry.update(bandwidth_bound_tokens_per_second=bound, fraction_of_bound=tps / bound)
        out[label] = entry
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def random_model(config: ModelConfig, device: str, dtype: torch.dtype, seed: int = 0) -> Llama:
    """A Llama with random weights built directly in ``dtype`` on ``device`` (no float32 copy)."""
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return Llama(config).eval()
    finally:
        torch.set_default_dtype(previous)


def bound_entry(model: Llama, tps: float, bandwidth: float | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"tokens_per_second": tps}
    if bandwidth:
        bound = bandwidth / bytes_read_per_token(model)
        entry.update(bandwidth_bound_tokens_per_second=bound, fraction_of_bound=tps / bound)
    return entry


def dry_run_mode(device: str) -> str | None:
    """A GPU gets compile_for_decoding's default (CUDA graphs); the CPU, which runs only the
    dry run, Inductor's plain default: the dry run checks that the sections run, and
    autotuning its shapes would add a minute and a half to CI."""
    return None if torch.device(device).type == "cuda" else "default"


def check_compiled_decode(
    bandwidth: float | None,
    config: ModelConfig = LLAMA2_CONFIGS["7b"],
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    steps: int = 64,
) -> dict[str, Any]:
    """Decode tokens/s of one random model, eager and then compiled (one-token steps), and
    each against the bandwidth bound."""
    # deferred: Inductor loads only for the checks that compile
    from model.fast.compile import (
        compile_for_decoding,
    )

    model = random_model(config, device, dtype)
    out = {"eager": bound_entry(model, decode_tokens_per_second(model, steps=steps), bandwidth)}
    compiled = compile_for_decoding(
        model,
        (1,),
        cache_len=min(config.max_seq_len, 32 + 8 + steps + 1),
        mode=dry_run_mode(device),
    )
    out["compiled"] = bound_entry(model, decode_tokens_per_second(model, steps=steps), bandwidth)
    out["compile_seconds"] = compiled.compile_s
    out["compiled_over_eager"] = (
        out["compiled"]["tokens_per_second"] / out["eager"]["tokens_per_second"]
    )
    return out


def early_exit_draft(target: Llama, layers: int) -> Llama:
    """A draft of the target's shape with its first ``layers`` layers (and its embedding, final
    norm and head): random weights that still agree with the target now and then."""
    draft = copy.deepcopy(target)
    draft.layers = draft.layers[:layers]
    draft.config = ModelConfig(**{**vars(target.config), "n_layers": layers})
    return draft


def check_speculative_7b(
    config: ModelConfig = LLAMA2_CONFIGS["7b"],
    draft_layers: int = 4,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    max_new_tokens: int = 64,
    gamma: int = 4,
) -> dict[str, Any]:
    """A 7B-shaped target and a 1B-shaped early-exit draft (4 of 32 layers: ~1.1B parameters),
    greedy: speculative against the target alone, eager, then both models compiled."""
    from model.fast.compile import compile_for_decoding, decode_widths  # deferred: as above
    from speculative import autoregressive_generate, speculative_generate

    target = random_model(config, device, dtype)
    draft = early_exit_draft(target, draft_layers)
    prompt = torch.randint(
        0, config.vocab_size, (16,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    out: dict[str, Any] = {
        "draft_parameters": sum(p.numel() for p in draft.parameters()),
        "target_parameters": sum(p.numel() for p in target.parameters()),
    }
    for label in ("eager", "compiled"):
        if label == "compiled":
            cache_len = min(config.max_seq_len, len(prompt) + max_new_tokens + gamma + 2)
            seconds = sum(
                compile_for_decoding(
                    m, widths, cache_len=cache_len, mode=dry_run_mode(device)
                ).compile_s
                for m, widths in ((target, decode_widths(gamma, gamma)), (draft, (1, 2)))
            )
        with torch.inference_mode():
            autoregressive_generate(target, prompt, 4, temperature=0.0)  # warm-up
            alone = autoregressive_generate(target, prompt, max_new_tokens, temperature=0.0)
            spec = speculative_generate(
                target, draft, prompt, max_new_tokens, gamma=gamma, temperature=0.0
            )
        out[label] = {
            "target_alone_tokens_per_second": alone.stats.tokens_per_second,
            "speculative_tokens_per_second": spec.stats.tokens_per_second,
            "speedup": spec.stats.tokens_per_second / alone.stats.tokens_per_second,
            "acceptance_rate": spec.stats.acceptance_rate,
            "cost_ratio": spec.stats.cost_ratio,
            "same_output": list(spec.tokens) == list(alone.tokens),
            "tokens": list(spec.tokens),
        }
        if label == "compiled":
            out[label]["compile_seconds"] = seconds
            out[label]["same_output_as_eager"] = out[label]["tokens"] == out["eager"]["tokens"]
    return out


def check_shipped_pair(
    max_new_tokens: int = 128,
    gamma: int = 4,
    device: str = "cuda",
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
) -> dict[str, Any]:
    """Speculative vs target-only on tiny-draft -> tiny-target on the GPU, greedy."""
    # deferred: the checks of the bare GPU run first, without the project's packages loaded
    from speculative import autoregressive_generate, speculative_generate
    from weights import load_model, load_tokenizer

    out: dict[str, Any] = {}
    for dtype in dtypes:
        target = load_model("tiny-target", device, dtype)
        draft = load_model("tiny-draft", device, dtype)
        prompt = load_tokenizer("tiny-target").encode("Once upon a time", bos=True)
        with torch.inference_mode():
            # warm-up (kernels, allocator)
            autoregressive_generate(target, prompt, 8, temperature=0.0)
            speculative_generate(target, draft, prompt, 8, gamma=gamma, temperature=0.0)
            alone = autoregressive_generate(target, prompt, max_new_tokens, temperature=0.0)
            spec = speculative_generate(
                target, draft, prompt, max_new_tokens, gamma=gamma, temperature=0.0
            )
        a, s = alone.stats, spec.stats
        out[str(dtype).removeprefix("torch.")] = {
            "target_alone_tokens_per_second": a.tokens_per_second,
            "speculative_tokens_per_second": s.tokens_per_second,
            "speedup": s.tokens_per_second / a.tokens_per_second,
            "acceptance_rate": s.acceptance_rate,
            "tokens_per_target_call": s.tokens_per_target_call,
            "gamma": gamma,
            "new_tokens": s.new_tokens,
            "same_output": list(spec.tokens) == list(alone.tokens),
        }
    return out


class SectionTimeoutError(Exception):
    pass


def section(
    report: dict[str, Any], name: str, fn: Callable[[], Any], timeout_s: float = 120.0
) -> Any:
    """Run one check, record its result or its error, never raise. A check still running
    after ``timeout_s`` is interrupted (SIGALRM, between Python operations) and recorded as
    timed out, so the script cannot hang on one section."""
    start = time.perf_counter()  # how long the section took, for the report: not a measurement

    def expire(signum: int, frame: Any) -> None:
        raise SectionTimeoutError(f"{name} ran past its {timeout_s:.0f}s timeout")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        report[name] = fn()
    except Exception as err:  # noqa: BLE001 - a failed check is a result to record
        report[name] = {
            "error": f"{type(err).__name__}: {err}",
            "traceback": traceback.format_exc(limit=5),
        }
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    report.setdefault("seconds", {})[name] = round(time.perf_counter() - start, 1)
    print(f"[gpu_check] {name}: {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return report[name]


def dry_run(out: Path) -> int:
    """Sections 4-6 on the CPU, tiny shapes, float32: the code paths CI can run."""
    report: dict[str, Any] = {"torch": torch.__version__, "dry_run": True}
    section(
        report,
        "decode_compiled",
        lambda: check_compiled_decode(1e10, DRY_CONFIG, "cpu", torch.float32, 8),
    )
    section(
        report,
        "speculative_7b_shaped",
        lambda: check_speculative_7b(DRY_CONFIG, 1, "cpu", torch.float32, 16),
    )
    if (ROOT / "weights" / "tiny-target").is_dir() and (ROOT / "weights" / "tiny-draft").is_dir():
        section(
            report,
            "shipped_pair",
            lambda: check_shipped_pair(16, device="cpu", dtypes=(torch.float32,)),
        )
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 1 if any(isinstance(v, dict) and "error" in v for v in report.values()) else 0


def main(argv: list[str] | None = None) -> int:
    parser = script_parser("gpu_check", __doc__)
    parser.add_argument(
        "--out", default="gpu_check.json", help="where to write the JSON (default gpu_check.json)"
    )
    parser.add_argument(
        "--pytest-timeout", type=float, default=150.0, help="seconds allowed for pytest -m cuda"
    )
    parser.add_argument("--skip-pytest", action="store_true", help="only the measurements")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="run the compiled and speculative sections on the CPU with tiny shapes (for CI)",
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.dry_run:
        return dry_run(out)
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "machine": describe_machine()[0],
    }
    if not torch.cuda.is_available():
        report["error"] = "no CUDA GPU is visible: this script is for a machine with one"
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"error: {report['error']}", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    report.update(
        gpu=props.name,
        gpu_count=torch.cuda.device_count(),
        gpu_memory_bytes=props.total_memory,
        cuda=torch.version.cuda,
    )
    start = time.perf_counter()  # the whole run's duration, for the report
    if not args.skip_pytest:
        section(report, "pytest_cuda", lambda: run_pytest(args.pytest_timeout))
    bandwidth = section(report, "bandwidth", measure_bandwidth)
    measured = bandwidth.get("bytes_per_second") if isinstance(bandwidth, dict) else None
    nominal = report["nominal_bandwidth_bytes_per_second"] = nominal_bandwidth()
    section(report, "decode_7b_random", lambda: check_7b_decode(measured or nominal))
    section(
        report,
        "decode_7b_compiled",
        lambda: check_compiled_decode(measured or nominal),
        timeout_s=150,
    )
    section(report, "speculative_7b_1b", check_speculative_7b, timeout_s=180)
    if (ROOT / "weights" / "tiny-target").is_dir() and (ROOT / "weights" / "tiny-draft").is_dir():
        section(report, "shipped_pair", check_shipped_pair)
    else:
        report["shipped_pair"] = {"skipped": "weights/tiny-target or weights/tiny-draft is missing"}
    report["total_seconds"] = round(time.perf_counter() - start, 1)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(json.dumps(report, indent=2, default=str))
    failed = any(isinstance(v, dict) and "error" in v for v in report.values())
    pytest_ok = args.skip_pytest or report.get("pytest_cuda", {}).get("passed", False)
    return 0 if pytest_ok and not failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
