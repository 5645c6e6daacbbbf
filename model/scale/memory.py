"""Will a draft/target pair fit? Bytes per device from the configs alone, before any download.

Per device, with tensor parallelism over ``tp`` GPUs:

* target block weights (q, k, v, o, gate, up, down) / tp, at the weight dtype's bytes,
  or 1 byte each plus one scale per output row and rank with int8;
* target embeddings, ``lm_head`` and RMSNorm weights, replicated on every GPU;
* the draft model, whole on every GPU (it is small, and sharding it would add a
  collective to each of its many cheap calls);
* KV caches: 2 (keys and values) x layers x kv_heads x head_dim x context x batch x bytes,
  the target's with kv_heads / tp per GPU, the draft's in full;
* a runtime reserve (CUDA context, cuBLAS/NCCL workspaces, allocator slack,
  activations of a decode step), and with int8 the largest dequantised temporary.

Device capacities are the *nominal* decimal sizes NVIDIA quotes (H200 141 GB, A100
80 GB / 40 GB as 141e9, 80e9, 40e9 bytes). CUDA reports a little more (an A100 40GB
has 42.3e9 bytes, an H200 about 150e9), so a plan that fits the nominal size keeps a
few percent in hand. ``device="auto"`` uses the total memory CUDA reports instead.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from model.config import ModelConfig
from model.scale.tensor_parallel import check_divisible

GB = 1e9

# The published shapes of Llama-2 (the configs of meta-llama/Llama-2-{7,13,70}b-hf).
LLAMA2_CONFIGS: dict[str, ModelConfig] = {
    "7b": ModelConfig(
        vocab_size=32000,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        hidden_dim=11008,
        max_seq_len=4096,
    ),
    "13b": ModelConfig(
        vocab_size=32000,
        dim=5120,
        n_layers=40,
        n_heads=40,
        n_kv_heads=40,
        hidden_dim=13824,
        max_seq_len=4096,
    ),
    "70b": ModelConfig(
        vocab_size=32000,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        hidden_dim=28672,
        max_seq_len=4096,
    ),
}


@dataclass(frozen=True)
class DeviceSpec:
    """A GPU's memory (bytes) and nominal memory bandwidth (bytes/s, for roofline estimates)."""

    name: str
    memory_bytes: int
    bandwidth: float | None = None


DEVICES: dict[str, DeviceSpec] = {
    "h200": DeviceSpec("NVIDIA H200 141GB", int(141e9), 4.8e12),
    "h100-80gb": DeviceSpec("NVIDIA H100 80GB (SXM)", int(80e9), 3.35e12),
    "a100-80gb": DeviceSpec("NVIDIA A100 80GB (SXM)", int(80e9), 2.039e12),
    "a100-40gb": DeviceSpec("NVIDIA A100 40GB (SXM)", int(40e9), 1.555e12),
}

# 1 GiB: CUDA context (~0.5 GB), cuBLAS and NCCL workspaces, allocator slack
DEFAULT_RESERVE = 2**30


def device_spec(name: str) -> DeviceSpec:
    """A named device (``h200``, ``a100-80gb``, ``a100-40gb``, ``h100-80gb``), or ``auto``/``cuda``/``cuda:N``
    for the GPU CUDA reports (its total memory, not the nominal size). Unknown names are an error."""
    key = name.lower()
    if key in DEVICES:
        return DEVICES[key]
    if key in ("auto", "cuda") or key.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {name!r} asks for the detected GPU, but CUDA is not available; "
                f"name one of {', '.join(DEVICES)}"
            )
        props = torch.cuda.get_device_properties(torch.device("cuda" if key == "auto" else key))
        return DeviceSpec(props.name, int(props.total_memory), None)
    raise ValueError(
        f"unknown device {name!r}; use one of {', '.join(DEVICES)} or auto (the detected GPU)"
    )


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ----------------------------------------------------------------------------- counting
def block_linear_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """[out, in] of one block's seven linear layers, in the full (unsharded) model."""
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    return [
        (q, config.dim),
        (kv, config.dim),
        (kv, config.dim),
        (config.dim, q),
        (config.hidden_dim, config.dim),
        (config.hidden_dim, config.dim),
        (config.dim, config.hidden_dim),
    ]


ROW_PARALLEL_INDEX = (3, 6)  # o_proj and down_proj in block_linear_shapes: split by input features


def sharded_shapes(config: ModelConfig, tp: int) -> list[tuple[int, int]]:
    """[out, in] of one block's linears on one of ``tp`` ranks."""
    return [
        (out, inp // tp) if i in ROW_PARALLEL_INDEX else (out // tp, inp)
        for i, (out, inp) in enumerate(block_linear_shapes(config))
    ]


def linear_bytes(shapes: list[tuple[int, int]], dtype: torch.dtype, quantize: str | None) -> int:
    """Bytes of linear weights: dtype bytes each; with int8 1 byte each + one dtype scale per output
    row; with int4 (or a file's own 4-bit codes) half a byte each + a dtype scale and zero per group
    of 32."""
    if quantize is None:
        return sum(o * i for o, i in shapes) * dtype_bytes(dtype)
    if quantize in ("int4", "file"):
        return sum(o * i // 2 + o * (i // 32) * 2 * dtype_bytes(dtype) for o, i in shapes)
    if quantize != "int8":
        raise ValueError(f"quantize must be None, 'int8', 'int4' or 'file', got {quantize!r}")
    return sum(o * i + o * dtype_bytes(dtype) for o, i in shapes)


def replicated_params(config: ModelConfig) -> int:
    """Embeddings, lm_head (unless tied) and every RMSNorm weight: never split, never quantized."""
    head = 0 if config.tie_word_embeddings else config.vocab_size * config.dim
    return config.vocab_size * config.dim + head + (2 * config.n_layers + 1) * config.dim


def kv_bytes_per_position(
    config: ModelConfig, dtype: torch.dtype, tp: int = 1, batch: int = 1
) -> int:
    """Keys and values of one position, all layers, this rank's KV heads."""
    return (
        2
        * config.n_layers
        * (config.n_kv_heads // tp)
        * config.head_dim
        * batch
        * dtype_bytes(dtype)
    )


def weights_per_rank(
    config: ModelConfig, dtype: torch.dtype, tp: int = 1, quantize: str | None = None
) -> tuple[int, int]:
    """(sharded block weights, replicated weights) in bytes on one of ``tp`` ranks."""
    sharded = config.n_layers * linear_bytes(sharded_shapes(config, tp), dtype, quantize)
    return sharded, replicated_params(config) * dtype_bytes(dtype)


# ----------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device for a draft/target pair; ``fits`` says whether they fit ``capacity``."""

    target_name: str
    draft_name: str | None
    dtype: torch.dtype
    tp_size: int
    context: int
    batch: int
    quantize: str | None
    device_name: str
    capacity: int
    target_sharded: int
    target_replicated: int
    draft_weights: int
    target_kv: int
    draft_kv: int
    workspace: int
    max_context: int  # the longest context whose KV caches still fit (0: the weights alone do not)

    @property
    def weights(self) -> int:
        return self.target_sharded + self.target_replicated + self.draft_weights

    @property
    def kv_cache(self) -> int:
        return self.target_kv + self.draft_kv

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.workspace

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    @property
    def free(self) -> int:
        return self.capacity - self.total

    def to_dict(self) -> dict[str, object]:
        """Plain numbers (bytes), for JSON."""
        return {
            "target": self.target_name,
            "draft": self.draft_name,
            "dtype": str(self.dtype).removeprefix("torch."),
            "tp_size": self.tp_size,
            "context": self.context,
            "batch": self.batch,
            "quantize": self.quantize,
            "device": self.device_name,
            "capacity": self.capacity,
            "target_sharded": self.target_sharded,
            "target_replicated": self.target_replicated,
            "draft_weights": self.draft_weights,
            "target_kv": self.target_kv,
            "draft_kv": self.draft_kv,
            "workspace": self.workspace,
            "total": self.total,
            "fits": self.fits,
            "max_context": self.max_context,
        }

    def render(self) -> str:
        """A readable table, in decimal GB (MB for a tiny model's lines)."""
        dtype = str(self.dtype).removeprefix("torch.")
        weights = f"{self.quantize} + {dtype}" if self.quantize else dtype
        pair = (
            f"draft {self.draft_name} -> target {self.target_name}"
            if self.draft_name
            else self.target_name
        )
        split = f"tensor-parallel over {self.tp_size} GPUs" if self.tp_size > 1 else "one GPU"
        rows = [
            (
                f"target block weights ({'1/' + str(self.tp_size) if self.tp_size > 1 else 'whole'})",
                self.target_sharded,
            ),
            ("target embeddings, lm_head, norms (replicated)", self.target_replicated),
        ]
        if self.draft_name:
            rows.append(("draft weights (whole on every GPU)", self.draft_weights))
        rows.append(
            (f"target KV cache ({self.context} positions x batch {self.batch})", self.target_kv)
        )
        if self.draft_name:
            rows.append(("draft KV cache", self.draft_kv))
        rows.append(("runtime reserve and temporaries", self.workspace))
        width = max(len(r[0]) for r in rows) + 2
        lines = [f"memory plan: {pair}, {weights} weights, {split}, per GPU on {self.device_name}"]
        lines += [f"  {label:<{width}}{_size(n):>12}" for label, n in rows]
        lines.append(
            f"  {'total per GPU':<{width}}{_size(self.total):>12} of {_size(self.capacity)}"
        )
        if self.fits:
            verdict = f"fits, {_size(self.free)} to spare"
        else:
            verdict = f"does NOT fit: {_size(-self.free)} short"
        if self.max_context and self.max_context != self.context:
            verdict += f"; longest context that fits: {self.max_context} positions"
        elif not self.max_context:
            verdict += "; the weights alone exceed the device"
        lines.append(f"  {verdict}")
        return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n / GB:.2f} GB" if abs(n) >= 0.1 * GB else f"{n / 1e6:.2f} MB"


def plan(
    config_target: ModelConfig,
    config_draft: ModelConfig | None,
    dtype: torch.dtype = torch.bfloat16,
    tp_size: int = 1,
    context: int | None = None,
    quantize: str | None = None,
    device_name: str = "h200",
    batch: int = 1,
    reserve: int = DEFAULT_RESERVE,
    target_name: str = "target",
    draft_name: str = "draft",
    capacity_bytes: int | None = None,
) -> MemoryPlan:
    """Bytes per GPU to run ``config_target`` split over ``tp_size`` GPUs with ``config_draft`` on each.

    ``context`` defaults to the shorter max_position_embeddings of the two models.
    ``quantize="int8"`` applies to both models' block weights (generate.py --quantize).
    ``capacity_bytes`` replaces the named device's size (e.g. the free memory measured
    right now); ``device_name`` is then only a label.
    """
    check_divisible(config_target, tp_size)
    configs = [config_target] + ([config_draft] if config_draft is not None else [])
    if context is None:
        context = min(c.max_seq_len for c in configs)
    if context < 1 or batch < 1:
        raise ValueError(f"context and batch must be >= 1, got {context} and {batch}")
    spec = (
        device_spec(device_name)
        if capacity_bytes is None
        else DeviceSpec(device_name, int(capacity_bytes))
    )
    sharded, replicated = weights_per_rank(config_target, dtype, tp_size, quantize)
    draft = (
        sum(weights_per_rank(config_draft, dtype, 1, quantize)) if config_draft is not None else 0
    )
    per_pos = kv_bytes_per_position(config_target, dtype, tp_size, batch)
    per_pos_draft = (
        kv_bytes_per_position(config_draft, dtype, 1, batch) if config_draft is not None else 0
    )
    workspace = reserve
    # Int8Linear's forward off a CPU casts the weight to the activation dtype: one at a time
    if quantize == "int8":
        shapes = sharded_shapes(config_target, tp_size)
        if config_draft is not None:
            shapes += block_linear_shapes(config_draft)
        workspace += max(o * i for o, i in shapes) * dtype_bytes(dtype)
    fixed = sharded + replicated + draft + workspace
    longest = min(c.max_seq_len for c in configs)
    max_context = max(0, min(longest, (spec.memory_bytes - fixed) // (per_pos + per_pos_draft)))
    return MemoryPlan(
        target_name=target_name,
        draft_name=draft_name if config_draft is not None else None,
        dtype=dtype,
        tp_size=tp_size,
        context=context,
        batch=batch,
        quantize=quantize,
        device_name=spec.name,
        capacity=spec.memory_bytes,
        target_sharded=sharded,
        target_replicated=replicated,
        draft_weights=draft,
        target_kv=per_pos * context,
        draft_kv=per_pos_draft * context,
        workspace=workspace,
        max_context=int(max_context),
    )


TP_SIZES = (2, 4, 8, 16, 32, 64)  # tensor-parallel sizes a suggestion may propose


def cheapest_fit(
    config_target: ModelConfig,
    config_draft: ModelConfig | None,
    dtype: torch.dtype = torch.bfloat16,
    tp_size: int = 1,
    quantize: str | None = None,
    device_name: str = "h200",
    context: int | None = None,
) -> str | None:
    """The cheapest single change of generate.py flags that makes a plan that does not fit fit, or None.

    "Cheapest" in what it asks of the user, tried in this order: ``--dtype bfloat16`` when
    the plan is for 4- or 8-byte weights (the default on a GPU); ``--quantize int8`` on the
    same GPUs (no hardware, a small quality cost, benchmarks/int8_quality.py); then the
    fewest more GPUs of the same kind (``--tp``); then one bigger GPU (``--plan-device``);
    then int8 on the fewest more GPUs. None when none of those fits (nor when the plan
    already fits): then only a smaller pair or a shorter context helps, which the plan's
    "longest context that fits" already says.
    """

    def fits(**changes: object) -> bool:
        settings: dict[str, object] = dict(
            dtype=dtype,
            tp_size=tp_size,
            quantize=quantize,
            device_name=device_name,
            context=context,
        )
        settings.update(changes)
        try:
            return plan(config_target, config_draft, **settings).fits  # type: ignore[arg-type]
        except ValueError:
            return False  # a split the heads do not allow (TensorParallelError), an unusable device

    if fits():
        return None
    more_gpus = [tp for tp in TP_SIZES if tp > tp_size]
    if dtype_bytes(dtype) > 2 and fits(dtype=torch.bfloat16):
        return "--dtype bfloat16"
    if quantize is None and fits(quantize="int8"):
        return "--quantize int8"
    for tp in more_gpus:
        if fits(tp_size=tp):
            return f"--tp {tp} (run with torchrun --nproc-per-node {tp} generate.py ...)"
    capacity = plan(
        config_target, config_draft, dtype, tp_size, context, quantize, device_name
    ).capacity
    for name, spec in sorted(DEVICES.items(), key=lambda item: item[1].memory_bytes):
        if spec.memory_bytes > capacity and fits(device_name=name):
            return f"--plan-device {name} (a {spec.name})"
    if quantize is None:
        for tp in more_gpus:
            if fits(quantize="int8", tp_size=tp):
                return f"--quantize int8 --tp {tp} (run with torchrun --nproc-per-node {tp} generate.py ...)"
    return None


# ----------------------------------------------------------------------------- the memory free now
class NotEnoughMemoryError(ValueError):
    """A pair does not fit in the memory free on its device right now (check_memory)."""


def available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` right now: CUDA's free bytes, the CPU's MemAvailable (total
    physical memory off Linux); None when it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:  # not Linux: total physical memory is the best cheap bound
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    return None


# A server's default context (serve.py without --max-model-len): the model's, but no longer than
# llama.cpp's default (-c 4096), and no more KV cache than KV_BUDGET or a quarter of the free memory
# for all its rows: a 135M model's full 8,192 positions for 16 rows of float32 took 6 GB. The budget
# keeps a small model's server within 2 GB resident (the KV cache is held for every row at once).
DEFAULT_CONTEXT = 4096
KV_BUDGET = 3 * 2**28
CONTEXT_STEP = 256


def default_context(model_context: int, per_position: int, available: int | None) -> int:
    """The context a server sizes its KV cache to by default (see DEFAULT_CONTEXT): ``per_position``
    is the bytes of one position for all rows; ``available``, the free memory (None: unknown). In
    steps of CONTEXT_STEP, at least one step (the model's own context where that is shorter)."""
    budget = KV_BUDGET if available is None else min(KV_BUDGET, available // 4)
    fits = budget // max(per_position, 1) // CONTEXT_STEP * CONTEXT_STEP
    return min(model_context, DEFAULT_CONTEXT, max(fits, CONTEXT_STEP))


def gb(n: float) -> str:
    """Bytes as ``1.3 GB`` (``12.0 MB`` below 0.1 GB), for one-line messages."""
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def check_memory(
    target: tuple[str, ModelConfig],
    draft: tuple[str, ModelConfig] | None,
    positions: int,
    dtype: torch.dtype,
    device: torch.device,
    tp_size: int = 1,
    quantize: str | None = None,
    batch: int = 1,
) -> MemoryPlan | None:
    """Refuse, before loading anything, a pair that will not fit in the memory free right now.

    ``target`` and ``draft`` are (name, config) pairs (a feature head counts as a one-layer
    model of its target's shape). The plan counts this rank's weights under tensor
    parallelism (int8 blocks with ``quantize``), KV caches of ``positions`` x ``batch`` rows
    and, on a GPU, DEFAULT_RESERVE; ranks on one host share its CPU memory
    (LOCAL_WORLD_SIZE). Returns the plan (None when the free memory cannot be told); raises
    NotEnoughMemoryError, naming what it needs and what is free, when it does not fit."""
    free = available_bytes(device)
    if free is None:
        return None
    if device.type == "cpu" and tp_size > 1:  # the ranks on this host share its memory
        free //= int(os.environ.get("LOCAL_WORLD_SIZE", str(tp_size)))
    reserve = DEFAULT_RESERVE if device.type == "cuda" else 0
    result = plan(
        target[1],
        draft[1] if draft else None,
        dtype,
        tp_size=tp_size,
        context=positions,
        batch=batch,
        quantize=quantize,
        device_name=f"{device} (free)",
        reserve=reserve,
        target_name=target[0],
        draft_name=draft[0] if draft else "draft",
        capacity_bytes=free,
    )
    if not result.fits:
        names = f"{target[0]} + {draft[0]}" if draft else target[0]
        weights = quantize or str(dtype).removeprefix("torch.")
        ranks = f" per device over {tp_size} ranks" if tp_size > 1 else ""
        extra = f" + {gb(result.workspace)} runtime reserve" if result.workspace else ""
        rows = f" x {batch} rows" if batch > 1 else ""
        raise NotEnoughMemoryError(
            f"{names} {'need' if draft else 'needs'} about {gb(result.total)}{ranks} in {weights} (weights "
            f"{gb(result.weights)} + KV cache {gb(result.kv_cache)} for {positions} positions{rows}{extra}) but "
            f"{device} has {gb(free)} free; use a smaller dtype, a smaller pair, or a device with more memory (see "
            "generate.py --plan)"
        )
    return result


def plan_suggestion(
    config_target: ModelConfig,
    config_draft: ModelConfig | None,
    dtype: torch.dtype,
    tp_size: int,
    quantize: str | None,
    device_name: str,
) -> str | None:
    """What ``generate.py --plan`` prints under a plan that does not fit: cheapest_fit's change,
    or that no single change fits. None when the plan fits."""
    if plan(
        config_target,
        config_draft,
        dtype,
        tp_size=tp_size,
        quantize=quantize,
        device_name=device_name,
    ).fits:
        return None
    change = cheapest_fit(
        config_target,
        config_draft,
        dtype,
        tp_size=tp_size,
        quantize=quantize,
        device_name=device_name,
    )
    return (
        f"the cheapest change that fits: {change}"
        if change
        else "no single change of --dtype, --quantize, --tp or --plan-device fits it: use a smaller pair"
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m model.scale.memory --draft 7b --target 70b --tp 2 --device h200``: Llama-2 shapes only."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--target", default="70b", choices=sorted(LLAMA2_CONFIGS))
    parser.add_argument("--draft", default="7b", choices=sorted(LLAMA2_CONFIGS) + ["none"])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--device", default="h200", help=f"{', '.join(DEVICES)} or auto")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--quantize", default=None, choices=["int8"])
    parser.add_argument("--context", type=int, default=None)
    args = parser.parse_args(argv)
    draft = None if args.draft == "none" else LLAMA2_CONFIGS[args.draft]
    result = plan(
        LLAMA2_CONFIGS[args.target],
        draft,
        getattr(torch, args.dtype),
        args.tp,
        args.context,
        args.quantize,
        args.device,
        target_name=args.target,
        draft_name=args.draft,
    )
    print(result.render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
