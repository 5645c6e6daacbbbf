"""The EAGLE-3 head (Li et al. 2025, arXiv 2503.01840): one decoder block that drafts from a
LLaMA's hidden states at three of its layers, with an output layer of its own over a
reduced vocabulary.

What it reads at position j, for the token after next (x_{j+2}):

* the target's *fused* feature: the inputs of three of its layers (low, middle and high;
  2, N/2 and N-3 by default), concatenated [3 * target dim] and projected by ``fc`` to the
  head's width, or, while drafting ahead, the head's own previous output in their place;
* the embedding of the next token x_{j+1} (the target's embedding table, not stored here).

The block normalises the two apart, concatenates them, [norm(embedding); norm(feature)], and
attends from that 2 * dim vector (its q, k and v projections are twice as wide); the
residual stream starts from the feature. Its output h is what it feeds back for the next
position; ``lm_head(norm(h))`` gives logits over the draft vocabulary, whose id i is the
target's id ``i + d2t[i]`` (``t2d[v]`` says whether target id v has a draft id). Names
follow the ``speculators`` layout (``layers.0.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``,
``t2d``), so that its files map one to one onto this module.

A network and nothing else: speculative/draft/eagle.py drafts with it, and the cached call
is the model's one (model/model.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from model.config import ModelConfig
from model.model import Block, CacheCall, CachedStack, RMSNorm, rope_tables


def default_layers(n_layers: int) -> tuple[int, int, int]:
    """The target layers whose inputs EAGLE-3 fuses by default (the official code's and vLLM's
    choice): an early one, the middle one and one near the end."""
    return (min(2, n_layers - 1), n_layers // 2, max(n_layers - 3, 0))


class Eagle3Block(Block):
    """A LLaMA block whose attention reads [norm(embedding); norm(feature)] (2 * dim wide)."""

    def __init__(self, config: ModelConfig, norm_before_residual: bool = False) -> None:
        super().__init__(config)
        self.hidden_norm = RMSNorm(config.dim, config.norm_eps)
        self.norm_before_residual = norm_before_residual
        attn = self.self_attn
        for name, heads in (
            ("q_proj", config.n_heads),
            ("k_proj", config.n_kv_heads),
            ("v_proj", config.n_kv_heads),
        ):
            setattr(attn, name, nn.Linear(2 * config.dim, heads * config.head_dim, bias=False))

    def inputs(
        self, embeddings: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What attention reads, and the residual stream it adds to."""
        normed = self.hidden_norm(hidden)
        both = torch.cat([self.input_layernorm(embeddings), normed], dim=-1)
        return both, normed if self.norm_before_residual else hidden

    def finish(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The residual add and the MLP after attention."""
        x = residual + attended
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(
        self,
        embeddings: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        write: tuple | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:  # type: ignore[override]
        both, residual = self.inputs(embeddings, hidden)
        return self.finish(residual, self.self_attn(both, cos, sin, write, mask))


class Eagle3Head(CachedStack):
    """fc (3 target features -> dim), one :class:`Eagle3Block` with a KV cache, norm and an
    output layer over ``draft_vocab`` ids. ``target_layers``: the target layers whose inputs
    it reads; ``target_dim``: the target's width (the head's own, ``config.dim``, is the same
    in every published head, since it adds the target's embeddings)."""

    # The target's embedding table serves it (speculative.draft.protocol.Head: P-EAGLE's has its own).
    embed = None

    def __init__(
        self,
        config: ModelConfig,
        target_layers: Sequence[int],
        draft_vocab: int | None = None,
        norm_before_residual: bool = False,
    ) -> None:
        super().__init__()
        self.config = config
        self.target_layers = tuple(int(i) for i in target_layers)
        self.draft_vocab = config.vocab_size if draft_vocab is None else int(draft_vocab)
        self.fc = nn.Linear(len(self.target_layers) * config.dim, config.dim, bias=False)
        self.layers = nn.ModuleList([Eagle3Block(config, norm_before_residual)])
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, self.draft_vocab, bias=False)
        # draft id i is target id i + d2t[i]; t2d[v]: target id v has a draft id (identity by default)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab, dtype=torch.long))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: self.draft_vocab] = True
        self.register_buffer("t2d", t2d)
        self.init_cache_state()

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def reads_features(self) -> tuple[int, ...]:
        """What the target's calls return for it (Llama's return_hidden): the inputs of its target layers."""
        return self.target_layers

    def set_vocabulary(self, target_ids: torch.Tensor) -> None:
        """The draft vocabulary: draft id i is target id ``target_ids[i]`` (ascending, distinct)."""
        target_ids = target_ids.to(torch.long).cpu()
        if target_ids.shape != (self.draft_vocab,) or bool((target_ids.diff() <= 0).any()):
            raise ValueError(
                f"a draft vocabulary is {self.draft_vocab} ascending distinct target ids"
            )
        self.d2t.copy_(target_ids - torch.arange(self.draft_vocab))
        self.t2d.zero_()
        self.t2d[target_ids] = True

    def target_ids(self) -> torch.Tensor:
        """Target id of each draft id [draft_vocab]."""
        return torch.arange(self.draft_vocab, device=self.d2t.device) + self.d2t

    def project(self, fused: torch.Tensor) -> torch.Tensor:
        """The target's fused features [..., 3 * dim] -> the head's input features [..., dim]."""
        return self.fc(fused)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary for the head's outputs."""
        return self.lm_head(self.norm(hidden))

    def forward(
        self, features: torch.Tensor, embeddings: torch.Tensor, call: CacheCall | None = None
    ) -> torch.Tensor:
        """Outputs [B, T, dim] for projected features (or the head's own outputs) and next-token
        embeddings [B, T, dim], through the KV cache as ``call`` places them, or causal without one."""
        if call is not None:
            return self.cached((features, embeddings), call, False)
        cos, sin = rope_tables(self.config, features.shape[1], self.device, self.dtype)
        return self.layers[0](embeddings, features, cos, sin, None, None)

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
        """A cached call's computation, as Llama.step."""
        return self.layers[0](
            embeddings, features, *self.attention_inputs(positions, slots, visible, window)
        )

    def example_inputs(self, batch: int, width: int) -> tuple[torch.Tensor, ...]:
        """Inputs of a call of ``batch`` rows and ``width`` tokens, for compiling the step."""
        shape = (batch, width, self.config.dim)
        return tuple(torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2))


class PEagleHead(Eagle3Head):
    """P-EAGLE (parallel EAGLE, vLLM's ``speculators`` "peagle"): an EAGLE-3 head taught to draft a
    whole block in one call. The positions after the sequence have no feature and no token
    yet; they read a learned feature (``mask_hidden``, at the fused width, through ``fc`` like a
    target's) and the embedding of a mask id (``mask_embedding``, also what that id reads where it
    occurs in the text). ``embed_tokens``: a table of the head's own when its files bring one
    that differs from the target's (P-EAGLE trains its embeddings), else None (the target's)."""

    def __init__(
        self,
        config: ModelConfig,
        target_layers: Sequence[int],
        draft_vocab: int | None = None,
        norm_before_residual: bool = False,
        mask_token_id: int = 0,
    ) -> None:
        super().__init__(config, target_layers, draft_vocab, norm_before_residual)
        self.mask_token_id = int(mask_token_id)
        self.mask_hidden = nn.Parameter(torch.zeros(len(self.target_layers) * config.dim))
        self.mask_embedding = nn.Parameter(torch.zeros(config.dim))
        self.embed_tokens: nn.Embedding | None = None

    def embed(self, ids: torch.Tensor, target_embeddings: nn.Embedding) -> torch.Tensor:
        """Token embeddings as the head reads them: its own table or the target's, and the mask
        embedding for the mask id itself (it is that id's row in a P-EAGLE file)."""
        table = self.embed_tokens if self.embed_tokens is not None else target_embeddings
        return torch.where(
            (ids == self.mask_token_id).unsqueeze(-1), self.mask_embedding, table(ids)
        )

    def mask_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A mask position's feature (projected) and embedding, [dim] each."""
        return self.project(self.mask_hidden), self.mask_embedding
