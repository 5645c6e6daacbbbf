"""Stack the projections that read the same input into one layer: fewer operators per decode step.

Why this exists. Every operator PyTorch runs has a fixed cost (a few microseconds on a
CPU, a kernel launch on a GPU, and on a CPU with prepacked weights oneDNN's own set-up per
call). q, k and v are three products of the same normalised input, and so are gate and up
in the MLP: stacking their weights makes two products out of five per layer, and the
rotary embedding then turns the query and key heads in one go (what it saves per step:
``python -m benchmarks.widths --subject pair``). Checkpoints keep the Hugging Face layout; this is done
after loading, for inference, like model/fast/prepack.py, by giving each stacked module a
class of its own (:func:`in_front`), so that model/model.py knows nothing of it.

The stacked product computes the same dot products as the separate ones; only the
blocking of the matrix product may change, so results agree to float rounding.
"""

from __future__ import annotations

import torch
from torch import nn

from model.fast.prepack import PrepackedLinear, prepack_linears
from model.model import MLP, Attention, apply_rope


def _stacks_itself(*layers: nn.Module | None) -> bool:
    """Layers of one class that stacks its own kind: a ``stacked(layers)`` classmethod that builds
    one layer whose outputs are theirs in order, or raises ValueError (model/scale/quantize.py's
    Int4Linear, whose packed codes this module cannot read)."""
    kind = type(layers[0])
    return all(type(layer) is kind for layer in layers) and callable(getattr(kind, "stacked", None))


def _plain(*layers: nn.Module | None) -> bool:
    """Plain bias-free nn.Linear layers on one device and dtype (not int8, not prepacked,
    not an all-reducing tensor-parallel layer)."""
    if any(type(layer) is not nn.Linear or layer.bias is not None for layer in layers):
        return False
    weights = [layer.weight for layer in layers]
    return all(w.device == weights[0].device and w.dtype == weights[0].dtype for w in weights)


def _stacked(*layers: nn.Module) -> nn.Module:
    weight = torch.cat([layer.weight.detach() for layer in layers])
    stacked = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    stacked.weight = nn.Parameter(weight, requires_grad=False)
    return stacked


def stack(*layers: nn.Module | None) -> nn.Module | None:
    """One layer whose outputs are ``layers``' outputs in order, or None where they do not stack."""
    if _plain(*layers):
        return _stacked(*layers)
    if _stacks_itself(*layers):
        try:  # a class that refuses these layers (other group sizes, dtypes) leaves them apart
            return type(layers[0]).stacked(layers)
        except ValueError:
            return None
    return None


class StackedAttention:
    """Put in front of an attention class (:func:`in_front`): q, k and v from one product, and one
    rotation for the query and key heads together."""

    @property
    def local_kv_heads(self) -> int:
        return self.qkv_heads[1]

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        batch, seq, _ = x.shape
        n_q, n_kv = self.qkv_heads
        qkv = self.qkv_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        qk = apply_rope(qkv[:, : n_q + n_kv], cos, sin)
        return qk[:, :n_q], qk[:, n_q:], qkv[:, n_q + n_kv :]


class StackedMLP:
    """Put in front of an MLP class (:func:`in_front`): gate and up from one product."""

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up_proj(x).chunk(2, dim=-1)


_CLASSES: dict[tuple[type, type], type] = {}


def in_front(module: nn.Module, front: type, prefix: str) -> None:
    """Make ``module`` an instance of ``front`` put in front of its own class (named prefix + its
    class's name): how a fast path changes a built module from outside. A tensor-parallel layer
    stays one: its forward still wraps what ``front`` overrides."""
    cls = type(module)
    if (front, cls) not in _CLASSES:
        _CLASSES[front, cls] = type(f"{prefix}{cls.__name__}", (front, cls), {})
    module.__class__ = _CLASSES[front, cls]


def fuse_projections(model: nn.Module) -> int:
    """Replace q/k/v_proj by one ``qkv_proj`` and gate/up_proj by one ``gate_up_proj`` in
    every attention and MLP of ``model`` whose layers stack (plain nn.Linear, or a class that
    stacks its own kind), in place; returns how many groups were fused.

    For inference only: the fused model is not saved by weights.save_model (its parameter
    names are no longer the checkpoint's) and the originals are dropped, so memory does
    not grow. Call it before model/fast/prepack.py, which then packs the stacked weights.
    """
    fused = 0
    for module in list(model.modules()):  # a list: the loop adds modules
        if isinstance(module, Attention) and not isinstance(module, StackedAttention):
            qkv = stack(module.q_proj, module.k_proj, module.v_proj)
            if qkv is None:
                continue
            module.qkv_heads = (
                module.q_proj.out_features // module.head_dim,
                module.k_proj.out_features // module.head_dim,
            )
            module.qkv_proj = qkv
            module.q_proj = module.k_proj = module.v_proj = None
            in_front(module, StackedAttention, "Stacked")
            fused += 1
        elif isinstance(module, MLP) and not isinstance(module, StackedMLP):
            gate_up = stack(module.gate_proj, module.up_proj)
            if gate_up is None:
                continue
            module.gate_up_proj = gate_up
            module.gate_proj = module.up_proj = None
            in_front(module, StackedMLP, "Stacked")
            fused += 1
    return fused


def prepare_for_decoding(
    model: nn.Module, stack: bool = True, prepack: bool = True
) -> tuple[int, int]:
    """The decoding set-up of generate.py and the benchmarks, in the order it needs: stack
    the projections, then prepack (model/fast/prepack.py), which then packs the stacked weights.
    Either step can be turned off; returns (groups stacked, layers prepacked)."""
    stacked = fuse_projections(model) if stack else 0
    return stacked, prepack_linears(model) if prepack else 0


def prepared(model: nn.Module) -> tuple[int, int]:
    """What a model's set-up holds: (projection groups stacked, layers prepacked)."""
    count = sum(isinstance(m, (StackedAttention, StackedMLP)) for m in model.modules())
    return count, sum(isinstance(m, PrepackedLinear) for m in model.modules())
