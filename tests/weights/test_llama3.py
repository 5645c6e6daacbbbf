"""A Llama-3 checkpoint as published (issue: today's models as they are): small random models with
Llama-3.1-8B-Instruct's real tokenizer.json, tokenizer_config.json (its chat template inside),
generation_config.json and config.json fields (the list of three end ids, llama3 rope scaling),
checked against transformers on the same folder: token ids, the rendered template, greedy tokens
and where a run stops; then the same through an EAGLE-3 head in both published layouts.

Two models: ``random`` (every weight random) and ``stopper``, whose blocks add nothing (their output
projections are zero) and whose embedding and head make greedy decoding a chain that is certain to
emit <|eot_id|> (128009), the end of a turn, which only the lists of end ids name: a runtime that
keeps the first id of config.json's list (128001) runs past it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from model import Llama, ModelConfig
from speculative.serving.text import encode_prompt
from tests.support.checkpoints import llama31_folder, transformers_tokenizer
from tests.support.cli import cli
from tests.support.hf import randomize_
from tests.support.toy_models import random_eagle3_head
from weights import load_model, load_tokenizer, read_pair
from weights.checkpoint import hf_name
from weights.eagle3 import save_eagle3_head

EOT, END_OF_TEXT = 128009, 128001
TEXTS = [
    "Hello world",
    " leading space",
    "The year 2024 had 366 days; 1234567 is a number.",
    "Café naïve 東京 🙂 ünïcödé",
    "def f(x):\n    return x ** 2  # square\n\n\n",
    "<|eot_id|> inside text",
    "Hello , world . I 'm here and you 're not",
    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
]


def write_weights(folder: Path, model: Llama) -> Path:
    save_file(
        {hf_name(n): p.detach().contiguous() for n, p in model.named_parameters()},
        folder / "model.safetensors",
        metadata={"format": "pt"},
    )
    return folder


@pytest.fixture(scope="module")
def random_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = llama31_folder(tmp_path_factory.mktemp("llama3") / "Llama-3.1-tiny-Instruct")
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    with torch.no_grad():
        return write_weights(folder, randomize_(Llama(config), seed=0))


def chain_ids(folder: Path) -> tuple[list[int], list[int]]:
    """The chat prompt's ids and the answer the stopper model gives: " Paris." then <|eot_id|>."""
    tokenizer = load_tokenizer(folder)
    prompt = encode_prompt(tokenizer, "What is the capital of France?", chat=True)
    return prompt, tokenizer.encode(" Paris.", bos=False) + [EOT]


@pytest.fixture(scope="module")
def stopper_folder(tmp_path_factory: pytest.TempPathFactory, random_folder: Path) -> Path:
    folder = llama31_folder(tmp_path_factory.mktemp("llama3") / "Llama-3.1-stopper-Instruct")
    model = load_model(random_folder)
    prompt, answer = chain_ids(folder)
    with torch.no_grad():
        # every block adds nothing: the last hidden state is the token's embedding
        for layer in model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.norm.weight.fill_(1.0)
        chain = [prompt[-1], *answer]
        for i, (token, following) in enumerate(zip(chain, chain[1:])):
            model.embed_tokens.weight[token] = 0.0
            model.embed_tokens.weight[token, i] = 1.0  # a direction of its own
            model.lm_head.weight[following] = 0.0
            model.lm_head.weight[following, i] = 10.0  # which only the next token's row reads
    return write_weights(folder, model)


@pytest.mark.parametrize("text", TEXTS)
def test_token_ids_and_text_equal_transformers(random_folder: Path, text: str) -> None:
    ours, theirs = load_tokenizer(random_folder), transformers_tokenizer(random_folder)
    assert ours.kind == "tokenizer.json" and ours.bos_id == 128000 and ours.eos_id == EOT
    expected = theirs(text)["input_ids"]
    assert expected[0] == 128000  # its post-processor's BOS
    assert ours.encode(text) == expected
    assert ours.encode(text, bos=False) == theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(expected) == theirs.decode(expected, skip_special_tokens=True)


def test_the_pair_reads_every_end_id_and_the_sampling_defaults(random_folder: Path) -> None:
    spec = read_pair(random_folder)
    assert spec.stop_ids == (END_OF_TEXT, 128008, EOT)
    assert spec.sampling_defaults == {"temperature": 0.6, "top_p": 0.9}
    assert spec.target_config.rope_scaling["rope_type"] == "llama3" and spec.notes == []


def transformers_greedy(folder: Path, prompt: list[int], count: int) -> list[int]:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), torch_dtype=torch.float32
    ).eval()
    with torch.no_grad():  # its generation_config.json gives the end ids, as it does ours
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=count,
            do_sample=False,
            top_p=None,
            temperature=None,
            pad_token_id=END_OF_TEXT,
        )
    return out[0, len(prompt) :].tolist()


def test_greedy_tokens_equal_transformers_on_a_random_model(random_folder: Path) -> None:
    tokenizer = load_tokenizer(random_folder)
    # float32 as transformers runs here: the folder is stored in bfloat16, as Llama-3's are, which a CPU that
    # computes bfloat16 natively runs in bfloat16 by default (another target)
    out = cli(
        "--target",
        str(random_folder),
        "--no-draft",
        "--prompt",
        "The capital of France is",
        "--max-new-tokens",
        "12",
        "--json",
        "--dtype",
        "float32",
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["tokens"] == transformers_greedy(
        random_folder, tokenizer.encode("The capital of France is"), 12
    )
    # --json: no notes
    assert "generation_config.json suggests --temperature 0.6, --top-p 0.9" not in out.stderr
    out = cli("--target", str(random_folder), "--no-draft", "--max-new-tokens", "2")
    assert (
        "note: " in out.stderr
        and "generation_config.json suggests --temperature 0.6, --top-p 0.9" in out.stderr
    )


def test_a_chat_stops_at_the_end_of_its_turn_as_transformers_does(stopper_folder: Path) -> None:
    prompt, answer = chain_ids(stopper_folder)
    assert transformers_greedy(stopper_folder, prompt, 10) == answer
    out = cli(
        "--target",
        str(stopper_folder),
        "--no-draft",
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-new-tokens",
        "10",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["prompt_tokens"] == len(prompt) and doc["tokens"] == answer
    assert (doc["stats"]["stop_reason"], doc["stats"]["stop_token"]) == ("eos", EOT)
    assert doc["text"] == " Paris."  # the end of the turn is markup, not text


@pytest.mark.parametrize("layout", ["speculators", "official"])
def test_an_eagle3_head_in_either_layout_speculates_for_it_end_to_end(
    tmp_path: Path, stopper_folder: Path, layout: str
) -> None:
    """A head of Llama-3's vocabulary reduced to 32,000 ids, as the published heads are, found from its
    folder alone; greedy speculation gives the target's own tokens and stops at <|eot_id|>."""
    target = load_model(stopper_folder)
    prompt, answer = chain_ids(stopper_folder)
    kept = sorted(set(range(32000 - len(answer))) | set(answer))
    head = random_eagle3_head(target, drop=sorted(set(range(target.config.vocab_size)) - set(kept)))
    save_eagle3_head(
        head, tmp_path / "head", target, target_name=str(stopper_folder), layout=layout
    )
    out = cli(
        "--target",
        str(stopper_folder),
        "--draft",
        str(tmp_path / "head"),
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-new-tokens",
        "10",
        "--gamma",
        "3",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["tokens"] == answer and doc["stats"]["stop_token"] == EOT
    assert doc["settings"]["draft"] == str(tmp_path / "head")


def test_streamed_byte_level_text_never_holds_half_a_character(random_folder: Path) -> None:
    """A byte-level BPE token may end inside a character (🙂 is four bytes over several tokens): the
    stream hands out nothing until the character is whole, and the pieces add up to the text."""
    import io

    from speculative.cli import output
    from speculative.serving.text import TextStream

    tokenizer = load_tokenizer(random_folder)
    prompt = tokenizer.encode("Once upon a time")
    new = tokenizer.encode(" the café said 🙂🙂 and 東京 smiled.<|eot_id|>", bos=False)
    # some tokens are parts of a character
    assert any("\ufffd" in tokenizer.decode([t]) for t in new)
    stream = TextStream(tokenizer, prompt)
    pieces = [stream.add(token) for token in new]
    assert not any("\ufffd" in piece for piece in pieces) and "" in pieces
    assert "".join(pieces) + stream.finish() == " the café said 🙂🙂 and 東京 smiled."
    printed = io.StringIO()
    streamer = output.Streamer(tokenizer, prompt, printed, color=False)
    for token in new:
        streamer([token], [False])
        assert "\ufffd" not in printed.getvalue()
    streamer.finish()
    assert printed.getvalue().endswith(" the café said 🙂🙂 and 東京 smiled.\n")
