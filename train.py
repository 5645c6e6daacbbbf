"""Train the shipped tiny pair: a SentencePiece tokenizer, LLaMA models from scratch, and
a draft distilled toward its target (DistillSpec, Zhou et al. 2023).

    python train.py tokenizer --corpus A.txt B.txt --vocab-size 2048 --out runs/tok
    python train.py pretrain  --corpus A.txt B.txt --tokenizer runs/tok/tokenizer.model --out runs/target ...
    python train.py distill   --target runs/target/hf --draft runs/draft/hf --corpus A.txt --out runs/distill ...
    python train.py eagle     --target tiny-target --corpus A.txt --eval-corpus B.txt --out runs/eagle ...

Every run writes into its --out folder: ``state.pt`` (resumable), ``log.jsonl``,
``loss.png`` and, at the end, an HF-layout checkpoint in ``hf/``. Rerunning the same
command resumes from ``state.pt``; a folder that holds a run of another shape is refused.
Bad input (a missing file, another run's folder) ends with exit status 2 and one
``error: ...`` line on stderr.

Run it with the project's environment: .venv/bin/python train.py ..., or after
source .venv/bin/activate. The recipes that made the shipped pair are in
weights/tiny-target/README.md, weights/tiny-draft-undistilled/README.md and
weights/tiny-draft/README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from model import ConfigError, Llama, ModelConfig
from model.feature_head import FeatureHead
from speculative import calls
from speculative.distill import DIVERGENCES, divergence
from weights import CheckpointError, Tokenizer, UnknownCheckpointError, load_model, load_tokenizer, save_model
from weights.corpus import read_documents, tokenize_corpus


class TrainError(ValueError):
    """Bad input to train.py; reported as one ``error:`` line with exit status 2."""


# Held-out loss: log.jsonl's eval_loss, every --eval-every steps, averages LOG_EVAL_BATCHES
# batches of EVAL_BATCH windows; summary.json's held_out_loss, once at the end, averages
# FINAL_EVAL_BATCHES. The windows are drawn from one fixed seed, so the log's are the first
# of the summary's, and both files name how many they average.
EVAL_BATCH, LOG_EVAL_BATCHES, FINAL_EVAL_BATCHES = 8, 8, 32


# ----------------------------------------------------------------------------- helpers
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def random_batch(data: np.ndarray, batch: int, seq_len: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen).tolist()
    chunk = torch.stack([torch.from_numpy(data[s:s + seq_len + 1].astype(np.int64)) for s in starts])
    return chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def evaluate(model: Llama, data: np.ndarray, seq_len: int, batches: int = 8, batch: int = 8) -> float:
    """Mean cross-entropy on fixed held-out windows (same windows every call)."""
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(batches):
        x, y = random_batch(data, batch, seq_len, gen)
        losses.append(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item())
    model.train()
    return sum(losses) / len(losses)


def plot_losses(log_path: Path, png_path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), label="train", alpha=0.7)
    if evals:
        ax.plot(*zip(*evals), "o-", label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def log(out: Path, row: dict) -> None:
    with open(out / "log.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def save_state(out: Path, step: int, model: Llama, optimizer: torch.optim.Optimizer, gen: torch.Generator) -> None:
    tmp = out / "state.pt.tmp"
    torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "generator": gen.get_state(), "torch_rng": torch.get_rng_state(),
                "config": model.config.to_hf()}, tmp)
    tmp.replace(out / "state.pt")


# config.json names -> the pretrain flags that set them, for the error about another run's shape.
SHAPE_FLAGS = {"hidden_size": "--dim", "num_hidden_layers": "--n-layers", "num_attention_heads": "--n-heads",
               "num_key_value_heads": "--n-kv-heads", "intermediate_size": "--hidden-dim",
               "max_position_embeddings": "--max-seq-len", "tie_word_embeddings": "--tie",
               "vocab_size": "vocab_size (the tokenizer's)"}


def load_state(out: Path, model: Llama, optimizer: torch.optim.Optimizer, gen: torch.Generator) -> int:
    path = out / "state.pt"
    if not path.is_file():
        return 0
    state = torch.load(path, weights_only=False)
    saved, wanted = state.get("config"), model.config.to_hf()
    if saved is not None and saved != wanted:
        diffs = [f"{SHAPE_FLAGS.get(key, key)} {saved.get(key)} there, {wanted.get(key)} now"
                 for key in sorted(set(saved) | set(wanted)) if saved.get(key) != wanted.get(key)]
        raise TrainError(f"{out} holds a run of another shape ({', '.join(diffs[:4])}): rerun with the settings it "
                         f"was started with, choose another --out, or delete {path} to start over")
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as err:  # e.g. a state.pt of an older version without its config
        raise TrainError(f"{path} does not fit this model ({str(err).splitlines()[0]}); choose another --out, "
                         f"or delete {path} to start over") from None
    optimizer.load_state_dict(state["optimizer"])
    gen.set_state(state["generator"])
    torch.set_rng_state(state["torch_rng"])
    print(f"resuming from {path} at step {state['step']}")
    return int(state["step"])


def export(out: Path, model: Llama, tokenizer_path: Path, dtype: torch.dtype) -> Path:
    hf = save_model(model, out / "hf", dtype=dtype)
    shutil.copyfile(tokenizer_path, hf / "tokenizer.model")
    return hf


# ----------------------------------------------------------------------------- tokenizer
def cmd_tokenizer(args: argparse.Namespace) -> None:
    import sentencepiece as spm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    docs = [d for path in args.corpus for d in read_documents(path)]
    # Llama-2-style settings: BPE, digits split, bytes for anything unseen, no normalisation.
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(docs), model_prefix=str(out / "tokenizer"), vocab_size=args.vocab_size,
        model_type="bpe", character_coverage=1.0, byte_fallback=True, split_digits=True,
        normalization_rule_name="identity", add_dummy_prefix=True, remove_extra_whitespaces=False,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, max_sentence_length=1 << 15,
        num_threads=2, minloglevel=2, input_sentence_size=0)
    tok = Tokenizer(out / "tokenizer.model")
    print(f"wrote {out / 'tokenizer.model'} ({tok.vocab_size} pieces, trained on {len(docs)} documents)")


# ----------------------------------------------------------------------------- pretrain
def cmd_pretrain(args: argparse.Namespace) -> None:
    seed_everything(args.seed)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(args.tokenizer)
    train_data = tokenize_corpus(args.corpus, tokenizer, args.cache_dir)
    eval_data = tokenize_corpus(args.eval_corpus, tokenizer, args.cache_dir) if args.eval_corpus else None
    config = ModelConfig(vocab_size=tokenizer.vocab_size, dim=args.dim, n_layers=args.n_layers,
                         n_heads=args.n_heads, n_kv_heads=args.n_kv_heads or args.n_heads,
                         hidden_dim=args.hidden_dim, max_seq_len=args.max_seq_len, norm_eps=1e-5,
                         tie_word_embeddings=args.tie, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
    model = Llama(config)
    for name, p in model.named_parameters():  # GPT-2-style init, scaled down on residual outputs
        if p.dim() == 2:
            residual = name.endswith(("o_proj.weight", "down_proj.weight"))
            std = 0.02 / math.sqrt(2 * config.n_layers) if residual else 0.02
            torch.nn.init.normal_(p, mean=0.0, std=std)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    step = load_state(out, model, optimizer, gen)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters; corpus: {len(train_data):,} tokens"
          + (f"; held-out: {len(eval_data):,} tokens" if eval_data is not None else ""))
    tokens_per_step = args.batch_size * args.seq_len
    bar = tqdm(total=args.steps, initial=step, desc="pretrain", dynamic_ncols=True, disable=args.no_progress)
    t0 = time.perf_counter()
    while step < args.steps:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        x, y = random_batch(train_data, args.batch_size, args.seq_len, gen)
        # bf16 autocast keeps float32 master weights and roughly doubles CPU throughput
        # where the CPU has bf16 instructions.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        elapsed = time.perf_counter() - t0
        t0 = time.perf_counter()
        row = {"step": step, "loss": loss.item(), "lr": lr_at(step - 1, args),
               "tokens_per_s": tokens_per_step / elapsed}
        if eval_data is not None and (step % args.eval_every == 0 or step == args.steps):
            row["eval_loss"] = evaluate(model, eval_data, args.seq_len, LOG_EVAL_BATCHES, EVAL_BATCH)
            row["eval_windows"] = LOG_EVAL_BATCHES * EVAL_BATCH
        log(out, row)
        bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
        bar.update(1)
        if step % args.save_every == 0 or step == args.steps:
            save_state(out, step, model, optimizer, gen)
            plot_losses(out / "log.jsonl", out / "loss.png", f"pretrain {out.name}")
    bar.close()
    model.eval()
    hf = export(out, model, Path(args.tokenizer), getattr(torch, args.save_dtype))
    summary = {"parameters": n_params, "steps": step, "final_train_loss": row_mean_tail(out / "log.jsonl")}
    if eval_data is not None:
        summary["held_out_loss"] = evaluate(model, eval_data, args.seq_len, FINAL_EVAL_BATCHES, EVAL_BATCH)
        summary["held_out_windows"] = FINAL_EVAL_BATCHES * EVAL_BATCH
        summary["held_out_perplexity"] = math.exp(summary["held_out_loss"])
        summary["note"] = (f"held_out_loss averages {summary['held_out_windows']} fixed held-out windows of "
                           f"--seq-len tokens; log.jsonl's eval_loss averages the first "
                           f"{LOG_EVAL_BATCHES * EVAL_BATCH} of them (eval_windows), so at the same step the two "
                           "differ a little")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    print(f"wrote {hf}")


def row_mean_tail(log_path: Path, n: int = 20) -> float:
    losses = [json.loads(line)["loss"] for line in log_path.read_text().splitlines() if '"loss"' in line]
    tail = losses[-n:]
    return sum(tail) / len(tail)


# ----------------------------------------------------------------------------- distill
def held_out_prompts(paths: list[str], tokenizer: Tokenizer, count: int, prompt_tokens: int,
                     seed: int) -> list[list[int]]:
    """The first ``prompt_tokens`` tokens of ``count`` documents drawn at random (fixed seed)."""
    docs = [d for p in paths for d in read_documents(p)]
    rng = random.Random(seed)
    picked = rng.sample(docs, min(count, len(docs)))
    return [tokenizer.encode(d)[:prompt_tokens] for d in picked]


@torch.no_grad()
def measure_acceptance(target: Llama, draft: Any, prompts: list[list[int]], new_tokens: int,
                       gamma: int, seed: int) -> dict[str, float]:
    """Acceptance of speculative decoding on the prompts, greedy and at temperature 1.

    ``alpha_*`` is the paper's alpha: the mean over verified positions of sum_x min(p, q), the
    probability that a drafted token is accepted. ``acceptance_*`` is the empirical fraction of
    drafted tokens that were kept, which is lower because the tokens after a rejection count
    as drafted but never get their chance. ``tau_*`` is the number of tokens per target call.
    ``draft`` is a draft model or any drafter (speculative.drafter).
    """
    from speculative import speculative_generate

    result = {}
    for name, temperature in (("greedy", 0.0), ("t1", 1.0)):
        accepted = drafted = new = calls = 0
        alpha_sum = alpha_count = 0.0
        for i, prompt in enumerate(prompts):
            out = speculative_generate(target, draft, prompt, new_tokens, gamma=gamma,
                                       temperature=temperature, seed=seed + i)
            accepted += out.stats.accepted_draft_tokens
            drafted += out.stats.drafted_tokens
            alpha_sum += out.stats.overlap_sum
            alpha_count += out.stats.verified_positions
            new += out.stats.new_tokens
            calls += out.stats.target_calls
        result[f"alpha_{name}"] = alpha_sum / max(1.0, alpha_count)
        result[f"acceptance_{name}"] = accepted / max(1, drafted)
        result[f"tau_{name}"] = new / max(1, calls)
    return result


# What measure_acceptance's numbers mean, written next to them into distill's summary.json.
ACCEPTANCE_NOTES = {
    "alpha": "alpha_greedy, alpha_t1: the paper's alpha, the probability that the target accepts a drafted token "
             "(the mean of sum_x min(p, q) over the verified draft positions); the alpha of the cost model",
    "acceptance": "acceptance_greedy, acceptance_t1: accepted / drafted tokens; lower than alpha, because the "
                  "tokens drafted after a rejection count as drafted but are never verified",
    "tau": "tau_greedy, tau_t1: new tokens per target call",
}


@torch.no_grad()
def sample_sequences(model: Llama, prompts: list[list[int]], length: int, gen: torch.Generator,
                     greedy: bool = False) -> torch.Tensor:
    """Sample continuations at temperature 1 (or greedy ones) for a batch of equal-length prompts."""
    tokens = torch.tensor(prompts)
    model.setup_cache(len(prompts), tokens.shape[1] + length)
    logits = model(tokens, calls.chain(0, tokens.shape[1], tokens.device, rows=len(prompts)))[:, -1]
    pos = tokens.shape[1]
    out = [tokens]
    for _ in range(length):
        if greedy:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            nxt = torch.multinomial(F.softmax(logits.float(), -1), 1, generator=gen)
        out.append(nxt)
        logits = model(nxt, calls.chain(pos, 1, nxt.device, rows=len(prompts)))[:, -1]
        pos += 1
    return torch.cat(out, dim=1)


def frozen_target(args: argparse.Namespace) -> tuple[Path, Llama]:
    """Seeds, threads, the --out folder, and the target with gradients off: the start of the
    two subcommands that train something against a frozen target."""
    seed_everything(args.seed)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = load_model(args.target).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    return out, target


def cmd_distill(args: argparse.Namespace) -> None:
    out, target = frozen_target(args)
    draft = load_model(args.draft)
    tokenizer = load_tokenizer(args.target)
    if draft.config.vocab_size != target.config.vocab_size:
        raise TrainError(f"the draft's vocabulary ({draft.config.vocab_size}) differs from the target's "
                         f"({target.config.vocab_size})")
    # Prompts are story openings; only stories at least --prompt-tokens long are used, so that a
    # batch of prompts has one length and needs no padding.
    openings = [tokenizer.encode(d)[:args.prompt_tokens] for p in args.corpus for d in read_documents(p)]
    openings = [o for o in openings if len(o) == args.prompt_tokens]
    if len(openings) < args.batch_size:
        raise TrainError(f"the corpus has fewer than {args.batch_size} stories of {args.prompt_tokens}+ tokens")
    eval_prompts = held_out_prompts(args.eval_corpus, tokenizer, args.eval_prompts, args.prompt_tokens, args.seed)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    step = load_state(out, draft, optimizer, gen)
    if step == 0:
        before = measure_acceptance(target, draft, eval_prompts, args.eval_new_tokens, args.gamma, args.seed)
        (out / "before.json").write_text(json.dumps(before, indent=2) + "\n")
        print(f"before distillation: {before}")
    rng = random.Random(args.seed + step)
    bar = tqdm(total=args.steps, initial=step, desc=f"distill ({args.divergence})", dynamic_ncols=True,
               disable=args.no_progress)
    while step < args.steps:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        t0 = time.perf_counter()
        prompts = rng.sample(openings, args.batch_size)
        # On-policy data (DistillSpec): sequences the draft itself generates; with probability
        # --target-mix the target writes them instead.
        writer = target if rng.random() < args.target_mix else draft
        draft.eval()
        seqs = sample_sequences(writer, prompts, args.gen_tokens, gen)
        draft.train()
        with torch.no_grad():
            target_logits = target(seqs)[:, args.prompt_tokens - 1:-1]
        draft_logits = draft(seqs)[:, args.prompt_tokens - 1:-1]
        loss = divergence(args.divergence, target_logits, draft_logits)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        step += 1
        tokens = seqs.numel()
        row = {"step": step, "loss": loss.item(), "tokens_per_s": tokens / (time.perf_counter() - t0)}
        log(out, row)
        bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
        bar.update(1)
        if step % args.save_every == 0 or step == args.steps:
            save_state(out, step, draft, optimizer, gen)
            plot_losses(out / "log.jsonl", out / "loss.png", f"distill {args.divergence}")
    bar.close()
    draft.eval()
    after = measure_acceptance(target, draft, eval_prompts, args.eval_new_tokens, args.gamma, args.seed)
    before = json.loads((out / "before.json").read_text())
    summary = {"divergence": args.divergence, "steps": step, "before": before, "after": after,
               "notes": ACCEPTANCE_NOTES}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    hf = save_model(draft, out / "hf", dtype=getattr(torch, args.save_dtype))
    shutil.copyfile(load_tokenizer(args.draft).path, hf / "tokenizer.model")
    print(json.dumps(summary))
    print(f"wrote {hf}")


# ----------------------------------------------------------------------------- eagle
def eagle_losses(head: FeatureHead, target: Llama, tokens: torch.Tensor, noise: float,
                 gen: torch.Generator, bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE's two losses on a batch of sequences [B, T] (Li et al. 2024, section 4.2).

    The frozen target gives its features f_0..f_{T-1} (what its output head reads). The head
    reads (f_j + noise, e(x_{j+1})) for j < T-1 and predicts f_{j+1}: a smooth-L1 regression
    on the features, and a cross-entropy of the target's output head applied to the
    prediction against the target's own next-token distribution softmax(head(f_{j+1})).
    The uniform noise on the input features stands in for the errors of the head's own
    predictions, which it reads back while drafting.
    """
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        _, feats = target(tokens, return_hidden=True)
    feats = feats.float()
    with torch.no_grad():
        wanted = F.softmax(target.lm_head(feats[:, 1:]).float(), dim=-1)
        embeddings = target.embed_tokens(tokens[:, 1:])
        jitter = (torch.rand(feats[:, :-1].shape, generator=gen) * 2 - 1) * noise
    predicted = head(feats[:, :-1] + jitter, embeddings)
    regression = F.smooth_l1_loss(predicted, feats[:, 1:])
    log_q = F.log_softmax(target.lm_head(predicted).float(), dim=-1)
    classification = -(wanted * log_q).sum(-1).mean()
    return regression, classification


def cmd_eagle(args: argparse.Namespace) -> None:
    from speculative import FeatureDrafter
    from weights.drafters import save_feature_head

    out, target = frozen_target(args)
    tokenizer = load_tokenizer(args.target)
    train_data = tokenize_corpus(args.corpus, tokenizer, args.cache_dir)
    # The head is one block of the target's own shape (EAGLE-1), with the target's context length.
    config = ModelConfig(**{**vars(target.config), "n_layers": 1, "extra": {}})
    head = FeatureHead(config)
    for name, p in head.named_parameters():
        if p.dim() == 2:
            residual = name.endswith(("o_proj.weight", "down_proj.weight"))
            torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2) if residual else 0.02)
        elif name == "fc.bias":
            torch.nn.init.zeros_(p)
    head.train()
    openings = [tokenizer.encode(d)[:args.prompt_tokens] for p in args.corpus for d in read_documents(p)]
    openings = [o for o in openings if len(o) == args.prompt_tokens]
    eval_prompts = held_out_prompts(args.eval_corpus, tokenizer, args.eval_prompts, args.prompt_tokens, args.seed)
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    step = load_state(out, head, optimizer, gen)
    rng = random.Random(args.seed + step)
    print(f"head: {sum(p.numel() for p in head.parameters()):,} parameters; corpus: {len(train_data):,} tokens")
    bar = tqdm(total=args.steps, initial=step, desc="eagle", dynamic_ncols=True, disable=args.no_progress)
    while step < args.steps:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        t0 = time.perf_counter()
        # Text the target writes itself (greedy or sampled, as it will decode) or corpus text.
        kind = rng.random()
        if kind < args.self_mix:
            prompts = rng.sample(openings, args.batch_size)
            greedy = kind < args.self_mix / 2
            tokens = sample_sequences(target, prompts, args.seq_len - args.prompt_tokens, gen, greedy=greedy)
        else:
            tokens = random_batch(train_data, args.batch_size, args.seq_len, gen)[0]
        regression, classification = eagle_losses(head, target, tokens, args.noise, gen, args.bf16)
        loss = regression + args.cls_weight * classification
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        step += 1
        row = {"step": step, "loss": loss.item(), "regression": regression.item(),
               "classification": classification.item(), "self_written": kind < args.self_mix,
               "tokens_per_s": tokens.numel() / (time.perf_counter() - t0)}
        log(out, row)
        bar.set_postfix(reg=f"{row['regression']:.4f}", cls=f"{row['classification']:.3f}",
                        tok_s=f"{row['tokens_per_s']:.0f}")
        bar.update(1)
        if step % args.save_every == 0 or step == args.steps:
            save_state(out, step, head, optimizer, gen)
            plot_losses(out / "log.jsonl", out / "loss.png", "eagle head")
    bar.close()
    head.eval()
    hf = save_feature_head(head, out / "hf", target, dtype=getattr(torch, args.save_dtype), target_name=args.target)
    # Measure what will ship: the head as saved (rounded to --save-dtype), read back.
    from weights.drafters import load_feature_head

    drafter = FeatureDrafter(load_feature_head(hf, target, args.target), target)
    after = measure_acceptance(target, drafter, eval_prompts, args.eval_new_tokens, args.gamma, args.seed)
    summary = {"steps": step, "gamma": args.gamma, "held_out": after}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    print(f"wrote {hf}")


# ----------------------------------------------------------------------------- CLI
class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad command line is one ``error:`` line (status 2), without the usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {self.prog}: {message} (see --help)\n")


DISTILL_DESCRIPTION = """Distill a draft toward its target (DistillSpec, Zhou et al. 2023) on text the draft
itself writes, then measure its acceptance on held-out prompts, before (before.json) and
after (summary.json), greedy and at temperature 1:

  alpha_greedy, alpha_t1            the paper's alpha: the probability that the target
                                    accepts a drafted token, the mean of sum_x min(p, q)
                                    over the verified draft positions (the cost model's alpha)
  acceptance_greedy, acceptance_t1  accepted / drafted tokens: lower than alpha, because the
                                    tokens drafted after a rejection are never verified
  tau_greedy, tau_t1                new tokens per target call
"""


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    tok = sub.add_parser("tokenizer", help="train a SentencePiece BPE tokenizer on a text corpus")
    tok.add_argument("--corpus", nargs="+", required=True, help="text files (stories split on <|endoftext|>)")
    tok.add_argument("--vocab-size", type=int, default=2048, help="number of pieces (default 2048)")
    tok.add_argument("--out", required=True, help="folder to write tokenizer.model into")
    tok.set_defaults(func=cmd_tokenizer)

    def common(p: argparse.ArgumentParser, steps: int, lr: float) -> None:
        p.add_argument("--out", required=True, help="run folder: state.pt, log.jsonl, loss.png, hf/")
        p.add_argument("--steps", type=int, default=steps, help=f"optimizer steps (default {steps})")
        p.add_argument("--lr", type=float, default=lr, help=f"peak learning rate (default {lr})")
        p.add_argument("--warmup", type=int, default=20, help="linear warmup steps (default 20)")
        p.add_argument("--batch-size", type=int, default=16, help="sequences per step (default 16)")
        p.add_argument("--seed", type=int, default=0, help="seed for data order and init (default 0)")
        p.add_argument("--save-every", type=int, default=50, help="write state.pt every N steps (default 50)")
        p.add_argument("--save-dtype", default="float16", choices=["float16", "bfloat16", "float32"],
                       help="dtype of the exported safetensors (default float16)")
        p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                       help=f"torch CPU threads (default: torch's choice, {torch.get_num_threads()} here)")
        p.add_argument("--no-progress", action="store_true", help="no progress bar (default: a tqdm bar)")

    def acceptance_options(p: argparse.ArgumentParser, prompt_help: str) -> None:
        """The prompts and the measurement of acceptance on held-out text (distill and eagle)."""
        p.add_argument("--prompt-tokens", type=int, default=8, help=prompt_help)
        p.add_argument("--gamma", type=int, default=4, help="gamma used to measure acceptance (default 4)")
        p.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts for acceptance (default 16)")
        p.add_argument("--eval-new-tokens", type=int, default=64,
                       help="tokens generated per held-out prompt (default 64)")

    pre = sub.add_parser("pretrain", help="train a LLaMA of a given shape from scratch (next-token loss)")
    pre.add_argument("--corpus", nargs="+", required=True, help="training text files")
    pre.add_argument("--eval-corpus", nargs="*", default=[],
                     help="held-out text files for the eval loss (default: none, and no held-out loss)")
    pre.add_argument("--tokenizer", required=True, help="tokenizer.model from `train.py tokenizer`")
    pre.add_argument("--dim", type=int, default=288, help="hidden size (default 288)")
    pre.add_argument("--n-layers", type=int, default=6, help="transformer blocks (default 6)")
    pre.add_argument("--n-heads", type=int, default=6, help="query heads; they must divide --dim (default 6)")
    pre.add_argument("--n-kv-heads", type=int, default=None,
                     help="KV heads, dividing --n-heads: fewer is grouped-query attention (default: --n-heads)")
    pre.add_argument("--hidden-dim", type=int, default=768, help="SwiGLU inner size (default 768)")
    pre.add_argument("--tie", action="store_true", help="tie the output head to the embeddings (default: untied)")
    pre.add_argument("--seq-len", type=int, default=256, help="training context (default 256)")
    pre.add_argument("--max-seq-len", type=int, default=1024,
                     help="max_position_embeddings written to config.json (default 1024)")
    pre.add_argument("--weight-decay", type=float, default=0.1,
                     help="AdamW weight decay of the matrices; norms and biases get none (default 0.1)")
    pre.add_argument("--cache-dir", default="runs/cache", help="tokenised-corpus cache folder (default runs/cache)")
    pre.add_argument("--eval-every", type=int, default=50,
                     help=f"log the held-out loss (eval_loss: {LOG_EVAL_BATCHES * EVAL_BATCH} windows; "
                          f"summary.json's held_out_loss at the end uses {FINAL_EVAL_BATCHES * EVAL_BATCH}) "
                          "every N steps (default 50)")
    pre.add_argument("--bf16", action="store_true",
                     help="bf16 autocast for the forward, float32 weights (default: float32 throughout)")
    common(pre, steps=1000, lr=1e-3)
    pre.set_defaults(func=cmd_pretrain)

    dis = sub.add_parser("distill", help="align a draft with its target on draft-generated (on-policy) text",
                         description=DISTILL_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    dis.add_argument("--target", required=True, help="target checkpoint (name or HF-layout folder)")
    dis.add_argument("--draft", required=True, help="draft checkpoint to start from")
    dis.add_argument("--corpus", nargs="+", required=True, help="text files whose story openings are prompts")
    dis.add_argument("--eval-corpus", nargs="+", required=True, help="held-out files for the acceptance prompts")
    dis.add_argument("--divergence", choices=sorted(DIVERGENCES), default="tv",
                     help="token-level divergence D(p_target || q_draft): forward KL, reverse KL, JSD or "
                          "total variation (1 - TV is the expected acceptance) (default tv)")
    dis.add_argument("--target-mix", type=float, default=0.0,
                     help="fraction of batches generated by the target instead of the draft (default 0)")
    dis.add_argument("--gen-tokens", type=int, default=128, help="tokens generated per sequence (default 128)")
    acceptance_options(dis, "prompt length taken from each story (default 8)")
    common(dis, steps=300, lr=3e-4)
    dis.set_defaults(func=cmd_distill)
    eag = sub.add_parser("eagle", help="train an EAGLE-style feature head that drafts from the frozen target's "
                                       "own features")
    eag.add_argument("--target", required=True, help="target checkpoint (name or HF-layout folder)")
    eag.add_argument("--corpus", nargs="+", required=True,
                     help="training text files (windows of them, and story openings for target-written text)")
    eag.add_argument("--eval-corpus", nargs="+", required=True, help="held-out files for the acceptance prompts")
    eag.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence (default 256)")
    eag.add_argument("--self-mix", type=float, default=0.5,
                     help="fraction of batches the target writes itself, half greedy and half sampled at "
                          "temperature 1; the rest are corpus windows (default 0.5)")
    eag.add_argument("--noise", type=float, default=0.2,
                     help="half-width of the uniform noise added to the input features (default 0.2)")
    eag.add_argument("--cls-weight", type=float, default=0.5,
                     help="weight of the cross-entropy against the target's distribution next to the feature "
                          "regression (default 0.5)")
    eag.add_argument("--bf16", action="store_true", help="bf16 autocast for the frozen target's forward")
    eag.add_argument("--cache-dir", default="runs/cache", help="tokenised-corpus cache folder (default runs/cache)")
    acceptance_options(eag, "length of the story openings the target continues (default 8)")
    common(eag, steps=1500, lr=1e-3)
    eag.set_defaults(func=cmd_eagle)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (TrainError, CheckpointError, UnknownCheckpointError, ConfigError, FileNotFoundError) as err:
        print(f"error: {err}".splitlines()[0], file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
