"""A training run's folder: what ``train.py`` writes and resumes from.

    out/state.pt      the resumable state: step, weights, optimizer, data generator, RNG, config
    out/log.jsonl     one JSON object per step (loss, tokens/s, held-out figures)
    out/loss.png      the losses plotted (needs matplotlib, the ``train`` extra)
    out/hf/           the HF-layout checkpoint exported at the end

A folder that holds a run of another shape is refused with :class:`RunFolderError`, naming
the differences, instead of failing deep inside ``load_state_dict``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from weights.checkpoint import save_model


class RunFolderError(ValueError):
    """The run folder holds a state that does not fit this run."""


class RunFolder:
    """The folder ``out`` (created if needed) of one training run."""

    def __init__(self, out: str | os.PathLike) -> None:
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)

    def log(self, row: dict[str, Any]) -> None:
        """Append one row to log.jsonl."""
        with open(self.out / "log.jsonl", "a") as f:
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
        (self.out / name).write_text(json.dumps(doc, indent=2) + "\n")

    def read_json(self, name: str) -> Any:
        """What :meth:`write_json` wrote."""
        return json.loads((self.out / name).read_text())

    def save_state(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                   gen: torch.Generator) -> None:
        """state.pt, written whole or not at all (through a temporary file)."""
        tmp = self.out / "state.pt.tmp"
        torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "generator": gen.get_state(), "torch_rng": torch.get_rng_state(),
                    "config": model.config.to_hf()}, tmp)
        tmp.replace(self.out / "state.pt")

    def load_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, gen: torch.Generator,
                   names: dict[str, str] | None = None) -> int:
        """Resume from state.pt: the step it reached (0 without one), with the model, optimizer,
        ``gen`` and torch's RNG restored. A state of another shape raises RunFolderError naming
        up to four differences; ``names`` maps config.json keys to what the caller calls them
        (e.g. a command-line flag)."""
        path = self.out / "state.pt"
        if not path.is_file():
            return 0
        state = torch.load(path, weights_only=False)
        saved, wanted = state.get("config"), model.config.to_hf()
        if saved is not None and saved != wanted:
            diffs = [f"{(names or {}).get(key, key)} {saved.get(key)} there, {wanted.get(key)} now"
                     for key in sorted(set(saved) | set(wanted)) if saved.get(key) != wanted.get(key)]
            raise RunFolderError(f"{self.out} holds a run of another shape ({', '.join(diffs[:4])}): rerun with the "
                                 f"settings it was started with, choose another --out, or delete {path} to start over")
        try:
            model.load_state_dict(state["model"])
        except RuntimeError as err:  # e.g. a state.pt of an older version without its config
            raise RunFolderError(f"{path} does not fit this model ({str(err).splitlines()[0]}); choose another "
                                 f"--out, or delete {path} to start over") from None
        optimizer.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        return int(state["step"])

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
        fig.savefig(self.out / "loss.png", dpi=100)
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
            smooth = [sum(values[max(0, i - 19):i + 1]) / len(values[max(0, i - 19):i + 1]) for i in range(len(values))]
            ax.plot([r["step"] for r in rows], smooth, label=f"depth {depth + 1}")
        ax.set_xlabel("step")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(self.out / name, dpi=100)
        plt.close(fig)

    def export(self, model: nn.Module, tokenizer_path: str | os.PathLike, dtype: torch.dtype) -> Path:
        """hf/: the model as an HF-layout checkpoint in ``dtype``, with its tokenizer.model."""
        hf = save_model(model, self.out / "hf", dtype=dtype)
        shutil.copyfile(tokenizer_path, hf / "tokenizer.model")
        return hf
