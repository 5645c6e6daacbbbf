"""Can these two models speculate together? They must share one vocabulary.

Algorithm 1 compares p(x) and q(x) for the same token id x, so the draft and the target
must mean the same thing by every id: the same vocabulary size, and, when the tokenizers
are at hand, the same tokenizer (two tokenizers of equal size can still map ids to
different pieces, and then speculation would be fast and meaningless).
"""

from __future__ import annotations

from typing import Any


class PairMismatchError(ValueError):
    """The draft cannot speculate for the target: their vocabularies or tokenizers differ."""


def check_pair(target: Any, draft: Any, target_tokenizer: Any = None, draft_tokenizer: Any = None) -> None:
    """Raise PairMismatchError unless draft and target share a vocabulary.

    Compares ``config.vocab_size`` always (a drafter's ``vocab_size``; None for a drafter
    that only proposes ids taken from the sequence, such as prompt lookup), and
    ``tokenizer.fingerprint()`` (the serialized tokenizer, see weights/tokenizer.py) when
    both tokenizers are given.
    """
    v_target = target.config.vocab_size
    v_draft = draft.config.vocab_size if hasattr(draft, "config") else draft.vocab_size
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
