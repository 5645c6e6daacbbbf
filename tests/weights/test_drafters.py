"""Drafters on disk (weights/drafters.py): a feature head saved and loaded back bit for bit,
``load_drafter`` by folder or name, and a head trained for another target, or a broken head
folder, refused with a CheckpointError that says so.
"""

from __future__ import annotations

import copy

import pytest
import torch

from speculative import FeatureDrafter, PromptLookupDrafter
from tests.support.toy_models import random_head, random_llama
from weights import CheckpointError, load_drafter
from weights.drafters import load_feature_head, save_feature_head


# ----------------------------------------------------------------------------- loading
def test_feature_head_round_trip_and_load_drafter(tmp_path) -> None:
    target = random_llama(vocab=8, dim=16, n_layers=2, max_seq_len=32)
    head = random_head(target)
    save_feature_head(head, tmp_path / "head", target, target_name="toy-target")
    loaded = load_feature_head(tmp_path / "head", target)
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert (
        tmp_path / "head" / "model.safetensors"
    ).stat().st_mode & 0o044  # readable by others, like config.json
    assert isinstance(load_drafter(tmp_path / "head", target), FeatureDrafter)
    assert isinstance(load_drafter("lookup", target), PromptLookupDrafter)


@pytest.mark.parametrize(
    "other, what",
    [
        ({"dim": 32, "n_heads": 2}, "hidden_size"),
        ({"vocab": 9}, "vocab_size"),
        ({"n_layers": 3}, "num_hidden_layers"),
        ({"seed": 11}, "fingerprint"),
    ],
)
def test_a_head_trained_for_another_target_is_refused(tmp_path, other: dict, what: str) -> None:
    shape = {"vocab": 8, "dim": 16, "n_layers": 2, "n_heads": 2, "seed": 0}
    trained_for = random_llama(vocab=8, dim=16, n_layers=2, n_heads=2, seed=0)
    save_feature_head(
        random_head(trained_for), tmp_path / "head", trained_for, target_name="target-a"
    )
    another = random_llama(**{**shape, **other})
    with pytest.raises(CheckpointError, match=f"target-a.*{what}|{what}.*target-a") as err:
        load_feature_head(tmp_path / "head", another, "target-b")
    assert "target-b" in str(err.value) and "target-a" in str(err.value)
    # The same target, cast to bfloat16, is still the one the head was trained for.
    load_feature_head(tmp_path / "head", copy.deepcopy(trained_for).to(torch.bfloat16))


def test_a_broken_head_folder_is_a_checkpoint_error(tmp_path) -> None:
    target = random_llama(vocab=8, dim=16)
    save_feature_head(random_head(target), tmp_path / "head", target)
    path = tmp_path / "head" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-64:] = b"\xff" * 64  # NaN in float32
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="non-finite"):
        load_feature_head(tmp_path / "head", target)
    (tmp_path / "head" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="feature head"):
        load_feature_head(tmp_path / "head", target)
