"""Chat templates (weights/chat.py) rendered and encoded as transformers' apply_chat_template does,
on the real templates of Llama-3.1, Llama-3.2, SmolLM2, Llama-2-chat and TinyLlama-chat
(tests/data/chat_templates, sources in tests/data/SOURCES.md), and the rules a template is rendered
under: the sandbox, raise_exception, tojson, strftime_now, no double BOS."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from speculative.serving.text import LLAMA2_CHAT, NoChatTemplateError, encode_dialog, encode_prompt
from tests.support.checkpoints import (
    FAMILY,
    TEMPLATES,
    chat_ids,
    template_folder,
    transformers_tokenizer,
)
from tests.support.paths import TARGET
from weights import CheckpointError, load_tokenizer
from weights.chat import ChatTemplate, ChatTemplateError

CONVERSATIONS = {
    "one user turn": [{"role": "user", "content": "What is the capital of France?"}],
    "system and user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colours."},
    ],
    "answered turns": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Tell me a joke about cats."},
    ],
    "system and answered turns": [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Good morning"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "And good night?"},
    ],
    "unicode and spacing": [
        {"role": "user", "content": "  Café, naïve, 東京, 🙂 — and\ttabs\n\nnew lines  "}
    ],
}


def names_with_templates() -> list[str]:
    return [name for name in FAMILY if (TEMPLATES / f"{name}.jinja").is_file()]


@pytest.fixture(scope="module", params=names_with_templates())
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return template_folder(request.param, tmp_path_factory.mktemp(request.param))


def test_all_five_real_templates_are_kept() -> None:
    assert names_with_templates() == list(FAMILY)


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_ids_equal_transformers_apply_chat_template(folder: Path, conversation: str) -> None:
    messages = CONVERSATIONS[conversation]
    ours = load_tokenizer(folder)
    theirs = transformers_tokenizer(folder)
    rendered = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if ours.kind == "sentencepiece":
        assert ours.chat.render(messages) == rendered
        # runs of spaces: transformers' converted Llama tokenizer
        if conversation == "unicode and spacing":
            pytest.skip(
                "differs from SentencePiece itself there (tests/weights/test_tokenizer.py: ours is "
                "SentencePiece's, as Meta's reference is); the rendered text is equal"
            )
    else:
        assert ours.chat.render(messages) == rendered
    got = encode_dialog(ours, [(m["role"], m["content"]) for m in messages])
    assert got == chat_ids(theirs, messages)
    bos = ours.bos_id
    if bos is not None and got[:1] == [bos]:
        assert got[1:2] != [bos]  # the template writes its BOS; none is added in front


def test_generate_and_the_server_use_the_template(folder: Path) -> None:
    """--chat's one user turn, with and without --system, is the template's conversation."""
    ours = load_tokenizer(folder)
    theirs = transformers_tokenizer(folder)
    assert encode_prompt(ours, "Hello there", chat=True) == chat_ids(
        theirs, [{"role": "user", "content": "Hello there"}]
    )
    with_system = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
    ]
    assert encode_prompt(ours, "Hello there", chat=True, system="Be brief.") == chat_ids(
        theirs, with_system
    )


def test_a_llama2_chat_model_without_a_template_gets_llama2_s_format(tmp_path: Path) -> None:
    """A SentencePiece checkpoint marked for chat (its name) with no template: Meta's reference format
    (each turn encoded as text, so "[INST]" after BOS is "▁[", where the published template's ids have "["
    after its written-out "<s>"); the same folder with the template renders it."""
    folder = template_folder("Llama-2-7b-chat-hf", tmp_path / "Llama-2-7b-chat-hf")
    templated = load_tokenizer(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    bare = load_tokenizer(folder)
    assert bare.chat is LLAMA2_CHAT and templated.chat is not LLAMA2_CHAT
    turns = [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye")]
    assert encode_dialog(bare, turns) == bare.encode(
        "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! ", eos=True
    ) + bare.encode("[INST] Bye [/INST]")
    first = encode_dialog(templated, turns)
    assert first[:2] == [1, bare.token_id("[")] and encode_dialog(bare, turns)[:2] == [
        1,
        bare.token_id("▁["),
    ]


def test_a_base_model_without_a_template_is_refused_in_one_line() -> None:
    tokenizer = load_tokenizer(TARGET)
    assert tokenizer.chat is None
    with pytest.raises(NoChatTemplateError, match="has no chat template") as error:
        encode_dialog(tokenizer, [("user", "Hi")])
    assert "\n" not in str(error.value)


def test_the_template_file_beside_the_config_comes_first(tmp_path: Path) -> None:
    folder = template_folder("Llama-3.1-8B-Instruct", tmp_path / "llama")
    (folder / "chat_template.jinja").write_text(
        "{{ bos_token }}Q: {{ messages[-1]['content'] }}\nA:"
    )
    tokenizer = load_tokenizer(folder)
    ids = encode_dialog(tokenizer, [("user", "two plus two?")])
    assert ids == [128000] + tokenizer.encode_special("Q: two plus two?\nA:")


def template(source: str) -> ChatTemplate:
    return ChatTemplate(source, {"bos_token": "<s>", "eos_token": "</s>"}, "test template")


def test_raise_exception_tojson_strftime_and_whitespace_control() -> None:
    refusing = template(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('users speak first') }}{% endif %}ok"
    )
    with pytest.raises(ChatTemplateError, match="^users speak first$"):
        refusing.render([{"role": "assistant", "content": "hi"}])
    assert refusing.render([{"role": "user", "content": "hi"}]) == "ok"
    assert (
        template("{{ messages | tojson }}").render([{"role": "user", "content": 'é"'}])
        == '[{"role": "user", "content": "é\\""}]'
    )
    assert (
        template('{{ {"b": 1, "a": [1, 2]} | tojson(indent=2) }}').render([])
        == '{\n  "b": 1,\n  "a": [\n    1,\n    2\n  ]\n}'
    )
    assert template("{{ strftime_now('%Y') }}").render([]) == str(datetime.now().year)
    # trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before one
    assert (
        template(
            "{% for m in messages %}\n    {% if true %}\n[{{ m['content'] }}]\n    {% endif %}\n"
            "{% endfor %}"
        ).render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
        == "[a]\n[b]\n"
    )
    assert (
        template(
            "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m['content'] }}"
            "{% endfor %}"
        ).render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
        == "a"
    )
    assert (
        template("{% if add_generation_prompt %}GO{% endif %}{{ eos_token }}").render([])
        == "GO</s>"
    )
    assert (
        template("{% if add_generation_prompt %}GO{% endif %}").render(
            [], add_generation_prompt=False
        )
        == ""
    )


def test_a_template_cannot_reach_python_or_change_its_messages() -> None:
    """A template is code from a download: the sandbox refuses attributes that lead out of it, and the
    immutable one refuses changing the messages (both one ChatTemplateError line)."""
    for source in (
        "{{ messages.__class__.__mro__ }}",
        "{{ ''.__class__.__subclasses__() }}",
        "{{ messages.append({'role': 'user'}) }}",
        "{% set x = messages.pop() %}",
    ):
        with pytest.raises(ChatTemplateError) as error:
            template(source).render([{"role": "user", "content": "hi"}])
        assert "\n" not in str(error.value)


def test_a_broken_template_is_one_line_when_read_and_when_rendered(tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match="not a valid Jinja template"):
        template("{% for m in messages %}unclosed")
    with pytest.raises(ChatTemplateError, match="failed"):
        template("{{ messages[5]['content'] | int + none }}").render([])
    folder = template_folder("Llama-3.1-8B-Instruct", tmp_path / "broken")
    (folder / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(CheckpointError, match="not a valid Jinja template") as error:
        load_tokenizer(folder)
    assert "\n" not in str(error.value)


def test_llama2_chat_s_template_renders_the_text_recorded_for_it() -> None:
    """The rendered text that text-generation-inference's test of chat templates records for
    meta-llama/Llama-2-13b-chat-hf (tests/data/SOURCES.md) for these six messages."""
    source = (TEMPLATES / "Llama-2-7b-chat-hf.jinja").read_text()
    messages = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there"},
        {"role": "user", "content": "Who are you"},
        {"role": "assistant", "content": "   I am an assistant   "},
        {"role": "user", "content": "Another question"},
    ]
    assert template(source).render(messages) == (
        "<s>[INST] <<SYS>>\nYou are a helpful assistant\n<</SYS>>\n\nHello [/INST] Hi there </s><s>[INST] Who are you "
        "[/INST] I am an assistant </s><s>[INST] Another question [/INST]"
    )
