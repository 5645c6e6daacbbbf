"""What weight-only int8 costs in accuracy: logits and speculative acceptance, int8 vs float.

    python -m benchmarks.int8_quality                       # the shipped pair (tiny-target, tiny-draft)
    python -m benchmarks.int8_quality --random              # a random pair, no checkpoint needed
    python -m benchmarks.int8_quality --target 70b --draft 7b --device cuda --reference bfloat16

For the target and the draft it reports the largest change int8 makes to any logit (and
bfloat16's change, for scale), both against the reference dtype, on a fixed sequence;
then the acceptance rate alpha of speculative decoding (the paper's expected acceptance,
noise-free) and the tokens per target call, for the reference pair and the int8 pair, at
temperature 0 and 1 with the same seed; and whether greedy output changed. Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
from typing import Any

import torch

from benchmarks.harness import machine_line, script_parser, time_call
from model import Llama, ModelConfig
from model.scale.quantize import quantize_int8
from speculative import autoregressive_generate, speculative_generate
from weights import load_model, load_tokenizer
from weights.sharded import load_model_tp

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
PROMPT = "Once upon a time, there was a little"


def random_pair(seed: int = 0) -> tuple[Llama, Llama]:
    """A target with peaked next-token distributions and a draft that is a noisy copy of it,
    so that acceptance sits in between 0 and 1 where a change would show."""
    config = ModelConfig(
        vocab_size=512,
        dim=128,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=344,
        max_seq_len=256,
    )
    gen = torch.Generator().manual_seed(seed)
    target, draft = Llama(config), Llama(config)
    with torch.no_grad():
        for p, q in zip(target.parameters(), draft.parameters()):
            if p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.12 * torch.randn(p.shape, generator=gen))
            q.copy_(p + 0.25 * p.std() * torch.randn(p.shape, generator=gen) if p.ndim > 1 else p)
    return target.eval(), draft.eval()


def converted(model: Llama, dtype: torch.dtype) -> Llama:

    return copy.deepcopy(model).to(dtype)


def logit_change(reference: Llama, other: Llama, tokens: torch.Tensor) -> dict[str, float]:
    with torch.inference_mode():
        a, b = reference(tokens).double(), other(tokens).double()
    return {
        "max_abs": (a - b).abs().max().item(),
        "relative_to_std": ((a - b).abs().max() / a.std()).item(),
        "top1_agreement": (a.argmax(-1) == b.argmax(-1)).double().mean().item(),
    }


def speculate(
    target: Llama,
    draft: Llama,
    prompt: list[int],
    new: int,
    gamma: int,
    temperature: float,
    seed: int,
) -> dict[str, Any]:
    with torch.inference_mode():
        result = speculative_generate(
            target, draft, prompt, new, gamma=gamma, temperature=temperature, seed=seed
        )
    stats = result.stats
    return {
        "acceptance_rate": stats.acceptance_rate,
        "tokens_per_target_call": stats.tokens_per_target_call,
        "tokens": list(result.tokens),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """The report's figures (see the module docstring)."""
    dtype, device = DTYPES[args.reference], torch.device(args.device)
    if args.random:
        target, draft = (m.to(device=device, dtype=dtype) for m in random_pair(args.seed))
        target8, draft8 = (
            quantize_int8(converted(target, dtype)),
            quantize_int8(converted(draft, dtype)),
        )
        prompt = [1, 17, 42, 99, 7, 300]
    else:
        target, draft = (
            load_model(args.target, device, dtype),
            load_model(args.draft, device, dtype),
        )
        target8 = load_model_tp(args.target, device, dtype, quantize="int8")
        draft8 = load_model_tp(args.draft, device, dtype, quantize="int8")
        prompt = load_tokenizer(args.target).encode(PROMPT, bos=True)
    with torch.inference_mode():
        greedy = autoregressive_generate(
            target, prompt, args.max_new_tokens, temperature=0.0
        ).tokens
        greedy8 = autoregressive_generate(
            target8, prompt, args.max_new_tokens, temperature=0.0
        ).tokens
    sequence = torch.tensor([prompt + list(greedy)], device=device)
    report: dict[str, Any] = {
        "pair": "random" if args.random else f"{args.draft} -> {args.target}",
        "reference_dtype": args.reference,
        "device": str(device),
    }
    for role, ref, q in (("target", target, target8), ("draft", draft, draft8)):
        report[f"{role}_int8_logits"] = logit_change(ref, q, sequence)
        if dtype != torch.bfloat16:
            report[f"{role}_bfloat16_logits"] = logit_change(
                ref, converted(ref, torch.bfloat16), sequence
            )
    first_diff = next((i for i, (a, b) in enumerate(zip(greedy, greedy8)) if a != b), None)
    report["greedy_first_divergence_int8_vs_reference"] = first_diff
    for temperature in (0.0, 1.0):
        ref = speculate(
            target, draft, prompt, args.max_new_tokens, args.gamma, temperature, args.seed
        )
        q = speculate(
            target8, draft8, prompt, args.max_new_tokens, args.gamma, temperature, args.seed
        )
        key = f"temperature_{temperature:g}"
        report[key] = {
            "reference": {k: v for k, v in ref.items() if k != "tokens"},
            "int8": {k: v for k, v in q.items() if k != "tokens"},
            "acceptance_change": q["acceptance_rate"] - ref["acceptance_rate"],
        }
        if temperature == 0:
            report[key]["reference_spec_equals_target"] = ref["tokens"] == list(greedy)
            report[key]["int8_spec_equals_int8_target"] = q["tokens"] == list(greedy8)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = script_parser("int8_quality", __doc__)
    parser.add_argument("--target", default="tiny-target")
    parser.add_argument("--draft", default="tiny-draft")
    parser.add_argument(
        "--random", action="store_true", help="a random pair instead of checkpoints"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--reference",
        default="float32",
        choices=sorted(DTYPES),
        help="the dtype int8 is compared with; int8 layers compute in it too",
    )
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    timing = time_call(lambda: measure(args))
    report = timing.result
    report.update(seconds=round(timing.median, 1), machine=machine_line(args.threads))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
