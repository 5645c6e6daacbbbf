"""A drafter in another dtype than its target's (weights.load.PairSpec.draft_dtype, --draft-dtype).

The verifier makes the output the target's whatever the drafter proposes, so the drafter's
numerics are free; what must hold is that nothing of the drafter's dtype leaks into the law or
into the greedy output: its q reaches the verifier in float32 (speculative.sampling.full_width),
the target's features and embeddings reach a head in the head's dtype.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import generate
from model.host import CPU
from speculative import FeatureDrafter, speculative_generate
from speculative.sampling import Sampling
from tests.support.paths import ROOT, TARGET
from tests.support.proofs import proof
from tests.support.statistical import BUGS, P_VALUE, Setting, sample_counts, window_distribution
from tests.support.toy_models import (
    chi_square_pvalue,
    llama_next_logits,
    random_eagle3_head,
    random_llama,
    ref_warp,
    reference_greedy,
)
from weights import load as weights_load
from weights.load import read_pair

RUNS = 1000
WEIGHTS = ROOT / "weights"
CASES = [("correct", "head"), ("correct", "model"), ("inverted-ratio", "head")]


@pytest.fixture(scope="module")
def small() -> dict:
    target = random_llama(
        vocab=8, dim=16, n_layers=3, n_heads=2, n_kv_heads=1, hidden_dim=32, seed=0
    )
    return {
        "target": target,
        "logits": llama_next_logits(target),
        "head": random_eagle3_head(target, drop=(1, 6)).to(torch.bfloat16),
        "model": random_llama(
            vocab=8,
            dim=16,
            n_layers=1,
            n_heads=2,
            n_kv_heads=1,
            hidden_dim=32,
            seed=7,
            dtype=torch.bfloat16,
        ),
    }


@proof(
    "a bfloat16 drafter (an EAGLE-3 head, a draft model) beside a float32 target keeps the target's law",
    "chi-square, p > 1e-3, 1000 seeded runs",
    rejects=("inverted ratio",),
)
@pytest.mark.parametrize("variant, kind", CASES, ids=[f"{v}-{k}" for v, k in CASES])
def test_a_bfloat16_drafter_keeps_a_float32_targets_law(
    small: dict, variant: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sampling = Sampling(temperature=0.9)
    if variant in BUGS:
        BUGS[variant](monkeypatch, Setting(sampling, draft_after=lambda drafted: None))
    target = small["target"]
    drafter = FeatureDrafter(small["head"], target) if kind == "head" else small["model"]

    def run(seed: int) -> list[int]:
        return speculative_generate(
            target,
            drafter,
            [1, 5],
            4,
            gamma=2,
            temperature=0.9,
            seed=seed,
            verify="token",  # the bugs catalogued are of the token-wise rule
        ).tokens

    counts = sample_counts(run, RUNS, 1, 2)
    p_value = chi_square_pvalue(
        counts,
        window_distribution(
            lambda ctx: ref_warp(small["logits"](ctx).tolist(), 0.9, None, None), [1, 5], 1, 2
        ),
    )
    if variant in BUGS:
        assert p_value < P_VALUE, f"the test did not catch {variant} (p = {p_value:.3g})"
    else:
        assert p_value > P_VALUE, f"{variant} rejected (p = {p_value:.3g})"


@proof(
    "a drafter in another dtype than its float64 target gives the target's greedy output, in chains and trees",
    "exact identity",
)
@pytest.mark.parametrize(
    "shape", [{"gamma": 3}, {"gamma": 5}, {"tree": (2, 2)}, {"tree": (3, 1, 1)}]
)
@pytest.mark.parametrize("kind", ["head", "model"])
def test_a_drafter_in_another_dtype_gives_the_targets_greedy_output(kind: str, shape: dict) -> None:
    target = random_llama(
        vocab=16,
        dim=32,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=64,
        max_seq_len=64,
        seed=3,
        dtype=torch.float64,
    )
    if kind == "head":
        drafter = FeatureDrafter(
            random_eagle3_head(target, std=0.2, drop=(3, 9)).to(torch.float32), target
        )
    else:
        drafter = random_llama(
            vocab=16,
            dim=32,
            n_layers=1,
            n_heads=4,
            n_kv_heads=2,
            hidden_dim=64,
            max_seq_len=64,
            seed=4,
            dtype=torch.bfloat16,
        )
    for prompt in ([1], [4, 2, 9], [7, 7, 7, 1, 0]):
        out = speculative_generate(target, drafter, prompt, 20, temperature=0, **shape)
        assert out.tokens == reference_greedy(target, prompt, 20)


def bf16_copy(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / f"{name}-bf16"
    shutil.copytree(WEIGHTS / name, folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["torch_dtype"] == "float16"  # the shipped drafters stay in their target's dtype
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    return folder


@pytest.mark.parametrize("name", ["tiny-eagle3", "tiny-draft"])
def test_a_drafter_stored_in_bfloat16_runs_in_it_where_the_cpu_computes_it(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = bf16_copy(tmp_path, name)
    for flags, want in (
        (("avx512f", "avx512_bf16"), torch.bfloat16),
        (("avx512f", "avx512bw"), torch.float32),
    ):
        monkeypatch.setattr(weights_load, "describe_cpu", lambda flags=flags: CPU("a cpu", flags))
        spec = read_pair(TARGET, folder)
        assert spec.draft_dtype("cpu", torch.float32) == want
        # a GPU: the target's, as before
        assert spec.draft_dtype("cuda", torch.float16) == torch.float16
        assert read_pair(TARGET, WEIGHTS / name).draft_dtype("cpu", torch.float32) == torch.float32
        assert read_pair(TARGET, "lookup").draft_dtype("cpu", torch.float32) == torch.float32
    pair = read_pair(TARGET, folder).load(dtype=torch.float32, draft_dtype=torch.bfloat16)
    assert pair.target.dtype == torch.float32 and pair.draft_dtype == torch.bfloat16
    network = pair.head if pair.head is not None else pair.draft_model
    assert all(p.dtype == torch.bfloat16 for p in network.parameters())


def test_generate_says_the_drafters_dtype_and_draft_dtype_overrides_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = bf16_copy(tmp_path, "tiny-eagle3")
    monkeypatch.setattr(
        weights_load, "describe_cpu", lambda: CPU("a cpu", ("avx512f", "avx512_bf16"))
    )

    def run(*flags: str) -> tuple[dict, str]:
        capsys.readouterr()
        assert (
            generate.main(["--draft", str(folder), "--max-new-tokens", "4", "--json", *flags]) == 0
        )
        assert generate.main(["--draft", str(folder), "--max-new-tokens", "4", *flags]) == 0
        out = capsys.readouterr()
        return json.loads(out.out.splitlines()[0])["settings"], out.err.splitlines()[0]

    settings, header = run()
    assert (settings["dtype"], settings["draft_dtype"]) == ("float32", "bfloat16")
    assert "in float32, the drafter in bfloat16" in header
    settings, header = run("--draft-dtype", "float32")
    assert (settings["dtype"], settings["draft_dtype"]) == ("float32", "float32")
    assert "the drafter in" not in header
