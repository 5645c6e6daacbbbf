"""benchmarks/llama_cpp.py --chat gives llama.cpp the very prompts ours decodes: each held-out request rendered in the
target's chat template is, tokenized, benchmarks.drafters --chat's prompt (weights.corpus.chat_prompts)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.harness import ROOT
from benchmarks.llama_cpp import VALID, chat_requests_for
from tests.support.checkpoints import needs_smollm2, smollm2_gguf
from weights import load_tokenizer
from weights.corpus import chat_prompts


@needs_smollm2
def test_the_rendered_requests_are_the_drafters_benchmark_prompts() -> None:
    target = str(smollm2_gguf())
    tokenizer = load_tokenizer(target)
    rendered = chat_requests_for(target, 3)
    assert [tokenizer.encode_special(text) for _, text in rendered] == chat_prompts(
        [str(VALID)], tokenizer, 3, 0
    )
    request, text = rendered[0]
    # ready for the assistant's answer
    assert request in text and text.endswith("<|im_start|>assistant\n")


def test_transformers_assisted_generation_is_timed_from_the_first_new_token(tmp_path: Path) -> None:
    """--transformers: the target alone greedy and assisted by a draft model at temperature 1, each a
    process of its own that reports decode tokens/s (a failure there is one line, not a number)."""
    pytest.importorskip("transformers", reason="transformers (the peer) is in the [test] extras")
    from benchmarks.llama_cpp import transformers_chat

    args = SimpleNamespace(
        threads=1,
        transformers=ROOT / "weights" / "tiny-target",
        transformers_draft=ROOT / "weights" / "tiny-draft",
        gamma=3,
        max_new_tokens=12,
    )
    speeds = [
        transformers_chat("Once upon a time", 0, t, draft, args)
        for draft, t in ((False, 0.0), (True, 1.0))
    ]
    assert all(0 < s < 1e6 for s in speeds)
    with pytest.raises(SystemExit, match="transformers failed"):
        transformers_chat(
            "Once", 0, 0.0, True, SimpleNamespace(**{**vars(args), "transformers_draft": tmp_path})
        )


def test_ours_runs_each_dtype_and_int4_in_a_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """--dtypes: a dtype is generate.py's --dtype; int4-DTYPE adds --quantize int4 (the row compared with
    llama.cpp's Q4_1 at the same weight precision)."""
    import benchmarks.llama_cpp as bench

    seen: list[list[str]] = []
    monkeypatch.setattr(bench, "generate_speed", lambda cmd: seen.append(cmd) or 1.0)
    args = SimpleNamespace(target="t.gguf", max_new_tokens=4, threads=1, gamma=3, draft=None)
    for dtype in ("float32", "int4-bfloat16"):
        bench.ours_chat("hi", 0, 0.0, False, ("CACHE", dtype), args)

    def flag(cmd: list[str], name: str) -> str | None:
        return cmd[cmd.index(name) + 1] if name in cmd else None

    assert [(flag(c, "--dtype"), flag(c, "--quantize")) for c in seen] == [
        ("float32", None),
        ("bfloat16", "int4"),
    ]
    assert all(flag(c, "--cache-dir") == "CACHE" and "--no-draft" in c for c in seen)
