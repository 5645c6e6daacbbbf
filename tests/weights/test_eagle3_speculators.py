"""vLLM's ``speculators`` package (0.9.0) as the oracle for EAGLE-3 heads in its layout, both
ways: a head that save_eagle3_head writes loads through speculators' own
Eagle3DraftModel.from_pretrained and gives the same logits; one built and saved there loads
with load_eagle3_head and gives the same logits, target layers and vocabulary map (or, of more
than one decoder layer, is refused). The same both ways for P-EAGLE heads ("peagle"), whose
logits at real and mask positions are compared over one conditional-drop layout.

speculators depends on a CUDA build of torch, so CI (.ci/run) installs it without its
dependencies, and the test skips where it cannot be imported:

    .venv/bin/pip install --no-deps speculators==0.9.0 loguru==0.7.3 pydantic-settings python-dotenv

Its package imports its training modules, which import ``datasets`` and ``hs_connectors``;
the model never calls them, so stubs stand in while it is imported (and only then).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
import types

import pytest
import torch
from safetensors import safe_open

from model import call as calls
from model.eagle3_head import PEagleHead
from speculative.proofs.toys import random_eagle3_head, random_llama, random_peagle_head
from weights import CheckpointError
from weights.checkpoint import save_model
from weights.eagle3 import load_eagle3_head, save_eagle3_head

INSTALL = "pip install --no-deps speculators==0.9.0 loguru==0.7.3 pydantic-settings python-dotenv"
# What the import chain of speculators.models.eagle3 reads from the two absent modules.
STUBS = {
    "datasets": {"load_from_disk": None},
    "hs_connectors": {"FileTransfer": object, "HiddenStatesTransfer": object},
}


def import_speculators() -> tuple[types.ModuleType, ...]:
    if importlib.util.find_spec("speculators") is None:
        pytest.skip(
            f"speculators (the oracle) is not importable: {INSTALL}", allow_module_level=True
        )
    stubbed = [name for name in STUBS if importlib.util.find_spec(name) is None]
    for name in stubbed:
        sys.modules[name] = types.ModuleType(name)
        vars(sys.modules[name]).update(STUBS[name])
    try:
        return tuple(
            importlib.import_module(f"speculators{m}")
            for m in (
                "",
                ".models.eagle3",
                ".proposals.greedy",
                ".models.peagle",
                ".models.peagle.core",
            )
        )
    except ImportError as err:
        pytest.skip(
            f"speculators (the oracle) does not import here ({err}): {INSTALL}",
            allow_module_level=True,
        )
    finally:
        for name in stubbed:
            sys.modules.pop(name, None)


spec, spec_eagle3, spec_greedy, spec_peagle, spec_peagle_core = import_speculators()

# LLaMA 3 rope with an original length so short that the scaling changes every band at these
# positions: a rope field lost or misread on either side changes the logits.
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
THETA = 500000.0
# the draft vocabulary's target ids
KEPT = torch.tensor([i for i in range(64) if i not in (1, 7, 20)])
IDS = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
# three target layers' inputs
FUSED = torch.randn(1, 12, 3 * 32, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def target():
    # 8 layers, so that the default layers (2, 4, 5) are distinct, as speculators requires
    return random_llama(
        vocab=64,
        dim=32,
        n_layers=8,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=64,
        max_seq_len=64,
        seed=3,
        std=0.6,
        dtype=torch.float32,
    )


@pytest.fixture(scope="module")
def verifier(target, tmp_path_factory):
    """The target as an HF checkpoint: speculators reads its embeddings and layer count from it."""
    return str(save_model(target, tmp_path_factory.mktemp("verifier")))


@torch.no_grad()
def our_logits(head, target) -> torch.Tensor:
    return head.draft_logits(head(head.project(FUSED), target.embed_tokens(IDS)))


@torch.no_grad()
def their_logits(model) -> torch.Tensor:
    """The first TTT step's logits over the draft vocabulary (forward returns only its argmax)."""
    seen = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out))
    try:
        model.eval()(FUSED, IDS, document_ids=torch.zeros_like(IDS), ttt_steps=1)
    finally:
        hook.remove()
    return seen[0]


def assert_vocabulary(d2t: torch.Tensor, t2d: torch.Tensor, kept: torch.Tensor = KEPT) -> None:
    assert torch.equal(torch.arange(len(kept)) + d2t, kept)
    assert torch.equal(t2d.nonzero().flatten(), kept)


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_our_head_loads_in_speculators(target, verifier, tmp_path, norm_before_residual):
    head = random_eagle3_head(target, seed=5, std=0.3, drop=(1, 7, 20))
    head.config = dataclasses.replace(head.config, rope_theta=THETA, rope_scaling=LLAMA3)
    head.layers[0].norm_before_residual = norm_before_residual
    save_eagle3_head(head, tmp_path, target, target_name=verifier)

    config = spec_eagle3.Eagle3SpeculatorConfig.from_pretrained(tmp_path)
    config.transformer_layer_config._attn_implementation = (
        "eager"  # its default, flex attention, needs a GPU
    )
    theirs = spec_eagle3.Eagle3DraftModel.from_pretrained(tmp_path, config=config)
    with safe_open(tmp_path / "model.safetensors", "pt") as written:
        # every tensor written has its place there
        assert set(written.keys()) <= set(theirs.state_dict())
    assert theirs.config.norm_before_residual is norm_before_residual
    assert theirs.config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]
    assert_vocabulary(theirs.d2t, theirs.t2d)
    # The file has no embeddings (vLLM shares the target's). speculators takes the verifier's only
    # where its own are NaN, but from_pretrained leaves a tensor absent from the file uninitialised
    # (memory, not NaN, under transformers 5.24; speculators pins <= 5.19), so set them here.
    with torch.no_grad():
        theirs.embed_tokens.weight.copy_(target.embed_tokens.weight)
    torch.testing.assert_close(our_logits(head, target), their_logits(theirs), atol=1e-5, rtol=1e-5)


def their_head(verifier: str, kept: torch.Tensor, n_layers: int = 1):
    """A random Eagle3DraftModel for the target, built as speculators builds one to train."""
    from transformers import LlamaConfig  # present: speculators imported

    layer = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": THETA, **LLAMA3},
    )
    layer._attn_implementation = "eager"
    proposal = spec_greedy.GreedyTokenProposalConfig(speculative_tokens=3)
    config = spec_eagle3.Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=len(kept),
        norm_before_residual=True,
        eagle_aux_hidden_state_layer_ids=[1, 4, 6],
        speculators_config=spec.SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[proposal],
            default_proposal_method="greedy",
            verifier=spec.VerifierConfig(name_or_path=verifier, architectures=["LlamaForCausalLM"]),
        ),
    )
    model = spec_eagle3.Eagle3DraftModel(config)
    t2d = torch.zeros(64, dtype=torch.bool)
    t2d[kept] = True
    # ignored (no maps) for the full vocabulary
    model.load_vocab_mappings(t2d, kept - torch.arange(len(kept)))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # left unset: load_verifier_weights takes the target's
            if name != "embed_tokens.weight":
                noise = torch.randn(param.shape, generator=gen)
                param.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.3 * noise)
    model.load_verifier_weights()
    return model


@pytest.mark.parametrize("kept", [KEPT, torch.arange(64)], ids=["reduced", "full"])
def test_speculators_head_loads_here(target, verifier, tmp_path, kept):
    theirs = their_head(verifier, kept)
    theirs.save_pretrained(tmp_path)

    ours = load_eagle3_head(tmp_path, target)
    assert ours.target_layers == (1, 4, 6)
    assert_vocabulary(ours.d2t, ours.t2d, kept)
    torch.testing.assert_close(our_logits(ours, target), their_logits(theirs), atol=1e-5, rtol=1e-5)


def test_a_speculators_head_of_two_layers_is_refused(target, verifier, tmp_path):
    their_head(verifier, KEPT, n_layers=2).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="head of 2 decoder layers is not implemented"):
        load_eagle3_head(tmp_path, target)


# ----------------------------------------------------------------------------- P-EAGLE
# Real nodes 0..11, then mask nodes (anchor, depth): speculators' layout of one conditional drop.
ANCHORS = torch.cat([torch.arange(12), torch.tensor([0, 2, 3, 5, 9, 0, 3, 9, 0])])
DEPTHS = torch.cat([torch.zeros(12, dtype=torch.long), torch.tensor([1, 1, 1, 1, 1, 2, 2, 2, 3])])


@torch.no_grad()
def our_parallel_logits(head, target) -> torch.Tensor:
    """Each node as the parallel drafter computes it: the head's cached call over the true inputs
    up to its anchor and ``depth`` mask positions, the last one's logits."""
    mask_feature, mask_embedding = head.mask_inputs()
    features, embeddings = head.project(FUSED[0]), head.embed(IDS[0], target.embed_tokens)
    rows = []
    for anchor, depth in zip(ANCHORS.tolist(), DEPTHS.tolist()):
        head.setup_cache(1, 32)
        f = torch.cat([features[: anchor + 1], mask_feature.expand(depth, -1)]).unsqueeze(0)
        e = torch.cat([embeddings[: anchor + 1], mask_embedding.expand(depth, -1)]).unsqueeze(0)
        rows.append(head.draft_logits(head(f, e, calls.chain(0, anchor + 1 + depth, "cpu"))[0, -1]))
    return torch.stack(rows)


@torch.no_grad()
def their_parallel_logits(model, monkeypatch) -> torch.Tensor:
    """PEagleDraftModel.forward (its training pass, the only one it has) over the same layout,
    the logits read at its output layer; the loss after them needs Triton and is not reached."""
    monkeypatch.setattr(
        spec_peagle_core, "generate_cod_sample_indices", lambda **kw: (ANCHORS, DEPTHS)
    )
    seen = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out))
    try:
        model.eval()(
            FUSED,
            IDS,
            document_ids=torch.zeros_like(IDS),
            verifier_last_hidden_states=torch.zeros(1, 12, 32),
            num_depths=4,
        )
    except RuntimeError as err:
        assert "Triton" in str(err), err
    finally:
        hook.remove()
    return seen[0][0]


def test_our_peagle_head_loads_in_speculators(target, verifier, tmp_path, monkeypatch):
    head = random_peagle_head(target, seed=5, std=0.3, drop=(1, 7, 20))
    # the mask id also occurs in the text: it reads the mask embedding there
    head.mask_token_id = int(IDS[0, 6])
    save_eagle3_head(head, tmp_path, target, target_name=verifier)
    config = spec_peagle.PEagleSpeculatorConfig.from_pretrained(tmp_path)
    config.transformer_layer_config._attn_implementation = "eager"
    theirs = spec_peagle.PEagleDraftModel.from_pretrained(tmp_path, config=config)
    assert theirs.mask_token_id == head.mask_token_id
    torch.testing.assert_close(theirs.mask_hidden.flatten(), head.mask_hidden.detach())
    assert_vocabulary(theirs.d2t, theirs.t2d)
    torch.testing.assert_close(
        our_parallel_logits(head, target),
        their_parallel_logits(theirs, monkeypatch),
        atol=1e-5,
        rtol=1e-5,
    )


def test_speculators_peagle_head_loads_here(target, verifier, tmp_path, monkeypatch):
    """Built there as it trains one (its embeddings trained too: here they differ from the
    target's), saved, read here into a PEagleHead with a table of its own."""
    theirs = their_head(verifier, KEPT)
    config = spec_peagle.PEagleSpeculatorConfig(
        **{**theirs.config.model_dump(), "speculators_model_type": "peagle", "mask_token_id": 11}
    )
    config.transformer_layer_config._attn_implementation = "eager"
    model = spec_peagle.PEagleDraftModel(config)
    model.load_state_dict(theirs.state_dict(), strict=False)
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        model.mask_hidden.copy_(torch.randn(model.mask_hidden.shape, generator=gen))
        model.embed_tokens.weight.add_(
            0.05 * torch.randn(model.embed_tokens.weight.shape, generator=gen)
        )
    model.save_pretrained(tmp_path)

    ours = load_eagle3_head(tmp_path, target)
    assert (
        isinstance(ours, PEagleHead) and ours.mask_token_id == 11 and ours.embed_tokens is not None
    )
    assert ours.target_layers == (1, 4, 6)
    torch.testing.assert_close(
        our_parallel_logits(ours, target),
        their_parallel_logits(model, monkeypatch),
        atol=1e-5,
        rtol=1e-5,
    )
