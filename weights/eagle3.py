"""EAGLE-3 heads on disk, in the two layouts that serving engines read, both ways.

* **speculators** (vLLM's ``speculators`` package; what vLLM serves, and what ``train.py
  eagle3`` writes): config.json with ``speculators_model_type: "eagle3"``, the block's
  LLaMA shape under ``transformer_layer_config`` (its ``vocab_size`` is the target's),
  ``draft_vocab_size``, ``norm_before_residual``, ``target_hidden_size``,
  ``eagle_aux_hidden_state_layer_ids`` and ``speculators_config.verifier``; the weights in
  model.safetensors as ``layers.0.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``
  (and, optionally, a copy of the target's ``embed_tokens``, which is ignored here: the
  target's own is used).
* **official** (SafeAILab/EAGLE; SGLang and SpecForge read it): a LLaMA config.json whose
  architectures name ``LlamaForCausalLMEagle3``, with ``draft_vocab_size`` and, optionally,
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` (else the default layers 2, N/2, N-3);
  the weights as ``midlayer.*`` in place of ``layers.0.*``, in model.safetensors or
  pytorch_model.bin.

A P-EAGLE head (speculators' "peagle": an EAGLE-3 head that drafts a block in one call,
model.eagle3_head.PEagleHead) is the speculators layout with ``speculators_model_type:
"peagle"``, a ``mask_token_id``, the learned ``mask_hidden`` [1, 1, 3 * dim] and its own
``embed_tokens`` (P-EAGLE trains them; the mask's row is the mask embedding). Read here, a table
equal to the target's is dropped (the target's is used) and the mask row kept; written here,
the table is the target's with the mask row set.

A head is checked against the target before anything is built: its hidden size and
vocabulary must be the target's and its layer ids must exist, or CheckpointError says which
in one line. Our own files also record a fingerprint of the target's weights
(model.feature_head.fingerprint), so that a head trained here for one target is refused on
another of the same shape.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from model import ModelConfig
from model.eagle3_head import Eagle3Head, PEagleHead, default_layers
from model.feature_head import fingerprint, same_fingerprint
from weights.checkpoint import CheckpointError, _normal_permissions, check_finite
from weights.registry import resolve

# What marks a folder as an EAGLE-3 head (weights.drafters.folder_kind reads these).
OFFICIAL_ARCHITECTURES = ("LlamaForCausalLMEagle3",)
SPECULATORS_TYPE = "eagle3"
PEAGLE_TYPE = "peagle"
# speculators options that change the computation and that this head does not implement
UNSUPPORTED = ("norm_before_fc", "fc_norm", "norm_output")


def is_eagle3(config: dict[str, Any]) -> bool:
    """Whether a config.json describes an EAGLE-3 head, in either layout."""
    return config.get("speculators_model_type") in (SPECULATORS_TYPE, PEAGLE_TYPE) or any(
        a in OFFICIAL_ARCHITECTURES for a in config.get("architectures") or []
    )


def is_peagle_head(config: dict[str, Any]) -> bool:
    """Whether a config.json describes a P-EAGLE head (the speculators layout: the only one it has)."""
    return config.get("speculators_model_type") == PEAGLE_TYPE


def is_eagle3_head(config: dict[str, Any]) -> bool:
    """Whether a config.json describes an EAGLE-3 head that drafts step by step, in either layout."""
    return is_eagle3(config) and not is_peagle_head(config)


def _shape(hf: dict[str, Any]) -> ModelConfig:
    """The block's LLaMA shape from a config's fields (the layer count is the head's one block)."""
    keep = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "max_position_embeddings",
        "hidden_act",
        "attention_bias",
        "mlp_bias",
    )
    fields = {k: hf[k] for k in keep if k in hf and hf[k] is not None}
    return ModelConfig.from_hf({**fields, "num_hidden_layers": 1, "tie_word_embeddings": False})


def read_config(directory: Path) -> dict[str, Any]:
    """What a head's folder says, layout aside: ``layout``, ``shape`` (a ModelConfig), ``draft_vocab``,
    ``layers`` (None: the default for the target), ``norm_before_residual``, ``target`` (ours only)."""
    path = directory / "config.json"
    try:
        hf = json.loads(path.read_text())
        if hf.get("speculators_model_type") in (SPECULATORS_TYPE, PEAGLE_TYPE):
            bad = [k for k in UNSUPPORTED if hf.get(k)]
            if bad:
                raise CheckpointError(f"{path}: EAGLE-3 option {bad[0]} is not implemented here")
            layer = hf["transformer_layer_config"]
            # speculators trains drafts of several decoder layers too; this head is the one block
            if layer.get("num_hidden_layers", 1) != 1:
                raise CheckpointError(
                    f"{path}: an EAGLE-3 head of {layer['num_hidden_layers']} decoder layers is "
                    f"not implemented here (only of one)"
                )
            target_dim = hf.get("target_hidden_size")
            if target_dim not in (None, layer["hidden_size"]):
                raise CheckpointError(
                    f"{path}: a head of width {layer['hidden_size']} over a target of width "
                    f"{target_dim} is not implemented here (the head adds the target's embeddings)"
                )
            return {
                "layout": "speculators",
                "shape": _shape(layer),
                "draft_vocab": int(hf["draft_vocab_size"]),
                "layers": hf.get("eagle_aux_hidden_state_layer_ids"),
                "norm_before_residual": bool(hf.get("norm_before_residual", False)),
                "target": hf.get("target_fingerprint"),
                "mask": int(hf.get("mask_token_id") or 0)
                if hf["speculators_model_type"] == PEAGLE_TYPE
                else None,
            }
        eagle = hf.get("eagle_config") or {}
        return {
            "layout": "official",
            "shape": _shape(hf),
            "draft_vocab": int(hf.get("draft_vocab_size") or hf["vocab_size"]),
            "layers": eagle.get("eagle_aux_hidden_state_layer_ids"),
            "norm_before_residual": False,
            "target": None,
            "mask": None,
        }
    except CheckpointError:
        raise
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{path} is not an EAGLE-3 head's config ({err})") from None


def _tensors(directory: Path, layout: str) -> dict[str, torch.Tensor]:
    """The weights, renamed to this module's names."""
    safetensors, pickled = directory / "model.safetensors", directory / "pytorch_model.bin"
    try:
        if safetensors.is_file() or not pickled.is_file():
            state = load_file(safetensors, device="cpu")
        else:
            state = torch.load(pickled, map_location="cpu", weights_only=True)
    except (OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(
            f"{directory}: no readable model.safetensors or pytorch_model.bin ({err})"
        ) from None
    renamed = {}
    for name, tensor in state.items():
        name = name.removeprefix("model.")
        if layout == "official" and name.startswith("midlayer."):
            name = "layers.0." + name.removeprefix("midlayer.")
        renamed[name] = tensor
    return renamed


def target_shape(config: Any) -> dict[str, int]:
    """What our heads record of their target's config: a target of this shape takes the shipped head trained for
    one by default (weights.load.default_draft; its fingerprint then tells whether it is that model)."""
    return {
        "hidden_size": config.dim,
        "num_hidden_layers": config.n_layers,
        "vocab_size": config.vocab_size,
    }


def proposal_length(directory: Path) -> int | None:
    """The draft length a speculators head's config proposes (``proposal_methods``' ``speculative_tokens``, what
    vLLM takes as its number of speculative tokens), or None."""
    try:
        methods = json.loads((directory / "config.json").read_text())["speculators_config"][
            "proposal_methods"
        ]
        return int(methods[0]["speculative_tokens"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def load_eagle3_head(
    name_or_path: str | os.PathLike,
    target: Any,
    target_name: str = "the target",
    dtype: torch.dtype | None = None,
) -> Eagle3Head:
    """An Eagle3Head from its folder (either layout), checked against ``target``, in ``dtype``
    (default the target's) and on the target's device."""
    directory = resolve(name_or_path)
    info = read_config(directory)
    shape, head_name = info["shape"], str(name_or_path)
    layers = tuple(info["layers"]) if info["layers"] else default_layers(target.config.n_layers)
    checks = [
        ("hidden size", shape.dim, target.config.dim),
        ("vocabulary", shape.vocab_size, target.config.vocab_size),
    ]
    for what, mine, theirs in checks:
        if mine != theirs:
            raise CheckpointError(
                f"EAGLE-3 head {head_name} has {what} {mine}, {target_name} has {theirs}"
            )
    if len(layers) != 3 or not all(0 <= i < target.config.n_layers for i in layers):
        raise CheckpointError(
            f"EAGLE-3 head {head_name} reads target layers {list(layers)}, {target_name} has "
            f"{target.config.n_layers} (ids 0..{target.config.n_layers - 1})"
        )
    if info["target"] is not None and not same_fingerprint(fingerprint(target), info["target"]):
        raise CheckpointError(
            f"EAGLE-3 head {head_name} was trained for another target, whose weights differ from "
            f"{target_name}'s (fingerprint mismatch): train one for it with train.py eagle3"
        )
    # it drafts at the target's positions (published heads say 2048)
    shape.max_seq_len = target.config.max_seq_len
    with torch.device("meta"):
        head = (
            Eagle3Head(shape, layers, info["draft_vocab"], info["norm_before_residual"])
            if info["mask"] is None
            else PEagleHead(
                shape, layers, info["draft_vocab"], info["norm_before_residual"], info["mask"]
            )
        )
    state = _tensors(directory, info["layout"])
    # the target's own embeddings are used (EAGLE-3 copies them)
    table = state.pop("embed_tokens.weight", None)
    own_table = None
    if info["mask"] is not None:
        own_table = _peagle_inputs(state, table, target, info["mask"], directory)
    # one vocabulary: identity maps
    if "d2t" not in state and info["draft_vocab"] == shape.vocab_size:
        state["d2t"] = torch.zeros(shape.vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(shape.vocab_size, dtype=torch.bool)
    expected = {
        name: tuple(t.shape) for name, t in (*head.named_parameters(), *head.named_buffers())
    }
    got = {name: tuple(t.shape) for name, t in state.items()}
    if got != expected:
        diff = sorted(set(got) ^ set(expected)) or [n for n in got if got[n] != expected[n]]
        raise CheckpointError(f"{directory}: tensors {diff[:4]} do not match its config.json")
    embedding = target.embed_tokens.weight
    dtype = dtype or embedding.dtype
    ids = (torch.arange(info["draft_vocab"]) + state["d2t"].long()).tolist()
    if ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= shape.vocab_size:
        raise CheckpointError(
            f"{directory}: d2t does not map the draft ids to distinct target ids in order"
        )
    for name, tensor in state.items():
        if tensor.is_floating_point():
            check_finite(directory, name, tensor, tensor)
            state[name] = tensor.to(device=embedding.device, dtype=dtype)
        else:
            state[name] = tensor.to(
                device=embedding.device, dtype=torch.long if name == "d2t" else torch.bool
            )
    head.load_state_dict(state, assign=True, strict=True)
    if own_table is not None:
        head.embed_tokens = nn.Embedding.from_pretrained(
            own_table.to(device=embedding.device, dtype=dtype)
        )
    return head.eval()


def _peagle_inputs(
    state: dict[str, torch.Tensor],
    table: torch.Tensor | None,
    target: Any,
    mask: int,
    directory: Path,
) -> torch.Tensor | None:
    """A P-EAGLE file's mask inputs as PEagleHead holds them (in ``state``); its own embedding
    table where it differs from the target's (else None: the target's is used)."""
    if "mask_hidden" not in state:
        raise CheckpointError(f"{directory}: a P-EAGLE head without mask_hidden")
    state["mask_hidden"] = state["mask_hidden"].reshape(-1)
    own = target.embed_tokens.weight.detach().cpu().float()
    if not 0 <= mask < own.shape[0]:
        raise CheckpointError(
            f"{directory}: mask_token_id {mask} is not an id of the target's vocabulary"
        )
    rows = table.float() if table is not None else own
    state["mask_embedding"] = rows[mask].clone()
    if table is None or tuple(table.shape) != tuple(own.shape):
        return None
    others = torch.ones(own.shape[0], dtype=torch.bool)
    others[mask] = False
    same = torch.allclose(rows[others], own[others], rtol=1e-2, atol=1e-3 * float(own.abs().max()))
    return None if same else rows


def save_eagle3_head(
    head: Eagle3Head,
    directory: str | os.PathLike,
    target: Any,
    *,
    target_name: str | None = None,
    dtype: torch.dtype | None = None,
    layout: str = "speculators",
) -> Path:
    """Write ``head`` (trained for ``target``) as config.json + model.safetensors in the
    ``speculators`` layout (or the ``official`` one)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    parallel = isinstance(head, PEagleHead)
    if parallel and layout != "speculators":
        raise ValueError("a P-EAGLE head is written in the speculators layout only")
    tensors = {}
    for name, t in (*head.named_parameters(), *head.named_buffers()):
        if name.startswith("embed_tokens.") or name in ("mask_embedding", "mask_hidden"):
            continue  # P-EAGLE's inputs, written below in speculators' form
        if layout == "official" and name.startswith("layers.0."):
            name = "midlayer." + name.removeprefix("layers.0.")
        tensors[name] = (
            t.detach().to(dtype or t.dtype if t.is_floating_point() else t.dtype).cpu().contiguous()
        )
    dtype_name = str(head.dtype if dtype is None else dtype).removeprefix("torch.")
    layer = {**head.config.to_hf(), "num_hidden_layers": 1}
    for key in (
        "architectures",
        "torch_dtype",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        layer.pop(key, None)
    layer["model_type"] = "llama"
    if layout == "official":
        config = {
            **layer,
            "architectures": list(OFFICIAL_ARCHITECTURES),
            "draft_vocab_size": head.draft_vocab,
            "torch_dtype": dtype_name,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(head.target_layers)},
        }
    else:
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": SPECULATORS_TYPE,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
                "verifier": {"name_or_path": target_name, "architectures": ["LlamaForCausalLM"]},
            },
            "transformer_layer_config": layer,
            "draft_vocab_size": head.draft_vocab,
            "norm_before_residual": head.layers[0].norm_before_residual,
            "target_hidden_size": target.config.dim,
            "eagle_aux_hidden_state_layer_ids": list(head.target_layers),
            "torch_dtype": dtype_name,
            "target_fingerprint": fingerprint(target),
            "target_shape": target_shape(target.config),
        }
        if parallel:
            save = dtype or head.dtype
            table = (
                head.embed_tokens if head.embed_tokens is not None else target.embed_tokens
            ).weight.detach()
            table = table.to(save).cpu().clone()
            table[head.mask_token_id] = head.mask_embedding.detach().to(save).cpu()
            tensors["embed_tokens.weight"] = table.contiguous()
            tensors["mask_hidden"] = (
                head.mask_hidden.detach().to(save).cpu().reshape(1, 1, -1).contiguous()
            )
            config.update(
                {
                    "architectures": ["PEagleSpeculator"],
                    "speculators_model_type": PEAGLE_TYPE,
                    "mask_token_id": head.mask_token_id,
                    "embed_requires_grad": True,
                }
            )
            config["speculators_config"]["algorithm"] = PEAGLE_TYPE
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    _normal_permissions(directory / "model.safetensors")
    return directory
