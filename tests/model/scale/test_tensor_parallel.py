"""Tensor parallelism on the CPU: 2 gloo ranks against the single-process model.

The two ranks are started once per module (process start-up dominates the cost) by
``launch_local``, which gives them torchrun's environment; each rank writes what it
computed to a file and the tests below compare those with the single-process model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import Llama, ModelConfig
from model.call import chain
from model.scale.tensor_parallel import (
    TensorParallelError,
    broadcast_seed,
    check_divisible,
    init_distributed,
    launch_local,
    shard_config,
    shard_index,
    sync_logits,
    weight_bytes,
)
from speculative import autoregressive_generate, speculative_generate
from weights import load_model, save_model
from weights.sharded import load_model_tp

# Under pytest -n, the two ranks' run (`ranks`) happens once, on one worker (pyproject.toml: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("test_tensor_parallel")

WORLD = 2
# Grouped-query attention (4 query heads sharing 2 KV heads) so that a rank holds
# 2 query heads and 1 KV head, and the query -> KV head pairing is exercised.
TARGET = ModelConfig(
    vocab_size=80, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=96, max_seq_len=64
)
DRAFT = ModelConfig(
    vocab_size=80, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=48, max_seq_len=64
)
PROMPT = [1, 5, 9, 17, 33, 2, 40]
NEW_TOKENS = 24


def random_model(config: ModelConfig, seed: int) -> Llama:
    torch.manual_seed(seed)
    model = Llama(config)
    # RMSNorm weights start at 1; randomise them so a mis-sliced norm would show
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model.eval()


def tokens() -> torch.Tensor:
    return torch.tensor([PROMPT + [3, 7, 11]])


def rank_main(directory: str) -> None:
    """What each rank computes (runs in a spawned process)."""
    torch.set_num_threads(1)
    info = init_distributed("cpu")
    out: dict[str, object] = {
        "rank": info.rank,
        "world_size": info.world_size,
        "backend": info.backend,
    }
    ckpt, draft_ckpt = Path(directory) / "target", Path(directory) / "draft"
    with torch.inference_mode():
        model = load_model_tp(ckpt, "cpu", torch.float32)
        out["logits"] = model(tokens())
        model.setup_cache(1, 32)
        prefill = model(tokens()[:, :6], chain(0, 6, "cpu"))
        step = model(tokens()[:, 6:7], chain(6, 1, "cpu"))
        out["cached"] = torch.cat([prefill, step], dim=1)
        out["kv_heads"] = model.layers[0].self_attn.cache.k.shape[1]
        out["bytes"] = weight_bytes(model)
        # What the rank really keeps alive: the storages behind its tensors (a view of a whole
        # row-major tensor would hold all of it).
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in model.state_dict().values()
        }
        out["storage_bytes"] = sum(storages.values())
        out["sharded_bytes"] = sum(
            p.numel() * p.element_size() for n, p in model.named_parameters() if "proj" in n
        )
        out["seed"] = broadcast_seed(None)
        draft = load_model_tp(draft_ckpt, "cpu", torch.float32, shard=False)
        out["draft_logits"], out["draft_bytes"] = draft(tokens()), weight_bytes(draft)
        # sync_logits: rank 1 computes from different inputs but must return rank 0's logits.
        out["synced"] = sync_logits(load_model(ckpt, "cpu", torch.float32))(
            tokens() if info.rank == 0 else tokens().flip(1)
        )

        quantized = load_model_tp(ckpt, "cpu", torch.float32, quantize="int8")
        out["int8_logits"] = quantized(tokens())
        out["int8_bytes"] = weight_bytes(quantized)

        target64 = load_model_tp(ckpt, "cpu", torch.float64)
        # replicated, rank 0's logits
        draft64 = load_model_tp(draft_ckpt, "cpu", torch.float64, shard=False)
        out["spec_greedy"] = speculative_generate(
            target64, draft64, PROMPT, NEW_TOKENS, gamma=3, temperature=0.0
        ).tokens
        out["target_greedy"] = autoregressive_generate(
            target64, PROMPT, NEW_TOKENS, temperature=0.0
        ).tokens
        # Sampling: the same seed and rank 0's logits everywhere -> the same draws on every rank.
        out["spec_sampled"] = speculative_generate(
            target64, draft64, PROMPT, NEW_TOKENS, gamma=3, temperature=1.0, seed=1234
        ).tokens
    torch.save(out, Path(directory) / f"rank{info.rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The single-process references and what each of the two ranks computed."""
    torch.set_num_threads(1)
    directory = tmp_path_factory.mktemp("tp")
    target, draft = random_model(TARGET, 0), random_model(DRAFT, 1)
    # several shards: slices cross files
    save_model(target, directory / "target", max_shard_bytes=40_000)
    save_model(draft, directory / "draft")
    launch_local(rank_main, WORLD, str(directory), timeout=150)
    return {
        "dir": directory,
        "target": target,
        "draft": draft,
        "results": [
            torch.load(directory / f"rank{r}.pt", weights_only=False) for r in range(WORLD)
        ],
    }


def test_ranks_joined_one_gloo_group(ranks: dict) -> None:
    results = ranks["results"]
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == WORLD and r["backend"] == "gloo" for r in results)


def test_logits_equal_single_process(ranks: dict) -> None:
    with torch.inference_mode():
        reference = load_model(ranks["dir"] / "target", "cpu", torch.float32)(tokens())
    for result in ranks["results"]:
        diff = (result["logits"] - reference).abs().max().item()
        assert diff < 1e-5, f"rank {result['rank']}: tensor-parallel logits differ by {diff:.3g}"


def test_cached_decode_equals_single_process(ranks: dict) -> None:
    with torch.inference_mode():
        reference = load_model(ranks["dir"] / "target", "cpu", torch.float32)(tokens()[:, :7])
    for result in ranks["results"]:
        # each rank caches only its KV heads
        assert result["kv_heads"] == TARGET.n_kv_heads // WORLD
        assert (result["cached"] - reference).abs().max().item() < 1e-5


def test_each_rank_holds_half_the_sharded_weights(ranks: dict) -> None:
    full = ranks["target"]
    sharded = sum(p.numel() * p.element_size() for n, p in full.named_parameters() if "proj" in n)
    replicated = sum(
        p.numel() * p.element_size() for n, p in full.named_parameters() if "proj" not in n
    )
    for result in ranks["results"]:
        assert result["sharded_bytes"] * WORLD == sharded
        assert result["bytes"] == sharded // WORLD + replicated
        # no slice keeps its whole source tensor alive
        assert result["storage_bytes"] == result["bytes"]


def test_replicated_draft_is_whole_on_every_rank(ranks: dict) -> None:
    with torch.inference_mode():
        reference = ranks["draft"](tokens())
    for result in ranks["results"]:
        assert result["draft_bytes"] == weight_bytes(ranks["draft"])
        assert torch.equal(result["draft_logits"], reference)


def test_sync_logits_hands_rank_0s_logits_to_every_rank(ranks: dict) -> None:
    first, second = (r["synced"] for r in ranks["results"])
    assert torch.equal(first, second)
    with torch.inference_mode():
        assert torch.equal(
            first, load_model(ranks["dir"] / "target", "cpu", torch.float32)(tokens())
        )


def test_all_ranks_share_one_seed(ranks: dict) -> None:
    seeds = {r["seed"] for r in ranks["results"]}
    assert len(seeds) == 1


def test_int8_tensor_parallel_close_and_half_the_bytes(ranks: dict) -> None:
    with torch.inference_mode():
        reference = load_model(ranks["dir"] / "target", "cpu", torch.float32)(tokens())
    # LOGIT_BOUND of tests/model/scale/test_quantize.py, justified there
    bound = 0.025 * reference.std().item()
    for result in ranks["results"]:
        assert (result["int8_logits"] - reference).abs().max().item() < bound
        # float32 -> int8 is 4x smaller for the block weights; embeddings/norms stay float32.
        assert result["int8_bytes"] < 0.5 * result["bytes"]


def test_speculative_greedy_on_two_ranks_equals_single_process(ranks: dict) -> None:
    with torch.inference_mode():
        target = load_model(ranks["dir"] / "target", "cpu", torch.float64)
        draft = load_model(ranks["dir"] / "draft", "cpu", torch.float64)
        expected = speculative_generate(
            target, draft, PROMPT, NEW_TOKENS, gamma=3, temperature=0.0
        ).tokens
    assert len(expected) == NEW_TOKENS
    for result in ranks["results"]:
        assert result["spec_greedy"] == expected  # float64: no rounding ties, so exact identity
        assert result["target_greedy"] == expected  # and both equal the target's own greedy output


def test_sampling_decisions_agree_across_ranks(ranks: dict) -> None:
    first, second = (r["spec_sampled"] for r in ranks["results"])
    assert first == second and len(first) == NEW_TOKENS


# ----------------------------------------------------------------------------- single process
def test_indivisible_heads_are_a_clear_error() -> None:
    gqa = ModelConfig(vocab_size=80, dim=64, n_layers=1, n_heads=8, n_kv_heads=2, hidden_dim=96)
    with pytest.raises(TensorParallelError, match="num_key_value_heads=2 is not divisible by 4"):
        check_divisible(gqa, 4)
    mha = ModelConfig(vocab_size=80, dim=96, n_layers=1, n_heads=6, n_kv_heads=6, hidden_dim=96)
    with pytest.raises(
        TensorParallelError, match="num_attention_heads=6, num_key_value_heads=6 are not divisible"
    ):
        check_divisible(mha, 4)
    check_divisible(gqa, 2)  # 8 and 2 heads over 2 ranks is fine
    with pytest.raises(TensorParallelError, match="not divisible by 16"):
        shard_config(
            ModelConfig(
                vocab_size=80, dim=128, n_layers=1, n_heads=64, n_kv_heads=8, hidden_dim=64
            ),
            16,
        )


def test_shard_config_and_slices_cover_the_matrix() -> None:
    local = shard_config(TARGET, 2)
    assert (local.n_heads, local.n_kv_heads, local.hidden_dim, local.head_dim) == (
        2,
        1,
        48,
        TARGET.head_dim,
    )
    q_shape, o_shape = (64, 64), (64, 64)
    rows = [shard_index("model.layers.0.self_attn.q_proj.weight", q_shape, r, 2) for r in range(2)]
    cols = [shard_index("model.layers.0.self_attn.o_proj.weight", o_shape, r, 2) for r in range(2)]
    assert rows == [(slice(0, 32),), (slice(32, 64),)]
    assert cols == [(slice(None), slice(0, 32)), (slice(None), slice(32, 64))]
    assert shard_index("model.embed_tokens.weight", (80, 64), 1, 2) is None
    assert shard_index("model.layers.0.input_layernorm.weight", (64,), 1, 2) is None


def test_single_process_load_is_the_whole_model(tmp_path: Path) -> None:
    """Without a process group load_model_tp is load_model (the --quantize path on one GPU).

    The checkpoint also holds per-layer ``rotary_emb.inv_freq`` tensors, as the Llama-2 *-hf
    repositories do; like load_model, the sharded loader skips them.
    """
    model = random_model(TARGET, 2)
    save_model(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for i in range(TARGET.n_layers):
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(
            TARGET.head_dim // 2
        )
    save_file(tensors, tmp_path / "model.safetensors")
    with torch.inference_mode():
        ours = load_model_tp(tmp_path, "cpu", torch.float32)(tokens())
        reference = load_model(tmp_path, "cpu", torch.float32)(tokens())
    assert torch.equal(ours, reference)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tensor_parallel_logits(tmp_path: Path) -> None:
    """2 ranks on the GPU(s): NCCL over two GPUs when there are two, else gloo on one GPU."""
    model = random_model(TARGET, 3)
    save_model(model, tmp_path / "target")
    launch_local(cuda_rank_main, WORLD, str(tmp_path), timeout=240)
    with torch.inference_mode():
        reference = load_model(tmp_path / "target", "cuda", torch.float32)(tokens().cuda()).cpu()
    for r in range(WORLD):
        logits = torch.load(tmp_path / f"rank{r}.pt")
        # TF32-free float32, different summation order
        assert (logits - reference).abs().max().item() < 1e-4


def cuda_rank_main(directory: str) -> None:
    two_gpus = torch.cuda.device_count() >= 2
    if two_gpus:
        info = init_distributed(None, backend=None)
    else:
        info = init_distributed("cuda:0", backend="gloo")
    with torch.inference_mode():
        model = load_model_tp(Path(directory) / "target", info.device, torch.float32)
        logits = model(tokens().to(info.device)).cpu()
    torch.save(logits, Path(directory) / f"rank{info.rank}.pt")
