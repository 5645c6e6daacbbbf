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
from speculative.cli.options import UsageError, pick_device
from speculative.cli.training import COMMANDS, build_parser
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
    r.a = args
    r.target = None
    r.tokenizer = None
    device = pick_device(vars(args).get("device", "cpu"))  # the data stays here; batches go there
    r.device = device
    if COMMANDS[args.command].frozen_target:
        r.target = load_model(args.target, device)
        r.tokenizer = load_tokenizer(args.target)
        r.target.eval().requires_grad_(False)
    model = r.build()  # with every check of the arguments: nothing is written yet
    r.model = model
    run = RunFolder(args.out)
    r.run = run
    run.check(model, SHAPE_FLAGS)  # another run's folder is refused before anything is made in it
    # The data generators: seeded here for a new run, as state.pt left them for a resumed one.
    r.gen = torch.Generator().manual_seed(args.seed)
    r.rng = random.Random(args.seed)
    r.data()
    model.to(device).train()
    if "weight_decay" in args:
        params = decay_groups(model, args.weight_decay)
    else:
        params = model.parameters()
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
    """A training command as what it changes in :func:`train`: ``build`` (the model, every argument
    checked: nothing is written yet), ``data`` (read by the steps, once the run folder fits),
    ``batch_loss`` (a step's loss, fields logged, tokens read), ``after`` (fields logged after a
    step), the summary. By default a drafter. Its flags, help and defaults are its command's
    (speculative/cli/training.py)."""

    # Formatted with the arguments: loss.png's title and the progress bar's label.
    title = ""
    desc = ""
    # Said once the state is loaded, formatted with the arguments and the recipe's own attributes.
    about = ""
    depth_plot = ""  # alpha.png's title, of the logged alpha_by_depth ("": no alpha.png)
    vocabulary = None  # the tokenizer exported with the checkpoint (None: a head, which has none)
    timed = False  # whether summary.json gives this session's seconds
    settings: tuple[str, ...] = ()  # summary.json's, from the recipe's own or the arguments

    def data(self) -> None:
        """Story openings (prompts of one length: no padding) and the held-out prompts; with
        --data chat, requests in the target's chat template about held-out documents."""
        a = self.a
        if getattr(a, "data", None) == "chat":
            # Room for the answer, and for a few tokens drafted past its last.
            room = self.target.config.max_seq_len - a.eval_new_tokens - 8
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
        a = self.a
        own = {**vars(self.a), **vars(self)}
        drafter = load_drafter(hf, self.target, a.target)
        after = measure_acceptance(
            self.target, drafter, self.eval_prompts, a.eval_new_tokens, a.gamma, a.seed
        )
        seconds = {}
        if self.timed:
            seconds["train_seconds_this_session"] = time.perf_counter() - self.began
        return {
            "steps": step,
            "gamma": a.gamma,
            **{name: own[name] for name in self.settings},
            **seconds,
            "held_out": after,
        }


# ----------------------------------------------------------------------------- the recipes
class Pretrain(Recipe):
    title = "pretrain {name}"
    desc = "pretrain"
    about = "model: {parameters:,} parameters; corpus: {corpus_tokens:,} tokens{eval_tokens}"

    def build(self) -> nn.Module:
        a = self.a
        tokenizer = SentencePieceTokenizer(a.tokenizer)
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
        self.tokenizer = tokenizer
        self.vocabulary = a.tokenizer
        model = Llama(config)
        init_weights(model, config.n_layers)
        return model

    def data(self) -> None:
        """The corpus's tokens, and the held-out corpus's if --eval-corpus names one."""
        a = self.a
        self.train_data = tokenize_corpus(a.corpus, self.tokenizer, a.cache_dir)
        self.eval_data = None
        self.eval_tokens = ""
        if a.eval_corpus:
            self.eval_data = tokenize_corpus(a.eval_corpus, self.tokenizer, a.cache_dir)
            self.eval_tokens = f"; held-out: {len(self.eval_data):,} tokens"
        self.corpus_tokens = len(self.train_data)

    def batch_loss(self, step: int) -> tuple[torch.Tensor, dict, int]:
        a = self.a
        x, y = random_batch(self.train_data, a.batch_size, a.seq_len, self.gen)
        loss = next_token_loss(self.model, x, y, a.bf16)
        logged = {"lr": lr_at(step, a.lr, a.warmup, a.steps)}
        return loss, logged, x.numel()

    def after(self, step: int) -> dict:
        """The held-out loss every --eval-every steps and at the last."""
        if self.eval_data is None:
            return {}
        if step % self.a.eval_every == 0 or step == self.a.steps:
            return held_out(self.model, self.eval_data, self.a.seq_len)
        return {}

    def summary(self, step: int, hf: Path) -> dict:
        final = {}
        if self.eval_data is not None:
            final = held_out(self.model, self.eval_data, self.a.seq_len, final=True)
        return {
            "parameters": self.parameters,
            "steps": step,
            "final_train_loss": self.run.tail_loss(),
            **final,
        }


class Chain(Recipe):
    """eagle3, parallel, peagle (distill's data too): a drafter trained on the target's own text
    (data.pt) or corpus windows, logging loss and alpha by draft position; parallel and peagle's
    ``losses`` with conditional drop."""

    timed = True
    depth_plot = "training alpha by draft position (one call, true tokens)"
    settings = ("depths", "keep", "min_keep", "data", "mask_id")

    def data(self) -> None:
        super().data()
        a = self.a
        length = a.seq_len - a.prompt_tokens
        kind = getattr(a, "data", "target")
        if kind == "corpus":  # windows of the corpus
            self.corpus = tokenize_corpus(a.corpus, self.tokenizer, a.cache_dir)
            return
        if kind == "draft":  # none: distill's draft writes its own text
            self.corpus = None
            return
        # Another target's text is not this target's: data.pt is made again for it.
        made_from = {
            "target": fingerprint(self.target),
            "seq_len": a.seq_len,
            "prompt_tokens": a.prompt_tokens,
        }
        if kind == "chat":
            # One stream of requests and the target's answers, read in windows as a corpus is.
            answers = self.run.answers(
                self.target,
                self.tokenizer,
                a.target,
                a.corpus,
                a.sequences,
                length,
                a.seed,
                made_from,
                self.device,
            )
            self.corpus = answers.numpy()
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
        a = self.a
        if getattr(a, "data", "target") == "target":  # rows of the target's continuations
            rows = torch.tensor(self.rng.sample(range(len(self.tokens)), a.batch_size))
            tokens = self.tokens[rows]
        else:  # windows of a stream: the corpus, the answers
            tokens = random_batch(self.corpus, a.batch_size, a.seq_len, self.gen)[0]
        loss, per_step = self.objective(tokens.to(self.device))
        logged = {"loss_by_depth": per_step["loss"], "alpha_by_depth": per_step["alpha"]}
        return loss, logged, tokens.numel()

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
    title = "distill {divergence}"
    desc = "distill ({divergence})"
    timed = False
    depth_plot = ""

    def build(self) -> nn.Module:
        a = self.a
        target = self.target
        if a.draft:
            draft = load_model(a.draft)
        else:  # a fresh one of the flags' shape
            n_kv_heads = a.n_kv_heads or a.n_heads
            draft = fresh_draft(target, a.dim, a.n_layers, a.n_heads, n_kv_heads, a.hidden_dim)
        if draft.config.vocab_size != target.config.vocab_size:
            raise UsageError(
                f"the draft's vocabulary ({draft.config.vocab_size}) differs from the target's "
                f"({target.config.vocab_size})"
            )
        if a.draft:
            self.vocabulary = load_tokenizer(a.draft)
        else:
            self.vocabulary = self.tokenizer
        return draft

    def start(self, step: int) -> None:
        a = self.a
        if a.data == "draft" and len(self.openings) < a.batch_size:  # nothing is written yet
            raise UsageError(
                f"the corpus has fewer than {a.batch_size} stories of {a.prompt_tokens}+ tokens"
            )
        if step == 0:
            before = self.measure()
            self.run.write_json("before.json", before)
            print(f"before distillation: {before}")

    def measure(self) -> dict:
        """The draft as it is, in float32: before and after distillation alike."""
        a = self.a
        return measure_acceptance(
            self.target, self.model, self.eval_prompts, a.eval_new_tokens, a.gamma, a.seed
        )

    def batch_loss(self, step: int) -> tuple[torch.Tensor, dict, int]:
        a = self.a
        if a.data == "chat":  # windows of the target's answers, scored from their second token
            tokens = random_batch(self.corpus, a.batch_size, a.seq_len, self.gen)[0]
            start = 1
        else:  # on-policy: the draft writes (the target, --target-mix of the time) after a prompt
            tokens = distill.on_policy_batch(
                self.model,
                self.target,
                self.openings,
                self.rng,
                self.gen,
                a.batch_size,
                a.gen_tokens,
                a.target_mix,
            )
            start = a.prompt_tokens
        loss = distill.distill_loss(a.divergence, self.target, self.model, tokens, start, a.bf16)
        return loss, {}, tokens.numel()

    def summary(self, step: int, hf: Path) -> dict:
        return {
            "divergence": self.a.divergence,
            "steps": step,
            "before": self.run.read_json("before.json"),
            "after": self.measure(),
            "notes": ACCEPTANCE_NOTES,
        }


class Eagle(Recipe):
    title = "eagle head"
    desc = "eagle"
    about = "head: {parameters:,} parameters; corpus: {corpus_tokens:,} tokens"

    def build(self) -> nn.Module:
        """One block of the target's own shape (EAGLE-1), with its context length."""
        config = ModelConfig(**{**vars(self.target.config), "n_layers": 1, "extra": {}})
        head = FeatureHead(config)
        init_weights(head, 1)
        return head

    def data(self) -> None:
        self.train_data = tokenize_corpus(self.a.corpus, self.tokenizer, self.a.cache_dir)
        self.corpus_tokens = len(self.train_data)
        super().data()

    def batch_loss(self, step: int) -> tuple[torch.Tensor, dict, int]:
        a = self.a
        # The target's own text (--self-mix of the time) or corpus windows.
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
    title = "eagle3 head"
    desc = "eagle3"
    depth_plot = "training alpha by draft depth (true tokens, own features)"
    about = (
        "head: {parameters:,} parameters; target layers {layers}; draft vocabulary {draft_vocab} "
        "ids covering {coverage:.1%} of the training tokens; data: {data}"
    )
    settings = ("init", "draft_vocab", "coverage", "layers", "data", "loss", "ttt_steps")

    def build(self) -> nn.Module:
        a = self.a
        n = self.target.config.n_layers
        vocab = self.target.config.vocab_size
        layers = self.target_layers(n)
        if len(layers) != 3 or not all(0 <= i < n for i in layers):
            raise UsageError(f"--layers takes three layer ids in 0..{n - 1}, got {a.layers}")
        if not 1 <= a.ttt_steps < a.seq_len or not 0 <= a.draft_vocab <= vocab:
            raise UsageError(
                f"--ttt-steps must lie in 1..{a.seq_len - 1} and --draft-vocab in 0..{vocab}"
            )
        if a.init:  # a head to go on training: its own layers and draft vocabulary
            head = load_eagle3_head(a.init, self.target, a.target, torch.float32)
            if isinstance(head, PEagleHead):
                raise UsageError(f"--init {a.init} is a P-EAGLE head; eagle3 takes an EAGLE-3 head")
            self.layers = list(head.target_layers)
            self.draft_vocab = head.draft_vocab
            return head.requires_grad_(True)
        self.layers = list(layers)
        self.draft_vocab = a.draft_vocab or vocab
        # One block of the target's shape.
        config = ModelConfig(**{**vars(self.target.config), "n_layers": 1, "extra": {}})
        head = Eagle3Head(config, layers, draft_vocab=self.draft_vocab)
        init_weights(head, 1)
        return head

    def target_layers(self, n: int) -> tuple[int, ...]:
        """--layers as layer ids, or by default EAGLE-3's choice for a target of n layers."""
        if not self.a.layers:
            return default_layers(n)
        try:
            return tuple(int(i) for i in self.a.layers.split(","))
        except ValueError:
            raise UsageError(
                f"--layers takes three layer ids as I,J,K, got {self.a.layers!r}"
            ) from None

    def data(self) -> None:
        """Chain's, and the head's vocabulary: the ids most frequent in it."""
        super().data()
        if self.a.data == "target":
            counted = self.tokens[:, self.a.prompt_tokens :]
        else:  # the stream's first two million tokens
            counted = torch.from_numpy(self.corpus[:2_000_000].astype(np.int64))
        if self.a.init:  # its vocabulary stays: the share of the data it covers
            kept = self.model.target_ids().to(counted.device)
            self.coverage = float(torch.isin(counted, kept).double().mean())
            return
        self.coverage = start_vocabulary(self.model, self.target, counted)

    def objective(self, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
        a = self.a
        return ttt_losses(
            self.model,
            self.target,
            tokens,
            a.ttt_steps,
            decay=a.ttt_decay,
            loss=a.loss,
            bf16=a.bf16,
        )


class Parallel(Chain):
    title = "parallel draft"
    desc = "parallel"
    about = (
        "draft: {parameters:,} parameters, mask id {mask_id}; {depths} draft positions per call; "
        "data: {data}"
    )
    losses = staticmethod(parallel_losses)

    def build(self) -> nn.Module:
        start_from = load_model(self.a.draft)
        vocab = self.target.config.vocab_size
        if "pard_token" in start_from.config.extra:  # a parallel draft already: go on with it
            draft = start_from
        elif start_from.config.vocab_size != vocab:
            raise UsageError(
                f"the draft's vocabulary ({start_from.config.vocab_size}) differs from the target's "
                f"({vocab})"
            )
        else:
            draft = with_mask_token(start_from)
        self.check_depths(self.a.seq_len - 1)
        self.mask_id = draft.config.extra["pard_token"]
        self.vocabulary = self.tokenizer
        return draft


class PEagle(Chain):
    title = "P-EAGLE head"
    desc = "peagle"
    about = "head: {parameters:,} parameters; {depths} draft positions per call; data: {data}"
    losses = staticmethod(peagle_losses)

    def build(self) -> nn.Module:
        a = self.a
        target = self.target
        start_from = load_eagle3_head(a.head, target, a.target)
        if not 0 <= a.mask_id < target.config.vocab_size:
            raise UsageError(f"--mask-id must be a target id in 0..{target.config.vocab_size - 1}")
        self.check_depths(a.seq_len - 2)
        if isinstance(start_from, PEagleHead):  # a P-EAGLE head already: go on with it
            head = start_from
        else:
            # The EAGLE-3 head's weights, a mask feature of zeros, the mean embedding as the mask's.
            mask_embedding = target.embed_tokens.weight.mean(0)
            try:
                head = with_mask_feature(start_from, a.mask_id, mask_embedding)
            except ValueError as err:
                raise UsageError(f"{a.head}: {err}") from None
        self.mask_id = head.mask_token_id
        return head.requires_grad_(True)


# What each training command does; its flags, help and defaults are its COMMANDS entry's
# (speculative/cli/training.py).
RECIPES = {
    "pretrain": Pretrain,
    "distill": Distill,
    "eagle": Eagle,
    "eagle3": Eagle3,
    "parallel": Parallel,
    "peagle": PEagle,
}


# ----------------------------------------------------------------------------- the command line
def make_tokenizer(args: argparse.Namespace) -> None:
    """train.py tokenizer: a SentencePiece BPE tokenizer trained on the corpus."""
    written = train_tokenizer(args.corpus, args.vocab_size, args.out)
    print("wrote {} ({} pieces, trained on {} documents)".format(*written))


def main(argv: list[str] | None = None) -> None:
    try:
        args = build_parser(__doc__).parse_args(argv)
        if args.command == "tokenizer":
            make_tokenizer(args)
        else:
            train(args)
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
