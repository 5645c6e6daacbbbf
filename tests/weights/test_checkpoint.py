"""Checkpoint I/O: sharding, dtypes, the registry, and one clear error for each way a checkpoint breaks."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import ConfigError, Llama, ModelConfig
from model.call import chain
from tests.support.damage import overwrite_middle
from tests.support.hf import hf_config, hf_logits, hf_model, random_tokens, randomize_
from weights import (
    CheckpointError,
    NonFiniteWeightsError,
    UnknownCheckpointError,
    load_model,
    load_tokenizer,
    save_model,
)
from weights.registry import ENV_VAR, LLAMA2, WEIGHTS_DIR
from weights.sharded import load_model_tp


def _saved(directory: Path, name: str = "gqa", seed: int = 1, **save_kwargs) -> Llama:
    """A random model of the named tiny config, saved with save_model into ``directory``."""
    model = randomize_(Llama(ModelConfig.from_hf(hf_config(name))), seed=seed).eval()
    save_model(model, directory, **save_kwargs)
    return model


def _same_logits(a: Llama, b: Llama, atol: float = 0.0) -> bool:
    tokens = random_tokens(2, 16, a.config.vocab_size, seed=2)
    with torch.no_grad():
        return (a(tokens) - b(tokens)).abs().max().item() <= atol


def _edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


# ----------------------------------------------------------------------------- round trips
def test_save_load_round_trip_is_exact(tmp_path: Path) -> None:
    model = _saved(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_model(tmp_path)
    for (name, p), (name2, q) in zip(
        model.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert name == name2 and torch.equal(p, q), name
    assert _same_logits(model, loaded)


def test_our_shards_load_here_and_in_transformers(tmp_path: Path) -> None:
    model = _saved(tmp_path, max_shard_bytes=40_000)
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 3 and not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert _same_logits(model, load_model(tmp_path))

    transformers = pytest.importorskip("transformers")
    reference = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = random_tokens(1, 16, model.config.vocab_size)
    with torch.no_grad():
        assert (model(tokens) - hf_logits(reference, tokens)).abs().max().item() <= 1e-5


def test_transformers_shards_load(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    config = hf_config("tied")
    reference = hf_model(config, seed=5)
    reference.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 3
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = load_model(tmp_path)
    tokens = random_tokens(2, 16, config["vocab_size"])
    with torch.no_grad():
        assert (ours(tokens) - hf_logits(reference, tokens)).abs().max().item() <= 1e-5


def test_saving_again_removes_stale_shards(tmp_path: Path) -> None:
    _saved(tmp_path, max_shard_bytes=40_000)
    model = _saved(tmp_path, seed=2)  # now a single file: the old shards and index must go
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert _same_logits(model, load_model(tmp_path))


def test_rotary_inv_freq_tensors_are_ignored(tmp_path: Path) -> None:
    """Llama-2 *-hf checkpoints also store ``rotary_emb.inv_freq`` per layer; they must still load."""
    model = _saved(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    for i in range(model.config.n_layers):
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(
            model.config.head_dim // 2
        )
    save_file(tensors, path)
    assert _same_logits(model, load_model(tmp_path))


@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    [(torch.float32, 0.0), (torch.float64, 1e-4), (torch.float16, 0.02), (torch.bfloat16, 0.08)],
)
def test_load_dtypes(tmp_path: Path, dtype: torch.dtype, tolerance: float) -> None:
    """Every supported dtype loads, runs (cached and not) and stays close to float32.

    Tolerances are relative to the largest logit: half precision keeps ~3 significant
    digits, bfloat16 ~2 (measured: 0.4% and 2.7%).
    """
    reference = _saved(tmp_path)
    model = load_model(tmp_path, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}
    tokens = random_tokens(2, 24, reference.config.vocab_size, seed=3)
    with torch.no_grad():
        expected = reference(tokens)
        got = model(tokens)
        model.setup_cache(max_batch_size=2, max_seq_len=24)
        cached = torch.cat(
            [
                model(tokens[:, :20], chain(0, 20, "cpu", rows=2)),
                model(tokens[:, 20:], chain(20, 4, "cpu", rows=2)),
            ],
            dim=1,
        )
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    scale = expected.abs().max().item()
    assert (got.double() - expected.double()).abs().max().item() <= tolerance * scale
    assert (cached.double() - expected.double()).abs().max().item() <= tolerance * scale + 1e-5


def test_unsupported_dtype_is_refused(tmp_path: Path) -> None:
    _saved(tmp_path)
    with pytest.raises(CheckpointError, match="dtype torch.int8 is not supported"):
        load_model(tmp_path, dtype=torch.int8)


# ----------------------------------------------------------------------------- broken checkpoints
def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(
        UnknownCheckpointError, match=f"checkpoint directory {tmp_path / 'nope'} does not exist"
    ):
        load_model(tmp_path / "nope")


def test_missing_config_json(tmp_path: Path) -> None:
    _saved(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(
        CheckpointError,
        match=r"config\.json is missing: an HF-layout checkpoint needs a config\.json",
    ):
        load_model(tmp_path)


def test_invalid_config_json(tmp_path: Path) -> None:
    _saved(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON"):
        load_model(tmp_path)


def test_no_weights_at_all(tmp_path: Path) -> None:
    _saved(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(
        CheckpointError,
        match="has no model.safetensors, model.safetensors.index.json or pytorch_model.bin",
    ):
        load_model(tmp_path)


def test_shard_named_in_index_is_missing(tmp_path: Path) -> None:
    _saved(tmp_path, max_shard_bytes=40_000)
    shard = sorted(tmp_path.glob("model-*-of-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(
        CheckpointError,
        match=re.escape(
            f"shard {shard.name} named in model.safetensors.index.json is missing from {tmp_path}"
        ),
    ):
        load_model(tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "corrupt-header"])
def test_truncated_or_corrupt_single_file(tmp_path: Path, damage: str) -> None:
    _saved(tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\xff" * 16 + data[16:])
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors is not a readable safetensors file"
    ):
        load_model(tmp_path)


def test_truncated_shard(tmp_path: Path) -> None:
    _saved(tmp_path, max_shard_bytes=40_000)
    path = sorted(tmp_path.glob("model-*-of-*.safetensors"))[-1]
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=re.escape(f"{path} is truncated or corrupt")):
        load_model(tmp_path)


@pytest.mark.parametrize("save_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_corrupted_data_is_refused_naming_file_and_tensor(
    tmp_path: Path, save_dtype: torch.dtype
) -> None:
    """Header intact, data overwritten in the middle: the file opens and every shape checks out,
    so only the values betray it. Both loaders refuse it (the tensor-parallel one, here with one
    rank, is what --quantize uses)."""
    _saved(tmp_path, dtype=save_dtype)
    path = tmp_path / "model.safetensors"
    name = overwrite_middle(path)
    pattern = re.escape(f"{path}: tensor {name} holds ") + r"\d+ non-finite values \(NaN or inf\)"
    with pytest.raises(NonFiniteWeightsError, match=pattern):
        load_model(tmp_path)
    with pytest.raises(NonFiniteWeightsError, match=pattern):
        load_model_tp(tmp_path, quantize="int8")
    assert issubclass(NonFiniteWeightsError, CheckpointError)


def test_corrupted_shard_is_refused(tmp_path: Path) -> None:
    _saved(tmp_path, max_shard_bytes=40_000)
    path = sorted(tmp_path.glob("model-*-of-*.safetensors"))[1]
    name = overwrite_middle(path)
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: tensor {name} holds ")):
        load_model(tmp_path)


def test_an_infinity_saved_on_purpose_is_refused(tmp_path: Path) -> None:
    model = randomize_(Llama(ModelConfig.from_hf(hf_config("gqa"))), seed=1).eval()
    with torch.no_grad():
        model.norm.weight[3] = float("inf")
    save_model(model, tmp_path)
    with pytest.raises(
        NonFiniteWeightsError, match=r"tensor model\.norm\.weight holds 1 non-finite values"
    ):
        load_model(tmp_path)


def test_a_value_that_overflows_the_load_dtype_is_refused(tmp_path: Path) -> None:
    """1e6 is finite in the float32 file but infinite in float16: said so, with what to do instead."""
    model = randomize_(Llama(ModelConfig.from_hf(hf_config("gqa"))), seed=1).eval()
    with torch.no_grad():
        model.layers[1].mlp.down_proj.weight[0, 0] = 1e6
    save_model(model, tmp_path)
    assert load_model(tmp_path, dtype=torch.float32) is not None
    with pytest.raises(
        NonFiniteWeightsError,
        match=r"tensor model\.layers\.1\.mlp\.down_proj\.weight has values "
        r"up to 1e\+06, which overflow float16; load it in float32",
    ):
        load_model(tmp_path, dtype=torch.float16)


def test_saved_files_get_the_usual_permissions(tmp_path: Path) -> None:
    """safetensors creates its files 0600; save_model gives them what open() gives (0644 under umask 022)."""
    old = os.umask(0o022)
    try:
        _saved(tmp_path / "single")
        _saved(tmp_path / "sharded", max_shard_bytes=40_000)
    finally:
        os.umask(old)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) > 5
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


def test_shape_contradicts_config(tmp_path: Path) -> None:
    _saved(tmp_path)
    _edit_config(tmp_path, intermediate_size=180)
    with pytest.raises(
        CheckpointError,
        match=r"tensor model\.layers\.\d\.mlp\.\w+_proj\.weight has shape "
        r"\[\d+, \d+\] but config\.json implies \[\d+, \d+\]",
    ):
        load_model(tmp_path)


def test_unknown_tensor_names(tmp_path: Path) -> None:
    _saved(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)  # a Qwen3-style extra
    save_file(tensors, path)
    with pytest.raises(
        CheckpointError,
        match=r"unknown tensors not in a Llama model: model\.layers\.0\.self_attn\.q_norm\.weight",
    ):
        load_model(tmp_path)


def test_missing_tensors(tmp_path: Path) -> None:
    _saved(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"], tensors["lm_head.weight"]
    save_file(tensors, path)
    with pytest.raises(
        CheckpointError,
        match=r"missing tensors: lm_head\.weight, model\.layers\.1\.mlp\.up_proj\.weight$",
    ):
        load_model(tmp_path)


def test_unknown_short_name() -> None:
    with pytest.raises(
        UnknownCheckpointError, match="unknown checkpoint 'llama-9000b': use one of 7b, 13b, 70b"
    ):
        load_model("llama-9000b")


def test_missing_registry_checkpoint_says_what_to_download(tmp_path: Path, monkeypatch) -> None:
    name = "70b-chat"
    dirname, repo = LLAMA2[name]
    if (WEIGHTS_DIR / dirname).exists():
        pytest.skip(f"{WEIGHTS_DIR / dirname} exists on this machine")
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    with pytest.raises(UnknownCheckpointError) as info:
        load_model(name)
    message = str(info.value)
    assert f"download {repo}" in message
    assert str(tmp_path / dirname) in message and str(WEIGHTS_DIR / dirname) in message
    assert ENV_VAR in message


def test_registry_finds_a_checkpoint_under_the_env_folder(tmp_path: Path, monkeypatch) -> None:
    dirname, _ = LLAMA2["7b"]
    if (WEIGHTS_DIR / dirname).exists():
        pytest.skip(f"{WEIGHTS_DIR / dirname} exists on this machine")
    model = _saved(tmp_path / dirname)
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    assert _same_logits(model, load_model("7b"))


def test_load_tokenizer_without_tokenizer_model(tmp_path: Path) -> None:
    _saved(tmp_path)
    with pytest.raises(
        CheckpointError, match=r"has no tokenizer: neither a SentencePiece tokenizer\.model nor a "
    ):
        load_tokenizer(tmp_path)


# ----------------------------------------------------------------------------- unsupported configs
UNSUPPORTED = {
    "yarn (v4 rope_scaling)": (
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
        "'yarn' is not implemented",
    ),
    "dynamic (v4 rope_scaling)": (
        {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
        "'dynamic' is not implemented",
    ),
    "yarn (v5 rope_parameters)": (
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}},
        "'yarn' is not implemented",
    ),
    "attention_bias": ({"attention_bias": True}, "attention_bias=True; only False is implemented"),
    "mlp_bias": ({"mlp_bias": True}, "mlp_bias=True; only False is implemented"),
    "sliding_window": ({"sliding_window": 4096}, "sliding_window=4096; only None is implemented"),
    "hidden_act": ({"hidden_act": "gelu"}, "hidden_act='gelu'; only 'silu' is implemented"),
    "model_type": (
        {"model_type": "mistral"},
        "model_type is 'mistral'; only 'llama' checkpoints are supported",
    ),
    "unknown field": ({"qk_layernorm": True}, "fields this model does not implement: qk_layernorm"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_config_raises_config_error(case: str, tmp_path: Path) -> None:
    changes, message = UNSUPPORTED[case]
    config = {**hf_config(), **changes}
    with pytest.raises(ConfigError, match=re.escape(message)):
        ModelConfig.from_hf(config)
    # Through load_model the same sentence comes back, prefixed with the config.json it is in.
    _saved(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError,
        match=re.escape(f"{tmp_path / 'config.json'}: ") + ".*" + re.escape(message),
    ):
        load_model(tmp_path)


def test_config_shape_errors() -> None:
    with pytest.raises(ConfigError, match="not a multiple of num_key_value_heads 3"):
        ModelConfig.from_hf(hf_config(num_key_value_heads=3))
    with pytest.raises(ConfigError, match="missing required fields: intermediate_size"):
        ModelConfig.from_hf({k: v for k, v in hf_config().items() if k != "intermediate_size"})


def test_a_folder_of_pytorch_model_bin_loads_as_its_safetensors_would(tmp_path: Path) -> None:
    """vicuna-7b-v1.5's main branch has only pytorch_model.bin shards: read with weights_only, the same
    model; a pickle that holds more than tensors is refused in one line, not run."""
    saved = tmp_path / "st"
    reference = _saved(saved, max_shard_bytes=40_000)
    index = json.loads((saved / "model.safetensors.index.json").read_text())
    bins = tmp_path / "bin"
    bins.mkdir()
    (bins / "config.json").write_text((saved / "config.json").read_text())
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, shard in index["weight_map"].items():
        shards.setdefault(
            shard.replace("model-", "pytorch_model-").replace(".safetensors", ".bin"), {}
        )[name] = reference.state_dict()[name.removeprefix("model.")]
    for shard, tensors in shards.items():
        torch.save({k: v.clone() for k, v in tensors.items()}, bins / shard)
    (bins / "pytorch_model.bin.index.json").write_text(
        json.dumps(
            {"weight_map": {name: shard for shard, tensors in shards.items() for name in tensors}}
        )
    )
    loaded = load_model(bins)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    one = tmp_path / "one"
    one.mkdir()
    (one / "config.json").write_text((saved / "config.json").read_text())
    torch.save(
        {
            "model." + k if not k.startswith("lm_head") else k: v
            for k, v in reference.state_dict().items()
        },
        one / "pytorch_model.bin",
    )
    assert torch.equal(load_model(one).lm_head.weight, reference.lm_head.weight)
    # not only tensors
    torch.save({"weights": reference.state_dict(), "hook": print}, one / "pytorch_model.bin")
    with pytest.raises(
        CheckpointError, match="pytorch_model.bin is not a readable PyTorch weights file"
    ) as error:
        load_model(one)
    assert "\n" not in str(error.value)
