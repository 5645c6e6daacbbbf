"""Compiled decoding (model/fast/compile.py): the static-shape step is the eager forward, a
compiled run never recompiles, and compiled output keeps every promise of the eager one.

* ``Llama.step`` (run eagerly, as the compiled dispatcher calls it: the window the whole
  static cache, scratch slot included) gives the logits of the plain forward, for ragged rows
  after stale entries (float64, to 1e-12);
* compiled models, over whole speculative runs with rollbacks, EOS and gamma="auto", never
  recompile: dynamo is told to raise on any recompilation, and its graph count must not move;
* compiled greedy output is the eager greedy output and the target's, up to the float32
  near-ties of the numerics policy (docs/algorithm.md);
* a chi-square test of the first tokens' joint law, with compiled target and draft;
* what cannot be compiled is refused with a one-line error.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from model import call as calls
from model.call import CacheCall
from model.fast.compile import MODE_ENV, CompileError, compile_for_decoding, decode_widths
from model.fast.prepack import prepack_linears, prepack_supported
from model.fast.setup import cacheable
from model.scale.quantize import Int4Linear, quantize_int4
from speculative import autoregressive_generate, speculative_generate, speculative_generate_batch
from speculative.draft.eagle import FeatureDrafter
from speculative.inputs import GAMMA_MAX
from speculative.verify.tree import TokenTree, branching_parents
from tests.support.cli import PAIR, main_error, main_ok, needs_pair
from tests.support.toy_models import (
    chi_square_pvalue,
    far_from_argmax,
    llama_next_logits,
    noisy_copy,
    random_head,
    random_llama,
    ref_warp,
    sequence_distribution,
)

# Under pytest -n, the module's compiled pairs are compiled once, on one worker (pyproject.toml: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("test_compile")

torch.set_num_threads(1)


def pair(
    dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[torch.nn.Module, torch.nn.Module]:
    target = random_llama(
        vocab=16,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=64,
        max_seq_len=64,
        seed=seed,
        dtype=dtype,
    )
    return target, noisy_copy(target, std=0.05, seed=seed + 1)


# ----------------------------------------------------------------------------- the compiled step, eagerly
@torch.no_grad()
def test_the_step_is_the_cached_forward() -> None:
    """Llama.step, the function compile_for_decoding compiles, run eagerly with what the
    compiled dispatcher passes it (the window the whole cache, its scratch slot included but
    never visible): the logits of the plain forward over each row, after a ragged prefix
    and over stale cache entries; the public ragged call gives the same."""
    model = random_llama(
        vocab=16,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=32,
        seed=1,
        dtype=torch.float64,
    )
    reference = copy.deepcopy(model)
    rows = [[1, 2, 3, 4, 5], [6, 7, 8]]
    model.setup_cache(2, 24)
    model.layers[0].self_attn.cache.k.normal_()  # stale entries must stay invisible
    model(torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]]), calls.ragged([0, 0], 5, 24, "cpu"))
    slots = torch.tensor([[5, 6, 7], [3, 4, 5]])
    window = model.layers[0].self_attn.cache.k.shape[2]
    assert window == 25  # 24 slots and the scratch slot
    # each token sees its row up to its own slot
    visible = torch.arange(window) <= slots.unsqueeze(-1)
    tokens = torch.tensor([[9, 10, 11], [12, 13, 0]])
    out = model.step(tokens, slots, slots, visible, window, False)
    again = model(tokens, calls.ragged([5, 3], 3, 24, "cpu"))  # rewrites the same entries
    for b, new in enumerate([[9, 10, 11], [12, 13]]):
        alone = reference(torch.tensor([rows[b] + new]))[0, -len(new) :]
        assert torch.allclose(out[b, : len(new)], alone, atol=1e-12, rtol=0)
        assert torch.allclose(again[b, : len(new)], alone, atol=1e-12, rtol=0)


# ----------------------------------------------------------------------------- compiled
@pytest.fixture(scope="module")
def compiled_pair() -> dict:
    """Eager and compiled copies of one float32 pair (compiled once for the module: every
    width gamma="auto" can use)."""
    target, draft = pair()
    ctarget, cdraft = copy.deepcopy(target), copy.deepcopy(draft)
    widths = decode_widths("auto", GAMMA_MAX)
    # Inductor's default mode: what these tests check does not depend on the kernels, and the
    # 12 shapes compile in a fraction of autotune's time (a CLI test below runs autotune).
    steps = [
        compile_for_decoding(m, widths, cache_len=64, mode="default") for m in (ctarget, cdraft)
    ]
    return {"target": target, "draft": draft, "ctarget": ctarget, "cdraft": cdraft, "steps": steps}


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("gamma", [4, "auto"])
def test_a_compiled_run_never_recompiles(compiled_pair: dict, gamma: int | str) -> None:
    """Rollbacks (an imperfect draft), EOS, gamma changing between iterations, new prompts of
    new lengths, sampled and greedy: dynamo must compile nothing new."""
    before = graphs()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed, prompt in enumerate([[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 11], [2, 2]]):
            for temperature in (0.0, 1.0):
                out = speculative_generate(
                    compiled_pair["ctarget"],
                    compiled_pair["cdraft"],
                    prompt,
                    30,
                    gamma=gamma,
                    temperature=temperature,
                    seed=seed,
                    eos_id=3,
                )
                assert out.stats.target_calls > 1
            autoregressive_generate(
                compiled_pair["ctarget"], prompt, 12, temperature=1.0, seed=seed
            )
    assert graphs() == before


@pytest.mark.parametrize("gamma", [1, 4, "auto"])
def test_compiled_greedy_is_the_target_up_to_near_ties(
    compiled_pair: dict, gamma: int | str
) -> None:
    differ = 0
    for seed in range(5):
        prompt = torch.randint(
            0, 16, (1 + seed,), generator=torch.Generator().manual_seed(seed)
        ).tolist()
        compiled = speculative_generate(
            compiled_pair["ctarget"],
            compiled_pair["cdraft"],
            prompt,
            24,
            gamma=gamma,
            temperature=0,
        )
        eager = speculative_generate(
            compiled_pair["target"], compiled_pair["draft"], prompt, 24, gamma=gamma, temperature=0
        )
        assert far_from_argmax(compiled_pair["target"], prompt, compiled.tokens) == []
        differ += compiled.tokens != eager.tokens
    assert differ <= 1  # a near-tie may fall the other way; never more than rarely


def test_the_near_tie_check_sees_a_wrong_compiled_model(compiled_pair: dict) -> None:
    """The check above can fail: a compiled model of other weights is caught."""
    other = random_llama(
        vocab=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=64, seed=9
    )
    out = speculative_generate(
        compiled_pair["ctarget"], compiled_pair["cdraft"], [1, 2], 24, gamma=4, temperature=0
    )
    assert far_from_argmax(other, [1, 2], out.tokens) != []


def test_compiled_runs_have_the_target_distribution(compiled_pair: dict) -> None:
    """The first 2 tokens jointly (256 cells), 1500 runs at temperature 0.9, compiled pair."""
    target, runs = compiled_pair["target"], 1500
    logits = llama_next_logits(target)
    law = sequence_distribution(lambda ctx: ref_warp(logits(ctx).tolist(), 0.9), [1, 5], 2)
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(runs):
        out = speculative_generate(
            compiled_pair["ctarget"],
            compiled_pair["cdraft"],
            [1, 5],
            2,
            gamma=2,
            temperature=0.9,
            seed=seed,
        )
        key = tuple(out.tokens)
        counts[key] = counts.get(key, 0) + 1
    assert chi_square_pvalue(counts, law) > 1e-3


# ----------------------------------------------------------------------------- batch and tree buckets
TREE = (2, 2, 1)  # 10 nodes: the target's tree call is 11 wide; the draft's expansions 2 and 6


def count_compiled_calls(model: torch.nn.Module, counts: Counter) -> None:
    """Count every call of ``model``'s compiled step by its rows ("rows4"), and a token tree's
    call -- one where a token does not see a slot before its own (a sibling's), which no
    chain or ragged call does -- also as "tree" and by its compiled width ("tree11")."""
    real = model.compiled.fn

    def counted(*args, _real=real):
        # (*inputs, slots, positions, visible, window, hidden)
        where, visible, window = (
            args[-5],
            args[-3],
            args[-2],
        )
        rows, width = where.shape
        counts[f"rows{rows}"] += 1
        written = where < window - 1  # padding writes the scratch slot, the last one
        before = torch.arange(window, device=where.device) < where.unsqueeze(-1)
        if bool((written.unsqueeze(-1) & before & ~visible).any()):
            counts["tree"] += 1
            counts[f"tree{width}"] += 1
        return _real(*args)

    model.compiled.fn = counted


@pytest.fixture(scope="module")
def bucketed_pair() -> dict:
    """A pair compiled for batches of up to 4 rows (buckets 1, 2, 4) and for TREE's calls
    (one-row widths: the target's 11, the draft's expansions 2 and 6), with every compiled
    call counted by rows, and a tree's by width."""
    target, draft = pair(seed=3)
    ctarget, cdraft = copy.deepcopy(target), copy.deepcopy(draft)
    # Inductor's default mode: the buckets are the same whatever the kernels, and it compiles
    # these 18 shapes in a fraction of autotune's time (a CLI test runs autotune)
    compile_for_decoding(
        ctarget,
        decode_widths(4, 4),
        rows=(1, 2, 4),
        cache_len=64,
        tree_widths=(len(branching_parents(TREE)) + 1,),
        mode="default",
    )
    compile_for_decoding(
        cdraft,
        (1, 2),
        rows=(1, 2, 4),
        cache_len=64,
        tree_widths=[len(branching_parents(TREE[:d])) for d in range(1, len(TREE))],
        mode="default",
    )
    counts: Counter = Counter()
    for model in (ctarget, cdraft):
        count_compiled_calls(model, counts)
    return {"target": target, "draft": draft, "ctarget": ctarget, "cdraft": cdraft, "calls": counts}


PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [2, 2]]


def test_batch_and_tree_runs_use_their_buckets_and_never_recompile(bucketed_pair: dict) -> None:
    """Batches of 3 (padded to 4, then 2 and 1 as rows finish at EOS or their budget) and token
    trees, greedy and sampled: the compiled shapes are what runs (a tree's call through the
    same compiled step, padded to a compiled tree width), and nothing recompiles."""
    ctarget, cdraft, calls = (
        bucketed_pair["ctarget"],
        bucketed_pair["cdraft"],
        bucketed_pair["calls"],
    )
    before = graphs()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for temperature in (0.0, 1.0):
            speculative_generate_batch(
                ctarget,
                cdraft,
                PROMPTS,
                20,
                gamma=4,
                temperature=temperature,
                seed=1,
                eos_id=3,
                batch_size=3,
            )
            for seed, prompt in enumerate(PROMPTS):
                speculative_generate(
                    ctarget, cdraft, prompt, 20, temperature=temperature, seed=seed, tree=TREE
                )
    assert graphs() == before
    assert calls["rows4"] > 0 and calls["rows2"] > 0 and calls["rows1"] > 0 and calls["tree"] > 0
    # the target's and the draft's
    assert calls["tree11"] > 0 and calls["tree2"] > 0 and calls["tree6"] > 0


def test_compiled_batch_and_tree_greedy_is_the_target_up_to_near_ties(bucketed_pair: dict) -> None:
    target = bucketed_pair["target"]
    batch = speculative_generate_batch(
        bucketed_pair["ctarget"],
        bucketed_pair["cdraft"],
        PROMPTS,
        24,
        gamma=4,
        temperature=0,
        batch_size=3,
    )
    for prompt, row in zip(PROMPTS, batch.results):
        assert len(row.tokens) == 24 and far_from_argmax(target, prompt, row.tokens) == []
        tree = speculative_generate(
            bucketed_pair["ctarget"], bucketed_pair["cdraft"], prompt, 24, temperature=0, tree=TREE
        )
        assert len(tree.tokens) == 24 and far_from_argmax(target, prompt, tree.tokens) == []


def test_a_compiled_tree_call_uses_its_mask() -> None:
    """The compiled step over a tree's call (explicit positions and visibility, padded from 5
    to the compiled width 6) against the eager one, and a wrong mask (causal) caught."""
    model, _ = pair(seed=4)
    eager = copy.deepcopy(model)
    compile_for_decoding(model, (1,), cache_len=32, tree_widths=(6,), mode="default")
    counts: Counter = Counter()
    count_compiled_calls(model, counts)
    eager.setup_cache(1, 32)
    mask = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
        dtype=torch.bool,
    )
    slots, positions = torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[5, 6, 6, 7, 7]])
    # every cached slot 0..4, then the mask over the nodes
    visible = torch.ones(1, 5, 10, dtype=torch.bool)
    visible[0, :, 5:] = mask
    call = CacheCall(slots, positions, visible, 10, 9)
    # the builder makes this call for the tree with these parents (root at slot 4, nodes from 5)
    built = calls.tree(
        5,
        0,
        TokenTree(torch.tensor([6, 7, 8, 9, 10]), [-1, 0, 0, 1, 2], mode="deterministic"),
        "cpu",
    )
    assert torch.equal(built.slots, slots) and torch.equal(built.positions, positions)
    assert torch.equal(built.visible, visible) and (built.window, built.top) == (10, 9)
    with torch.inference_mode():
        for net in (model, eager):
            net(torch.tensor([[1, 2, 3, 4, 5]]), calls.chain(0, 5, "cpu"))
        nodes = torch.tensor([[6, 7, 8, 9, 10]])
        got = model(nodes, call)
        assert counts["tree6"] == 1  # it ran compiled, padded to width 6
        assert torch.allclose(got, eager(nodes, call), atol=1e-5)
        causal = model(
            nodes, CacheCall(slots, positions, torch.arange(10) <= slots.unsqueeze(-1), 10, 9)
        )
        assert not torch.allclose(got, causal, atol=1e-3)


def test_compile_reports_what_it_compiled(compiled_pair: dict) -> None:
    steps = compiled_pair["steps"][0]
    assert steps.widths == decode_widths("auto", GAMMA_MAX) and steps.rows == (1,)
    assert steps.widths[-1] == GAMMA_MAX + 1 and steps.widths[:3] == (1, 2, 3)
    assert (
        steps.compile_s > 0 and steps.shape_for(1, 3) == (1, 3) and steps.shape_for(1, 4) == (1, 5)
    )
    assert steps.shape_for(1, GAMMA_MAX + 2) is None and steps.shape_for(2, 1) is None
    with pytest.raises(ValueError, match="compiled for at most 1 rows and 64 positions"):
        compiled_pair["ctarget"].setup_cache(2, 10)


@pytest.mark.parametrize(
    "gamma, gamma_max, widths",
    [
        (4, 8, (1, 2, 5)),
        (1, 8, (1, 2)),
        ("auto", 8, (1, 2, 3, 5, 9)),
        ("auto", 4, (1, 2, 3, 5)),
        ("auto", 12, (1, 2, 3, 5, 9, 13)),
    ],
)
def test_decode_widths(gamma: int | str, gamma_max: int, widths: tuple[int, ...]) -> None:
    assert decode_widths(gamma, gamma_max) == widths


# ----------------------------------------------------------------------------- prepacked layers inside a graph
@pytest.mark.skipif(not prepack_supported(), reason="prepacking needs oneDNN")
def test_a_prepacked_model_compiles_with_its_packed_products() -> None:
    """A prepacked layer is one opaque operator in the graph (model/fast/prepack.py): the compiled
    prepacked model gives the eager prepacked model's logits, over a run of steps, and the
    packed weights are still what runs (a changed packed weight changes the output)."""
    model = random_llama(
        vocab=16, dim=512, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=512, max_seq_len=32
    )
    if not prepack_linears(model, min_elements=1):
        pytest.skip("nothing was prepacked on this machine")
    eager = copy.deepcopy(model)
    compile_for_decoding(model, (1, 3), cache_len=24, mode="default")
    eager.setup_cache(1, 24)
    with torch.inference_mode():
        feeds = [
            (torch.tensor([[1, 2, 3, 4]]), 0),
            (torch.tensor([[5]]), 4),
            (torch.tensor([[6, 7, 8]]), 5),
            (torch.tensor([[9]]), 8),
        ]
        for tokens, start in feeds:
            call = calls.chain(start, tokens.shape[1], "cpu")
            assert torch.allclose(model(tokens, call), eager(tokens, call), atol=1e-4, rtol=1e-4)
        layer = model.layers[0].mlp.down_proj
        before = model(torch.tensor([[3]]), calls.chain(9, 1, "cpu"))
        layer.packed = torch.ops.mkldnn._reorder_linear_weight(
            torch.zeros(layer.out_features, layer.in_features), None
        )
        assert not torch.allclose(model(torch.tensor([[3]]), calls.chain(9, 1, "cpu")), before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int4_model_compiles_with_its_packed_codes(dtype: torch.dtype) -> None:
    """Int4 block weights (model/scale/quantize.py: packed codes, scales and zeros) are tensors of
    the graph as any weight: the compiled int4 model gives the eager int4 model's logits over a run
    of steps, in float32 and in bfloat16, the codes still run (zeroed scales and zeros change the
    output), and its steps may be kept in the compiled-step cache (int8's may not)."""
    model = quantize_int4(
        random_llama(
            vocab=16,
            dim=64,
            n_layers=1,
            n_heads=4,
            n_kv_heads=2,
            hidden_dim=128,
            max_seq_len=32,
            dtype=dtype,
        )
    )
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 7 and cacheable(model)
    assert model.layers[0].mlp.down_proj.scales_and_zeros.dtype == dtype
    eager = copy.deepcopy(model)
    compile_for_decoding(model, (1, 3), cache_len=24, mode="default")
    eager.setup_cache(1, 24)
    # bfloat16: its rounding, fused differently
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    with torch.inference_mode():
        feeds = [
            (torch.tensor([[1, 2, 3, 4]]), 0),
            (torch.tensor([[5]]), 4),
            (torch.tensor([[6, 7, 8]]), 5),
            (torch.tensor([[9]]), 8),
        ]
        for tokens, start in feeds:
            call = calls.chain(start, tokens.shape[1], "cpu")
            got, want = model(tokens, call), eager(tokens, call)
            assert float((got.float() - want.float()).norm() / want.float().norm()) < tolerance
        before = model(torch.tensor([[3]]), calls.chain(9, 1, "cpu"))
        model.layers[0].mlp.down_proj.scales_and_zeros.zero_()
        after = model(torch.tensor([[3]]), calls.chain(9, 1, "cpu"))
        assert (
            float((after.float() - before.float()).norm() / before.float().norm()) > 10 * tolerance
        )


def test_bad_widths_are_refused() -> None:
    model = random_llama(max_seq_len=32)
    with pytest.raises(CompileError, match="widths and rows must be integers >= 1"):
        compile_for_decoding(model, (0, 2))
    with pytest.raises(CompileError, match="exceeds the model's max_seq_len"):
        compile_for_decoding(model, (1,), cache_len=64)


# ----------------------------------------------------------------------------- generate.py --compile
def test_cli_compile_refuses_what_it_cannot_compile(
    capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    main_error(capsys, PAIR + ["--compile", "--quantize", "int8"], "--compile", "int8")
    main_error(capsys, PAIR + ["--compile", "sometimes"], "--compile")
    main_error(capsys, PAIR + ["--compile", "--setup", "plain"], "--compile", "--setup plain")
    main_error(capsys, PAIR + ["--setup", "stacked", "--no-fuse"], "--no-fuse", "--setup stacked")
    main_error(capsys, PAIR + ["--setup", "fastest"], "--setup")


@needs_pair
def test_cli_compile_measures_chooses_and_keeps_the_tokens(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--compile force in the CPU's default mode (autotune: the one test that builds it, end to end):
    the target compiled and timed against the fixed eager set-up (the record the default run reads),
    the choice and compile time on stderr, and the greedy tokens of the eager run (numerics policy: the
    shipped target has no near-tie in these 24 tokens); then --compile measures every set-up, keeps the
    fastest, and loads the step it kept. One width of one model: autotuning times a C++ kernel per product
    and shape, minutes on a cold 2-core machine for a pair (a pair through the command line: test_aot.py's
    full-context run, in Inductor's default mode). The steps go to a cache of this test's own: in the
    session's, later default runs of the shipped target would load them."""
    monkeypatch.setenv("SPECULATIVE_CACHE", str(tmp_path))
    monkeypatch.delenv(MODE_ENV, raising=False)
    base = ["--target", PAIR[1], "--no-draft", "--no-color"]
    eager, _ = main_ok(capsys, base + ["--max-new-tokens", "24", "--json"])
    compiled, err = main_ok(
        capsys, base + ["--max-new-tokens", "24", "--json", "--compile", "force"]
    )
    eager, compiled = json.loads(eager), json.loads(compiled)
    lines = compiled["settings"]["setup"]
    assert [line.split(":")[0] for line in lines] == ["target"]
    assert all(
        " ms per step at each decode width (compiled in" in line
        and line.endswith("-> compiled (forced)")
        for line in lines
    ), lines
    assert compiled["tokens"] == eager["tokens"]
    out, err = main_ok(capsys, base + ["--max-new-tokens", "8", "--compile"])
    timed = [line for line in err if line.startswith("setup: ")]
    assert [line.split(":")[1].strip() for line in timed] == ["target"]
    for line in timed:  # every set-up timed, and the fastest kept
        times = dict(
            part.rsplit(" ", 1)
            for part in line.split(": ", 2)[2].split(" ms per step")[0].split(", ")
        )
        assert sorted(times) == ["compiled", "plain", "prepacked", "stacked"]
        assert line.endswith("-> " + min(times, key=lambda k: float(times[k])))
        # the width-1 step that --compile force kept: loaded, so no compile time to win back
        assert "(loaded from the compiled-step cache in" in line
    assert not any("does not pay for its compile time" in line for line in err)
    assert not any("Warning" in line for line in err)


@needs_pair
def test_cli_setup_forced_and_measured(capsys: pytest.CaptureFixture[str]) -> None:
    """--setup NAME runs that set-up (the greedy tokens of the default run: the shipped pair
    has no near-tie in these tokens); --setup measure times the eager three and says which."""
    base = PAIR + ["--max-new-tokens", "16", "--no-color", "--json"]
    default = json.loads(main_ok(capsys, base)[0])
    assert default["settings"]["setup"] == "default"
    for setup in ("plain", "stacked", "prepacked"):
        forced = json.loads(main_ok(capsys, base + ["--setup", setup])[0])
        assert forced["tokens"] == default["tokens"]
        assert forced["settings"]["setup"] == [
            f"target: {setup} (the only set-up asked for)",
            f"draft: {setup} (the only set-up asked for)",
        ]
    measured = json.loads(main_ok(capsys, base + ["--setup", "measure"])[0])
    for line in measured["settings"]["setup"]:
        assert (
            "plain" in line and "stacked" in line and "prepacked" in line and "compiled" not in line
        )
    assert measured["tokens"] == default["tokens"]


@needs_pair
def test_cli_compiled_batch_keeps_the_tokens(
    capsys: pytest.CaptureFixture[str], tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--setup compiled with --prompts-file: the target compiled for batch sizes 1 and 2,
    the greedy tokens of every prompt those of the eager batch (in Inductor's default mode: the
    buckets and tokens are the same whatever the kernels). The steps go to a cache of this
    test's own: in the session's, later default runs of the shipped target would load them."""
    monkeypatch.setenv("SPECULATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(MODE_ENV, "default")
    prompts = tmp_path / "p.txt"
    prompts.write_text("Once upon a time\nThe dog ran\nA little girl\n")
    base = [
        "--target",
        str(PAIR[1]),
        "--no-draft",
        "--max-new-tokens",
        "8",
        "--json",
        "--prompts-file",
        str(prompts),
        "--batch-size",
        "2",
    ]
    eager = json.loads(main_ok(capsys, base)[0])
    compiled = json.loads(main_ok(capsys, base + ["--setup", "compiled"])[0])
    assert [p["tokens"] for p in compiled["prompts"]] == [p["tokens"] for p in eager["prompts"]]
    assert compiled["settings"]["setup"][0].endswith("-> compiled (forced)")


# ----------------------------------------------------------------------------- the feature head
def test_a_compiled_feature_head_drafts_as_the_eager_one() -> None:
    """The head's step compiled (chain widths, batch buckets, a tree's expansions):
    its outputs are the eager head's within float32 rounding, the feature drafter's greedy
    output keeps the near-tie rule, and nothing recompiles over chain, batch and tree runs."""
    target = pair(seed=6)[0]
    head, chead = random_head(target), None
    chead = copy.deepcopy(head)
    compile_for_decoding(
        chead,
        decode_widths(4, 4),
        rows=(1, 2, 4),
        cache_len=64,
        mode="default",
        tree_widths=[len(branching_parents(TREE[:d])) for d in range(1, len(TREE))],
    )
    counts: Counter = Counter()
    count_compiled_calls(chead, counts)
    with torch.inference_mode():
        for net in (head, chead):
            net.setup_cache(1, 32)
        gen = torch.Generator().manual_seed(0)
        feats, embeds = torch.randn(1, 6, 32, generator=gen), torch.randn(1, 6, 32, generator=gen)
        call = calls.chain(0, 6, "cpu")
        assert torch.allclose(chead(feats, embeds, call), head(feats, embeds, call), atol=1e-5)
        one = (torch.randn(1, 1, 32, generator=gen), torch.randn(1, 1, 32, generator=gen))
        call = calls.chain(6, 1, "cpu")
        assert torch.allclose(chead(*one, call), head(*one, call), atol=1e-5)
    before = graphs()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompt in PROMPTS:
            out = speculative_generate(
                target, FeatureDrafter(chead, target), prompt, 20, temperature=0
            )
            assert far_from_argmax(target, prompt, out.tokens) == []
            speculative_generate(
                target,
                FeatureDrafter(chead, target),
                prompt,
                12,
                temperature=1.0,
                seed=1,
                tree=TREE,
            )
        speculative_generate_batch(
            target, FeatureDrafter(chead, target), PROMPTS, 12, temperature=0, batch_size=3
        )
    assert graphs() == before
    assert (
        counts["rows1"] > 0 and counts["tree"] > 0 and (counts["rows4"] > 0 or counts["rows2"] > 0)
    )


def test_the_default_mode_follows_the_layers(monkeypatch) -> None:
    """A CPU model compiles in "autotune"; one with int4 layers in "frozen" (no GEMM timed: its
    builds take half as long again with Inductor's int4 template rendered for every product)."""
    from model import Llama, ModelConfig
    from model.fast.compile import MODE_ENV, default_mode
    from model.scale.quantize import quantize_int4

    monkeypatch.delenv(MODE_ENV, raising=False)
    config = ModelConfig(
        dim=64, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=64, hidden_dim=128, max_seq_len=32
    )
    model = Llama(config).eval()
    assert default_mode(model) == "autotune"
    assert default_mode(quantize_int4(model)) == "frozen"
    monkeypatch.setenv(MODE_ENV, "default")
    assert default_mode(model) == "default"
