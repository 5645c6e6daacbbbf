"""train.py on tiny slices: pretraining lowers the loss, runs resume, checkpoints load in
transformers, and distillation raises the draft's measured acceptance; a resumed run draws the
batches an uninterrupted one draws, another run's folder is refused before anything is written,
the target's continuations are its own, and bad input is one line, not an assert."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train
from model import training
from speculative import FeatureDrafter
from speculative.cli.training import COMMANDS, build_parser
from tests.support.paths import SHARED_DATA
from tests.support.toy_models import random_eagle3_head, random_llama
from weights import CheckpointError, load_drafter, load_model, load_tokenizer
from weights.corpus import chat_requests
from weights.drafters import load_feature_head
from weights.runs import RunFolder

SHARED = SHARED_DATA
STORIES = SHARED / "tinystories" / "tinystories_v1_train_head_2MiB.txt"
VALID = SHARED / "tinystories" / "tinystories_v1_valid_head.txt"
needs_shared = pytest.mark.skipif(
    not STORIES.is_file(), reason="../shared/data is absent (a fresh clone); CI provides it"
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The first ~120 stories for training, the next ~40 held out, and a 512-piece tokenizer."""
    root = tmp_path_factory.mktemp("corpus")
    stories = STORIES.read_text(encoding="utf-8").split("<|endoftext|>")
    (root / "train.txt").write_text("<|endoftext|>".join(stories[:120]), encoding="utf-8")
    (root / "valid.txt").write_text("<|endoftext|>".join(stories[120:160]), encoding="utf-8")
    train.main(
        [
            "tokenizer",
            "--corpus",
            str(root / "train.txt"),
            "--vocab-size",
            "512",
            "--out",
            str(root / "tok"),
        ]
    )
    return {
        "train": root / "train.txt",
        "valid": root / "valid.txt",
        "tok": root / "tok" / "tokenizer.model",
        "root": root,
    }


def pretrain(
    corpus: dict[str, Path], out: Path, steps: int, dim: int, layers: int, seed: int = 0
) -> Path:
    train.main(
        [
            "pretrain",
            "--corpus",
            str(corpus["train"]),
            "--eval-corpus",
            str(corpus["valid"]),
            "--tokenizer",
            str(corpus["tok"]),
            "--out",
            str(out),
            "--dim",
            str(dim),
            "--n-layers",
            str(layers),
            "--n-heads",
            "4",
            "--n-kv-heads",
            "2",
            "--hidden-dim",
            str(2 * dim),
            "--seq-len",
            "64",
            "--max-seq-len",
            "256",
            "--batch-size",
            "8",
            "--steps",
            str(steps),
            "--warmup",
            "5",
            "--lr",
            "3e-3",
            "--eval-every",
            "10",
            "--save-every",
            "10",
            "--seed",
            str(seed),
            "--save-dtype",
            "float32",
            "--no-progress",
            "--threads",
            "1",
            "--cache-dir",
            str(corpus["root"] / "cache"),
        ]
    )
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
def test_train_checkpoint_loads_here_and_in_transformers(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    out = pretrain(corpus, tmp_path / "run", steps=3, dim=32, layers=2)
    ours = load_model(out / "hf")
    theirs = transformers.LlamaForCausalLM.from_pretrained(
        out / "hf", torch_dtype=torch.float32
    ).eval()
    tokens = torch.tensor([load_tokenizer(out / "hf").encode("Once upon a time, a cat sat.")])
    with torch.no_grad():
        diff = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    assert diff < 1e-5, f"logits differ by {diff}"


@needs_shared
def test_distillation_raises_acceptance(corpus: dict[str, Path], tmp_path: Path) -> None:
    target = pretrain(corpus, tmp_path / "target", steps=60, dim=64, layers=2, seed=0)
    draft = pretrain(corpus, tmp_path / "draft", steps=4, dim=32, layers=1, seed=1)
    out = tmp_path / "distill"
    train.main(
        [
            "distill",
            "--target",
            str(target / "hf"),
            "--draft",
            str(draft / "hf"),
            "--corpus",
            str(corpus["train"]),
            "--eval-corpus",
            str(corpus["valid"]),
            "--out",
            str(out),
            "--divergence",
            "tv",
            "--steps",
            "40",
            "--lr",
            "3e-3",
            "--warmup",
            "2",
            "--batch-size",
            "8",
            "--gen-tokens",
            "32",
            "--eval-prompts",
            "8",
            "--eval-new-tokens",
            "32",
            "--seed",
            "0",
            "--save-every",
            "20",
            "--save-dtype",
            "float32",
            "--no-progress",
            "--threads",
            "1",
        ]
    )
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["before"], summary["after"]
    assert after["acceptance_t1"] > before["acceptance_t1"] + 0.05, summary
    assert after["acceptance_greedy"] > before["acceptance_greedy"], summary
    assert load_model(out / "hf").config.vocab_size == 512


@needs_shared
def test_a_run_folder_of_another_shape_is_one_clear_error(
    corpus: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rerunning into the same --out with another --dim: one line naming the difference, status 2,
    instead of load_state_dict's size-mismatch traceback; state.pt is left as it was."""
    out = pretrain(corpus, tmp_path / "run", steps=2, dim=32, layers=2)
    before = (out / "state.pt").read_bytes()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        pretrain(corpus, out, steps=4, dim=48, layers=2)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "holds a run of another shape" in lines[0] and "--dim 32 there, 48 now" in lines[0], (
        lines[0]
    )
    assert (out / "state.pt").read_bytes() == before


@needs_shared
def test_exported_files_and_loss_names(corpus: dict[str, Path], tmp_path: Path) -> None:
    """Every file of a run is written with the usual mode (safetensors alone used to make 0600), and
    the two held-out figures say how many windows each averages."""
    old = os.umask(0o022)
    try:
        out = pretrain(corpus, tmp_path / "run", steps=3, dim=32, layers=1)
    finally:
        os.umask(old)
    modes = {
        p.relative_to(out).as_posix(): stat.S_IMODE(p.stat().st_mode)
        for p in out.rglob("*")
        if p.is_file()
    }
    assert "hf/model.safetensors" in modes and "hf/tokenizer.model" in modes
    assert all(mode == 0o644 for mode in modes.values()), modes
    summary = json.loads((out / "summary.json").read_text())
    evals = [
        json.loads(line)
        for line in (out / "log.jsonl").read_text().splitlines()
        if "eval_loss" in line
    ]
    assert summary["held_out_windows"] == training.FINAL_EVAL_BATCHES * training.EVAL_BATCH == 256
    assert evals and all(
        row["eval_windows"] == training.LOG_EVAL_BATCHES * training.EVAL_BATCH == 64
        for row in evals
    )
    assert "eval_loss" in summary["note"] and "held_out_loss" in summary["note"]
    # The log's windows are the first of the summary's: the two differ, but not by much.
    assert abs(summary["held_out_loss"] - evals[-1]["eval_loss"]) < 0.5


def test_every_training_command_has_its_recipe() -> None:
    assert list(train.RECIPES) == list(COMMANDS)


def test_every_option_has_help_and_a_default() -> None:
    parser = build_parser(train.__doc__)
    subparsers = next(
        a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
    ).choices
    assert {"tokenizer", "pretrain", "distill"} <= set(subparsers)
    for name, sub in subparsers.items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            where = f"train.py {name} {action.option_strings}"
            assert action.help, f"{where} has no help text"
            if action.required or isinstance(action, argparse._StoreTrueAction):
                continue  # nothing to default to: given or refused; a switch is off unless given
            assert "default" in action.help, f"{where} does not show its default"


def test_distill_help_explains_the_acceptance_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        train.main(["distill", "--help"])
    text = capsys.readouterr().out
    for name in ("alpha_greedy", "acceptance_greedy", "never verified", "sum_x min(p, q)"):
        assert name in text, name
    assert set(train.ACCEPTANCE_NOTES) == {"alpha", "acceptance", "tau"}


def test_bad_command_line_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        train.main(
            [
                "pretrain",
                "--corpus",
                "x.txt",
                "--tokenizer",
                "t.model",
                "--out",
                "o",
                "--dim",
                "wide",
            ]
        )
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--dim" in lines[0], lines


def test_a_missing_corpus_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        train.main(
            ["tokenizer", "--corpus", str(tmp_path / "absent.txt"), "--out", str(tmp_path / "tok")]
        )
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"error: corpus file {tmp_path / 'absent.txt'} does not exist"], lines


def eagle(target: Path, corpus: dict[str, Path], out: Path, steps: int) -> dict:
    train.main(
        [
            "eagle",
            "--target",
            str(target),
            "--corpus",
            str(corpus["train"]),
            "--eval-corpus",
            str(corpus["valid"]),
            "--out",
            str(out),
            "--steps",
            str(steps),
            "--lr",
            "3e-3",
            "--warmup",
            "2",
            "--batch-size",
            "8",
            "--seq-len",
            "48",
            "--self-mix",
            "0.5",
            "--eval-prompts",
            "6",
            "--eval-new-tokens",
            "24",
            "--seed",
            "0",
            "--save-every",
            "10",
            "--save-dtype",
            "float32",
            "--no-progress",
            "--threads",
            "1",
            "--cache-dir",
            str(corpus["root"] / "cache"),
        ]
    )
    return json.loads((out / "summary.json").read_text())


@needs_shared
def test_eagle_head_learns_to_draft_for_its_target_and_resumes(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """A few dozen steps on a small target: the head's greedy acceptance rises far above an
    untrained head's, the run resumes, and the head loads only for its own target."""
    target_dir = pretrain(corpus, tmp_path / "target", steps=60, dim=64, layers=2, seed=0) / "hf"
    first = eagle(target_dir, corpus, tmp_path / "eagle", steps=10)
    summary = eagle(target_dir, corpus, tmp_path / "eagle", steps=150)  # resumes at step 10
    steps = [
        json.loads(line)["step"]
        for line in (tmp_path / "eagle" / "log.jsonl").read_text().splitlines()
    ]
    assert steps == list(range(1, 151)) and summary["steps"] == 150
    rows = [
        json.loads(line) for line in (tmp_path / "eagle" / "log.jsonl").read_text().splitlines()
    ]
    assert rows[-1]["classification"] < rows[0]["classification"] - 0.5
    assert any(r["self_written"] for r in rows) and not all(r["self_written"] for r in rows)
    assert (tmp_path / "eagle" / "loss.png").stat().st_size > 1000
    assert summary["held_out"]["alpha_greedy"] > first["held_out"]["alpha_greedy"] + 0.1, (
        first,
        summary,
    )
    assert summary["held_out"]["tau_greedy"] > 1.3, summary
    target = load_model(target_dir)
    assert isinstance(load_drafter(tmp_path / "eagle" / "hf", target), FeatureDrafter)
    other = load_model(
        pretrain(corpus, tmp_path / "other", steps=2, dim=64, layers=2, seed=5) / "hf"
    )
    with pytest.raises(CheckpointError, match="fingerprint"):
        load_feature_head(tmp_path / "eagle" / "hf", other, "other")


def eagle3(target: Path, corpus: dict[str, Path], out: Path, steps: int, *extra: str) -> dict:
    train.main(
        [
            "eagle3",
            "--target",
            str(target),
            "--corpus",
            str(corpus["train"]),
            "--eval-corpus",
            str(corpus["valid"]),
            "--out",
            str(out),
            "--steps",
            str(steps),
            "--lr",
            "3e-3",
            "--warmup",
            "2",
            "--batch-size",
            "8",
            "--seq-len",
            "48",
            "--sequences",
            "32",
            "--ttt-steps",
            "3",
            "--draft-vocab",
            "256",
            "--eval-prompts",
            "6",
            "--eval-new-tokens",
            "24",
            "--seed",
            "0",
            "--save-every",
            "10",
            "--save-dtype",
            "float32",
            "--no-progress",
            "--threads",
            "1",
            *extra,
        ]
    )
    return json.loads((out / "summary.json").read_text())


@needs_shared
def test_eagle3_head_trains_on_the_target_s_own_text_and_resumes(
    corpus: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The target writes its continuations once (data.pt, reused on resume); training-time test
    logs a loss and an alpha per depth; the head as saved (the speculators layout) drafts
    better than after 10 steps and loads for its target."""
    target_dir = pretrain(corpus, tmp_path / "target", steps=60, dim=64, layers=4, seed=0) / "hf"
    first = eagle3(target_dir, corpus, tmp_path / "e3", steps=10)
    written = (tmp_path / "e3" / "data.pt").stat().st_mtime_ns
    summary = eagle3(target_dir, corpus, tmp_path / "e3", steps=80)  # resumes at step 10
    assert (tmp_path / "e3" / "data.pt").stat().st_mtime_ns == written
    rows = [json.loads(line) for line in (tmp_path / "e3" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 81)) and summary["steps"] == 80
    assert all(len(r["alpha_by_depth"]) == len(r["loss_by_depth"]) == 3 for r in rows)
    assert sum(r["loss"] for r in rows[-5:]) < sum(r["loss"] for r in rows[:5]) - 1.0
    assert (tmp_path / "e3" / "alpha.png").stat().st_size > 1000
    assert summary["held_out"]["alpha_greedy"] > first["held_out"]["alpha_greedy"] + 0.1, (
        first,
        summary,
    )
    config = json.loads((tmp_path / "e3" / "hf" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 256
    drafter = load_drafter(tmp_path / "e3" / "hf", load_model(target_dir))
    assert isinstance(drafter, FeatureDrafter) and drafter.reads_features == (2, 2, 1)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        eagle3(target_dir, corpus, tmp_path / "bad", 5, "--layers", "1,2,9")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --layers takes three layer ids in 0..3, got 1,2,9"
    ]


@needs_shared
def test_an_eagle3_run_goes_on_from_a_trained_head(
    corpus: dict[str, Path], targets: tuple[Path, Path], tmp_path: Path
) -> None:
    """--init: the run starts from the head's weights, target layers and draft vocabulary (not
    --layers' nor --draft-vocab's): no step exports it as it was; a step of an acceptance loss
    (--loss lk-lambda) moves it."""
    eagle3(targets[0], corpus, tmp_path / "first", 2, *QUICK, "--layers", "0,1,3")
    first = tmp_path / "first" / "hf"
    weights = load_file(first / "model.safetensors")
    extra = ("--init", str(first), "--layers", "2,2,1", "--draft-vocab", "128")
    summary = eagle3(targets[0], corpus, tmp_path / "same", 0, *QUICK, *extra)
    assert summary["layers"] == [0, 1, 3] and summary["draft_vocab"] == 256, summary
    assert summary["init"] == str(first)
    again = load_file(tmp_path / "same" / "hf" / "model.safetensors")
    assert again.keys() == weights.keys()
    assert all(torch.equal(again[name], weights[name]) for name in weights)
    summary = eagle3(targets[0], corpus, tmp_path / "lk", 1, *QUICK, *extra, "--loss", "lk-lambda")
    assert summary["loss"] == "lk-lambda"
    moved = load_file(tmp_path / "lk" / "hf" / "model.safetensors")
    assert torch.equal(moved["d2t"], weights["d2t"])
    assert not torch.equal(moved["fc.weight"], weights["fc.weight"])


def parallel(
    target: Path, draft: Path, corpus: dict[str, Path], out: Path, steps: int, *extra: str
) -> dict:
    train.main(
        [
            "parallel",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--corpus",
            str(corpus["train"]),
            "--eval-corpus",
            str(corpus["valid"]),
            "--out",
            str(out),
            "--steps",
            str(steps),
            "--lr",
            "3e-3",
            "--warmup",
            "2",
            "--batch-size",
            "8",
            "--seq-len",
            "48",
            "--sequences",
            "32",
            "--depths",
            "4",
            "--eval-prompts",
            "6",
            "--eval-new-tokens",
            "24",
            "--seed",
            "0",
            "--save-every",
            "10",
            "--save-dtype",
            "float32",
            "--no-progress",
            "--threads",
            "1",
            *extra,
        ]
    )
    return json.loads((out / "summary.json").read_text())


@needs_shared
def test_a_draft_adapts_to_parallel_drafting_and_resumes(
    corpus: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The draft gains a mask id; the target's continuations are written once; the loss and alpha
    of every draft position are logged; the adapted draft (pard_token in its config) drafts better
    than after 10 steps, in one call per iteration, and loads as a parallel drafter."""
    target_dir = pretrain(corpus, tmp_path / "target", steps=60, dim=64, layers=4, seed=0) / "hf"
    draft_dir = pretrain(corpus, tmp_path / "draft", steps=60, dim=32, layers=2, seed=1) / "hf"
    first = parallel(target_dir, draft_dir, corpus, tmp_path / "par", steps=10)
    written = (tmp_path / "par" / "data.pt").stat().st_mtime_ns
    # resumes at step 10
    summary = parallel(target_dir, draft_dir, corpus, tmp_path / "par", steps=80)
    assert (tmp_path / "par" / "data.pt").stat().st_mtime_ns == written
    rows = [json.loads(line) for line in (tmp_path / "par" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 81)) and summary["steps"] == 80
    assert all(len(r["alpha_by_depth"]) == 4 for r in rows)
    assert sum(r["loss"] for r in rows[-5:]) < sum(r["loss"] for r in rows[:5]) - 0.5
    assert (tmp_path / "par" / "alpha.png").stat().st_size > 1000
    assert summary["held_out"]["alpha_greedy"] > first["held_out"]["alpha_greedy"], (first, summary)
    config = json.loads((tmp_path / "par" / "hf" / "config.json").read_text())
    assert (
        config["pard_token"] == 512
        and config["vocab_size"] == 513
        and config["model_type"] == "llama"
    )
    from weights import load_pair

    pair = load_pair(target_dir, tmp_path / "par" / "hf")
    assert (
        pair.kind == "parallel"
        and pair.draft.mask_id == 512
        and pair.draft_model is pair.draft.model
    )
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        parallel(target_dir, draft_dir, corpus, tmp_path / "bad", 5, "--depths", "1")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --depths must lie in 2..47, and 0 < --min-keep <= --keep <= 1"
    ]


@needs_shared
def test_an_eagle3_head_adapts_to_parallel_drafting(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """train.py peagle from an EAGLE-3 head: written in speculators' "peagle" layout, it loads as a
    parallel feature drafter and its later draft positions gain acceptance."""
    target_dir = pretrain(corpus, tmp_path / "target", steps=60, dim=64, layers=4, seed=0) / "hf"
    eagle3(target_dir, corpus, tmp_path / "e3", steps=30)
    args = [
        "peagle",
        "--target",
        str(target_dir),
        "--head",
        str(tmp_path / "e3" / "hf"),
        "--corpus",
        str(corpus["train"]),
        "--eval-corpus",
        str(corpus["valid"]),
        "--out",
        str(tmp_path / "pe"),
        "--lr",
        "3e-3",
        "--warmup",
        "2",
        "--batch-size",
        "8",
        "--seq-len",
        "48",
        "--sequences",
        "32",
        "--depths",
        "4",
        "--eval-prompts",
        "6",
        "--eval-new-tokens",
        "24",
        "--seed",
        "0",
        "--save-every",
        "10",
        "--save-dtype",
        "float32",
        "--no-progress",
        "--threads",
        "1",
    ]
    train.main([*args, "--steps", "40"])
    rows = [json.loads(line) for line in (tmp_path / "pe" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 41)) and all(
        len(r["alpha_by_depth"]) == 4 for r in rows
    )
    late = [sum(r["alpha_by_depth"][1:]) for r in rows]
    assert sum(late[-5:]) > sum(late[:5]), "the mask positions did not learn"
    config = json.loads((tmp_path / "pe" / "hf" / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["mask_token_id"] == 0
    from speculative.draft.parallel import ParallelFeatureDrafter

    drafter = load_drafter(tmp_path / "pe" / "hf", load_model(target_dir))
    assert isinstance(drafter, ParallelFeatureDrafter) and drafter.parallel


# ----------------------------------------------------------------------------- the skeleton's defects, fixed
QUICK = (
    "--sequences",
    "16",
    "--seq-len",
    "24",
    "--batch-size",
    "8",
    "--eval-prompts",
    "2",
    "--eval-new-tokens",
    "8",
)


@pytest.fixture(scope="module")
def targets(corpus: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two small targets of one shape (4 layers, for EAGLE-3's three) and different weights."""
    root = tmp_path_factory.mktemp("targets")
    return tuple(
        pretrain(corpus, root / name, steps=2, dim=32, layers=4, seed=seed) / "hf"
        for name, seed in (("a", 0), ("b", 5))
    )


def chat_model(target: Path, tmp_path: Path) -> Path:
    """A copy of ``target`` with a chat template of its own."""
    chat_target = tmp_path / "chat-target"
    shutil.copytree(target, chat_target)
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    (chat_target / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return chat_target


def continuations(out: Path) -> torch.Tensor:
    saved = torch.load(out / "data.pt", weights_only=False)
    # an older version saved the bare tensor
    return saved["tokens"] if isinstance(saved, dict) else saved


@needs_shared
def test_another_run_s_folder_is_refused_before_anything_is_written(
    corpus: dict[str, Path],
    targets: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A folder that holds a run of another shape is refused before the target writes its
    continuations into it (data.pt: minutes at full size), or anything else."""
    out = tmp_path / "e3"
    other = random_llama(vocab=8, dim=16)
    RunFolder(out).save_state(3, other, torch.optim.AdamW(other.parameters()), torch.Generator())
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        eagle3(targets[0], corpus, out, 2, *QUICK)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "holds a run of another shape" in lines[0], lines
    assert sorted(path.name for path in out.iterdir()) == ["state.pt"]


@needs_shared
def test_the_continuations_are_the_target_s_own(
    corpus: dict[str, Path], targets: tuple[Path, Path], tmp_path: Path
) -> None:
    """data.pt is reused for the target that wrote it only: pointed at a folder made for target a,
    a run for target b (same shape, same lengths and count) trains on b's continuations, as a
    run in a new folder would."""
    a, b = targets
    eagle3(a, corpus, tmp_path / "for_a", 1, *QUICK)
    eagle3(b, corpus, tmp_path / "for_b", 1, *QUICK)
    assert not torch.equal(continuations(tmp_path / "for_a"), continuations(tmp_path / "for_b"))
    eagle3(b, corpus, tmp_path / "for_a", 2, *QUICK)  # resumes the head, now for b
    assert torch.equal(continuations(tmp_path / "for_a"), continuations(tmp_path / "for_b"))


class KilledError(Exception):
    """Stands for a run killed right after it wrote state.pt."""


@needs_shared
def test_a_resumed_run_draws_the_batches_of_an_uninterrupted_one(
    corpus: dict[str, Path],
    targets: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stopped after state.pt at step 2 and rerun, a run goes on as if it had never stopped: the
    same batches at every step (each step's losses and alphas by depth are the batch's), and the
    same head at the end."""
    eagle3(targets[0], corpus, tmp_path / "whole", 4, *QUICK, "--save-every", "2")
    save = RunFolder.save_state

    def save_then_stop(self: RunFolder, step: int, *args: object, **kwargs: object) -> None:
        save(self, step, *args, **kwargs)
        if step == 2:
            raise KilledError

    monkeypatch.setattr(RunFolder, "save_state", save_then_stop)
    with pytest.raises(KilledError):
        eagle3(targets[0], corpus, tmp_path / "stopped", 4, *QUICK, "--save-every", "2")
    monkeypatch.undo()
    eagle3(targets[0], corpus, tmp_path / "stopped", 4, *QUICK, "--save-every", "2")
    whole, resumed = (
        [json.loads(line) for line in (tmp_path / run / "log.jsonl").read_text().splitlines()]
        for run in ("whole", "stopped")
    )
    assert [row["step"] for row in resumed] == [1, 2, 3, 4]
    drawn = [
        [(row["loss"], row["loss_by_depth"], row["alpha_by_depth"]) for row in rows]
        for rows in (whole, resumed)
    ]
    assert drawn[0] == drawn[1]
    assert (tmp_path / "whole" / "hf" / "model.safetensors").read_bytes() == (
        tmp_path / "stopped" / "hf" / "model.safetensors"
    ).read_bytes()


@needs_shared
def test_a_head_that_does_not_carry_over_to_p_eagle_is_one_clear_error(
    corpus: dict[str, Path],
    targets: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An EAGLE-3 head whose weights do not carry over to a P-EAGLE head one for one is bad input:
    one line and status 2 (an assert used to guard it: a traceback, and nothing at all under
    python -O), before anything is written."""
    head = random_eagle3_head(load_model(targets[0]))
    del head.fc  # its weights lack fc.weight
    monkeypatch.setattr(train, "load_eagle3_head", lambda *args: head)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        train.main(
            [
                "peagle",
                "--target",
                str(targets[0]),
                "--head",
                "a-head",
                "--corpus",
                str(corpus["train"]),
                "--eval-corpus",
                str(corpus["valid"]),
                "--out",
                str(tmp_path / "pe"),
                "--no-progress",
                "--threads",
                "1",
                *QUICK,
            ]
        )
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: a-head: ") and "fc.weight" in lines[0], (
        lines
    )
    assert not (tmp_path / "pe").exists()


@needs_shared
def test_a_chat_model_s_drafter_trains_on_its_answers_to_requests(
    corpus: dict[str, Path],
    targets: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--data chat: data.pt is one stream of requests about the corpus, each in the target's chat
    template, and the target's answer after it (the first greedy, to a stop id or the length);
    the held-out prompts are chat requests too. A base model is refused in one line."""
    chat_target = chat_model(targets[0], tmp_path)
    eagle3(chat_target, corpus, tmp_path / "e3", 2, *QUICK, "--data", "chat", "--sequences", "4")
    stream = continuations(tmp_path / "e3").tolist()
    tokenizer, model = load_tokenizer(chat_target), load_model(chat_target)
    (request, *_) = chat_requests([corpus["train"]], 4, seed=1)  # the run's seed + 1
    # the template writes no BOS
    prompt = tokenizer.encode(f"user: {request}\nassistant:", bos=False)
    assert stream[: len(prompt)] == prompt
    answer = []  # the target's greedy answer, by a plain forward with no cache: up to 24 - 8 tokens
    with torch.no_grad():
        while len(answer) < 16 and (not answer or answer[-1] != tokenizer.eos_id):
            answer.append(int(model(torch.tensor([prompt + answer]))[0, -1].argmax()))
    assert stream[len(prompt) : len(prompt) + len(answer)] == answer
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        eagle3(targets[0], corpus, tmp_path / "base", 1, *QUICK, "--data", "chat")
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "has no chat template" in lines[0], lines


@needs_shared
def test_answers_another_device_wrote_are_read_here_and_a_p_eagle_head_trains_on_them(
    corpus: dict[str, Path], targets: tuple[Path, Path], tmp_path: Path
) -> None:
    """data.pt written as a GPU writes it (512 requests answered at once) is the data of a run on
    the CPU: read as it is, and grown with the rows it was made with, not made again with the
    CPU's 32. peagle takes --data chat as eagle3 does."""
    chat_target = chat_model(targets[0], tmp_path)
    eagle3(chat_target, corpus, tmp_path / "e3", 2, *QUICK, "--data", "chat", "--sequences", "4")
    saved = torch.load(tmp_path / "e3" / "data.pt", weights_only=True)
    assert saved["made_from"]["rows"] == 32
    # The same requests as a GPU's run records them; its answers marked so that a remade stream would show.
    tokens = saved["tokens"].clone()
    tokens[saved["ends"][0] - 1] = 7
    (tmp_path / "pe").mkdir()
    gpu_made = {**saved["made_from"], "rows": 512}
    torch.save({**saved, "tokens": tokens, "made_from": gpu_made}, tmp_path / "pe" / "data.pt")
    args = [
        "peagle",
        "--target",
        str(chat_target),
        "--head",
        str(tmp_path / "e3" / "hf"),
        "--corpus",
        str(corpus["train"]),
        "--eval-corpus",
        str(corpus["valid"]),
        "--out",
        str(tmp_path / "pe"),
        "--lr",
        "3e-3",
        "--warmup",
        "1",
        "--depths",
        "3",
        "--save-dtype",
        "float32",
        "--no-progress",
        "--threads",
        "1",
        *QUICK,
        "--data",
        "chat",
        "--sequences",
        "6",
        "--steps",
        "2",
    ]
    train.main(args)
    grown = torch.load(tmp_path / "pe" / "data.pt", weights_only=True)
    assert grown["made_from"]["rows"] == 512 and len(grown["ends"]) == 6
    # the first four as they were, the marked one too
    assert torch.equal(grown["tokens"][: saved["ends"][3]], tokens)
    summary = json.loads((tmp_path / "pe" / "summary.json").read_text())
    assert summary["data"] == "chat" and summary["steps"] == 2


@needs_shared
def test_a_fresh_draft_is_distilled_on_a_chat_model_s_answers(
    corpus: dict[str, Path],
    targets: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """distill without --draft: a fresh draft of the shape given and of the target's vocabulary,
    trained on windows of the target's answers (data.pt, as eagle3 --data chat makes it) against the
    target's distributions; the loss falls, it is written with the target's tokenizer and drafts for
    it. A shape wider than the target is one line."""
    chat_target = chat_model(targets[0], tmp_path)
    args = [
        "distill",
        "--target",
        str(chat_target),
        "--dim",
        "16",
        "--n-layers",
        "1",
        "--n-heads",
        "2",
        "--hidden-dim",
        "32",
        "--data",
        "chat",
        "--divergence",
        "fkl",
        "--corpus",
        str(corpus["train"]),
        "--eval-corpus",
        str(corpus["valid"]),
        "--lr",
        "1e-2",
        "--warmup",
        "1",
        "--save-dtype",
        "float32",
        "--no-progress",
        "--threads",
        "1",
        *QUICK,
        "--sequences",
        "8",
    ]
    train.main([*args, "--steps", "12", "--out", str(tmp_path / "d")])
    rows = [json.loads(line) for line in (tmp_path / "d" / "log.jsonl").read_text().splitlines()]
    assert sum(r["loss"] for r in rows[-3:]) < sum(r["loss"] for r in rows[:3])
    saved = torch.load(tmp_path / "d" / "data.pt", weights_only=True)
    assert len(saved["ends"]) == 8 and saved["made_from"]["rows"] == 32
    draft = load_model(tmp_path / "d" / "hf")
    assert (draft.config.dim, draft.config.n_layers, draft.config.vocab_size) == (16, 1, 512)
    assert load_tokenizer(tmp_path / "d" / "hf").encode("Once upon a time") == load_tokenizer(
        chat_target
    ).encode("Once upon a time")
    summary = json.loads((tmp_path / "d" / "summary.json").read_text())
    assert 0 <= summary["after"]["alpha_greedy"] <= 1 and "alpha_greedy" in summary["before"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        train.main(
            [
                *args,
                "--dim",
                "64",
                "--n-heads",
                "2",
                "--steps",
                "1",
                "--out",
                str(tmp_path / "wide"),
            ]
        )
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "wider than its target" in lines[0], lines


def test_a_fresh_draft_starts_from_the_target_s_embedding_geometry() -> None:
    """model.training.fresh_draft: at the target's own width the projection is a rotation of the
    table about its mean, so the distances between ids are the target's; narrower, the draft keeps
    the directions along which the target's ids differ most (more of the spread than a random
    projection of the same width keeps)."""
    target = random_llama(vocab=64, dim=32, seed=0)
    with torch.no_grad():  # ids that differ mostly along a few directions, as trained embeddings do
        target.embed_tokens.weight.mul_(torch.linspace(3.0, 0.1, 32))
    table = target.embed_tokens.weight.detach()
    same = training.fresh_draft(target, 32, 1, 4, 2, 64).embed_tokens.weight.detach()
    exact = "donot_use_mm_for_euclid_dist"
    assert torch.allclose(
        torch.cdist(same, same, compute_mode=exact),
        torch.cdist(table, table, compute_mode=exact),
        atol=1e-4,
    )
    narrow = training.fresh_draft(target, 8, 1, 2, 1, 16)
    assert narrow.config.vocab_size == 64 and narrow.config.tie_word_embeddings
    kept = narrow.embed_tokens.weight.detach().var(0).sum()
    random = (
        (table @ torch.linalg.qr(torch.randn(32, 8, generator=torch.Generator().manual_seed(1)))[0])
        .var(0)
        .sum()
    )
    assert kept > 1.5 * random


@needs_shared
@pytest.mark.parametrize("device", ["gpu", "cuda:99"])
def test_a_device_that_is_not_there_is_one_clear_error(
    corpus: dict[str, Path],
    targets: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    device: str,
) -> None:
    """--device names where the target and the drafter compute: a name torch does not know, or a
    GPU this machine does not have, is one line and status 2, before anything is written."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        eagle3(targets[0], corpus, tmp_path / "e3", 1, *QUICK, "--device", device)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and device in lines[0], lines
    assert not (tmp_path / "e3").exists()


@needs_shared
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_chat_model_s_head_trains_on_a_gpu_and_its_run_goes_on_on_the_cpu(
    corpus: dict[str, Path], targets: tuple[Path, Path], tmp_path: Path
) -> None:
    """train.py eagle3 --device cuda: the target answers the requests on the GPU (data.pt), the head
    trains there, and the head it writes drafts for the target on the CPU; the same run folder
    goes on on the CPU (state.pt written on the GPU is read there)."""
    chat_target = chat_model(targets[0], tmp_path)
    on_gpu = eagle3(
        chat_target, corpus, tmp_path / "e3", 4, *QUICK, "--data", "chat", "--device", "cuda"
    )
    assert on_gpu["steps"] == 4 and 0 <= on_gpu["held_out"]["alpha_greedy"] <= 1
    assert torch.load(tmp_path / "e3" / "data.pt", weights_only=True)["made_from"]["rows"] == 512
    drafter = load_drafter(tmp_path / "e3" / "hf", load_model(chat_target))
    assert drafter is not None
    on_cpu = eagle3(
        chat_target, corpus, tmp_path / "e3", 6, *QUICK, "--data", "chat", "--device", "cpu"
    )
    assert on_cpu["steps"] == 6
