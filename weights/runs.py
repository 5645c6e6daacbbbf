"""A training run's folder: what ``train.py`` writes and resumes from.

    out/state.pt      the resumable state: step, weights, optimizer, the data generators, RNG, config
    out/log.jsonl     one JSON object per step (loss, tokens/s, held-out figures)
    out/loss.png      the losses plotted (needs matplotlib, the ``train`` extra)
    out/data.pt       training data made once and reused (the target's continuations), or grown in
                      pieces (its answers to chat requests), with what it was made from
    out/hf/           the HF-layout checkpoint exported at the end

A folder that holds a run of another shape is refused with :class:`RunFolderError`, naming
the differences, instead of failing deep inside ``load_state_dict``; :meth:`RunFolder.check`
does it before anything is written, and the folder itself is only created by the first write.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from model.eagle3_head import Eagle3Head
from weights.checkpoint import read_generation_config, save_model, stop_ids
from weights.corpus import chat_prompts
from weights.drafters import save_feature_head
from weights.eagle3 import save_eagle3_head
from weights.tokenizer import JsonTokenizer, Tokenizer


class RunFolderError(ValueError):
    """The run folder holds a state that does not fit this run."""


class RunFolder:
    """The folder ``out`` of one training run, created by the first file written into it: a run
    refused before then (another run's folder, bad input) leaves nothing behind."""

    def __init__(self, out: str | os.PathLike) -> None:
        self.out = Path(out)
        self._state: dict[str, Any] | None = None  # state.pt as check read it, for load_state

    def _made(self) -> Path:
        self.out.mkdir(parents=True, exist_ok=True)
        return self.out

    def log(self, row: dict[str, Any]) -> None:
        """Append one row to log.jsonl."""
        with open(self._made() / "log.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    def rows(self) -> list[dict[str, Any]]:
        """Every row of log.jsonl, in order."""
        path = self.out / "log.jsonl"
        text = path.read_text() if path.is_file() else ""
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def tail_loss(self, n: int = 20) -> float:
        """The mean training loss of the last ``n`` logged steps."""
        tail = [row["loss"] for row in self.rows() if "loss" in row][-n:]
        return sum(tail) / len(tail)

    def write_json(self, name: str, doc: Any) -> None:
        """``doc`` as indented JSON in the file ``name`` of the folder (summary.json, before.json)."""
        (self._made() / name).write_text(json.dumps(doc, indent=2) + "\n")

    def read_json(self, name: str) -> Any:
        """What :meth:`write_json` wrote."""
        return json.loads((self.out / name).read_text())

    def save_state(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        gen: torch.Generator,
        rng: random.Random | None = None,
    ) -> None:
        """state.pt, written whole or not at all (through a temporary file). ``gen`` and ``rng``
        are the run's data generators: saved, so that a resumed run draws the batches an
        uninterrupted one would have drawn."""
        tmp = self._made() / "state.pt.tmp"
        torch.save(
            {
                "step": step,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "generator": gen.get_state(),
                "rng": rng.getstate() if rng is not None else None,
                "torch_rng": torch.get_rng_state(),
                "config": model.config.to_hf(),
            },
            tmp,
        )
        tmp.replace(self.out / "state.pt")
        self._state = None

    def check(self, model: nn.Module, names: dict[str, str] | None = None) -> None:
        """Raise RunFolderError if state.pt holds a run that ``model`` cannot resume: another
        config (naming up to four differences; ``names`` maps config.json keys to what the caller
        calls them, e.g. a command-line flag) or other weights' names and shapes. Reads only:
        a run calls it before it writes anything (data.pt, the log)."""
        path = self.out / "state.pt"
        if not path.is_file():
            return
        if self._state is None:
            # a GPU's run goes on anywhere
            self._state = torch.load(path, map_location="cpu", weights_only=False)
        saved = self._state.get("config")
        wanted = model.config.to_hf()
        if saved is not None and saved != wanted:
            diffs = [
                f"{(names or {}).get(key, key)} {saved.get(key)} there, {wanted.get(key)} now"
                for key in sorted(set(saved) | set(wanted))
                if saved.get(key) != wanted.get(key)
            ]
            raise RunFolderError(
                f"{self.out} holds a run of another shape ({', '.join(diffs[:4])}): rerun with the "
                f"settings it was started with, choose another --out, or delete {path} to start over"
            )
        # The config does not say everything (a head's draft vocabulary; a state.pt of an older
        # version has no config): the weights' names and shapes, as load_state_dict would see them.
        there = {key: tuple(value.shape) for key, value in self._state["model"].items()}
        here = {key: tuple(value.shape) for key, value in model.state_dict().items()}
        if there != here:
            diff = next(
                f"{key}: {there.get(key, 'absent')} there, {here.get(key, 'absent')} now"
                for key in sorted(set(there) | set(here))
                if there.get(key) != here.get(key)
            )
            raise RunFolderError(
                f"{path} does not fit this model ({diff}); choose another --out, or delete "
                f"{path} to start over"
            )

    def load_state(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        gen: torch.Generator,
        names: dict[str, str] | None = None,
        rng: random.Random | None = None,
    ) -> int:
        """Resume from state.pt: the step it reached (0 without one), with the model, optimizer,
        ``gen``, ``rng`` and torch's RNG restored. A state the model cannot take raises
        RunFolderError (:meth:`check`). ``rng`` is left as it is when state.pt has none (an older
        version's)."""
        path = self.out / "state.pt"
        if not path.is_file():
            return 0
        self.check(model, names)
        state = self._state
        self._state = None  # freed: the model and the optimizer hold it now
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        if rng is not None and state.get("rng") is not None:
            rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        return int(state["step"])

    def data(
        self, made_from: dict[str, Any], rows: int, make: Callable[[], torch.Tensor], what: str
    ) -> torch.Tensor:
        """data.pt: training data made once by ``make()`` (saying ``what`` it makes), and its first
        ``rows`` rows. A resumed run, or another run pointed at the folder, reads it back when it
        was made from the same ``made_from`` (e.g. the target's fingerprint and the lengths: the
        same data of another target would be the wrong data) and holds at least ``rows`` rows;
        otherwise it is made again and replaced."""
        path = self.out / "data.pt"
        if path.is_file():
            saved = torch.load(path, weights_only=True)
            # An older version saved the bare tensor, without what it was made from: made again.
            if (
                isinstance(saved, dict)
                and saved.get("made_from") == made_from
                and len(saved["tokens"]) >= rows
            ):
                return saved["tokens"][:rows]
        print(f"{what} into {path} (once)")
        tokens = make()
        tmp = self._made() / "data.pt.tmp"
        torch.save({"tokens": tokens, "made_from": made_from}, tmp)
        tmp.replace(path)  # written whole or not at all, as state.pt
        return tokens[:rows]

    def answers(
        self,
        target: nn.Module,
        tokenizer: Tokenizer,
        target_name: str,
        corpus: Sequence[str],
        count: int,
        length: int,
        seed: int,
        made_from: dict[str, Any],
        device: torch.device,
    ) -> torch.Tensor:
        """data.pt as one stream (:meth:`grown`): ``count`` chat requests about ``corpus`` in the target's
        template (weights.corpus.chat_prompts, ``seed`` + 1), each followed by the target's answer, to a
        stop id or ``length`` tokens (speculative.engine.generation.conversations). The rows answered at
        once (32 on a CPU, 512 on a GPU) follow the data already there (:meth:`made_with`)."""
        # the engine, only where answers are made
        from speculative.engine.generation import conversations

        prompts = chat_prompts(
            corpus, tokenizer, count, seed + 1, target.config.max_seq_len - length
        )
        stops = stop_ids(target.config, read_generation_config(target_name), tokenizer)
        rows = self.made_with("rows", 32 if device.type == "cpu" else 512)
        return self.grown(
            {**made_from, "seed": seed, "rows": rows},
            count,
            lambda i, j: conversations(
                target, prompts[i:j], length, stops, seed, first=i, rows=rows
            ),
            f"the target answers requests ({length} tokens at most)",
            every=2 * rows,
        )

    def made_with(self, name: str, default: Any) -> Any:
        """The field ``name`` of what data.pt was made with, else ``default``: a setting that changes
        how the data is made but not what it is (the rows a GPU answered at once) follows the data
        already there, so a run goes on with it on another device instead of making it again."""
        path = self.out / "data.pt"
        saved = torch.load(path, weights_only=True) if path.is_file() else None
        return (
            saved["made_from"].get(name, default)
            if isinstance(saved, dict) and "made_from" in saved
            else default
        )

    def grown(
        self,
        made_from: dict[str, Any],
        count: int,
        make: Callable[[int, int], list[list[int]]],
        what: str,
        every: int = 64,
    ) -> torch.Tensor:
        """data.pt grown in pieces: the tokens of the first ``count`` items that ``make(start, end)``
        makes in order (items start..end-1, each a list of tokens), as one stream, saved after every
        ``every`` items. A run stopped while it writes goes on from the last piece saved, and a later
        run that asks for more items adds to them, as long as ``make`` gives the same items for the
        same positions; data made from another ``made_from`` is made again."""
        path = self.out / "data.pt"
        tokens = torch.empty(0, dtype=torch.long)
        ends: list[int] = []  # where each item's tokens end in the stream
        if path.is_file():
            saved = torch.load(path, weights_only=True)
            if isinstance(saved, dict) and saved.get("made_from") == made_from and "ends" in saved:
                tokens = saved["tokens"]
                ends = list(saved["ends"])
        if len(ends) < count:
            print(f"{what} into {path} ({len(ends)} of {count} there)", flush=True)
        while len(ends) < count:
            items = make(len(ends), min(len(ends) + every, count))
            tokens = torch.cat(
                [tokens, torch.tensor([t for item in items for t in item], dtype=torch.long)]
            )
            for item in items:
                ends.append((ends[-1] if ends else 0) + len(item))
            tmp = self._made() / "data.pt.tmp"
            torch.save({"tokens": tokens, "ends": ends, "made_from": made_from}, tmp)
            tmp.replace(path)
            print(f"  {len(ends)} of {count}", flush=True)
        return tokens[: ends[count - 1]] if count else tokens[:0]

    def plot(self, title: str) -> None:
        """loss.png: the training loss per step and the held-out loss where it was logged."""
        import matplotlib  # the train extra, and slow to import: only where a plot is drawn

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = self.rows()
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
        fig.savefig(self._made() / "loss.png", dpi=100)
        plt.close(fig)

    def plot_depths(self, key: str, name: str, title: str) -> None:
        """``name`` (a .png): a per-depth list logged under ``key`` at every step, one line per depth,
        smoothed over 20 steps (EAGLE-3's training alpha by draft depth)."""
        import matplotlib  # the train extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = [r for r in self.rows() if key in r]
        if not rows:
            return
        fig, ax = plt.subplots(figsize=(6, 4))
        for depth in range(len(rows[0][key])):
            values = [r[key][depth] for r in rows]
            smooth = [
                sum(values[max(0, i - 19) : i + 1]) / len(values[max(0, i - 19) : i + 1])
                for i in range(len(values))
            ]
            ax.plot([r["step"] for r in rows], smooth, label=f"depth {depth + 1}")
        ax.set_xlabel("step")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(self._made() / name, dpi=100)
        plt.close(fig)

    def export(
        self,
        model: nn.Module,
        tokenizer: str | os.PathLike | Tokenizer | None,
        dtype: torch.dtype,
        target: nn.Module | None = None,
        target_name: str = "the target",
    ) -> Path:
        """hf/: the model as an HF-layout checkpoint in ``dtype``, with its tokenizer (a tokenizer.model
        file, or a loaded tokenizer: a SentencePiece one's file, a tokenizer.json's text with the ids of
        its BOS and EOS in tokenizer_config.json); or, with no ``tokenizer``, a feature head (EAGLE) or
        an EAGLE-3 head (P-EAGLE's too) in its own files, which record the ``target`` it was trained for
        (named ``target_name``)."""
        hf = self._made() / "hf"
        if tokenizer is None and isinstance(model, Eagle3Head):
            return save_eagle3_head(model, hf, target, target_name=target_name, dtype=dtype)
        if tokenizer is None:
            return save_feature_head(model, hf, target, dtype=dtype, target_name=target_name)
        save_model(model, hf, dtype=dtype)
        if isinstance(tokenizer, JsonTokenizer):
            (hf / "tokenizer.json").write_text(tokenizer.text, encoding="utf-8")
            ids = {"bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_id}
            names = {
                key: tokenizer.backend.id_to_token(i) for key, i in ids.items() if i is not None
            }
            (hf / "tokenizer_config.json").write_text(json.dumps(names, indent=2))
        else:
            shutil.copyfile(getattr(tokenizer, "path", tokenizer), hf / "tokenizer.model")
        return hf
