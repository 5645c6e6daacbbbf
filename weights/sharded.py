"""Loading one rank's share of a checkpoint (tensor parallelism), optionally as int8 or int4.

:func:`load_model_tp` is :func:`weights.checkpoint.load_model` for a process in a
tensor-parallel group: it builds the model on the meta device, swaps the blocks for
their sharded versions (:mod:`model.scale.tensor_parallel`), and reads from the safetensors
files only this rank's rows or columns of each split matrix, through
``safe_open(...).get_slice(name)[rows]`` / ``[:, cols]``. A rank of Llama-2-70B on 8
GPUs therefore reads (and holds in host memory) about 1/8 of the 138 GB, never a whole
tensor it does not keep.

With ``quantize="int8"`` each block's linear weight is quantized as soon as it has been
read, one matrix at a time on the target device, so the full-precision model never
exists: that is what lets 70B (69 GB of int8) load on one 80 GB GPU. ``quantize="int4"`` does the
same with groupwise int4 (model.scale.quantize.Int4Linear, a CPU in float32 or bfloat16).

Without a process group (or with one rank) it loads the whole model, so the same
function serves ``generate.py --quantize int8`` on one GPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from model import Llama, ModelConfig
from model.scale.codes import int4_layer
from model.scale.memory import LLAMA2_CONFIGS
from model.scale.quantize import INT4_DTYPES, Int4Linear, Int8Linear, quantize_weight
from model.scale.tensor_parallel import check_divisible, parallelize, shard_index, sync_logits
from weights.checkpoint import (
    SUPPORTED_DTYPES,
    CheckpointError,
    gguf_file,
    read_config,
    read_tensors,
)
from weights.gguf import GGUFError, is_gguf
from weights.registry import UnknownCheckpointError, resolve

QUANTIZE_MODES = (None, "int8", "int4", "file")


def load_model_tp(
    name_or_path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    quantize: str | None = None,
    group: dist.ProcessGroup | None = None,
    shard: bool = True,
    sync: bool = True,
) -> Llama:
    """This rank's tensor-parallel share of an HF-layout checkpoint, ready for inference.

    The rank and world size come from ``group`` (default: the default process group;
    none means one rank, the whole model). ``shard=False`` loads the whole model on
    every rank instead: that is how the draft is loaded, replicated. ``quantize="int8"``
    stores the blocks' linear weights as int8 (:mod:`model.scale.quantize`). ``sync`` installs
    :func:`model.scale.tensor_parallel.sync_logits`, so that every rank returns rank 0's
    logits and speculative decoding takes the same decisions everywhere.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise CheckpointError(
            f"dtype {dtype} is not supported; use float32, bfloat16, float16 or float64"
        )
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be None, 'int8', 'int4' or 'file', got {quantize!r}")
    device = torch.device(device)
    if shard and dist.is_available() and dist.is_initialized():
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    else:
        rank, world_size = 0, 1
    directory = resolve(name_or_path)
    config = read_config(directory)
    check_divisible(config, world_size)  # before a byte is read
    with torch.device("meta"):
        model = parallelize(Llama(config), world_size, group)

    # int4 codes come from the checkpoint's values, not from their rounding to a 16-bit dtype (a GGUF's
    # Q4_1 blocks, read as float32, give back their own codes); _place casts the rest to dtype.
    read_dtype = torch.float32 if quantize == "int4" and dtype != torch.float64 else dtype

    def take(name: str, tensor_slice: Any) -> torch.Tensor:
        index = shard_index(name, tuple(tensor_slice.get_shape()), rank, world_size)
        # A zero-copy view of the memory-mapped file: only the pages under this
        # rank's rows (or columns) are ever read from disk.
        view = tensor_slice[index] if index is not None else tensor_slice[:]
        tensor = view.to(device=device, dtype=read_dtype)
        if tensor.untyped_storage().data_ptr() == view.untyped_storage().data_ptr():
            # .to() copied nothing (CPU, same dtype): the slice still points into the
            # whole mapped tensor. Copy it out, dense, so the rank owns just its slice.
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        return tensor

    # a file's 4-bit matrices are taken as their own codes (use_file_codes), never dequantized
    skip = four_bit_names(directory) if quantize == "file" else ()
    for name, tensor in read_tensors(directory, config, take, skip):
        _place(
            model,
            name.removeprefix("model."),
            tensor,
            None if quantize == "file" else quantize,
            dtype,
        )
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if quantize == "file":
        if world_size > 1:
            raise CheckpointError("a file's own codes are not split between ranks")
        use_file_codes(model, directory, dtype)
    left = [n for n, t in model.state_dict(keep_vars=True).items() if t.device.type == "meta"]
    if left:
        raise CheckpointError(f"{directory}: tensors never filled in: {', '.join(left[:5])}")
    model.eval()
    return sync_logits(model) if sync else model


def four_bit_names(directory: Path) -> set[str]:
    """The HF names of the matrices a GGUF file stores as 4-bit codes (none for another checkpoint)."""
    if not is_gguf(directory):
        return set()
    try:
        return set(gguf_file(directory).four_bit_shapes())
    except GGUFError as err:
        raise CheckpointError(str(err)) from None


def use_file_codes(model: Llama, directory: Path, dtype: torch.dtype) -> None:
    """Replace the block linears a GGUF file stores as 4-bit codes (Q4_0, Q4_1) with torch's int4
    kernel over those codes, computing in ``dtype`` (model/scale/codes.py), in place. The rest (norms,
    the embedding, 8-bit or K-quant matrices, the output head) stays as read, dequantized."""
    if not is_gguf(directory):
        raise CheckpointError(f"{directory} is not a GGUF file: it has no codes of its own to keep")
    if dtype not in INT4_DTYPES:
        raise CheckpointError(
            f"a file's 4-bit codes run in float32 or bfloat16 (torch's int4 kernel), not {dtype}"
        )
    try:
        file = gguf_file(directory)
        stored = file.codes(file.four_bit_shapes())
    except GGUFError as err:
        raise CheckpointError(str(err)) from None
    for name, codes in stored.items():
        parent, _, child = name.removeprefix("model.").removesuffix(".weight").rpartition(".")
        setattr(model.get_submodule(parent), child, int4_layer(codes, dtype))


def _place(
    model: Llama, name: str, tensor: torch.Tensor, quantize: str | None, dtype: torch.dtype
) -> None:
    """Put ``tensor`` where parameter ``name`` lives, in ``dtype``; block linears become Int8Linear with
    int8, and Int4Linear computing in ``dtype`` with int4 where their inputs split into groups of 32."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    current = getattr(module, attr)
    if tuple(current.shape) != tuple(tensor.shape):
        raise CheckpointError(
            f"{name}: this rank's slice has shape {list(tensor.shape)}, the sharded model "
            f"expects {list(current.shape)}"
        )
    if (
        quantize
        and isinstance(module, nn.Linear)
        and name.startswith("layers.")
        and (quantize == "int8" or tensor.shape[1] % 32 == 0)
    ):
        parent_name, _, child = module_name.rpartition(".")
        layer = (
            Int8Linear(*quantize_weight(tensor))
            if quantize == "int8"
            else Int4Linear.from_float(tensor, 32)
        )
        setattr(model.get_submodule(parent_name), child, layer.to(dtype))
        return
    setattr(module, attr, nn.Parameter(tensor.to(dtype), requires_grad=False))


def plan_config(name_or_path: str | os.PathLike) -> ModelConfig:
    """The config to plan memory with: the checkpoint's config.json when it is on disk,
    else the published shape of a Llama-2 short name (``7b``, ``70b-chat``...), so that
    ``generate.py --plan`` answers before anything has been downloaded."""
    try:
        return read_config(resolve(name_or_path))
    except (UnknownCheckpointError, CheckpointError):
        base = str(name_or_path).removesuffix("-chat")
        if base in LLAMA2_CONFIGS:
            return LLAMA2_CONFIGS[base]
        raise
