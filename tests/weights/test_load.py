"""Loading a pair by name (weights/load.py): what each draft name means, what is refused before the
weights are read, that a loaded pair decodes as its target alone; and what marks a checkpoint for
chat (weights/registry.py). The text helpers beside the tokenizer are tested in
tests/speculative/serving/test_text.py."""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from model import Llama
from model.scale.memory import LLAMA2_CONFIGS
from speculative import (
    FeatureDrafter,
    PairMismatchError,
    PromptLookupDrafter,
    autoregressive_generate,
    speculative_generate,
)
from weights import UnknownCheckpointError, load_model, load_pair, read_pair
from weights.load import draft_kind, plan_configs
from weights.registry import WEIGHTS_DIR, marked_for_chat

needs_pair = pytest.mark.skipif(
    not (WEIGHTS_DIR / "tiny-target" / "config.json").is_file()
    or not (WEIGHTS_DIR / "tiny-eagle" / "config.json").is_file(),
    reason="the shipped models are absent",
)


def config_json(name: str) -> dict:
    return json.loads((WEIGHTS_DIR / name / "config.json").read_text())


def stacked(model: torch.nn.Module) -> bool:
    return getattr(model.layers[0].self_attn, "qkv_proj", None) is not None


# ----------------------------------------------------------------------------- load_pair
@needs_pair
def test_a_loaded_pair_unpacks_and_decodes_as_its_target_alone() -> None:
    """float64, greedy: the speculative output is the target's own (docs/algorithm.md)."""
    target, draft, tokenizer = load_pair("tiny-target", "tiny-draft", dtype=torch.float64)
    assert isinstance(target, Llama) and isinstance(draft, Llama)
    prompt = tokenizer.encode("Once upon a time")
    with torch.inference_mode():
        fast = speculative_generate(target, draft, prompt, 24, gamma=3, temperature=0)
        alone = autoregressive_generate(
            load_model("tiny-target", dtype=torch.float64), prompt, 24, temperature=0
        )
    assert [int(t) for t in fast.tokens] == [int(t) for t in alone.tokens]
    assert fast.stats.draft_calls > 0


@needs_pair
def test_each_draft_name_means_its_drafter() -> None:
    assert read_pair("tiny-target").kind is None and load_pair("tiny-target").draft is None
    lookup = load_pair("tiny-target", "lookup")
    assert (
        lookup.kind == "lookup"
        and isinstance(lookup.draft, PromptLookupDrafter)
        and lookup.head is None
    )
    head = load_pair("tiny-target", "tiny-eagle")
    assert (
        head.kind == "head"
        and isinstance(head.draft, FeatureDrafter)
        and head.draft.target is head.target
    )
    assert head.draft_model is None and head.head is head.draft.head
    model = read_pair("tiny-target", "tiny-draft")
    assert model.kind == "model" and model.draft_config is not None
    assert (
        draft_kind("tiny-eagle") == "head"
        and draft_kind("tiny-draft") == "model"
        and draft_kind(None) is None
    )
    with pytest.raises(UnknownCheckpointError):
        read_pair("tiny-target", "no-such-draft")


@needs_pair
def test_what_a_spec_reads_from_the_configs() -> None:
    target, draft = config_json("tiny-target"), config_json("tiny-draft")
    spec = read_pair("tiny-target", "tiny-draft")
    assert spec.context == min(target["max_position_embeddings"], draft["max_position_embeddings"])
    assert spec.planned_draft.n_layers == draft["num_hidden_layers"]
    head = read_pair("tiny-target", "tiny-eagle")
    assert head.draft_config is None and head.context == target["max_position_embeddings"]
    # a head is planned as one block of its target's shape
    assert head.planned_draft == replace(head.target_config, n_layers=1)
    assert head.planned_draft.dim == target["hidden_size"]
    assert read_pair("tiny-target", "lookup").planned_draft is None


@needs_pair
def test_a_mismatched_pair_is_refused_before_loading_naming_both(tmp_path: Path) -> None:
    draft = tmp_path / "draft"
    shutil.copytree(WEIGHTS_DIR / "tiny-draft", draft)
    (draft / "model.safetensors").unlink()  # nothing heavy is read: there is nothing to read
    config = json.loads((draft / "config.json").read_text())
    config["vocab_size"] += 64
    (draft / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        PairMismatchError,
        match=f"draft {draft} cannot speculate for target tiny-target: .*vocabulary",
    ):
        read_pair("tiny-target", draft)


@needs_pair
def test_the_models_are_set_up_to_decode_unless_asked_not_to() -> None:
    layers = (
        config_json("tiny-target")["num_hidden_layers"]
        + config_json("tiny-draft")["num_hidden_layers"]
    )
    ready = load_pair("tiny-target", "tiny-draft")
    # attention and MLP
    assert ready.fused == 2 * layers and stacked(ready.target) and stacked(ready.draft)
    plain = read_pair("tiny-target", "tiny-draft").load(prepare_models=False)
    assert (
        plain.fused == 0
        and plain.prepacked == 0
        and not stacked(plain.target)
        and not stacked(plain.draft)
    )
    assert not stacked(read_pair("tiny-target").load(stack=False).target)
    # a feature head too is left as loaded, for Pair.set_up (compiled with its target, or prepared)
    head = read_pair("tiny-target", "tiny-eagle").load(prepare_models=False)
    assert not stacked(head.target) and not stacked(head.head) and head.fused == 0


@needs_pair
def test_with_models_builds_a_new_drafter_and_leaves_the_old_pair_alone() -> None:
    pair = load_pair("tiny-target", "tiny-eagle", prepare_models=False)
    old_drafter, new_target = pair.draft, copy.deepcopy(pair.target)
    swapped = pair.with_models(new_target)
    assert swapped.target is new_target and swapped.draft is not old_drafter
    assert swapped.draft.target is new_target and swapped.draft.head is old_drafter.head
    assert pair.draft is old_drafter and old_drafter.target is pair.target  # nothing patched
    models = load_pair("tiny-target", "tiny-draft", prepare_models=False)
    other = copy.deepcopy(models.draft)
    assert models.with_models(models.target, other).draft is other
    lookup = load_pair("tiny-target", "lookup")
    assert lookup.with_models(new_target).draft is lookup.draft


def test_plan_configs_know_the_published_shapes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SPECULATIVE_WEIGHTS", str(tmp_path))  # nothing downloaded there
    if (WEIGHTS_DIR / "Llama-2-70b-hf").is_dir() or (WEIGHTS_DIR / "Llama-2-7b-hf").is_dir():
        pytest.skip("Llama-2 checkpoints are present here")
    assert plan_configs("70b", "7b") == (LLAMA2_CONFIGS["70b"], LLAMA2_CONFIGS["7b"])
    assert plan_configs("70b-chat", None) == (LLAMA2_CONFIGS["70b"], None)
    assert plan_configs("70b", "lookup")[1] is None


@needs_pair
def test_plan_configs_count_a_head_as_one_block_of_its_target() -> None:
    target, head = plan_configs("tiny-target", "tiny-eagle")
    assert (
        head.n_layers == 1 and head.dim == target.dim == config_json("tiny-target")["hidden_size"]
    )


# ----------------------------------------------------------------------------- weights/registry.py
def test_what_marks_a_checkpoint_for_chat(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"_name_or_path": "meta-llama/Llama-2-7b-hf"}))
    assert not marked_for_chat(base)
    (base / "config.json").write_text(
        json.dumps({"_name_or_path": "meta-llama/Meta-Llama-3-8B-Instruct"})
    )
    assert marked_for_chat(base)
    (base / "config.json").write_text("{}")
    (base / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert marked_for_chat(base)
    named = tmp_path / "my-Chat-model"
    named.mkdir()
    (named / "config.json").write_text("{}")
    assert marked_for_chat(named) and marked_for_chat(str(named))
    with pytest.raises(UnknownCheckpointError):
        marked_for_chat(tmp_path / "nowhere")
