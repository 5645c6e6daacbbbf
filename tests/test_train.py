"""train.py on tiny slices: pretraining lowers the loss, runs resume, checkpoints load in
transformers, and distillation raises the draft's measured acceptance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import train
from weights import load_model, load_tokenizer

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
STORIES = SHARED / "tinystories" / "tinystories_v1_train_head_2MiB.txt"
VALID = SHARED / "tinystories" / "tinystories_v1_valid_head.txt"
needs_shared = pytest.mark.skipif(not STORIES.is_file(),
                                  reason="../shared/data is absent (a fresh clone); CI provides it")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The first ~120 stories for training, the next ~40 held out, and a 512-piece tokenizer."""
    root = tmp_path_factory.mktemp("corpus")
    stories = STORIES.read_text(encoding="utf-8").split("<|endoftext|>")
    (root / "train.txt").write_text("<|endoftext|>".join(stories[:120]), encoding="utf-8")
    (root / "valid.txt").write_text("<|endoftext|>".join(stories[120:160]), encoding="utf-8")
    train.main(["tokenizer", "--corpus", str(root / "train.txt"), "--vocab-size", "512", "--out", str(root / "tok")])
    return {"train": root / "train.txt", "valid": root / "valid.txt", "tok": root / "tok" / "tokenizer.model",
            "root": root}


def pretrain(corpus: dict[str, Path], out: Path, steps: int, dim: int, layers: int, seed: int = 0) -> Path:
    train.main(["pretrain", "--corpus", str(corpus["train"]), "--eval-corpus", str(corpus["valid"]),
                "--tokenizer", str(corpus["tok"]), "--out", str(out), "--dim", str(dim), "--n-layers", str(layers),
                "--n-heads", "4", "--n-kv-heads", "2", "--hidden-dim", str(2 * dim), "--seq-len", "64",
                "--max-seq-len", "256", "--batch-size", "8", "--steps", str(steps), "--warmup", "5",
                "--lr", "3e-3", "--eval-every", "10", "--save-every", "10", "--seed", str(seed),
                "--save-dtype", "float32", "--no-progress", "--threads", "1",
                "--cache-dir", str(corpus["root"] / "cache")])
    return out


@needs_shared
def test_pretraining_lowers_the_loss_and_resumes(corpus: dict[str, Path], tmp_path: Path) -> None:
    out = pretrain(corpus, tmp_path / "run", steps=20, dim=32, layers=2)
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert last < first - 0.4, f"training loss went from {first:.3f} to only {last:.3f}"
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert evals[-1] < evals[0], "held-out loss did not fall"
    assert (out / "loss.png").stat().st_size > 1000
    # Resuming: asking for more steps continues from state.pt instead of starting over.
    pretrain(corpus, out, steps=25, dim=32, layers=2)
    steps = [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 26))
    assert json.loads((out / "summary.json").read_text())["steps"] == 25


@needs_shared
def test_train_checkpoint_loads_here_and_in_transformers(corpus: dict[str, Path], tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    out = pretrain(corpus, tmp_path / "run", steps=3, dim=32, layers=2)
    ours = load_model(out / "hf")
    theirs = transformers.LlamaForCausalLM.from_pretrained(out / "hf", torch_dtype=torch.float32).eval()
    tokens = torch.tensor([load_tokenizer(out / "hf").encode("Once upon a time, a cat sat.")])
    with torch.no_grad():
        diff = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    assert diff < 1e-5, f"logits differ by {diff}"


@needs_shared
def test_distillation_raises_acceptance(corpus: dict[str, Path], tmp_path: Path) -> None:
    target = pretrain(corpus, tmp_path / "target", steps=60, dim=64, layers=2, seed=0)
    draft = pretrain(corpus, tmp_path / "draft", steps=4, dim=32, layers=1, seed=1)
    out = tmp_path / "distill"
    train.main(["distill", "--target", str(target / "hf"), "--draft", str(draft / "hf"),
                "--corpus", str(corpus["train"]), "--eval-corpus", str(corpus["valid"]), "--out", str(out),
                "--divergence", "tv", "--steps", "40", "--lr", "3e-3", "--warmup", "2", "--batch-size", "8",
                "--gen-tokens", "32", "--eval-prompts", "8", "--eval-new-tokens", "32", "--seed", "0",
                "--save-every", "20", "--save-dtype", "float32", "--no-progress", "--threads", "1"])
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["before"], summary["after"]
    assert after["acceptance_t1"] > before["acceptance_t1"] + 0.05, summary
    assert after["acceptance_greedy"] > before["acceptance_greedy"], summary
    assert load_model(out / "hf").config.vocab_size == 512
