"""The shipped pair in weights/: it loads, here and in transformers, and its model cards tell the truth
about what the files hold."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from speculative import FeatureDrafter, autoregressive_generate
from tests.support.checkpoints import needs_smollm2, smollm2_gguf
from weights import load_drafter, load_model, load_tokenizer, read_config
from weights.eagle3 import proposal_length
from weights.load import default_draft, own_drafter, read_named_pair
from weights.registry import FOR_OTHER_TARGETS, SHIPPED, SHIPPED_HEADS, SHIPPED_MODELS, WEIGHTS_DIR

MAX_SHIPPED_BYTES = 80 * 10**6  # everything tracked in weights/ stays within 80 MB


def card_figure(name: str, label: str) -> int:
    text = (WEIGHTS_DIR / name / "README.md").read_text()
    match = re.search(rf"^- {label}: ([\d,]+)$", text, flags=re.M)
    assert match, f"the model card of {name} has no '- {label}: N' line"
    return int(match.group(1).replace(",", ""))


@pytest.mark.parametrize("name", SHIPPED_MODELS)
def test_model_card_matches_the_files(name: str) -> None:
    model = load_model(name)
    tokenizer = load_tokenizer(name)
    n_params = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    assert card_figure(name, "Parameters") == n_params == model.config.num_parameters()
    # a parallel draft's mask id, after the tokenizer's
    masks = 1 if "pard_token" in model.config.extra else 0
    assert (
        card_figure(name, "Vocabulary") == model.config.vocab_size == tokenizer.vocab_size + masks
    )
    assert model.config.extra.get("pard_token", tokenizer.vocab_size) == tokenizer.vocab_size
    assert model.config.bos_id == tokenizer.bos_id and model.config.eos_id == tokenizer.eos_id


def check_head_card(name: str, target: torch.nn.Module, target_name: str) -> None:
    drafter = load_drafter(name, target, target_name)
    assert isinstance(drafter, FeatureDrafter)
    assert card_figure(name, "Parameters") == sum(p.numel() for p in drafter.head.parameters())
    assert card_figure(name, "Vocabulary") == target.config.vocab_size
    assert not (WEIGHTS_DIR / name / "tokenizer.model").exists()  # it reads the target's tokens


@pytest.mark.parametrize("name", [name for name in SHIPPED_HEADS if name not in FOR_OTHER_TARGETS])
def test_head_card_matches_the_files_and_the_head_loads_for_its_target(name: str) -> None:
    check_head_card(name, load_model("tiny-target"), "tiny-target")


@needs_smollm2
def test_the_smollm2_head_loads_for_its_target_whose_default_is_measured() -> None:
    """smollm2-eagle3 loads for the GGUF that the model card names, says what its card says, and is
    the drafter of that target (--draft hybrid runs it beside suffix decoding); what --draft means
    there when none is named is suffix decoding alone, measured fastest on Spec-Bench
    (weights.registry.MEASURED_DEFAULTS); the shipped target keeps its draft."""
    check_head_card("smollm2-eagle3", load_model(smollm2_gguf()), "SmolLM2-135M-Instruct")
    assert own_drafter(smollm2_gguf()) == "smollm2-eagle3"
    assert default_draft(smollm2_gguf()) == "suffix"
    named = read_named_pair(str(smollm2_gguf()), None, 4, gamma_given=False)
    assert (named.draft, named.gamma, named.defaulted) == ("suffix", 16, True)
    hybrid = read_named_pair(str(smollm2_gguf()), "hybrid", 4, gamma_given=False)
    assert (hybrid.draft, hybrid.gamma) == ("suffix+smollm2-eagle3", 16)
    # the draft length measured fastest (its card)
    assert proposal_length(WEIGHTS_DIR / "smollm2-eagle3") == 4
    assert default_draft("tiny-target") == "tiny-draft"


def test_pair_shares_one_tokenizer_and_fits_the_size_budget() -> None:
    fingerprints = {load_tokenizer(name).fingerprint() for name in SHIPPED_MODELS}
    assert len(fingerprints) == 1, "the shipped models must share one tokenizer.model"
    total = sum(f.stat().st_size for name in SHIPPED for f in (WEIGHTS_DIR / name).iterdir())
    assert total <= MAX_SHIPPED_BYTES, f"weights/ holds {total / 1e6:.1f} MB (budget 80 MB)"


def test_target_shape_allows_two_way_tensor_parallelism() -> None:
    config = read_config(WEIGHTS_DIR / "tiny-target")
    assert config.n_heads % 2 == 0 and config.n_kv_heads % 2 == 0 and config.hidden_dim % 2 == 0


@pytest.mark.parametrize("name", ["tiny-target", "tiny-draft"])
def test_shipped_checkpoint_loads_in_transformers_with_equal_logits(name: str) -> None:
    transformers = pytest.importorskip("transformers")
    ours = load_model(name)
    theirs = transformers.LlamaForCausalLM.from_pretrained(
        Path(WEIGHTS_DIR / name), torch_dtype=torch.float32
    ).eval()
    tokens = torch.tensor(
        [load_tokenizer(name).encode("Once upon a time, there was a little dog named Max.")]
    )
    with torch.no_grad():
        diff = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    assert diff < 1e-4, f"{name}: logits differ by {diff}"


def test_target_greedy_story_is_english() -> None:
    """A weak but falsifiable check that the target learned to write: its greedy continuation is made of
    common English words (a random or broken model writes fragments and non-words)."""
    model, tokenizer = load_model("tiny-target"), load_tokenizer("tiny-target")
    out = autoregressive_generate(model, tokenizer.encode("Once upon a time"), 60, temperature=0)
    words = re.findall(r"[a-z]+", tokenizer.decode(out.tokens).lower())
    common = {
        "the",
        "a",
        "was",
        "and",
        "she",
        "he",
        "to",
        "her",
        "his",
        "they",
        "there",
        "little",
        "named",
        "one",
        "day",
        "with",
        "play",
        "loved",
        "of",
        "in",
        "it",
        "saw",
        "said",
    }
    assert len(words) > 30
    assert sum(w in common for w in words) / len(words) > 0.25, words


@pytest.mark.parametrize("name", SHIPPED_MODELS)
def test_transformers_autotokenizer_loads_the_folder_as_it_is(name: str) -> None:
    """Load generators and evaluation harnesses count tokens with the model's own tokenizer:
    without tokenizer_config.json, AutoTokenizer refused the folder. On story text it gives our
    ids, BOS first (a text that starts with spaces is split otherwise by its Llama conversion)."""
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(WEIGHTS_DIR / name)
    ours = load_tokenizer(name)
    for text in [
        "Once upon a time, there was a little dog.",
        'Tom said: "Look!"\nThen 123 cats ran away.',
    ]:
        assert theirs(text).input_ids == ours.encode(text, bos=True)
        assert theirs.decode(ours.encode(text, bos=False)) == text
    assert (theirs.bos_token_id, theirs.eos_token_id) == (ours.bos_id, ours.eos_id)
