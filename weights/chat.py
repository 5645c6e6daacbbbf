"""A checkpoint's own chat template: the Jinja text that turns a conversation into the prompt the
model was fine-tuned on.

Every chat model since 2023 ships its format as a template (tokenizer_config.json's
``chat_template``, or a ``chat_template.jinja`` file, or a GGUF's ``tokenizer.chat_template``);
Llama-2's ``[INST]`` format is right for Llama-2 alone. A template is rendered here as transformers'
``apply_chat_template`` renders it, so that the ids are the ones the model saw in training:

* a sandboxed, immutable Jinja environment (a template is code from a download: it must not reach
  Python objects or change its inputs) with ``trim_blocks`` and ``lstrip_blocks``, and the loop
  controls (``break``, ``continue``);
* ``tojson`` as json.dumps without ASCII escapes, ``raise_exception(message)`` (a template's way to
  refuse a conversation: here a ChatTemplateError, a 400 from the server), ``strftime_now(format)``
  (Llama-3.2's template writes today's date);
* the special tokens' text as variables (``bos_token``, ``eos_token``, ...) and
  ``add_generation_prompt``;
* the text is then encoded with its special tokens read as such and nothing added: the template
  writes its own BOS, so a second one is never put in front.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from weights.tokenizer import Tokenizer


class ChatTemplateError(ValueError):
    """A template that does not compile, or that refuses (or fails on) a conversation."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class ChatTemplate:
    """A Jinja chat template and the special tokens' text it is rendered with; ``origin`` says where it
    was read (for messages)."""

    def __init__(
        self, source: str, tokens: dict[str, str] | None = None, origin: str = "the chat template"
    ) -> None:
        self.source = source
        self.tokens = dict(tokens or {})
        self.origin = origin
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        environment.filters["tojson"] = _tojson
        environment.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
        try:
            self.template = environment.from_string(source)
        except jinja2.TemplateError as err:
            raise ChatTemplateError(
                f"{origin} is not a valid Jinja template: {str(err).splitlines()[0]}"
            ) from None

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        **variables: Any,
    ) -> str:
        """The prompt's text for ``messages`` (dicts with "role" and "content")."""
        try:
            return self.template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **{**self.tokens, **variables},
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"{self.origin} failed: {str(err).splitlines()[0]}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as err:
            raise ChatTemplateError(
                f"{self.origin} failed on these messages: {type(err).__name__}: "
                f"{str(err).splitlines()[0]}"
            ) from None

    def encode(
        self,
        tokenizer: Tokenizer,
        messages: Sequence[tuple[str, str]] | Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """The prompt's ids: rendered, then encoded with the special tokens in it read as such."""
        dicts = [m if isinstance(m, dict) else {"role": m[0], "content": m[1]} for m in messages]
        return tokenizer.encode_special(self.render(dicts, add_generation_prompt))


def token_text(config: dict[str, Any], key: str) -> str | None:
    """A special token's text as tokenizer_config.json writes it (a string, or an AddedToken's dict)."""
    token = config.get(key)
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def template_source(directory: Path, config: dict[str, Any]) -> tuple[str, str] | None:
    """The checkpoint's chat template and where it was found: chat_template.jinja (transformers
    writes it since 4.43), else tokenizer_config.json's ``chat_template``. A list of named templates
    (some checkpoints keep "default" and "tool_use") gives the default one."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str) and template.strip():
        return template, f"{directory / 'tokenizer_config.json'}'s chat_template"
    return None


def chat_template(source: str, config: dict[str, Any], origin: str) -> ChatTemplate:
    """A ChatTemplate with the special tokens' text that ``config`` (tokenizer_config.json) names."""
    tokens = {
        key: text
        for key in ("bos_token", "eos_token", "unk_token", "pad_token")
        if (text := token_text(config, key)) is not None
    }
    return ChatTemplate(source, tokens, origin)
