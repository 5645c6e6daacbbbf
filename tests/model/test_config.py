"""config.json as real checkpoints write it: model/config.py against the published files.

The real config.json files are in tests/data/configs (tests/data/SOURCES.md says where each came
from). Each must load with no refusal and no unclassified field, and give the shape written below
by hand from the models' published facts (not read back from the files, so a loader that misreads
a field fails here). transformers' LlamaConfig, reading the same file, is the second opinion.
docs/checkpoint_fields.md is checked against the classification the code uses.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from model import ConfigError, ModelConfig
from model.config import FIELDS

DATA = Path(__file__).resolve().parents[1] / "data" / "configs"
DOC = Path(__file__).resolve().parents[2] / "docs" / "checkpoint_fields.md"
CONFIGS = sorted(p.stem for p in DATA.glob("*.json"))

LLAMA3_EOS = (128001, 128008, 128009)  # <|end_of_text|>, <|eom_id|>, <|eot_id|>


def _llama3(factor: float) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


# The published shapes: layers, hidden, heads, kv heads, head_dim, MLP width, vocab, context, rope, ids, tying.
FACTS: dict[str, dict[str, Any]] = {
    "Llama-2-7b-hf": dict(
        n_layers=32,
        dim=4096,
        n_heads=32,
        n_kv_heads=32,
        head_dim=128,
        hidden_dim=11008,
        vocab_size=32000,
        max_seq_len=4096,
        rope_theta=10000.0,
        rope_scaling=None,
        bos_id=1,
        eos_ids=(2,),
        tie_word_embeddings=False,
    ),
    "Llama-2-70b-chat-hf": dict(
        n_layers=80,
        dim=8192,
        n_heads=64,
        n_kv_heads=8,
        head_dim=128,
        hidden_dim=28672,
        vocab_size=32000,
        max_seq_len=4096,
        rope_theta=10000.0,
        rope_scaling=None,
        bos_id=1,
        eos_ids=(2,),
        tie_word_embeddings=False,
    ),
    "CodeLlama-7b-hf": dict(
        n_layers=32,
        dim=4096,
        n_heads=32,
        n_kv_heads=32,
        head_dim=128,
        hidden_dim=11008,
        vocab_size=32016,
        max_seq_len=16384,
        rope_theta=1000000.0,
        rope_scaling=None,
        bos_id=1,
        eos_ids=(2,),
        tie_word_embeddings=False,
    ),
    "Llama-3.1-8B-Instruct": dict(
        n_layers=32,
        dim=4096,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        hidden_dim=14336,
        vocab_size=128256,
        max_seq_len=131072,
        rope_theta=500000.0,
        rope_scaling=_llama3(8.0),
        bos_id=128000,
        eos_ids=LLAMA3_EOS,
        tie_word_embeddings=False,
    ),
    "Llama-3.2-1B-Instruct": dict(
        n_layers=16,
        dim=2048,
        n_heads=32,
        n_kv_heads=8,
        head_dim=64,
        hidden_dim=8192,
        vocab_size=128256,
        max_seq_len=131072,
        rope_theta=500000.0,
        rope_scaling=_llama3(32.0),
        bos_id=128000,
        eos_ids=LLAMA3_EOS,
        tie_word_embeddings=True,
    ),
    "Llama-3.3-70B-Instruct": dict(
        n_layers=80,
        dim=8192,
        n_heads=64,
        n_kv_heads=8,
        head_dim=128,
        hidden_dim=28672,
        vocab_size=128256,
        max_seq_len=131072,
        rope_theta=500000.0,
        rope_scaling=_llama3(8.0),
        bos_id=128000,
        eos_ids=LLAMA3_EOS,
        tie_word_embeddings=False,
    ),
    "DeepSeek-R1-Distill-Llama-8B": dict(
        n_layers=32,
        dim=4096,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        hidden_dim=14336,
        vocab_size=128256,
        max_seq_len=131072,
        rope_theta=500000.0,
        rope_scaling=_llama3(8.0),
        bos_id=128000,
        eos_ids=(128001,),
        tie_word_embeddings=False,
    ),
    "TinyLlama-1.1B-Chat-v1.0": dict(
        n_layers=22,
        dim=2048,
        n_heads=32,
        n_kv_heads=4,
        head_dim=64,
        hidden_dim=5632,
        vocab_size=32000,
        max_seq_len=2048,
        rope_theta=10000.0,
        rope_scaling=None,
        bos_id=1,
        eos_ids=(2,),
        tie_word_embeddings=False,
    ),
    "SmolLM2-135M-Instruct": dict(
        n_layers=30,
        dim=576,
        n_heads=9,
        n_kv_heads=3,
        head_dim=64,
        hidden_dim=1536,
        vocab_size=49152,
        max_seq_len=8192,
        rope_theta=100000.0,
        rope_scaling=None,
        bos_id=1,
        eos_ids=(2,),
        tie_word_embeddings=True,
    ),
    "SmolLM2-1.7B-Instruct": dict(
        n_layers=24,
        dim=2048,
        n_heads=32,
        n_kv_heads=32,
        head_dim=64,
        hidden_dim=8192,
        vocab_size=49152,
        max_seq_len=8192,
        rope_theta=130000.0,
        rope_scaling=None,
        bos_id=1,
        eos_ids=(2,),
        tie_word_embeddings=True,
    ),
}


def _real(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))


def _mismatches(config: ModelConfig, facts: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    return {k: (getattr(config, k), v) for k, v in facts.items() if getattr(config, k) != v}


def test_the_real_configs_are_there() -> None:
    # Three at least: a Llama-2-shaped one, a Llama-3.1 one with three end ids, a tied Llama-3.2 one.
    assert {"Llama-3.1-8B-Instruct", "Llama-3.2-1B-Instruct", "TinyLlama-1.1B-Chat-v1.0"} <= set(
        CONFIGS
    )
    assert set(CONFIGS) <= set(FACTS), (
        f"write the published facts of {sorted(set(CONFIGS) - set(FACTS))}"
    )


# ----------------------------------------------------------------------------- the real files
@pytest.mark.parametrize("name", CONFIGS)
def test_real_config_loads_with_the_published_shape(name: str) -> None:
    config = ModelConfig.from_hf(_real(name))
    assert config.unclassified == (), f"{name}: fields nobody classified: {config.unclassified}"
    assert _mismatches(config, FACTS[name]) == {}
    assert config.eos_id == FACTS[name]["eos_ids"][0]


@pytest.mark.parametrize("name", CONFIGS)
def test_shape_check_can_fail(name: str) -> None:
    """The comparison above sees a one-field change: a loader that swapped kv heads for heads would fail it."""
    wrong = {**_real(name), "num_key_value_heads": 1}
    assert set(_mismatches(ModelConfig.from_hf(wrong), FACTS[name])) == {"n_kv_heads"}


@pytest.mark.parametrize("name", CONFIGS)
def test_real_config_matches_transformers(name: str) -> None:
    """transformers' LlamaConfig reading the same file: the same shape, rope and end ids."""
    transformers = pytest.importorskip(
        "transformers", reason="transformers (the reference) is in the [test] extras"
    )
    # a copy of its own: LlamaConfig writes into rope_scaling
    theirs = transformers.LlamaConfig.from_dict(_real(name))
    ours = ModelConfig.from_hf(_real(name))
    assert (
        ours.n_layers,
        ours.dim,
        ours.n_heads,
        ours.n_kv_heads,
        ours.head_dim,
        ours.hidden_dim,
        ours.vocab_size,
        ours.max_seq_len,
        ours.tie_word_embeddings,
    ) == (
        theirs.num_hidden_layers,
        theirs.hidden_size,
        theirs.num_attention_heads,
        theirs.num_key_value_heads,
        theirs.head_dim,
        theirs.intermediate_size,
        theirs.vocab_size,
        theirs.max_position_embeddings,
        theirs.tie_word_embeddings,
    )
    assert ours.norm_eps == theirs.rms_norm_eps
    # transformers 5 folds rope_theta and rope_scaling into one dict
    rope = dict(theirs.rope_parameters)
    assert ours.rope_theta == rope.pop("rope_theta")
    rope_type = rope.pop("rope_type", "default")
    assert (ours.rope_scaling or {"rope_type": "default"}) == {"rope_type": rope_type, **rope}
    theirs_eos = theirs.eos_token_id
    assert ours.eos_ids == tuple(theirs_eos if isinstance(theirs_eos, list) else [theirs_eos])
    assert ours.bos_id == theirs.bos_token_id


@pytest.mark.parametrize("name", CONFIGS)
def test_real_config_round_trips(name: str) -> None:
    """to_hf writes what from_hf reads back to the same config, the end-id list included."""
    config = ModelConfig.from_hf(_real(name))
    written = config.to_hf()
    assert written["eos_token_id"] == (
        list(config.eos_ids) if len(config.eos_ids) > 1 else config.eos_ids[0]
    )
    assert ModelConfig.from_hf(written) == config


# ----------------------------------------------------------------------------- refusals and notes
BASE = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 172,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "eos_token_id": 2,
}

REFUSED = {
    "attention_bias": ({"attention_bias": True}, "attention_bias=True; only False is implemented"),
    "attention_bias as 1": ({"attention_bias": 1}, "attention_bias=1; only False is implemented"),
    "mlp_bias": ({"mlp_bias": True}, "mlp_bias=True; only False is implemented"),
    "hidden_act": (
        {"hidden_act": "gelu_pytorch_tanh"},
        "hidden_act='gelu_pytorch_tanh'; only 'silu' is implemented",
    ),
    "rope_interleaved": (
        {"rope_interleaved": True},
        "rope_interleaved=True; only False is implemented",
    ),
    "sliding_window": ({"sliding_window": 4096}, "sliding_window=4096; only None is implemented"),
    "use_sliding_window": (
        {"use_sliding_window": True},
        "use_sliding_window=True; only False is implemented",
    ),
    "yarn": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not implemented"),
    "longrope": (
        {"rope_scaling": {"type": "longrope", "factor": 4.0}},
        "'longrope' is not implemented",
    ),
    "qk_layernorm": ({"qk_layernorm": True}, "fields this model does not implement: qk_layernorm"),
    "partial_rotary_factor": (
        {"partial_rotary_factor": 0.5},
        "fields this model does not implement: partial_rotary_factor",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_forward_field_at_an_unimplemented_value_is_refused(case: str) -> None:
    change, message = REFUSED[case]
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        ModelConfig.from_hf({**BASE, **change})
    assert "\n" not in str(caught.value)


def test_smollm2_fields_are_accepted_as_metadata() -> None:
    """What nanotron and transformers.js leave in SmolLM2's config.json: no refusal, nothing unclassified."""
    config = ModelConfig.from_hf(
        {
            **BASE,
            "is_llama_config": True,
            "rope_interleaved": False,
            "unk_token_id": 0,
            "pad_token_id": 2,
            "pretraining_tp": 1,
            "transformers.js_config": {"kv_cache_dtype": {"q4f16": "float16", "fp16": "float16"}},
        }
    )
    assert config.unclassified == ()
    assert config.extra["transformers.js_config"]["kv_cache_dtype"]["fp16"] == "float16"


def test_pretraining_tp_above_one_is_accepted() -> None:
    # Llama-2's own configs were written with 2 before being reset to 1; the split does not change the products.
    assert ModelConfig.from_hf({**BASE, "pretraining_tp": 2}) == ModelConfig.from_hf(BASE)


def test_unknown_field_is_recorded_not_refused() -> None:
    config = ModelConfig.from_hf({**BASE, "zeta_routing": 3, "alpha_note": "x"})
    assert config.unclassified == ("alpha_note", "zeta_routing")
    assert "zeta_routing" not in repr(config)
    assert config == ModelConfig.from_hf(BASE)  # a note, not part of the shape
    assert "zeta_routing" not in config.to_hf()


# ----------------------------------------------------------------------------- end-of-sequence ids
@pytest.mark.parametrize(
    ("value", "eos_id", "eos_ids", "written"),
    [
        (2, 2, (2,), 2),
        ([128001, 128008, 128009], 128001, LLAMA3_EOS, [128001, 128008, 128009]),
        ([7], 7, (7,), 7),
        (None, None, (), None),
        ("absent", None, (), None),
    ],
)
def test_eos_token_id_forms(
    value: Any, eos_id: int | None, eos_ids: tuple[int, ...], written: Any
) -> None:
    hf = {k: v for k, v in BASE.items() if k != "eos_token_id"}
    if value != "absent":
        hf["eos_token_id"] = value
    config = ModelConfig.from_hf(hf)
    assert (config.eos_id, config.eos_ids) == (eos_id, eos_ids)
    assert config.to_hf()["eos_token_id"] == written


@pytest.mark.parametrize("bad", [True, "2", -1, [128001, "128009"], [False], 2.0])
def test_bad_eos_token_id_is_refused(bad: Any) -> None:
    with pytest.raises(
        ConfigError, match=r"^eos_token_id must be a non-negative integer or a list of them, got "
    ):
        ModelConfig.from_hf({**BASE, "eos_token_id": bad})


def test_eos_fields_built_by_hand_agree() -> None:
    shape = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, hidden_dim=172)
    assert ModelConfig(**shape).eos_ids == (2,)  # the old default, still one id
    assert ModelConfig(**shape, eos_id=None, eos_ids=(5, 6)).eos_id == 5
    with pytest.raises(ConfigError, match="eos_id 9 is not the first of eos_ids"):
        ModelConfig(**shape, eos_id=9, eos_ids=(5, 6))


# ----------------------------------------------------------------------------- docs/checkpoint_fields.md
def _doc_rows() -> dict[str, tuple[str, str, str]]:
    """The first table of the page: field -> (checkpoints, kind, handling)."""
    text = DOC.read_text(encoding="utf-8")
    table = text.split("<!-- fields:start -->")[1].split("<!-- fields:end -->")[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = (cells[1], cells[2], cells[3])
    return rows


def test_field_table_lists_every_field_of_every_real_config() -> None:
    carried: dict[str, list[str]] = {}
    for name in CONFIGS:
        for key in _real(name):
            carried.setdefault(key, []).append(name)
    rows = _doc_rows()
    assert set(rows) == set(carried), (
        "docs/checkpoint_fields.md is out of date with tests/data/configs"
    )
    for key, (checkpoints, kind, handling) in rows.items():
        assert kind == FIELDS[key].kind, key
        assert handling == FIELDS[key].handling, key
        expected = "all" if len(carried[key]) == len(CONFIGS) else ", ".join(carried[key])
        assert checkpoints == expected, key
