"""Train a tokenizer and LLaMA models from scratch, and drafters for a frozen target: a draft distilled toward it
(DistillSpec, Zhou et al. 2023), feature heads (EAGLE, EAGLE-3) and parallel drafters (PARD, P-EAGLE).

    python train.py tokenizer --corpus A.txt B.txt --vocab-size 2048 --out runs/tok
    python train.py pretrain  --corpus A.txt B.txt --tokenizer runs/tok/tokenizer.model --out runs/target ...
    python train.py distill   --target runs/target/hf --draft runs/draft/hf --corpus A.txt --out runs/distill ...
    python train.py eagle     --target tiny-target --corpus A.txt --eval-corpus B.txt --out runs/eagle ...
    python train.py eagle3    --target tiny-target --corpus A.txt --eval-corpus B.txt --out runs/eagle3 ...
    python train.py parallel  --target tiny-target --draft tiny-draft --corpus A.txt --eval-corpus B.txt ...
    python train.py peagle    --target tiny-target --head tiny-eagle3 --corpus A.txt --eval-corpus B.txt ...

A run writes state.pt (resumable), log.jsonl, loss.png and at the end an HF-layout checkpoint, hf/, in its --out
folder; the same command resumes it, and a folder holding a run of another shape is refused. Bad input ends with
status 2 and one ``error: ...`` line. The shipped models' recipes are in their README.md (weights/).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from textwrap import fill
from typing import Any

import numpy as np
import torch
from torch import nn

from model import ConfigError, Llama, ModelConfig
from model.eagle3_head import Eagle3Head, PEagleHead, default_layers
from model.feature_head import FeatureHead, fingerprint
from model.training import (
    decay_groups,
    fit,
    fresh_draft,
    held_out,
    init_weights,
    lr_at,
    next_token_loss,
    random_batch,
)
from speculative.cli.options import ArgumentParser, UsageError, add_flags, pick_device
from speculative.draft import distill
from speculative.draft.parallel_training import (
    parallel_losses,
    peagle_losses,
    with_mask_feature,
    with_mask_token,
)
from speculative.draft.ttt import start_vocabulary, ttt_losses
from speculative.engine.generation import ACCEPTANCE_NOTES, measure_acceptance
from weights import (
    CheckpointError,
    UnknownCheckpointError,
    load_drafter,
    load_model,
    load_tokenizer,
)
from weights.corpus import (
    CorpusError,
    chat_prompts,
    held_out_prompts,
    story_openings,
    tokenize_corpus,
    train_tokenizer,
)
from weights.eagle3 import load_eagle3_head
from weights.runs import RunFolder, RunFolderError
from weights.tokenizer import SentencePieceTokenizer

# config.json names -> the pretrain flags that set them, for the error about another run's shape.
SHAPE_FLAGS = {
    "hidden_size": "--dim",
    "num_hidden_layers": "--n-layers",
    "num_attention_heads": "--n-heads",
    "num_key_value_heads": "--n-kv-heads",
    "intermediate_size": "--hidden-dim",
    "max_position_embeddings": "--max-seq-len",
    "tie_word_embeddings": "--tie",
    "vocab_size": "vocab_size (the tokenizer's)",
}


# ----------------------------------------------------------------------------- the skeleton
def train(args: argparse.Namespace) -> None:
    """Every training command: the frozen target, the model trained, the run folder, the data, the
    loop, the export and the measure. RECIPES[args.command] is what the command changes."""
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    r = RECIPES[args.command]()
    r.a, r.target, r.tokenizer = args, None, None
    r.device = device = pick_device(
        vars(args).get("device", "cpu")
    )  # the data stays here; batches go there
    if r.frozen_target:
        r.target, r.tokenizer = load_model(args.target, device), load_tokenizer(args.target)
        r.target.eval().requires_grad_(False)
    model = r.model = r.build()  # with every check of the arguments: nothing is written yet
    run = r.run = RunFolder(args.out)
    run.check(model, SHAPE_FLAGS)  # another run's folder is refused before anything is made in it
    # The data generators: seeded here for a new run, as state.pt left them for a resumed one.
    r.gen, r.rng = torch.Generator().manual_seed(args.seed), random.Random(args.seed)
    r.data()
    model.to(device).train()
    params = (
        decay_groups(model, args.weight_decay) if "weight_decay" in args else model.parameters()
    )
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    if step := run.load_state(model, optimizer, r.gen, SHAPE_FLAGS, r.rng):
        print(f"resuming from {run.out / 'state.pt'} at step {step}")
    r.start(step)
    r.began = time.perf_counter()
    step = fit(
        model,
        optimizer,
        r.gen,
        run,
        start=step,
        steps=args.steps,
        lr=args.lr,
        warmup=args.warmup,
        batch_loss=r.batch_loss,
        after=getattr(r, "after", None),
        save_every=args.save_every,
        rng=r.rng,
        title=r.title.format(name=run.out.name, **vars(args)),
        desc=r.desc.format(**vars(args)),
        progress=not args.no_progress,
    )
    if r.depth_plot:
        run.plot_depths("alpha_by_depth", "alpha.png", r.depth_plot)
    model.eval()
    hf = run.export(
        model, r.vocabulary, getattr(torch, args.save_dtype), r.target, vars(args).get("target", "")
    )
    summary = r.summary(step, hf)
    run.write_json("summary.json", summary)
    print(json.dumps(summary), f"wrote {hf}", sep="\n")


class Recipe:
    """A training command as what it changes in :func:`train`: ``build`` (the model, every argument checked: nothing
    is written yet), ``data`` (read by the steps, once the run folder fits), ``batch_loss`` (a step's loss, fields
    logged, tokens read), ``after`` (fields logged after a step), the summary. By default a drafter."""

    help = flags = (
        ""  # its subcommand; its flags (OPTIONS), in order, before ACCEPTANCE (with a target) and COMMON
    )
    changes: dict[str, dict] = {}  # its own defaults and helps
    steps, lr, frozen_target, description = 1500, 1e-3, True, None
    # loss.png's title and the progress bar's label (with the arguments), what is said once the state is loaded
    title = desc = about = depth_plot = (
        ""  # (with the recipe's own too), alpha.png's title (alpha_by_depth logged)
    )
    vocabulary, timed = (
        None,
        False,
    )  # a checkpoint's tokenizer (None: a head); log this session's seconds
    settings: tuple[str, ...] = ()  # summary.json's, from the recipe's own or the arguments

    def data(
        self,
    ) -> None:  # story openings (prompts of one length: no padding), the held-out prompts
        a = self.a
        if (
            getattr(a, "data", None) == "chat"
        ):  # requests in the target's chat template, about held-out documents
            room = (
                self.target.config.max_seq_len - a.eval_new_tokens - 8
            )  # and a few drafted past the last
            self.eval_prompts = chat_prompts(
                a.eval_corpus, self.tokenizer, a.eval_prompts, a.seed, room
            )
            return
        self.openings = story_openings(a.corpus, self.tokenizer, a.prompt_tokens)
        self.eval_prompts = held_out_prompts(
            a.eval_corpus, self.tokenizer, a.eval_prompts, a.prompt_tokens, a.seed
        )

    def start(self, step: int) -> None:
        self.parameters = sum(p.numel() for p in self.model.parameters())
        print(self.about.format_map({**vars(self.a), **vars(self)}))

    def summary(self, step: int, hf: Path) -> dict:
        """The held-out acceptance of the drafter as saved (rounded to --save-dtype), read back as
        generate.py --draft reads it; the settings; the seconds."""
        a, own = self.a, {**vars(self.a), **vars(self)}
        drafter = load_drafter(hf, self.target, a.target)
        after = measure_acceptance(
            self.target, drafter, self.eval_prompts, a.eval_new_tokens, a.gamma, a.seed
        )
        seconds = (
            {"train_seconds_this_session": time.perf_counter() - self.began} if self.timed else {}
        )
        return {
            "steps": step,
            "gamma": a.gamma,
            **{name: own[name] for name in self.settings},
            **seconds,
            "held_out": after,
        }


# ----------------------------------------------------------------------------- the recipes
class Pretrain(Recipe):
    help = "train a LLaMA of a given shape from scratch (next-token loss)"
    flags = (
        "--corpus --eval-corpus --tokenizer --dim --n-layers --n-heads --n-kv-heads --hidden-dim --tie --seq-len "
        "--max-seq-len --weight-decay --cache-dir --eval-every --bf16"
    )
    changes = {
        "--seq-len": {"default": 256, "help": "training context"},
        "--eval-corpus": {
            "nargs": "*",
            "required": False,
            "default": [],
            "help": "held-out text files for the eval loss (default: none, and no held-out loss)",
        },
        "--bf16": {
            "help": "bf16 autocast for the forward, float32 weights (default: float32 throughout)"
        },
    }
    steps, frozen_target, title, desc = 1000, False, "pretrain {name}", "pretrain"
    about = "model: {parameters:,} parameters; corpus: {corpus_tokens:,} tokens{eval_tokens}"

    def build(self) -> nn.Module:
        a, tokenizer = self.a, SentencePieceTokenizer(self.a.tokenizer)
        config = ModelConfig(
            vocab_size=tokenizer.vocab_size,
            dim=a.dim,
            n_layers=a.n_layers,
            n_heads=a.n_heads,
            n_kv_heads=a.n_kv_heads or a.n_heads,
            hidden_dim=a.hidden_dim,
            max_seq_len=a.max_seq_len,
            norm_eps=1e-5,
            tie_word_embeddings=a.tie,
            bos_id=tokenizer.bos_id,
            eos_id=tokenizer.eos_id,
        )
        self.tokenizer, self.vocabulary = tokenizer, a.tokenizer
        init_weights(model := Llama(config), config.n_layers)
        return model

    def data(self) -> None:
        a = self.a
        self.train_data = tokenize_corpus(a.corpus, self.tokenizer, a.cache_dir)
        self.eval_data = (
            tokenize_corpus(a.eval_corpus, self.tokenizer, a.cache_dir) if a.eval_corpus else None
        )
        self.corpus_tokens = len(self.train_data)
        self.eval_tokens = (
            f"; held-out: {len(self.eval_data):,} tokens" if self.eval_data is not None else ""
        )

    def batch_loss(self, step: int) -> tuple[torch.Tensor, dict, int]:
        a = self.a
        x, y = random_batch(self.train_data, a.batch_size, a.seq_len, self.gen)
        return (
            next_token_loss(self.model, x, y, a.bf16),
            {"lr": lr_at(step, a.lr, a.warmup, a.steps)},
            x.numel(),
        )

    def after(self, step: int) -> dict:
        logged = self.eval_data is not None and (
            step % self.a.eval_every == 0 or step == self.a.steps
        )
        return held_out(self.model, self.eval_data, self.a.seq_len) if logged else {}

    def summary(self, step: int, hf: Path) -> dict:
        final = (
            held_out(self.model, self.eval_data, self.a.seq_len, final=True)
            if self.eval_data is not None
            else {}
        )
        return {
            "parameters": self.parameters,
            "steps": step,
            "final_train_loss": self.run.tail_loss(),
            **final,
        }


class Chain(Recipe):
    """eagle3, parallel, peagle (distill's data too): a drafter trained on the target's own text (data.pt) or corpus
    windows, logging loss and alpha by draft position; parallel and peagle's ``losses`` with conditional drop."""

    lr, timed, depth_plot = 5e-4, True, "training alpha by draft position (one call, true tokens)"
    settings = ("depths", "keep", "min_keep", "data", "mask_id")

    def data(self) -> None:
        super().data()
        a, length, kind = (
            self.a,
            self.a.seq_len - self.a.prompt_tokens,
            getattr(self.a, "data", "target"),
        )
        if kind in (
            "corpus",
            "draft",
        ):  # corpus windows; or none: distill's draft writes its own text
            self.corpus = (
                tokenize_corpus(a.corpus, self.tokenizer, a.cache_dir) if kind == "corpus" else None
            )
            return
        # Another target's text is not this target's: data.pt is made again for it.
        made_from = {
            "target": fingerprint(self.target),
            "seq_len": a.seq_len,
            "prompt_tokens": a.prompt_tokens,
        }
        if (
            kind == "chat"
        ):  # one stream of requests and the target's answers, read in windows as a corpus is
            self.corpus = self.run.answers(
                self.target,
                self.tokenizer,
                a.target,
                a.corpus,
                a.sequences,
                length,
                a.seed,
                made_from,
                self.device,
            ).numpy()
            return
        self.tokens = self.run.data(
            made_from,
            a.sequences,
            lambda: distill.target_continuations(
                self.target, self.openings, a.sequences, length, a.seed
            ),
            f"the target writes {a.sequences} continuations of {length} tokens",
        )

    def batch_loss(self, step: int) -> tuple[torch.Tensor, dict, int]:
        a = (
            self.a
        )  # rows of the target's continuations, or windows of a stream (the corpus, the answers)
        tokens = (
            self.tokens[torch.tensor(self.rng.sample(range(len(self.tokens)), a.batch_size))]
            if getattr(a, "data", "target") == "target"
            else random_batch(self.corpus, a.batch_size, a.seq_len, self.gen)[0]
        )
        loss, per_step = self.objective(tokens.to(self.device))
        return (
            loss,
            {"loss_by_depth": per_step["loss"], "alpha_by_depth": per_step["alpha"]},
            tokens.numel(),
        )

    def objective(self, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
        a = self.a
        return self.losses(
            self.model,
            self.target,
            tokens,
            a.depths,
            keep=a.keep,
            min_keep=a.min_keep,
            gen=self.gen,
            bf16=a.bf16,
        )

    def check_depths(self, most: int) -> None:
        if not 2 <= self.a.depths <= most or not 0 < self.a.min_keep <= self.a.keep <= 1:
            raise UsageError(f"--depths must lie in 2..{most}, and 0 < --min-keep <= --keep <= 1")


class Distill(Chain):
    help = "align a draft with its target on text the draft writes (on-policy) or on the target's answers"
    description = (
        "Distill a draft (without --draft a fresh one) toward its target (DistillSpec, Zhou et al. 2023) on "
        "text it writes, or the target's answers; held-out acceptance before (before.json) and after:"
    )
    flags = (
        "--draft --dim --n-layers --n-heads --n-kv-heads --hidden-dim --corpus --eval-corpus --data --sequences "
        "--seq-len --divergence --target-mix --gen-tokens --bf16 --cache-dir"
    )
    changes = {
        "--draft": {
            "required": False,
            "default": None,
            "help": "draft to start from (default: a fresh one of --dim ... --hidden-dim)",
        },
        "--data": {
            "default": "draft",
            "choices": ["draft", "chat"],
            "help": "the draft's continuations of story openings, or the target's answers to requests (data.pt)",
        },
    }
    steps, lr, title, desc, timed, depth_plot = (
        300,
        3e-4,
        "distill {divergence}",
        "distill ({divergence})",
        False,
        "",
    )

    def build(self) -> nn.Module:
        a, target = self.a, self.target
        draft = (
            load_model(a.draft)
            if a.draft
            else fresh_draft(
                target, a.dim, a.n_layers, a.n_heads, a.n_kv_heads or a.n_heads, a.hidden_dim
            )
        )
        if draft.config.vocab_size != target.config.vocab_size:
            raise UsageError(
                f"the draft's vocabulary ({draft.config.vocab_size}) differs from the target's "
                f"({target.config.vocab_size})"
            )
        self.vocabulary = load_tokenizer(a.draft) if a.draft else self.tokenizer
        return draft

    def start(self, step: int) -> None:
        if (
            self.a.data == "draft" and len(self.openings) < self.a.batch_size
        ):  # nothing is written yet
            raise UsageError(
                f"the corpus has fewer than {self.a.batch_size} stories of {self.a.prompt_tokens}+ tokens"
            )
        if step == 0:
            self.run.write_json("before.json", before := self.measure())
            print(f"before distillation: {before}")

    def measure(
        self,
    ) -> dict:  # the draft as it is, in float32: before and after distillation alike
        a = self.a
        return measure_acceptance(
            self.target, self.model, self.eval_prompts, a.eval_new_tokens, a.gamma, a.seed
        )

    def batch_loss(self, step: int) -> tuple[torch.Tensor, dict, int]:
        a = self.a  # on-policy: the draft writes (the target, --target-mix of the time); or windows of the answers
        tokens = (
            random_batch(self.corpus, a.batch_size, a.seq_len, self.gen)[0]
            if a.data == "chat"
            else distill.on_policy_batch(
                self.model,
                self.target,
                self.openings,
                self.rng,
                self.gen,
                a.batch_size,
                a.gen_tokens,
                a.target_mix,
            )
        )
        start = 1 if a.data == "chat" else a.prompt_tokens
        return (
            distill.distill_loss(a.divergence, self.target, self.model, tokens, start, a.bf16),
            {},
            tokens.numel(),
        )

    def summary(self, step: int, hf: Path) -> dict:
        return {
            "divergence": self.a.divergence,
            "steps": step,
            "before": self.run.read_json("before.json"),
            "after": self.measure(),
            "notes": ACCEPTANCE_NOTES,
        }


class Eagle(Recipe):
    help = "train an EAGLE-style feature head that drafts from the frozen target's own features"
    flags = "--corpus --eval-corpus --seq-len --self-mix --noise --cls-weight --bf16 --cache-dir"
    changes, title, desc = {"--seq-len": {"default": 256}}, "eagle head", "eagle"
    about = "head: {parameters:,} parameters; corpus: {corpus_tokens:,} tokens"

    def build(
        self,
    ) -> nn.Module:  # one block of the target's own shape (EAGLE-1), with its context length
        init_weights(
            head := FeatureHead(
                ModelConfig(**{**vars(self.target.config), "n_layers": 1, "extra": {}})
            ),
            1,
        )
        return head

    def data(self) -> None:
        self.train_data = tokenize_corpus(self.a.corpus, self.tokenizer, self.a.cache_dir)
        self.corpus_tokens = len(self.train_data)
        super().data()

    def batch_loss(self, step: int) -> tuple[torch.Tensor, dict, int]:
        a = self.a  # the target's own text (--self-mix of the time) or corpus windows
        tokens, written = distill.eagle_batch(
            self.target,
            self.openings,
            self.train_data,
            self.rng,
            self.gen,
            a.batch_size,
            a.seq_len,
            a.self_mix,
        )
        regression, classification = distill.eagle_losses(
            self.model, self.target, tokens, a.noise, self.gen, a.bf16
        )
        extra = {
            "regression": regression.item(),
            "classification": classification.item(),
            "self_written": written,
        }
        return regression + a.cls_weight * classification, extra, tokens.numel()


class Eagle3(Chain):
    help = (
        "train an EAGLE-3 head: fused features of three target layers, training-time test, the target's own "
        "continuations, a reduced vocabulary"
    )
    flags = (
        "--corpus --eval-corpus --data --sequences --seq-len --ttt-steps --ttt-decay --loss --draft-vocab "
        "--layers --bf16 --device --cache-dir"
    )
    lr, title, desc = 1e-3, "eagle3 head", "eagle3"
    depth_plot = "training alpha by draft depth (true tokens, own features)"
    about = (
        "head: {parameters:,} parameters; target layers {layers}; draft vocabulary {draft_vocab} ids covering "
        "{coverage:.1%} of the training tokens; data: {data}"
    )
    settings = ("draft_vocab", "coverage", "layers", "data", "loss", "ttt_steps")

    def build(self) -> nn.Module:
        a, n, vocab = self.a, self.target.config.n_layers, self.target.config.vocab_size
        try:
            layers = tuple(int(i) for i in a.layers.split(",")) if a.layers else default_layers(n)
        except ValueError:
            raise UsageError(f"--layers takes three layer ids as I,J,K, got {a.layers!r}") from None
        if len(layers) != 3 or not all(0 <= i < n for i in layers):
            raise UsageError(f"--layers takes three layer ids in 0..{n - 1}, got {a.layers}")
        if not 1 <= a.ttt_steps < a.seq_len or not 0 <= a.draft_vocab <= vocab:
            raise UsageError(
                f"--ttt-steps must lie in 1..{a.seq_len - 1} and --draft-vocab in 0..{vocab}"
            )
        self.layers, self.draft_vocab = list(layers), a.draft_vocab or vocab
        config = ModelConfig(
            **{**vars(self.target.config), "n_layers": 1, "extra": {}}
        )  # one block of its shape
        init_weights(head := Eagle3Head(config, layers, draft_vocab=self.draft_vocab), 1)
        return head

    def data(self) -> None:  # and the head's vocabulary: the ids most frequent in it
        super().data()
        counted = (
            self.tokens[:, self.a.prompt_tokens :]
            if self.a.data == "target"
            else torch.from_numpy(self.corpus[:2_000_000].astype(np.int64))
        )
        self.coverage = start_vocabulary(self.model, self.target, counted)

    def objective(self, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
        a = self.a
        return ttt_losses(
            self.model,
            self.target,
            tokens,
            a.ttt_steps,
            decay=a.ttt_decay,
            regression=a.loss == "regression",
            bf16=a.bf16,
        )


class Parallel(Chain):
    help = (
        "adapt a draft model to parallel drafting (PARD): a mask token, gamma tokens from one call, trained with "
        "conditional drop"
    )
    flags = (
        "--draft --corpus --eval-corpus --data --sequences --seq-len --depths --keep --min-keep --bf16 --device "
        "--cache-dir"
    )
    changes = {"--draft": {"help": "draft checkpoint to adapt (or a parallel draft to go on with)"}}
    title, desc, losses = "parallel draft", "parallel", staticmethod(parallel_losses)
    about = "draft: {parameters:,} parameters, mask id {mask_id}; {depths} draft positions per call; data: {data}"

    def build(self) -> nn.Module:
        start_from, vocab = load_model(self.a.draft), self.target.config.vocab_size
        parallel = (
            "pard_token" in start_from.config.extra
        )  # a parallel draft already: go on with it
        if not parallel and start_from.config.vocab_size != vocab:
            raise UsageError(
                f"the draft's vocabulary ({start_from.config.vocab_size}) differs from the target's "
                f"({vocab})"
            )
        draft = start_from if parallel else with_mask_token(start_from)
        self.check_depths(self.a.seq_len - 1)
        self.mask_id, self.vocabulary = draft.config.extra["pard_token"], self.tokenizer
        return draft


class PEagle(Chain):
    help = (
        "adapt an EAGLE-3 head to parallel drafting (P-EAGLE): a mask feature and embedding, the whole chain "
        "from one head call, trained with conditional drop"
    )
    flags = (
        "--head --corpus --eval-corpus --data --sequences --seq-len --depths --keep --min-keep --mask-id --bf16 "
        "--device"
    )
    steps, title, desc, losses = 600, "P-EAGLE head", "peagle", staticmethod(peagle_losses)
    about = "head: {parameters:,} parameters; {depths} draft positions per call; data: {data}"

    def build(self) -> nn.Module:
        a, target = self.a, self.target
        start_from = load_eagle3_head(a.head, target, a.target)
        if not 0 <= a.mask_id < target.config.vocab_size:
            raise UsageError(f"--mask-id must be a target id in 0..{target.config.vocab_size - 1}")
        self.check_depths(a.seq_len - 2)
        try:  # the EAGLE-3 head's weights, a mask feature of zeros and the mean embedding as the mask's
            head = (
                start_from
                if isinstance(start_from, PEagleHead)
                else with_mask_feature(start_from, a.mask_id, target.embed_tokens.weight.mean(0))
            )
        except ValueError as err:
            raise UsageError(f"{a.head}: {err}") from None
        self.mask_id = head.mask_token_id
        return head.requires_grad_(True)


RECIPES = {
    recipe.__name__.lower(): recipe
    for recipe in (Pretrain, Distill, Eagle, Eagle3, Parallel, PEagle)
}


# ----------------------------------------------------------------------------- the command line
# Every flag once (cli.options.add_flags): a recipe takes --target (if it has one), its flags, ACCEPTANCE, COMMON.
OPTIONS: dict[str, Any] = {
    "--target": dict(required=True, help="target checkpoint (name or HF-layout folder)"),
    "--draft": dict(required=True, help="draft checkpoint to start from"),
    "--head": dict(
        required=True, help="the EAGLE-3 head to adapt (or a P-EAGLE head to go on with)"
    ),
    "--corpus": dict(
        nargs="+",
        required=True,
        help="training text: its story openings, requests about it, windows",
    ),
    "--eval-corpus": dict(
        nargs="+", required=True, help="held-out files for the acceptance prompts"
    ),
    "--tokenizer": dict(required=True, help="tokenizer.model from `train.py tokenizer`"),
    "--dim": (int, 288, "hidden size"),
    "--n-layers": (int, 6, "transformer blocks"),
    "--n-heads": (int, 6, "query heads; they must divide --dim"),
    "--n-kv-heads": (
        int,
        None,
        "KV heads, dividing --n-heads: fewer is grouped-query attention (default: --n-heads)",
    ),
    "--hidden-dim": (int, 768, "SwiGLU inner size"),
    "--seq-len": (int, 128, "tokens per training sequence"),
    "--tie": dict(
        action="store_true", help="tie the output head to the embeddings (default: untied)"
    ),
    "--max-seq-len": (int, 1024, "max_position_embeddings written to config.json"),
    "--weight-decay": (float, 0.1, "AdamW weight decay of the matrices; norms and biases get none"),
    "--eval-every": (
        int,
        50,
        "log the held-out loss (eval_loss; summary.json's held_out_loss: more) every N steps",
    ),
    "--divergence": (
        str,
        "tv",
        "D(p_target || q_draft) per token (1 - TV: acceptance)",
        sorted(distill.DIVERGENCES),
    ),
    "--target-mix": (
        float,
        0.0,
        "fraction of batches generated by the target instead of the draft (default 0)",
    ),
    "--self-mix": (
        float,
        0.5,
        "share of batches the target writes (half greedy, half at T=1); else corpus windows",
    ),
    "--noise": (float, 0.2, "half-width of the uniform noise added to the input features"),
    "--cls-weight": (
        float,
        0.5,
        "weight of the cross-entropy against the target's distribution, beside regression",
    ),
    "--data": (
        str,
        "target",
        "the target's continuations of story openings or answers to requests about the corpus "
        "(made once: data.pt), or corpus windows",
        ["target", "chat", "corpus"],
    ),
    "--sequences": (
        int,
        2048,
        "continuations the target writes, half greedy, half at T=1 (data.pt's are reused)",
    ),
    "--ttt-steps": (int, 7, "drafting steps unrolled in training (training-time test; 1: none)"),
    "--ttt-decay": (float, 0.8, "weight of step k's loss is decay^k"),
    "--loss": (
        str,
        "soft-ce",
        "soft cross-entropy, or EAGLE-1's regression + 0.5 x it",
        ["soft-ce", "regression"],
    ),
    "--draft-vocab": (
        int,
        1024,
        "ids in the head's output layer: the data's most frequent (0: the target's all)",
    ),
    "--layers": (
        str,
        None,
        "the three target layers whose inputs are fused, as I,J,K (default 2, N/2, N-3)",
    ),
    "--depths": (int, 8, "draft positions trained, 1 real + masks"),
    "--keep": (float, 0.8, "conditional drop: depth d keeps keep^d of anchors"),
    "--min-keep": (float, 0.2, "at least"),
    "--mask-id": (
        int,
        0,
        "the target id whose embedding row the mask takes in the written file (default 0, <unk>)",
    ),
    "--bf16": dict(
        action="store_true",
        help="bf16 autocast for the frozen target's forward (and an EAGLE-3 head's)",
    ),
    "--device": (
        str,
        "cpu",
        "where the target and the drafter compute (cuda: a GPU); the data stays in memory here",
    ),
    "--cache-dir": (str, "runs/cache", "tokenised corpora"),
    "--gen-tokens": (int, 128, "tokens written per sequence"),
    "--prompt-tokens": (
        int,
        8,
        "length of the story openings (the prompts)",
    ),  # ACCEPTANCE from here
    "--gamma": (int, 4, "gamma of the acceptance runs"),
    "--eval-prompts": (int, 16, "held-out prompts for them"),
    "--eval-new-tokens": (int, 64, "tokens generated per held-out prompt"),
    "--out": dict(
        required=True, help="run folder: state.pt, log.jsonl, loss.png, hf/"
    ),  # COMMON from here
    "--steps": (int, None, "optimizer steps"),
    "--lr": (float, None, "peak learning rate"),
    "--warmup": (int, 20, "linear warmup steps"),
    "--batch-size": (int, 16, "sequences per step"),
    "--seed": (int, 0, "seed for data order and init"),
    "--save-every": (int, 50, "write state.pt every N steps"),
    "--save-dtype": (
        str,
        "float16",
        "dtype of the exported safetensors",
        ["float16", "bfloat16", "float32"],
    ),
    "--threads": (int, torch.get_num_threads(), "torch CPU threads (default: torch's choice here)"),
    "--no-progress": dict(action="store_true", help="no progress bar (default: a tqdm bar)"),
}
ACCEPTANCE, COMMON = list(OPTIONS)[-14:-10], list(OPTIONS)[-10:]


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    tok = sub.add_parser("tokenizer", help="train a SentencePiece BPE tokenizer on a text corpus")
    tok.add_argument(
        "--corpus", nargs="+", required=True, help="text files (stories split on <|endoftext|>)"
    )
    tok.add_argument("--vocab-size", type=int, default=2048, help="number of pieces (default 2048)")
    tok.add_argument("--out", required=True, help="folder to write tokenizer.model into")
    tok.set_defaults(
        func=lambda args: print(
            "wrote {} ({} pieces, trained on {} documents)".format(
                *train_tokenizer(args.corpus, args.vocab_size, args.out)
            )
        )
    )
    notes = "\n".join(
        fill(n, 88, initial_indent="  ", subsequent_indent="    ")
        for n in ACCEPTANCE_NOTES.values()
    )
    for name, recipe in RECIPES.items():
        description = recipe.description and f"{fill(recipe.description, 88)}\n\n{notes}"
        p = sub.add_parser(
            name,
            help=recipe.help,
            description=description,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        changes = {
            "--steps": {"default": recipe.steps},
            "--lr": {"default": recipe.lr},
            **recipe.changes,
        }
        flags = (
            ["--target", *recipe.flags.split(), *ACCEPTANCE]
            if recipe.frozen_target
            else recipe.flags.split()
        )
        add_flags(p, OPTIONS, flags + COMMON, changes)
        p.set_defaults(func=train)
    return parser


def main(argv: list[str] | None = None) -> None:
    try:
        args = build_parser().parse_args(argv)
        args.func(args)
    except (
        UsageError,
        RunFolderError,
        CheckpointError,
        UnknownCheckpointError,
        ConfigError,
        CorpusError,
        FileNotFoundError,
    ) as err:
        print(f"error: {err}".splitlines()[0], file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
