"""Float32 linear layers whose weights are reordered once for oneDNN: decoding on a CPU.

Why this exists. Speculative decoding's cost model assumes that the target scores γ + 1
tokens in about the time it takes to score one: decoding is memory-bound, and the weights
are read once either way. On a CPU, PyTorch sends a float32 ``F.linear`` to MKL's sgemm,
which copies ("packs") the whole weight matrix into its blocked layout at *every* call
with more than one input row. The copy costs as much as the product, so a verification of
a few tokens costs well over one step. oneDNN can reorder a weight into its blocked layout
once, ahead of time; its products then cost about the same for 1 to 8 rows (the
measurements, and the command that makes them, are in docs/cost_model.md).

:func:`prepack_linears` swaps large ``nn.Linear`` layers of a float32 CPU model for
:class:`PrepackedLinear`, in place. Small layers keep MKL: oneDNN's fixed cost per call
exceeds the whole product of a small matrix. The result
differs from ``F.linear`` only by the order of float32 additions (about 1e-6 relative).

Bfloat16 has the same cost on a CPU with native bf16 (AVX-512 BF16, AMX): ``F.linear`` sends it
to oneDNN, which reorders the weight at every call, so a product costs about twice the packed
one (``python -m benchmarks.widths --subject matmul --dtypes``), and bfloat16 weights are prepacked there
too. Float16 is not: its one-row product is already a fast memory-bound kernel, and this oneDNN
has no float16 reorder where the CPU lacks AVX-512 FP16 (docs/compiled.md: why float16
speculation gained nothing).

It uses two operators that PyTorch's own compiler (Inductor) uses for the same purpose,
``torch.ops.mkldnn._reorder_linear_weight`` and ``torch.ops.mkldnn._linear_pointwise``.
They are internal, so :func:`prepack_linears` checks them on a small matrix first and
leaves the model untouched where they are missing or disagree with ``F.linear``.
"""

from __future__ import annotations

import itertools
import weakref
from collections import Counter
from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import nn

from model.host import last_level_cache_bytes

# Below this many weights a layer stays an nn.Linear (see the module docstring).
MIN_ELEMENTS = 1 << 17


class PrepackedLinear(nn.Module):
    """y = x W^T for a bias-free float32 (or bfloat16) weight held in oneDNN's blocked layout.

    Only the packed copy is kept, so the layer costs no extra memory; it is for decoding
    (no gradients, not saved by ``state_dict``). ``in_features`` and ``out_features`` are
    those of the layer it replaces.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # batch_size=None: a layout that serves any number of rows (prefill, verification, one token).
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.key = register(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # an opaque operator in the graph (see packed_linear)
            return packed_linear(x, self.key, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def __deepcopy__(self, memo: dict) -> PrepackedLinear:  # a copy gets its own key
        copied = PrepackedLinear.__new__(PrepackedLinear)
        nn.Module.__init__(copied)
        copied.out_features = self.out_features
        copied.in_features = self.in_features
        copied.packed = self.packed.clone()
        copied.key = register(copied)
        return copied

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed"


# ------------------------------------------------------------------- inside a compiled graph
# Inductor cannot hold a oneDNN-layout tensor as a graph constant, so under torch.compile a
# PrepackedLinear is one opaque operator that names its layer by a key: Inductor fuses the
# elementwise work around it and calls it as an external kernel, the weight stays packed.
_LAYERS: weakref.WeakValueDictionary[int, PrepackedLinear] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def register(layer: PrepackedLinear) -> int:
    key = next(_KEYS)
    _LAYERS[key] = layer
    return key


@torch.library.custom_op("llama_spec::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    """x W^T by the packed layer registered under ``key`` (out_features: for the output's shape)."""
    return torch.ops.mkldnn._linear_pointwise(x, _LAYERS[key].packed, None, "none", [], "")


@packed_linear.register_fake
def _packed_linear_shape(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


def packable(dtype: torch.dtype) -> bool:
    """The dtypes worth prepacking: float32, and bfloat16 where oneDNN has native bf16 here."""
    if dtype == torch.bfloat16:
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            return False
    return dtype == torch.float32


def prepack_supported(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this PyTorch build can prepack ``dtype`` weights here, checked on a small product
    against F.linear."""
    if not torch.backends.mkldnn.is_available() or not packable(dtype):
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(96, 64, generator=generator).to(dtype)
        x = torch.randn(1, 3, 64, generator=generator).to(dtype)
        with torch.inference_mode():
            got = PrepackedLinear(weight)(x)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        return bool(torch.allclose(got.float(), F.linear(x, weight).float(), rtol=tol, atol=tol))
    except (AttributeError, RuntimeError):
        return False


def prepack_linears(
    model: nn.Module, min_elements: int = MIN_ELEMENTS, only: Collection[str] | None = None
) -> int:
    """Replace every plain ``nn.Linear`` of a float32 (or, with native bf16, bfloat16) CPU model
    holding at least ``min_elements`` weights by a :class:`PrepackedLinear`, in place; returns how many.
    ``only``: just these children of ``model`` itself (a compiled model's products that run outside
    its compiled step).

    Does nothing (returns 0) on other devices or dtypes, where PyTorch's kernels do not
    repack per call, or when this build lacks the oneDNN operators. Subclasses of
    ``nn.Linear`` (tensor parallelism's all-reducing layer), layers with a bias and layers
    whose weight is tied to another module's, unless it is larger than the CPU's last-level cache,
    are left alone. Call it after loading, for inference only.
    """
    # A weight held by more than one module (an output head tied to the embeddings) keeps its
    # original beside the packed copy, which the embeddings read. That costs memory (113 MB
    # for SmolLM2-135M's head in float32, 1 GB for Llama-3.2-1B's), and, for a head that fits
    # in the CPU's last-level cache, time: the extra copy made the shipped draft's step
    # slower. A larger head streams from memory either way (the embeddings read one row of
    # the original per token), so there only the packed copy is read, by the faster product.
    holders = Counter(
        id(weight) for module in model.modules() for weight in module.parameters(recurse=False)
    )
    cache = last_level_cache_bytes()

    def alone_or_large(weight: torch.Tensor) -> bool:
        return holders[id(weight)] == 1 or (
            cache is not None and weight.numel() * weight.element_size() > cache
        )

    candidates = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if only is not None and (parent is not model or name not in only):
                continue
            if (
                type(child) is nn.Linear
                and child.bias is None
                and child.weight.numel() >= min_elements
                and child.weight.device.type == "cpu"
                and packable(child.weight.dtype)
                and alone_or_large(child.weight)
            ):
                candidates.append((parent, name, child))
    dtypes = {child.weight.dtype for _, _, child in candidates}
    candidates = [
        c for c in candidates if c[2].weight.dtype in {d for d in dtypes if prepack_supported(d)}
    ]
    if not candidates:
        return 0
    for parent, name, child in candidates:
        setattr(parent, name, PrepackedLinear(child.weight))
    return len(candidates)
