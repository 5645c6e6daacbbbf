"""Checking the arguments of a generation call before any model runs (the prompt, gamma, the
pair of models: :func:`check_pair`), and the one thing the loops check of a model's output:
that its logits are numbers."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from typing import Any

import torch

GAMMA_MAX = 16  # the most tokens gamma="auto" drafts per iteration


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def check_prompt(
    prompt_ids: Sequence[int] | torch.Tensor, vocab_size: int, max_seq_len: int
) -> list[int]:
    """The prompt as a list of ints; ValueError if it is empty, holds ids outside the
    vocabulary, or is longer than max_seq_len."""
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1:
            prompt_ids = prompt_ids[0]
        if prompt_ids.dim() != 1 or prompt_ids.is_floating_point() or prompt_ids.is_complex():
            raise ValueError(
                f"prompt_ids must be a 1-D integer tensor (or [1, T]), got shape "
                f"{tuple(prompt_ids.shape)} and dtype {prompt_ids.dtype}"
            )
        prompt = prompt_ids.tolist()
    else:
        prompt = list(prompt_ids)
        if not all(_is_int(t) for t in prompt):
            raise ValueError("prompt_ids must be integers (token ids)")
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token id (e.g. BOS)")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise ValueError(
            f"prompt ids must lie in [0, {vocab_size}), got min {min(prompt)}, max {max(prompt)}"
        )
    if len(prompt) > max_seq_len:
        raise ValueError(
            f"the prompt has {len(prompt)} tokens, more than max_seq_len {max_seq_len}"
        )
    return [int(t) for t in prompt]


def check_stop_ids(eos_id: Any) -> frozenset[int]:
    """The ids that end a row, from None, one id, or several (Llama-3.1-Instruct's config lists
    three: the end of the text, of a tool call and of a turn): ValueError for anything but
    non-negative ints."""
    if eos_id is None:
        return frozenset()
    ids = [eos_id]
    if not _is_int(eos_id) and isinstance(eos_id, (Sequence, set, frozenset)):
        ids = list(eos_id)
    if isinstance(eos_id, (str, bytes)) or not all(_is_int(i) and i >= 0 for i in ids):
        raise ValueError(
            f"eos_id must be a token id >= 0, several of them, or None; got {eos_id!r}"
        )
    return frozenset(int(i) for i in ids)


def check_max_new_tokens(max_new_tokens: Any) -> None:
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")


def check_seed(seed: Any) -> None:
    if seed is not None and not _is_int(seed):
        raise ValueError(f"seed must be an integer or None, got {seed!r}")


def check_gamma(gamma: Any) -> int:
    """Validate gamma (an int >= 1 or "auto") and return the most tokens one iteration may draft."""
    if gamma == "auto":
        return GAMMA_MAX
    if not _is_int(gamma) or gamma < 1:
        raise ValueError(f'gamma must be an integer >= 1 or "auto", got {gamma!r}')
    return int(gamma)


def model_device(model: Any) -> torch.device:
    """Where a model's inputs go: the device of its first parameter or buffer (CPU for a
    model without any). Its logits, and so every probability, live there too."""
    if isinstance(model, torch.nn.Module):
        for tensor in model.parameters():
            return tensor.device
        for tensor in model.buffers():
            return tensor.device
    return torch.device("cpu")


class NonFiniteLogitsError(ValueError):
    """A model returned inf or NaN logits: its weights or its arithmetic are broken, and any
    token drawn from them would be meaningless."""

    def __init__(
        self,
        message: str = "the target returned non-finite logits (inf or NaN): its weights are "
        "corrupted or the dtype overflows; no tokens were produced from them",
    ) -> None:
        super().__init__(message)


def finite_flag(logits: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor on the logits' device: every row of ``logits`` is usable (see
    check_finite). Loops that fold the host read into another copy, or defer it, use this."""
    return torch.isfinite(logits.amax(-1)).all()


def usable_logits(logits: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """``logits`` [..., V] where ``finite`` holds, else zeros (a uniform draw): for a loop that
    samples before it reads the flag, so that no sampling kernel meets a NaN (CUDA's
    multinomial would stop the device); the flag's read then raises. ``finite``: one flag for
    all (finite_flag), or one per row of logits (finite_rows)."""
    keep = finite
    if finite.dim():  # one flag per row: the same for each of the row's V logits
        keep = finite.unsqueeze(-1)
    return torch.where(keep, logits, logits.new_zeros(()))


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """One flag per row of logits [N, V]: the row is usable (see check_finite)."""
    return torch.isfinite(logits.amax(-1))


def read_host(parts: Sequence[torch.Tensor], finite: torch.Tensor | None = None) -> list[list]:
    """Several 1-d tensors of one device in ONE device -> host copy: each part's values as a
    list (ints for an integer or bool part). ``finite`` (a finite_flag) rides in the same copy,
    and NonFiniteLogitsError is raised when it is False: this is how the verifiers check the
    target's logits without a read of their own. Mixed parts travel as float64, which holds
    every token id and probability exactly."""
    floating = any(part.is_floating_point() for part in parts)
    dtype = torch.float64 if floating else torch.long
    device = parts[0].device if parts else finite.device
    flat = [part.reshape(-1).to(device=device, dtype=dtype) for part in parts]
    if finite is not None:
        flat.append(finite.reshape(1).to(device=device, dtype=dtype))
    host = torch.cat(flat).tolist() if flat else []
    if finite is not None and not host.pop():
        raise NonFiniteLogitsError()
    out = []
    at = 0  # where this part's values start in host
    for part in parts:
        values = host[at : at + part.numel()]
        at += part.numel()
        out.append(values if part.is_floating_point() else [int(v) for v in values])
    return out


def check_finite(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` [..., V] unchanged, or NonFiniteLogitsError if a row holds NaN or +inf, or
    holds nothing but -inf. A -inf logit on its own is legitimate: a token of probability 0
    (a masked vocabulary, the toy models of the tests).

    The test is the row maximum: it is NaN if any entry is NaN (amax propagates NaN), +inf
    if any is +inf, and -inf only if all are. The loops call this once per target call, on
    the rows they are about to use: one reduction and one host read, microseconds next to a
    forward (benchmarks/benchmark.py prints the cost). It is what stands between a corrupted
    model and a stream of token 0 (the greedy argmax of NaN rows) or an out-of-range id
    (sampling them)."""
    if not bool(finite_flag(logits)):
        raise NonFiniteLogitsError()
    return logits


# ----------------------------------------------------------------------------- the pair
# Algorithm 1 compares p(x) and q(x) for the same token id x, so the draft and the target must
# mean the same thing by every id: the same vocabulary size and, when the tokenizers are at
# hand, the same tokenizer (two tokenizers of equal size can still map ids to different pieces,
# and then speculation would be fast and meaningless).
class PairMismatchError(ValueError):
    """The draft cannot speculate for the target: their vocabularies or tokenizers differ."""


def check_pair(
    target: Any, draft: Any, target_tokenizer: Any = None, draft_tokenizer: Any = None
) -> None:
    """Raise PairMismatchError unless draft and target share a vocabulary.

    Compares ``config.vocab_size`` always (a drafter's ``vocab_size``; None for a drafter
    that only proposes ids taken from the sequence, such as prompt lookup), and
    ``tokenizer.fingerprint()`` (the serialized tokenizer, see weights/tokenizer.py) when
    both tokenizers are given.
    """
    v_target = target.config.vocab_size
    # A model has a config; a drafter declares its vocab_size, None when it has none (the default of
    # speculative.draft.protocol.DEFAULTS, read here as it is: this module lies below the drafters).
    config = getattr(draft, "config", None)
    v_draft = config.vocab_size if config is not None else getattr(draft, "vocab_size", None)
    if v_draft is not None and v_target != v_draft:
        raise PairMismatchError(
            f"the draft's vocabulary has {v_draft} tokens but the target's has {v_target}: "
            "speculative decoding needs both models to share one vocabulary"
        )
    if target_tokenizer is not None and draft_tokenizer is not None:
        if target_tokenizer.fingerprint() != draft_tokenizer.fingerprint():
            raise PairMismatchError(
                "the draft and the target use different tokenizers (their serialized models differ): "
                "token ids would not mean the same pieces"
            )
