"""Train the shipped tiny pair: a SentencePiece tokenizer, LLaMA models from scratch, and
a draft distilled toward its target (DistillSpec, Zhou et al. 2023).

    python train.py tokenizer --corpus A.txt B.txt --vocab-size 2048 --out runs/tok
    python train.py pretrain  --corpus A.txt B.txt --tokenizer runs/tok/tokenizer.model --out runs/target ...
    python train.py distill   --target runs/target/hf --draft runs/draft/hf --corpus A.txt --out runs/distill ...
    python train.py eagle     --target tiny-target --corpus A.txt --eval-corpus B.txt --out runs/eagle ...
    python train.py eagle3    --target tiny-target --corpus A.txt --eval-corpus B.txt --out runs/eagle3 ...
    python train.py parallel  --target tiny-target --draft tiny-draft --corpus A.txt --eval-corpus B.txt ...
    python train.py peagle    --target tiny-target --head tiny-eagle3 --corpus A.txt --eval-corpus B.txt ...

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
import sys
import time
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch

from model import ConfigError, Llama, ModelConfig
from model.eagle3_head import Eagle3Head, PEagleHead, default_layers
from model.feature_head import FeatureHead
from model.training import evaluate, fit, init_weights, lr_at, next_token_loss, random_batch
from speculative import FeatureDrafter
from speculative.draft.distill import DIVERGENCES, distill_loss, eagle_losses, sample_sequences
from speculative.draft.parallel import ParallelDrafter, ParallelFeatureDrafter
from speculative.draft.parallel_training import parallel_losses, peagle_losses, with_mask_token
from speculative.draft.ttt import draft_vocabulary, ttt_losses
from speculative.engine.generation import ACCEPTANCE_NOTES, measure_acceptance
from weights import CheckpointError, Tokenizer, UnknownCheckpointError, load_model, load_tokenizer
from weights.corpus import held_out_prompts, read_documents, story_openings, tokenize_corpus
from weights.drafters import load_feature_head, save_feature_head
from weights.eagle3 import load_eagle3_head, save_eagle3_head
from weights.runs import RunFolder, RunFolderError

# Held-out loss: log.jsonl's eval_loss, every --eval-every steps, averages LOG_EVAL_BATCHES
# batches of EVAL_BATCH windows; summary.json's held_out_loss, once at the end, averages
# FINAL_EVAL_BATCHES. The windows are drawn from one fixed seed, so the log's are the first
# of the summary's, and both files name how many they average.
EVAL_BATCH, LOG_EVAL_BATCHES, FINAL_EVAL_BATCHES = 8, 8, 32

# config.json names -> the pretrain flags that set them, for the error about another run's shape.
SHAPE_FLAGS = {"hidden_size": "--dim", "num_hidden_layers": "--n-layers", "num_attention_heads": "--n-heads",
               "num_key_value_heads": "--n-kv-heads", "intermediate_size": "--hidden-dim",
               "max_position_embeddings": "--max-seq-len", "tie_word_embeddings": "--tie",
               "vocab_size": "vocab_size (the tokenizer's)"}


class TrainError(ValueError):
    """Bad input to train.py; reported as one ``error:`` line with exit status 2."""


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

    e3 = sub.add_parser("eagle3", help="train an EAGLE-3 head: fused features of three target layers, training-"
                                       "time test, the target's own continuations, a reduced vocabulary")
    e3.add_argument("--target", required=True, help="target checkpoint (name or HF-layout folder)")
    e3.add_argument("--corpus", nargs="+", required=True,
                    help="training text files: story openings for the target to continue (and windows, with "
                         "--data corpus)")
    e3.add_argument("--eval-corpus", nargs="+", required=True, help="held-out files for the acceptance prompts")
    e3.add_argument("--data", choices=["target", "corpus"], default="target",
                    help="what the head trains on: the target's own continuations of story openings, written "
                         "once to the run folder (data.pt) and reused, or corpus windows (default target)")
    e3.add_argument("--sequences", type=int, default=2048,
                    help="continuations the target writes for --data target, half greedy and half sampled at "
                         "temperature 1 (default 2048)")
    e3.add_argument("--seq-len", type=int, default=128, help="tokens per training sequence (default 128)")
    e3.add_argument("--ttt-steps", type=int, default=7,
                    help="drafting steps unrolled in training (training-time test; 1: none) (default 7)")
    e3.add_argument("--ttt-decay", type=float, default=0.8, help="weight of step k's loss is decay^k (default 0.8)")
    e3.add_argument("--loss", choices=["soft-ce", "regression"], default="soft-ce",
                    help="soft cross-entropy against the target's distribution, or EAGLE-1's smooth-L1 feature "
                         "regression plus 0.5 x that cross-entropy (default soft-ce)")
    e3.add_argument("--draft-vocab", type=int, default=1024,
                    help="ids of the head's own output layer: the most frequent in the data (0: the target's whole "
                         "vocabulary) (default 1024)")
    e3.add_argument("--layers", default=None,
                    help="the three target layers whose inputs are fused, as I,J,K (default 2, N/2, N-3)")
    e3.add_argument("--bf16", action="store_true", help="bf16 autocast for the frozen target's forward")
    e3.add_argument("--cache-dir", default="runs/cache", help="tokenised-corpus cache folder (default runs/cache)")
    acceptance_options(e3, "length of the story openings the target continues (default 8)")
    common(e3, steps=1500, lr=1e-3)
    e3.set_defaults(func=cmd_eagle3)

    par = sub.add_parser("parallel", help="adapt a draft model to parallel drafting (PARD): a mask token, gamma "
                                          "tokens from one call, trained with conditional drop")
    par.add_argument("--target", required=True, help="target checkpoint (name or HF-layout folder)")
    par.add_argument("--draft", required=True, help="draft checkpoint to adapt (or a parallel draft to go on with)")
    par.add_argument("--corpus", nargs="+", required=True,
                     help="text files: story openings the target continues, or the text itself (--data corpus)")
    par.add_argument("--eval-corpus", nargs="+", required=True, help="held-out files for the acceptance prompts")
    par.add_argument("--data", choices=["target", "corpus"], default="target",
                     help="train on the target's own continuations (written once to data.pt) or on corpus text "
                          "(default target)")
    par.add_argument("--sequences", type=int, default=2048,
                     help="continuations the target writes (default 2048; a run folder holding more reuses them)")
    par.add_argument("--seq-len", type=int, default=128, help="tokens per training sequence (default 128)")
    par.add_argument("--depths", type=int, default=8, help="draft positions trained, 1 real + masks (default 8)")
    par.add_argument("--keep", type=float, default=0.8,
                     help="conditional drop: depth d keeps keep^d of the anchors (default 0.8)")
    par.add_argument("--min-keep", type=float, default=0.2, help="... and at least this share (default 0.2)")
    par.add_argument("--bf16", action="store_true", help="bf16 autocast for the frozen target's forward")
    par.add_argument("--cache-dir", default="runs/cache", help="tokenised-corpus cache folder (default runs/cache)")
    acceptance_options(par, "length of the story openings the target continues (default 8)")
    common(par, steps=1500, lr=5e-4)
    par.set_defaults(func=cmd_parallel)

    pe = sub.add_parser("peagle", help="adapt an EAGLE-3 head to parallel drafting (P-EAGLE): a mask feature and "
                                       "embedding, the whole chain from one head call, trained with conditional drop")
    pe.add_argument("--target", required=True, help="target checkpoint (name or HF-layout folder)")
    pe.add_argument("--head", required=True, help="the EAGLE-3 head to adapt (or a P-EAGLE head to go on with)")
    pe.add_argument("--corpus", nargs="+", required=True, help="text files whose story openings the target continues")
    pe.add_argument("--eval-corpus", nargs="+", required=True, help="held-out files for the acceptance prompts")
    pe.add_argument("--sequences", type=int, default=2048,
                    help="continuations the target writes (default 2048; a run folder holding more reuses them)")
    pe.add_argument("--seq-len", type=int, default=128, help="tokens per training sequence (default 128)")
    pe.add_argument("--depths", type=int, default=8, help="draft positions trained, 1 real + masks (default 8)")
    pe.add_argument("--keep", type=float, default=0.8,
                    help="conditional drop: depth d keeps keep^d of the anchors (default 0.8)")
    pe.add_argument("--min-keep", type=float, default=0.2, help="... and at least this share (default 0.2)")
    pe.add_argument("--mask-id", type=int, default=0,
                    help="the target id whose embedding row the mask takes in the written file (default 0, <unk>)")
    pe.add_argument("--bf16", action="store_true", help="bf16 autocast for the frozen target's forward")
    acceptance_options(pe, "length of the story openings the target continues (default 8)")
    common(pe, steps=600, lr=5e-4)
    pe.set_defaults(func=cmd_peagle)
    return parser


# ----------------------------------------------------------------------------- what every command does
def seed_everything(args: argparse.Namespace) -> None:
    """--seed for every random number generator, and --threads."""
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)


def frozen_target(args: argparse.Namespace) -> Llama:
    """Seeds and threads, and the target with gradients off: the start of the two commands
    that train something against a frozen target."""
    seed_everything(args)
    target = load_model(args.target).eval()
    target.requires_grad_(False)
    return target


def adamw(params: object, args: argparse.Namespace) -> torch.optim.Optimizer:
    """The optimizer of distill and eagle: AdamW at --lr, no weight decay."""
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))


def start_run(args: argparse.Namespace, model: torch.nn.Module,
              optimizer: torch.optim.Optimizer) -> tuple[RunFolder, torch.Generator, int]:
    """The --out folder, the data generator, and the step to start from (state.pt's, if any)."""
    run, gen = RunFolder(args.out), torch.Generator().manual_seed(args.seed)
    step = run.load_state(model, optimizer, gen, SHAPE_FLAGS)
    if step:
        print(f"resuming from {run.out / 'state.pt'} at step {step}")
    return run, gen, step


def finish(run: RunFolder, summary: dict, hf: Path) -> None:
    """summary.json, and the summary and the checkpoint's folder on stdout."""
    run.write_json("summary.json", summary)
    print(json.dumps(summary))
    print(f"wrote {hf}")


# ----------------------------------------------------------------------------- tokenizer
def cmd_tokenizer(args: argparse.Namespace) -> None:
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
    seed_everything(args)
    tokenizer = Tokenizer(args.tokenizer)
    train_data = tokenize_corpus(args.corpus, tokenizer, args.cache_dir)
    eval_data = tokenize_corpus(args.eval_corpus, tokenizer, args.cache_dir) if args.eval_corpus else None
    config = ModelConfig(vocab_size=tokenizer.vocab_size, dim=args.dim, n_layers=args.n_layers,
                         n_heads=args.n_heads, n_kv_heads=args.n_kv_heads or args.n_heads,
                         hidden_dim=args.hidden_dim, max_seq_len=args.max_seq_len, norm_eps=1e-5,
                         tie_word_embeddings=args.tie, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
    model = Llama(config)
    init_weights(model, config.n_layers)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices decay; norms do not
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    run, gen, step = start_run(args, model, optimizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters; corpus: {len(train_data):,} tokens"
          + (f"; held-out: {len(eval_data):,} tokens" if eval_data is not None else ""))

    def batch_loss(step: int) -> tuple[torch.Tensor, dict, int]:
        x, y = random_batch(train_data, args.batch_size, args.seq_len, gen)
        return next_token_loss(model, x, y, args.bf16), {"lr": lr_at(step, args.lr, args.warmup, args.steps)}, x.numel()

    def held_out(step: int) -> dict:
        if eval_data is None or (step % args.eval_every and step != args.steps):
            return {}
        return {"eval_loss": evaluate(model, eval_data, args.seq_len, LOG_EVAL_BATCHES, EVAL_BATCH),
                "eval_windows": LOG_EVAL_BATCHES * EVAL_BATCH}

    step = fit(model, optimizer, gen, run, start=step, steps=args.steps, lr=args.lr, warmup=args.warmup,
               batch_loss=batch_loss, after=held_out, save_every=args.save_every, title=f"pretrain {run.out.name}",
               desc="pretrain", progress=not args.no_progress,
               show=lambda row: {"loss": f"{row['loss']:.3f}", "tok_s": f"{row['tokens_per_s']:.0f}"})
    model.eval()
    hf = run.export(model, args.tokenizer, getattr(torch, args.save_dtype))
    summary = {"parameters": n_params, "steps": step, "final_train_loss": run.tail_loss()}
    if eval_data is not None:
        summary["held_out_loss"] = evaluate(model, eval_data, args.seq_len, FINAL_EVAL_BATCHES, EVAL_BATCH)
        summary["held_out_windows"] = FINAL_EVAL_BATCHES * EVAL_BATCH
        summary["held_out_perplexity"] = math.exp(summary["held_out_loss"])
        summary["note"] = (f"held_out_loss averages {summary['held_out_windows']} fixed held-out windows of "
                           f"--seq-len tokens; log.jsonl's eval_loss averages the first "
                           f"{LOG_EVAL_BATCHES * EVAL_BATCH} of them (eval_windows), so at the same step the two "
                           "differ a little")
    finish(run, summary, hf)


# ----------------------------------------------------------------------------- distill
def cmd_distill(args: argparse.Namespace) -> None:
    target = frozen_target(args)
    draft = load_model(args.draft)
    tokenizer = load_tokenizer(args.target)
    if draft.config.vocab_size != target.config.vocab_size:
        raise TrainError(f"the draft's vocabulary ({draft.config.vocab_size}) differs from the target's "
                         f"({target.config.vocab_size})")
    # Prompts are story openings of --prompt-tokens tokens, so that a batch needs no padding.
    openings = story_openings(args.corpus, tokenizer, args.prompt_tokens)
    if len(openings) < args.batch_size:
        raise TrainError(f"the corpus has fewer than {args.batch_size} stories of {args.prompt_tokens}+ tokens")
    eval_prompts = held_out_prompts(args.eval_corpus, tokenizer, args.eval_prompts, args.prompt_tokens, args.seed)
    optimizer = adamw(draft.parameters(), args)
    run, gen, step = start_run(args, draft, optimizer)
    if step == 0:
        before = measure_acceptance(target, draft, eval_prompts, args.eval_new_tokens, args.gamma, args.seed)
        run.write_json("before.json", before)
        print(f"before distillation: {before}")
    rng = random.Random(args.seed + step)

    def batch_loss(step: int) -> tuple[torch.Tensor, dict, int]:
        prompts = rng.sample(openings, args.batch_size)
        # On-policy data (DistillSpec): sequences the draft itself generates; with probability
        # --target-mix the target writes them instead.
        writer = target if rng.random() < args.target_mix else draft
        draft.eval()
        sequences = sample_sequences(writer, prompts, args.gen_tokens, gen)
        draft.train()
        return distill_loss(args.divergence, target, draft, sequences, args.prompt_tokens), {}, sequences.numel()

    step = fit(draft, optimizer, gen, run, start=step, steps=args.steps, lr=args.lr, warmup=args.warmup,
               batch_loss=batch_loss, save_every=args.save_every, title=f"distill {args.divergence}",
               desc=f"distill ({args.divergence})", progress=not args.no_progress)
    draft.eval()
    after = measure_acceptance(target, draft, eval_prompts, args.eval_new_tokens, args.gamma, args.seed)
    hf = run.export(draft, load_tokenizer(args.draft).path, getattr(torch, args.save_dtype))
    finish(run, {"divergence": args.divergence, "steps": step, "before": run.read_json("before.json"),
                 "after": after, "notes": ACCEPTANCE_NOTES}, hf)


# ----------------------------------------------------------------------------- eagle
def cmd_eagle(args: argparse.Namespace) -> None:
    target = frozen_target(args)
    tokenizer = load_tokenizer(args.target)
    train_data = tokenize_corpus(args.corpus, tokenizer, args.cache_dir)
    # The head is one block of the target's own shape (EAGLE-1), with the target's context length.
    head = FeatureHead(ModelConfig(**{**vars(target.config), "n_layers": 1, "extra": {}}))
    init_weights(head, 1)
    head.train()
    openings = story_openings(args.corpus, tokenizer, args.prompt_tokens)
    eval_prompts = held_out_prompts(args.eval_corpus, tokenizer, args.eval_prompts, args.prompt_tokens, args.seed)
    optimizer = adamw(head.parameters(), args)
    run, gen, step = start_run(args, head, optimizer)
    rng = random.Random(args.seed + step)
    print(f"head: {sum(p.numel() for p in head.parameters()):,} parameters; corpus: {len(train_data):,} tokens")

    def batch_loss(step: int) -> tuple[torch.Tensor, dict, int]:
        # Text the target writes itself (greedy or sampled, as it will decode) or corpus text.
        kind = rng.random()
        if kind < args.self_mix:
            prompts = rng.sample(openings, args.batch_size)
            tokens = sample_sequences(target, prompts, args.seq_len - args.prompt_tokens, gen,
                                      greedy=kind < args.self_mix / 2)
        else:
            tokens = random_batch(train_data, args.batch_size, args.seq_len, gen)[0]
        regression, classification = eagle_losses(head, target, tokens, args.noise, gen, args.bf16)
        extra = {"regression": regression.item(), "classification": classification.item(),
                 "self_written": kind < args.self_mix}
        return regression + args.cls_weight * classification, extra, tokens.numel()

    step = fit(head, optimizer, gen, run, start=step, steps=args.steps, lr=args.lr, warmup=args.warmup,
               batch_loss=batch_loss, save_every=args.save_every, title="eagle head", desc="eagle",
               progress=not args.no_progress,
               show=lambda row: {"reg": f"{row['regression']:.4f}", "cls": f"{row['classification']:.3f}",
                                 "tok_s": f"{row['tokens_per_s']:.0f}"})
    head.eval()
    hf = save_feature_head(head, run.out / "hf", target, dtype=getattr(torch, args.save_dtype),
                           target_name=args.target)
    # Measure what will ship: the head as saved (rounded to --save-dtype), read back.
    drafter = FeatureDrafter(load_feature_head(hf, target, args.target), target)
    after = measure_acceptance(target, drafter, eval_prompts, args.eval_new_tokens, args.gamma, args.seed)
    finish(run, {"steps": step, "gamma": args.gamma, "held_out": after}, hf)


# ----------------------------------------------------------------------------- eagle3
def target_continuations(run: RunFolder, target: Llama, openings: list[list[int]], args: argparse.Namespace,
                         gen: torch.Generator) -> torch.Tensor:
    """data.pt of the run folder: --sequences continuations the frozen target writes after story
    openings, half greedy and half sampled at temperature 1, written once and reused (a resumed
    run, or another run pointed at the same folder, reads them back)."""
    path = run.out / "data.pt"
    if path.is_file():
        data = torch.load(path, weights_only=True)
        if data.shape[1] == args.seq_len and len(data) >= args.sequences:
            return data[:args.sequences]
    rng, chunks, chunk = random.Random(args.seed), [], 64
    print(f"the target writes {args.sequences} continuations of {args.seq_len - args.prompt_tokens} tokens "
          f"into {path} (once)")
    with torch.inference_mode():
        for start in range(0, args.sequences, chunk):
            prompts = [rng.choice(openings) for _ in range(min(chunk, args.sequences - start))]
            greedy = (start // chunk) % 2 == 0
            chunks.append(sample_sequences(target, prompts, args.seq_len - args.prompt_tokens, gen, greedy=greedy))
    data = torch.cat(chunks)
    torch.save(data, path)
    return data


def cmd_eagle3(args: argparse.Namespace) -> None:
    target = frozen_target(args)
    tokenizer = load_tokenizer(args.target)
    n = target.config.n_layers
    try:
        layers = tuple(int(i) for i in args.layers.split(",")) if args.layers else default_layers(n)
    except ValueError:
        raise TrainError(f"--layers takes three layer ids as I,J,K, got {args.layers!r}") from None
    if len(layers) != 3 or not all(0 <= i < n for i in layers):
        raise TrainError(f"--layers takes three layer ids in 0..{n - 1}, got {args.layers}")
    if not 1 <= args.ttt_steps < args.seq_len or not 0 <= args.draft_vocab <= target.config.vocab_size:
        raise TrainError(f"--ttt-steps must lie in 1..{args.seq_len - 1} and --draft-vocab in 0.."
                         f"{target.config.vocab_size}")
    openings = story_openings(args.corpus, tokenizer, args.prompt_tokens)
    eval_prompts = held_out_prompts(args.eval_corpus, tokenizer, args.eval_prompts, args.prompt_tokens, args.seed)
    run = RunFolder(args.out)
    data_gen = torch.Generator().manual_seed(args.seed + 1)
    if args.data == "target":
        data = target_continuations(run, target, openings, args, data_gen)
        counted = data[:, args.prompt_tokens:]
    else:
        corpus = tokenize_corpus(args.corpus, tokenizer, args.cache_dir)
        counted = torch.from_numpy(corpus[:2_000_000].astype(np.int64))
    vocab = args.draft_vocab or target.config.vocab_size
    kept, coverage = draft_vocabulary(counted, target.config.vocab_size, vocab)
    # The head: one block of the target's shape, its output layer started from the target's rows.
    head = Eagle3Head(ModelConfig(**{**vars(target.config), "n_layers": 1, "extra": {}}), layers, draft_vocab=vocab)
    init_weights(head, 1)
    with torch.no_grad():
        head.set_vocabulary(kept)
        head.lm_head.weight.copy_(target.lm_head.weight[kept])
        head.norm.weight.copy_(target.norm.weight)
    head.train()
    optimizer = adamw([p for p in head.parameters() if p.requires_grad], args)
    run, gen, step = start_run(args, head, optimizer)
    rng = random.Random(args.seed + step)
    print(f"head: {sum(p.numel() for p in head.parameters()):,} parameters; target layers {list(layers)}; draft "
          f"vocabulary {vocab} ids covering {coverage:.1%} of the training tokens; data: {args.data}")

    def batch_loss(step: int) -> tuple[torch.Tensor, dict, int]:
        if args.data == "target":
            tokens = data[torch.tensor(rng.sample(range(len(data)), args.batch_size))]
        else:
            tokens = random_batch(corpus, args.batch_size, args.seq_len, gen)[0]
        loss, per_step = ttt_losses(head, target, tokens, args.ttt_steps, decay=args.ttt_decay,
                                    regression=args.loss == "regression", bf16=args.bf16)
        return loss, {"loss_by_depth": per_step["loss"], "alpha_by_depth": per_step["alpha"]}, tokens.numel()

    start = time.perf_counter()
    step = fit(head, optimizer, gen, run, start=step, steps=args.steps, lr=args.lr, warmup=args.warmup,
               batch_loss=batch_loss, save_every=args.save_every, title="eagle3 head", desc="eagle3",
               progress=not args.no_progress,
               show=lambda row: {"loss": f"{row['loss']:.3f}", "a1": f"{row['alpha_by_depth'][0]:.2f}",
                                 "a_last": f"{row['alpha_by_depth'][-1]:.2f}", "tok_s": f"{row['tokens_per_s']:.0f}"})
    run.plot_depths("alpha_by_depth", "alpha.png", "training alpha by draft depth (true tokens, own features)")
    head.eval()
    hf = save_eagle3_head(head, run.out / "hf", target, target_name=args.target, dtype=getattr(torch, args.save_dtype))
    # Measure what will ship: the head as saved (rounded to --save-dtype), read back.
    drafter = FeatureDrafter(load_eagle3_head(hf, target, args.target), target)
    after = measure_acceptance(target, drafter, eval_prompts, args.eval_new_tokens, args.gamma, args.seed)
    finish(run, {"steps": step, "gamma": args.gamma, "draft_vocab": vocab, "coverage": coverage,
                 "layers": list(layers), "data": args.data, "loss": args.loss, "ttt_steps": args.ttt_steps,
                 "train_seconds_this_session": time.perf_counter() - start, "held_out": after}, hf)


# ----------------------------------------------------------------------------- parallel
def cmd_parallel(args: argparse.Namespace) -> None:
    target = frozen_target(args)
    tokenizer = load_tokenizer(args.target)
    start_from = load_model(args.draft)
    vocab = target.config.vocab_size
    if "pard_token" in start_from.config.extra:  # a parallel draft already: go on with it
        draft = start_from
    elif start_from.config.vocab_size == vocab:
        draft = with_mask_token(start_from)
    else:
        raise TrainError(f"the draft's vocabulary ({start_from.config.vocab_size}) differs from the target's ({vocab})")
    if not 2 <= args.depths < args.seq_len or not 0 < args.min_keep <= args.keep <= 1:
        raise TrainError(f"--depths must lie in 2..{args.seq_len - 1}, and 0 < --min-keep <= --keep <= 1")
    openings = story_openings(args.corpus, tokenizer, args.prompt_tokens)
    eval_prompts = held_out_prompts(args.eval_corpus, tokenizer, args.eval_prompts, args.prompt_tokens, args.seed)
    run = RunFolder(args.out)
    if args.data == "target":
        data = target_continuations(run, target, openings, args, torch.Generator().manual_seed(args.seed + 1))
    else:
        corpus = tokenize_corpus(args.corpus, tokenizer, args.cache_dir)
    draft.train()
    optimizer = adamw(draft.parameters(), args)
    run, gen, step = start_run(args, draft, optimizer)
    rng = random.Random(args.seed + step)
    mask = draft.config.extra["pard_token"]
    print(f"draft: {sum(p.numel() for p in draft.parameters()):,} parameters, mask id {mask}; {args.depths} draft "
          f"positions per call; data: {args.data}")

    def batch_loss(step: int) -> tuple[torch.Tensor, dict, int]:
        if args.data == "target":
            tokens = data[torch.tensor(rng.sample(range(len(data)), args.batch_size))]
        else:
            tokens = random_batch(corpus, args.batch_size, args.seq_len, gen)[0]
        loss, per_step = parallel_losses(draft, target, tokens, args.depths, keep=args.keep, min_keep=args.min_keep,
                                         gen=gen, bf16=args.bf16)
        return loss, {"loss_by_depth": per_step["loss"], "alpha_by_depth": per_step["alpha"]}, tokens.numel()

    start = time.perf_counter()
    step = fit(draft, optimizer, gen, run, start=step, steps=args.steps, lr=args.lr, warmup=args.warmup,
               batch_loss=batch_loss, save_every=args.save_every, title="parallel draft", desc="parallel",
               progress=not args.no_progress,
               show=lambda row: {"loss": f"{row['loss']:.3f}", "a1": f"{row['alpha_by_depth'][0]:.2f}",
                                 "a4": f"{row['alpha_by_depth'][min(3, len(row['alpha_by_depth']) - 1)]:.2f}",
                                 "tok_s": f"{row['tokens_per_s']:.0f}"})
    run.plot_depths("alpha_by_depth", "alpha.png", "training alpha by draft position (one call, true tokens)")
    draft.eval()
    hf = run.export(draft, load_tokenizer(args.target).path, getattr(torch, args.save_dtype))
    # Measure what will ship: the draft as saved (rounded to --save-dtype), read back.
    shipped = load_model(hf)
    drafter = ParallelDrafter(shipped, shipped.config.extra["pard_token"], vocab)
    after = measure_acceptance(target, drafter, eval_prompts, args.eval_new_tokens, args.gamma, args.seed)
    finish(run, {"steps": step, "gamma": args.gamma, "depths": args.depths, "keep": args.keep,
                 "min_keep": args.min_keep, "data": args.data, "mask_id": mask,
                 "train_seconds_this_session": time.perf_counter() - start, "held_out": after}, hf)


# ----------------------------------------------------------------------------- peagle
def cmd_peagle(args: argparse.Namespace) -> None:
    target = frozen_target(args)
    tokenizer = load_tokenizer(args.target)
    start_from = load_eagle3_head(args.head, target, args.target)
    if not 0 <= args.mask_id < target.config.vocab_size:
        raise TrainError(f"--mask-id must be a target id in 0..{target.config.vocab_size - 1}")
    if not 2 <= args.depths < args.seq_len - 1 or not 0 < args.min_keep <= args.keep <= 1:
        raise TrainError(f"--depths must lie in 2..{args.seq_len - 2}, and 0 < --min-keep <= --keep <= 1")
    if isinstance(start_from, PEagleHead):
        head = start_from
    else:  # the EAGLE-3 head's weights, a mask feature of zeros and the mean embedding as the mask's
        head = PEagleHead(start_from.config, start_from.target_layers, start_from.draft_vocab,
                          start_from.layers[0].norm_before_residual, args.mask_id)
        missing = head.load_state_dict(start_from.state_dict(), strict=False).missing_keys
        assert sorted(missing) == ["mask_embedding", "mask_hidden"], missing
        with torch.no_grad():
            head.mask_embedding.copy_(target.embed_tokens.weight.mean(0))
    head.requires_grad_(True)
    openings = story_openings(args.corpus, tokenizer, args.prompt_tokens)
    eval_prompts = held_out_prompts(args.eval_corpus, tokenizer, args.eval_prompts, args.prompt_tokens, args.seed)
    run = RunFolder(args.out)
    data = target_continuations(run, target, openings, args, torch.Generator().manual_seed(args.seed + 1))
    head.train()
    optimizer = adamw([p for p in head.parameters() if p.requires_grad], args)
    run, gen, step = start_run(args, head, optimizer)
    rng = random.Random(args.seed + step)
    print(f"head: {sum(p.numel() for p in head.parameters()):,} parameters; {args.depths} draft positions per call")

    def batch_loss(step: int) -> tuple[torch.Tensor, dict, int]:
        tokens = data[torch.tensor(rng.sample(range(len(data)), args.batch_size))]
        loss, per_step = peagle_losses(head, target, tokens, args.depths, keep=args.keep, min_keep=args.min_keep,
                                       gen=gen, bf16=args.bf16)
        return loss, {"loss_by_depth": per_step["loss"], "alpha_by_depth": per_step["alpha"]}, tokens.numel()

    start = time.perf_counter()
    step = fit(head, optimizer, gen, run, start=step, steps=args.steps, lr=args.lr, warmup=args.warmup,
               batch_loss=batch_loss, save_every=args.save_every, title="P-EAGLE head", desc="peagle",
               progress=not args.no_progress,
               show=lambda row: {"loss": f"{row['loss']:.3f}", "a1": f"{row['alpha_by_depth'][0]:.2f}",
                                 "a4": f"{row['alpha_by_depth'][min(3, len(row['alpha_by_depth']) - 1)]:.2f}"})
    run.plot_depths("alpha_by_depth", "alpha.png", "training alpha by draft position (one call, true tokens)")
    head.eval()
    hf = save_eagle3_head(head, run.out / "hf", target, target_name=args.target, dtype=getattr(torch, args.save_dtype))
    drafter = ParallelFeatureDrafter(load_eagle3_head(hf, target, args.target), target)
    after = measure_acceptance(target, drafter, eval_prompts, args.eval_new_tokens, args.gamma, args.seed)
    finish(run, {"steps": step, "gamma": args.gamma, "depths": args.depths, "keep": args.keep,
                 "min_keep": args.min_keep, "mask_id": head.mask_token_id,
                 "train_seconds_this_session": time.perf_counter() - start, "held_out": after}, hf)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (TrainError, RunFolderError, CheckpointError, UnknownCheckpointError, ConfigError, FileNotFoundError) as err:
        print(f"error: {err}".splitlines()[0], file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
