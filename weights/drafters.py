"""Loading and saving drafters: the files of each drafter kind (speculative.draft.DRAFTERS).

``load_drafter(name, target)`` is what ``generate.py --draft NAME`` calls: a kind that needs
no file by its name (``lookup``, or ``MODULE:OBJECT``); otherwise the folder's kind
(:func:`folder_kind`: the first registered kind that recognizes its config.json, else a draft
model), its files read by the kind's ``loader`` and the drafter built by the kind. The loaders of
the built-in kinds are here (``read_*``), named by their registrations. A feature head is checked
first against the target it was trained for (below).

A feature head's config.json holds the head's own LLaMA shape under "head", and under
"target" the shape it was trained against (hidden size, vocabulary, layer count) and a
fingerprint of that target's weights (model.feature_head.fingerprint). A head reads the
target's features and uses its output head, so on another target it would be wrong and
say nothing: the loader refuses it, naming both.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from model import Llama, ModelConfig
from model.feature_head import FeatureHead, fingerprint, same_fingerprint
from speculative.draft.eagle import HEAD_TYPE
from speculative.draft.registry import DrafterKind, named, of_folder
from weights.checkpoint import CheckpointError, _normal_permissions, check_finite, load_model
from weights.eagle3 import load_eagle3_head
from weights.registry import resolve


def folder_kind(directory: Path) -> DrafterKind:
    """The drafter kind of a folder: the first registered kind that recognizes its config.json
    (speculative.draft.registry.of_folder), else a draft model."""
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        config = {}
    return of_folder(config if isinstance(config, dict) else {})


def save_feature_head(
    head: FeatureHead,
    directory: str | os.PathLike,
    target: Any,
    dtype: torch.dtype | None = None,
    target_name: str | None = None,
) -> Path:
    """Write ``head`` (trained for ``target``) as config.json + model.safetensors."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: p.detach().to(dtype or p.dtype).cpu().contiguous()
        for name, p in head.named_parameters()
    }
    config = {
        "architectures": ["LlamaFeatureHead"],
        "model_type": HEAD_TYPE,
        "torch_dtype": str(next(iter(tensors.values())).dtype).removeprefix("torch."),
        "head": head.config.to_hf(),
        "target": {
            "name": target_name,
            "hidden_size": target.config.dim,
            "vocab_size": target.config.vocab_size,
            "num_hidden_layers": target.config.n_layers,
            "fingerprint": fingerprint(target),
        },
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    _normal_permissions(directory / "model.safetensors")
    return directory


def load_feature_head(
    name_or_path: str | os.PathLike,
    target: Any,
    target_name: str = "the target",
    dtype: torch.dtype | None = None,
) -> FeatureHead:
    """A FeatureHead from its folder, in ``dtype`` (default the target's) and on the target's device;
    CheckpointError if the files are broken or the head was trained for another target."""
    directory = resolve(name_or_path)
    try:
        config = json.loads((directory / "config.json").read_text())
        head_config = ModelConfig.from_hf(config["head"])
        trained_for = config["target"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise CheckpointError(
            f"{directory}/config.json is not a feature head's config ({err})"
        ) from None
    head_name, trained_name = str(name_or_path), trained_for.get("name") or "another target"
    mine = {
        "hidden_size": target.config.dim,
        "vocab_size": target.config.vocab_size,
        "num_hidden_layers": target.config.n_layers,
    }
    for key, value in mine.items():
        if trained_for.get(key) != value:
            raise CheckpointError(
                f"feature head {head_name} was trained for {trained_name} ({key} "
                f"{trained_for.get(key)}), not for {target_name} ({key} {value})"
            )
    if not same_fingerprint(fingerprint(target), trained_for.get("fingerprint") or []):
        raise CheckpointError(
            f"feature head {head_name} was trained for {trained_name}, whose weights differ from "
            f"{target_name}'s (fingerprint mismatch): train one for it with train.py eagle"
        )
    with torch.device("meta"):
        head = FeatureHead(head_config)
    path = directory / "model.safetensors"
    try:
        state = load_file(path, device="cpu")
    except (OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(
            f"{path} is missing or not a readable safetensors file ({err})"
        ) from None
    expected = {name: tuple(p.shape) for name, p in head.named_parameters()}
    got = {name: tuple(t.shape) for name, t in state.items()}
    if got != expected:
        raise CheckpointError(
            f"{path}: tensors {sorted(set(got) ^ set(expected)) or 'shapes'} do not match its "
            "config.json"
        )
    for (
        name,
        tensor,
    ) in state.items():  # the checkpoint loader's check (NonFiniteWeightsError names both)
        check_finite(path, name, tensor, tensor)
    # never prepacked or quantized: the target's device and dtype
    embedding = target.embed_tokens.weight
    state = {
        name: t.to(device=embedding.device, dtype=dtype or embedding.dtype)
        for name, t in state.items()
    }
    head.load_state_dict(state, assign=True, strict=True)
    return head.eval()


def load_drafter(
    name_or_path: str | os.PathLike,
    target: Any,
    target_name: str = "the target",
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> Any:
    """The drafter ``generate.py --draft NAME`` means (see the module docstring)."""
    kind = named(str(name_or_path))
    if kind is not None:
        return kind.build(None, target)
    directory = resolve(name_or_path)
    kind = folder_kind(directory)
    device = device if device is not None else target.embed_tokens.weight.device
    dtype = dtype if dtype is not None else target.embed_tokens.weight.dtype
    return kind.build(kind.load(directory, target, target_name, device, dtype), target)


# The loaders of the built-in kinds (DrafterKind.loader): (folder, target, its name, device, dtype) -> a network.
def read_draft_model(
    directory: Path, target: Any, target_name: str, device: Any, dtype: torch.dtype
) -> Llama:
    return load_model(directory, device=device, dtype=dtype)


def read_feature_head(
    directory: Path, target: Any, target_name: str, device: Any, dtype: torch.dtype
) -> FeatureHead:
    return load_feature_head(directory, target, target_name, dtype)


def read_eagle3_head(
    directory: Path, target: Any, target_name: str, device: Any, dtype: torch.dtype
) -> Any:
    return load_eagle3_head(directory, target, target_name, dtype)
