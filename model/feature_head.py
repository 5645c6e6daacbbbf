"""A one-layer network that predicts a LLaMA's next hidden state from its current one and
the next token (the architecture of EAGLE, Li et al. 2024, section 4).

Input at position j: the model's feature f_j (the final norm's output, which its output
head reads to predict token j+1) and the embedding of token j+1. One linear layer maps
[f_j; e(x_{j+1})] (2 dim) to dim, and one LLaMA decoder block with its own KV cache turns
the sequence of these into predictions of f_{j+1}. The model's own output head, applied
to a predicted feature, gives a distribution for token j+2. The embedding and the output
head are the model's and are not stored here: the head is the block and the linear layer.

This module is a network and nothing else; speculative/draft/eagle.py drafts with it.
"""

from __future__ import annotations

import torch
from torch import nn

from model.config import ModelConfig
from model.model import Block, CacheCall, CachedStack, rope_tables


class FeatureHead(CachedStack):
    """fc([feature; embedding]) -> one decoder block -> the predicted next feature. Its block
    keeps a KV cache and takes the model's one cached call (model/model.py)."""

    # What a drafter and the set-ups read of a head (speculative.draft.protocol.Head), declared here
    # because model/fast reads them and cannot import speculative/: it reads the target's final
    # features, and the target's output head and embedding table serve it.
    reads_features: bool | tuple[int, ...] = True
    draft_logits = None
    target_ids = None
    embed = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.dim, config.dim, bias=True)
        self.layers = nn.ModuleList([Block(config)])  # a list, so that names read like a LLaMA's
        self.init_cache_state()

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The head reads the target's final features as they are (EAGLE-3's fuses three: model/eagle3_head.py)."""
        return features

    def forward(
        self, features: torch.Tensor, embeddings: torch.Tensor, call: CacheCall | None = None
    ) -> torch.Tensor:
        """Predicted next features [B, T, dim] for features and next-token embeddings [B, T, dim],
        through the KV cache as ``call`` places them, or without a cache, causal (training)."""
        if call is not None:
            return self.cached((features, embeddings), call, False)
        cos, sin = rope_tables(self.config, features.shape[1], self.device, self.dtype)
        return self.layers[0](
            self.fc(torch.cat([features, embeddings], dim=-1)), cos, sin, None, None
        )

    def step(
        self,
        features: torch.Tensor,
        embeddings: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor | None,
        window: int,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """A cached call's computation, as Llama.step (``return_hidden`` is there for the common
        signature: the output is the features)."""
        x = self.fc(torch.cat([features, embeddings], dim=-1))
        return self.layers[0](x, *self.attention_inputs(positions, slots, visible, window))

    def example_inputs(self, batch: int, width: int) -> tuple[torch.Tensor, ...]:
        """Inputs of a call of ``batch`` rows and ``width`` tokens, for compiling the step."""
        shape = (batch, width, self.config.dim)  # two tensors: the graph must not assume one object
        return tuple(torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2))


def fingerprint(model: nn.Module) -> list[float]:
    """A few of a model's own weights, to tell which model a head was trained for: two heads
    of one shape fit two models of one shape equally well, so the shape is not enough.

    The first 8 weights of the final norm and the first 4 of the first 2 embedding rows,
    as floats; they survive a change of dtype to within bfloat16's rounding, which is how
    :func:`same_fingerprint` compares them."""
    values = torch.cat(
        [
            model.norm.weight.detach()[:8].flatten(),
            model.embed_tokens.weight.detach()[:2, :4].flatten(),
        ]
    )
    return [float(v) for v in values.float().cpu()]


def same_fingerprint(a: list[float], b: list[float]) -> bool:
    """Equal up to bfloat16 rounding (relative 1e-2, absolute 1e-3)."""
    return len(a) == len(b) and all(abs(x - y) <= 1e-3 + 1e-2 * abs(y) for x, y in zip(a, b))
