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
            raise ValueError(f"need one scale per output row: weight {list(weight.shape)}, scale {list(scale.shape)}")
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Int8Linear:
        """Quantize a float [out, in] weight matrix."""
        return cls(*quantize_weight(weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
