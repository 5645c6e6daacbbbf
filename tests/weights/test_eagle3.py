"""EAGLE-3 heads on disk (weights/eagle3.py): both published layouts written and read back to
the same logits, ``--draft FOLDER`` finding the kind from config.json alone, and a head that
does not fit the target (hidden size, vocabulary, layer ids, another target's weights, an
option not implemented, a broken map) refused with one line that says which.

The layouts are checked against their published form here by the key names and config
fields a reader of either expects; tests/weights/test_eagle3_speculators.py checks the
``speculators`` layout against that package itself.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculative import FeatureDrafter
from tests.support.cli import cli
from tests.support.toy_models import random_eagle3_head, random_llama
from weights import CheckpointError, load_drafter
from weights.eagle3 import load_eagle3_head, save_eagle3_head

SHAPE = {
    "vocab": 16,
    "dim": 32,
    "n_layers": 6,
    "n_heads": 4,
    "n_kv_heads": 2,
    "hidden_dim": 64,
    "max_seq_len": 64,
}


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return random_llama(**SHAPE, seed=3)


def logits_of(head: torch.nn.Module, target: torch.nn.Module) -> torch.Tensor:
    tokens = torch.tensor([[1, 4, 2, 8, 5, 7]])
    with torch.no_grad():
        _, fused = target(tokens, return_hidden=head.target_layers)
        return head.draft_logits(head(head.project(fused), target.embed_tokens(tokens)))


@pytest.mark.parametrize(
    "layout, prefix", [("speculators", "layers.0."), ("official", "midlayer.")]
)
def test_both_layouts_round_trip_to_the_same_logits(
    tmp_path, target, layout: str, prefix: str
) -> None:
    head = random_eagle3_head(target, drop=(2, 11))
    save_eagle3_head(head, tmp_path / "head", target, target_name="toy", layout=layout)
    names = set(load_file(tmp_path / "head" / "model.safetensors"))
    assert {
        f"{prefix}hidden_norm.weight",
        f"{prefix}self_attn.q_proj.weight",
        "fc.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
    } <= names
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    if layout == "speculators":
        assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 14
        assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]
        assert config["transformer_layer_config"]["vocab_size"] == 16
    else:
        assert (
            config["architectures"] == ["LlamaForCausalLMEagle3"]
            and config["draft_vocab_size"] == 14
        )
    loaded = load_eagle3_head(tmp_path / "head", target)
    torch.testing.assert_close(logits_of(loaded, target), logits_of(head, target), rtol=0, atol=0)
    assert loaded.target_ids().tolist() == [i for i in range(16) if i not in (2, 11)]
    drafter = load_drafter(tmp_path / "head", target)
    assert isinstance(drafter, FeatureDrafter) and drafter.reads_features == (2, 3, 3)


def test_an_official_head_without_layer_ids_reads_the_default_layers(tmp_path, target) -> None:
    save_eagle3_head(random_eagle3_head(target), tmp_path / "head", target, layout="official")
    path = tmp_path / "head" / "config.json"
    config = json.loads(path.read_text())
    del config["eagle_config"]
    path.write_text(json.dumps(config))
    # the official files are often torch pickles
    state = load_file(tmp_path / "head" / "model.safetensors")
    torch.save(state, tmp_path / "head" / "pytorch_model.bin")
    (tmp_path / "head" / "model.safetensors").unlink()
    assert load_eagle3_head(tmp_path / "head", target).target_layers == (2, 3, 3)


@pytest.mark.parametrize(
    "other, message",
    [
        ({"dim": 48, "n_heads": 4}, "hidden size 32, target-b has 48"),
        ({"vocab": 20}, "vocabulary 16, target-b has 20"),
        ({"n_layers": 3}, "reads target layers \\[2, 3, 3\\], target-b has 3"),
        ({"seed": 11}, "trained for another target"),
    ],
)
def test_a_head_that_does_not_fit_the_target_is_refused(
    tmp_path, target, other: dict, message: str
) -> None:
    save_eagle3_head(random_eagle3_head(target), tmp_path / "head", target, target_name="target-a")
    another = random_llama(**{**SHAPE, "seed": 3, **other})
    with pytest.raises(CheckpointError, match=message):
        load_eagle3_head(tmp_path / "head", another, "target-b")


def test_broken_files_are_one_line_errors(tmp_path, target) -> None:
    folder = tmp_path / "head"
    save_eagle3_head(random_eagle3_head(target), folder, target)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "norm_output": True}))
    with pytest.raises(CheckpointError, match="norm_output is not implemented"):
        load_eagle3_head(folder, target)
    (folder / "config.json").write_text(json.dumps(config))
    state = load_file(folder / "model.safetensors")
    save_file({**state, "d2t": state["d2t"].flip(0).contiguous()}, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="d2t does not map"):
        load_eagle3_head(folder, target)
    save_file({k: v for k, v in state.items() if k != "fc.weight"}, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="fc.weight"):
        load_eagle3_head(folder, target)


def test_generate_takes_an_eagle3_folder_and_refuses_one_for_another_target(tmp_path) -> None:
    from weights import load_model

    shipped = load_model("tiny-target")
    head = random_eagle3_head(shipped, drop=tuple(range(1500, 2048)))
    save_eagle3_head(head, tmp_path / "head", shipped, target_name="tiny-target")
    out = cli("--draft", str(tmp_path / "head"), "--max-new-tokens", "8", "--no-color")
    assert out.returncode == 0, out.stderr
    other = random_llama(
        vocab=2048, dim=384, n_layers=8, n_heads=8, n_kv_heads=4, hidden_dim=1024, seed=1
    )
    save_eagle3_head(random_eagle3_head(other), tmp_path / "other", other, target_name="elsewhere")
    out = cli("--draft", str(tmp_path / "other"), "--max-new-tokens", "8", "--no-color")
    assert (
        out.returncode == 2
        and out.stderr.count("\n") == 1
        and "trained for another target" in out.stderr
    )
