"""Weight-only int8 quantization: half the bytes of bfloat16 weights, activations untouched.

Each row of a weight matrix (one output feature) gets its own scale, the row's largest
absolute value divided by 127, and the weights are stored as round(w / scale) in int8.
Per-output-channel scales are the usual choice for weight-only int8 (LLM.int8's vector-
wise scales, gpt-fast's int8 mode): a row with large weights does not cost the other
rows their resolution, and the scale factors out of the dot product, so the layer is

    y = (x @ round(W / s)^T) * s

which we compute as ``F.linear(x, W_int8.to(x.dtype)) * s``: the int8 -> float cast is
exact (|q| <= 127 fits any float's mantissa) and the multiply by ``s`` touches the
output, not the weight. The rounding error of every weight is at most s/2, so each
output is off by at most (s/2) * sum_j |x_j| (:func:`max_abs_error_bound`).

The dequantising cast materialises a temporary of the weight in the activation dtype
per call; in eager PyTorch a decode step therefore reads more bytes than bfloat16 does,
and int8 is a way to *fit* a model (70B on one 80 GB GPU), not a speedup, unless
``torch.compile`` fuses the cast into the matmul.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

QMAX = 127  # symmetric: -127..127, so the scale maps the absmax exactly onto 127


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weights, per-row scales in ``weight``'s dtype) of a [out, in] matrix.

    Computed in float32 (float64 for float64 weights) so that the rounding to int8 is
    the only error. A row of zeros gets scale 1 rather than a division by zero.
    """
    if weight.dim() != 2:
        raise ValueError(f"expected a [out, in] weight matrix, got shape {list(weight.shape)}")
    work = weight.double() if weight.dtype == torch.float64 else weight.float()
    absmax = work.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax))
    q = torch.round(work / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale.to(weight.dtype)


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The matrix an int8 layer effectively multiplies by: q * scale, in scale's dtype."""
    return q.to(scale.dtype) * scale[:, None]


class Int8Linear(nn.Module):
    """A bias-free linear layer with int8 weights and per-output-channel scales.

    ``weight`` keeps the name and [out, in] shape of :class:`torch.nn.Linear`'s, so code
    that reads a layer's shape (``setup_cache`` counts KV heads from ``k_proj.weight``)
    works on quantized models. Weights and scales are buffers, not parameters: they
    are not trainable, and ``state_dict`` still carries them.
    """

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        if weight.dtype != torch.int8:
            raise TypeError(f"Int8Linear needs int8 weights, got {weight.dtype}")
        if scale.shape != weight.shape[:1]:
            raise ValueError(
                f"need one scale per output row: weight {list(weight.shape)}, scale {list(scale.shape)}"
            )
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Int8Linear:
        """Quantize a float [out, in] weight matrix."""
        return cls(*quantize_weight(weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's CPU int8 kernel (_weight_int8pack_mm) does without the float copy, but on a CPU both lose to
        # float32 (python -m benchmarks.widths --subject matmul --dtypes float32 int8 int4; docs/compiled.md).
        return F.linear(x, self.weight.to(x.dtype)) * self.scale.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def max_abs_error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Worst-case |int8 layer(x) - float layer(x)| per output: (scale / 2) * sum_j |x_j|.

    Every weight is rounded by at most half a step (scale / 2), so an output, a sum of
    weight * input products, moves by at most that times the inputs' L1 norm.
    """
    return x.abs().sum(-1, keepdim=True) * (scale / 2)


def quantize_int8(model: nn.Module, include_lm_head: bool = False) -> nn.Module:
    """Replace every ``nn.Linear`` in the transformer blocks with an :class:`Int8Linear`, in place.

    The embeddings, norms and (by default) ``lm_head`` keep their dtype: they are under
    1% of a 7B-70B model's weights, the embedding is a lookup (int8 saves no compute
    there), and keeping the output head exact keeps the logits, which speculative
    decoding compares between draft and target, as accurate as possible. A tied
    ``lm_head`` is never quantized, since it is the embedding matrix.
    """

    def swap(parent: nn.Module) -> None:
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                if child.bias is not None:
                    raise ValueError(f"{name} has a bias; LLaMA's linear layers have none")
                setattr(parent, name, Int8Linear.from_float(child.weight.detach()))
            else:
                swap(child)

    swap(model.layers)
    head = model.lm_head
    tied = head.weight is model.embed_tokens.weight if isinstance(head, nn.Linear) else False
    if include_lm_head and isinstance(head, nn.Linear) and not tied:
        model.lm_head = Int8Linear.from_float(head.weight.detach())
    return model


# ----------------------------------------------------------------------------- int4, groupwise (a CPU)
def quantize_int4_weight(
    weight: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes 0..15 as int32 [out, in], scales and zeros [out, in / group_size]) of a float matrix,
    asymmetric per group of ``group_size`` inputs, as gpt-fast's int4 mode: a group's smallest and
    largest weight span the 16 codes, and code c stands for (c - 8) * scale + zero. Every weight is
    within scale / 2 of what its code stands for."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"{in_features} inputs do not split into groups of {group_size}")
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-8)  # a constant group: any code stands for its value
    codes = ((groups - low) / scale).round().clamp(0, 15)
    return (
        codes.reshape(out_features, in_features).to(torch.int32),
        scale[..., 0],
        (low + 8 * scale)[..., 0],
    )


def dequantize_int4_weight(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> torch.Tensor:
    """The float32 matrix an int4 layer multiplies by: (code - 8) * scale + zero, group by group."""
    group_size = codes.shape[1] // scale.shape[1]
    scales = scale.repeat_interleave(group_size, 1)  # [out, in]: each group's scale per column
    zeros = zero.repeat_interleave(group_size, 1)  # [out, in]
    return (codes.float() - 8) * scales + zeros


# what torch's packed int4 kernel computes in on a CPU
INT4_DTYPES = (torch.float32, torch.bfloat16)


class Int4Linear(nn.Module):
    """A bias-free linear layer with 4-bit weights, groupwise scales and zeros, for a CPU: torch's
    packed int4 kernel (``_weight_int4pack_mm_for_cpu``) reads an eighth of float32's bytes. It
    computes in its scales' dtype, float32 or bfloat16 (``.to(torch.bfloat16)`` casts them; the
    output is rounded to bfloat16 as a bfloat16 model's every product is), and compiled with
    max-autotune Inductor may put its own int4 template in the kernel's place (bfloat16 inputs,
    AVX-512). ``weight`` holds the packed codes; ``shape`` is [out, in] as nn.Linear's."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.group_size = self.in_features // scale.shape[1]
        self.register_buffer(
            "weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 2)
        )
        self.register_buffer(
            "scales_and_zeros", torch.stack([scale.t(), zero.t()], -1).float().contiguous()
        )

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int = 32) -> Int4Linear:
        return cls(*quantize_int4_weight(weight, group_size))

    @classmethod
    def stacked(cls, layers: Sequence[Int4Linear]) -> Int4Linear:
        """One layer whose outputs are ``layers``' outputs one after another (model/fast/fuse.py). The
        kernel packs each output row on its own, so the packed rows and their scales concatenate
        as they are (tests/model/scale/test_quantize.py checks this against the separate layers)."""
        first = layers[0]
        same = (first.in_features, first.group_size, first.scales_and_zeros.dtype)
        if any((x.in_features, x.group_size, x.scales_and_zeros.dtype) != same for x in layers):
            raise ValueError("only int4 layers of one input size, group size and dtype stack")
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.in_features, out.group_size = first.in_features, first.group_size
        out.out_features = sum(x.out_features for x in layers)
        out.register_buffer("weight", torch.cat([x.weight for x in layers]))
        out.register_buffer(
            "scales_and_zeros", torch.cat([x.scales_and_zeros for x in layers], dim=1)
        )
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.device.type != "cpu"
            or x.dtype != self.scales_and_zeros.dtype
            or x.dtype not in INT4_DTYPES
        ):
            raise TypeError(
                f"this Int4Linear computes {self.scales_and_zeros.dtype} on a CPU, got {x.dtype} on "
                f"{x.device.type}"
            )
        flat = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, self.in_features).contiguous(),
            self.weight,
            self.group_size,
            self.scales_and_zeros,
        )
        return flat.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4, groups of {self.group_size}"


def quantize_int4(model: nn.Module, group_size: int = 32) -> nn.Module:
    """Replace every ``nn.Linear`` of the transformer blocks whose inputs split into groups of
    ``group_size`` with an :class:`Int4Linear` computing in the layer's dtype (float32 or bfloat16), in
    place (a CPU). As :func:`quantize_int8`, the embeddings, norms and output head keep their dtype. A
    quantized model is another target: offered and measured, never a default."""

    def swap(parent: nn.Module) -> None:
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.in_features % group_size == 0:
                if child.bias is not None:
                    raise ValueError(f"{name} has a bias; LLaMA's linear layers have none")
                layer = Int4Linear.from_float(child.weight.detach(), group_size)
                setattr(parent, name, layer.to(child.weight.dtype))
            elif not isinstance(child, nn.Linear):
                swap(child)

    swap(model.layers)
    return model
