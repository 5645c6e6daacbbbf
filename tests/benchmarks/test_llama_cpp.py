"""benchmarks/llama_cpp.py --chat gives llama.cpp the very prompts ours decodes: each held-out request rendered in the
target's chat template is, tokenized, benchmarks.drafters --chat's prompt (weights.corpus.chat_prompts)."""

from __future__ import annotations

from benchmarks.llama_cpp import VALID, chat_requests_for
from tests.support.checkpoints import needs_smollm2, smollm2_gguf
from weights import load_tokenizer
from weights.corpus import chat_prompts


@needs_smollm2
def test_the_rendered_requests_are_the_drafters_benchmark_prompts() -> None:
    target = str(smollm2_gguf())
    tokenizer = load_tokenizer(target)
    rendered = chat_requests_for(target, 3)
    assert [tokenizer.encode_special(text) for _, text in rendered] == chat_prompts([str(VALID)], tokenizer, 3, 0)
    request, text = rendered[0]
    assert request in text and text.endswith("<|im_start|>assistant\n")  # ready for the assistant's answer
