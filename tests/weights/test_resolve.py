"""weights.registry.resolve on what a user types: a GGUF file that is not there is named as a file,
and a Hugging Face Hub id is found in the local Hugging Face cache (its layout written here as
huggingface_hub writes it: models--OWNER--NAME/refs/main and snapshots/REVISION/), never downloaded."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.cli import main_error
from weights.registry import WEIGHTS_DIR, UnknownCheckpointError, resolve

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


def cached(home: Path, repo: str, revision: str, files: Path | None) -> Path:
    root = home / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / revision
    if files is None:
        snapshot.mkdir(parents=True)
    else:
        shutil.copytree(files, snapshot)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(revision)
    return snapshot


def test_a_missing_gguf_is_named_as_a_file(tmp_path) -> None:
    with pytest.raises(UnknownCheckpointError, match=r"^GGUF file .*absent\.gguf does not exist$"):
        resolve(tmp_path / "absent.gguf")


def test_a_hub_id_is_found_in_the_hugging_face_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    cached(tmp_path, REPO, "0123abc", None)  # an older snapshot without the files: not this one
    snapshot = cached(tmp_path, REPO, "4567def", WEIGHTS_DIR / "tiny-target")
    assert resolve(REPO) == snapshot
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))  # the variable wins
    with pytest.raises(UnknownCheckpointError, match="hf download HuggingFaceTB/SmolLM2"):
        resolve(REPO)


def test_a_hub_id_that_is_not_there_says_how_to_get_it(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    message = main_error(
        capsys, ["--target", REPO], "Hugging Face cache", "hf download"
    )  # generate.py
    assert str(tmp_path / "hub") in message and "nothing is downloaded" in message
