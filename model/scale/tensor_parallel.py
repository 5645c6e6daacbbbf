"""Tensor parallelism (Megatron-LM style) for the LLaMA decoder, over ``torch.distributed``.

Every rank holds a slice of each transformer block and the whole of everything else:

* ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj`` are split by output
  features ("column parallel"): rank r keeps a contiguous block of attention heads,
  of key/value heads and of the SwiGLU inner units. Nothing needs to be exchanged to
  use them, because attention is independent per head and SwiGLU is elementwise.
* ``o_proj`` and ``down_proj`` are split by input features ("row parallel"): each
  rank multiplies its own heads / inner units by its rows of the matrix and gets a
  partial sum of the full output, and one all-reduce per attention and per MLP adds
  the partial sums. That is two all-reduces of [B, T, dim] per layer, nothing else.
* The embeddings, ``lm_head`` and the RMSNorm weights are replicated (the simplest
  choice: for Llama-2-70B they are 1 GB in bfloat16, under 1% of the weights, and
  replicating them costs no communication at all).

Because rank r's query heads are r*H/tp .. (r+1)*H/tp - 1 and its KV heads are
r*KV/tp .. (r+1)*KV/tp - 1, grouped-query attention pairs every local query head with
the same KV head it used in the full model. The blocks are the model's own
:class:`~model.model.Attention` and :class:`~model.model.MLP` built from a config with
fewer heads, plus an all-reduce of their output, so :class:`~model.model.Llama` keeps
its calling convention (``model(tokens, call)``, ``setup_cache``, ``config``) and
the speculative decoding code runs unchanged on every rank.

Same decisions on every rank. Speculative decoding draws random numbers and compares
probabilities; if two ranks ever disagreed about accepting a token, they would issue
different numbers of forward passes and the next collective would hang. Two things make
the decisions identical: (1) every rank seeds its sampler with the same seed
(:func:`broadcast_seed` hands rank 0's seed to all), and (2) every rank sees the same
logits bit for bit: :func:`sync_logits` broadcasts rank 0's logits after each forward
pass (about 128 KB per token for a 32000-word vocabulary, a few microseconds on
NVLink), which removes any dependence on kernels being bitwise deterministic across
GPUs. The replicated draft model gets the same hook for the same reason.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from model.config import ModelConfig
from model.model import MLP, Attention, Llama


class TensorParallelError(ValueError):
    """A model cannot be split over the requested number of ranks."""


# ----------------------------------------------------------------------------- process group
@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: its rank, the number of ranks, and the device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None when running as a single process without a process group

    @property
    def is_main(self) -> bool:
        """Rank 0 alone prints and writes files, so output is not repeated world_size times."""
        return self.rank == 0


def init_distributed(
    device: str | torch.device | None = None, backend: str | None = None
) -> DistInfo:
    """Join the process group that ``torchrun`` describes through RANK, WORLD_SIZE and LOCAL_RANK.

    Without those variables (a plain ``python generate.py``) this is a single process and
    no process group is created. The backend follows the device: NCCL for CUDA, gloo for
    the CPU. On CUDA each process uses GPU ``LOCAL_RANK`` unless ``device`` names one.
    Calling it again once the group exists returns the same answer.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank if world_size > 1 else torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size == 1 and not dist.is_initialized():
        return DistInfo(0, 1, 0, device, None)
    if not dist.is_initialized():
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise RuntimeError(
                "WORLD_SIZE > 1 but MASTER_ADDR/MASTER_PORT are unset: launch with torchrun "
                "--nproc-per-node N, which sets them"
            )
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, dist.get_backend())


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def broadcast_seed(seed: int | None, device: torch.device | str = "cpu") -> int:
    """One seed for every rank: ``seed`` if given, else a fresh random one drawn on rank 0.

    With NCCL the tensor must live on the GPU, hence ``device``.
    """
    rank, size = world()
    if seed is None:
        seed = secrets.randbits(62) if rank == 0 else 0
    elif not -(2**63) <= seed < 2**63:
        raise ValueError(f"seed must fit in 64 signed bits to be broadcast, got {seed}")
    if size == 1:
        return int(seed)
    value = torch.tensor([seed], dtype=torch.int64, device=device)
    dist.broadcast(value, src=0)
    return int(value.item())


def sync_logits(model: nn.Module, src: int = 0) -> nn.Module:
    """Make every rank return rank ``src``'s logits from ``model(...)`` (a forward hook).

    A no-op without a process group. Idempotent: installing it twice keeps one hook.
    """
    if world()[1] == 1 or getattr(model, "_sync_logits_handle", None) is not None:
        return model

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        dist.broadcast(output, src=src)
        return output

    model._sync_logits_handle = model.register_forward_hook(hook)
    return model


# ----------------------------------------------------------------------------- sharded blocks
def check_divisible(config: ModelConfig, world_size: int) -> None:
    """Refuse a split that would give ranks unequal or fractional heads."""
    if world_size < 1:
        raise TensorParallelError(f"tensor-parallel size must be >= 1, got {world_size}")
    problems = []
    for what, n in (
        ("num_attention_heads", config.n_heads),
        ("num_key_value_heads", config.n_kv_heads),
        ("intermediate_size", config.hidden_dim),
    ):
        if n % world_size:
            problems.append(f"{what}={n}")
    if problems:
        raise TensorParallelError(
            f"cannot split the model over {world_size} ranks: {', '.join(problems)} "
            f"{'is' if len(problems) == 1 else 'are'} not divisible by {world_size}; "
            "use a tensor-parallel size that divides the number of heads and of key/value heads"
        )


def shard_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The config of one rank's blocks: 1/world_size of the heads, KV heads and SwiGLU units."""
    check_divisible(config, world_size)
    return dataclasses.replace(
        config,
        n_heads=config.n_heads // world_size,
        n_kv_heads=config.n_kv_heads // world_size,
        hidden_dim=config.hidden_dim // world_size,
        head_dim=config.head_dim,
    )


class ParallelAttention(Attention):
    """This rank's heads of an attention layer; the output is all-reduced over the group.

    ``o_proj`` holds this rank's input columns, so its output is a partial sum.
    """

    # Read by the fast paths (model.fast.compile.all_reduces), which do not import this layer:
    # an all-reduce is not captured in a compiled graph, nor kept in a package.
    all_reduces = True

    def __init__(self, config: ModelConfig, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(config)
        self.group = group

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        out = super().forward(*args, **kwargs)
        dist.all_reduce(out, group=self.group)
        return out


class ParallelMLP(MLP):
    """This rank's SwiGLU units; ``down_proj``'s partial sums are all-reduced over the group."""

    all_reduces = True  # as ParallelAttention's

    def __init__(self, config: ModelConfig, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(config)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        dist.all_reduce(out, group=self.group)
        return out


def parallelize(model: Llama, world_size: int, group: dist.ProcessGroup | None = None) -> Llama:
    """Swap every block's attention and MLP for this rank's sharded versions, in place.

    The new layers are created on ``model``'s device with fresh (uninitialised on
    ``meta``) weights: call it on a model built on the meta device, then fill the
    weights with the rank's slices (see :func:`weights.sharded.load_model_tp`).
    """
    if world_size == 1:
        return model
    local = shard_config(model.config, world_size)
    with torch.device(model.device):
        for block in model.layers:
            block.self_attn = ParallelAttention(local, group)
            block.mlp = ParallelMLP(local, group)
    model.tp_world_size = world_size
    return model


# ----------------------------------------------------------------------------- slices
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def shard_index(
    name: str, shape: tuple[int, ...], rank: int, world_size: int
) -> tuple[slice, ...] | None:
    """The part of tensor ``name`` (full ``shape``, torch's [out, in] layout) that ``rank`` keeps.

    None means the tensor is replicated. Column-parallel layers keep rows of the stored
    matrix (output features); row-parallel layers keep columns (input features). Heads
    are laid out head-major in both, so a contiguous block of rows/columns is a
    contiguous block of whole heads.
    """
    if world_size == 1:
        return None
    parts = name.split(".")
    kind = parts[-2] if len(parts) >= 2 else ""
    if kind in COLUMN_PARALLEL:
        step = shape[0] // world_size
        return (slice(rank * step, (rank + 1) * step),)
    if kind in ROW_PARALLEL:
        step = shape[1] // world_size
        return (slice(None), slice(rank * step, (rank + 1) * step))
    return None


def weight_bytes(model: nn.Module) -> int:
    """Bytes of this process's weights: parameters and persistent buffers, each tensor once.

    Int8 weights are buffers, the KV cache is a non-persistent buffer (not counted),
    and tied embeddings are counted once.
    """
    seen: set[int] = set()
    total = 0
    for tensor in model.state_dict(keep_vars=True).values():
        key = tensor.data_ptr() if tensor.device.type != "meta" else id(tensor)
        if key in seen:
            continue
        seen.add(key)
        total += tensor.numel() * tensor.element_size()
    return total


# ----------------------------------------------------------------------------- local launcher
def free_port() -> int:
    """A TCP port nobody listens on right now, for MASTER_PORT."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch_entry(
    rank: int, fn: Callable[..., None], world_size: int, port: int, args: tuple
) -> None:
    # What torchrun would have set, so that fn can call init_distributed() exactly as under torchrun.
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        fn(*args)
        if dist.is_initialized():
            # Every rank done before any tears down: rank 0 hosts the rendezvous store, and a rank
            # still using the group when rank 0 exits can abort in gloo's teardown.
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch_local(
    fn: Callable[..., None], world_size: int, *args: object, timeout: float = 120.0
) -> None:
    """Run ``fn(*args)`` in ``world_size`` fresh processes with torchrun's environment (tests, CPU demos).

    ``fn`` must be importable (a module-level function). A failing rank raises here
    with its traceback; ranks still running after ``timeout`` seconds (a collective
    that never completes) are killed and TimeoutError is raised, so a bug can fail a
    test but never hang it.
    """

    context = mp.start_processes(
        _launch_entry,
        args=(fn, world_size, free_port(), args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(
                f"{world_size} ranks did not finish within {timeout:.0f}s (a hung collective?)"
            )
