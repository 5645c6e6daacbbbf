"""One reader of MODULE:OBJECT for `--draft` and the checker (speculative.draft.registry.load_object), and
the head protocol that the heads of model/ declare whole (speculative.draft.protocol.Head)."""

from __future__ import annotations

from pathlib import Path

import pytest

from model.eagle3_head import Eagle3Head, PEagleHead
from model.feature_head import FeatureHead
from speculative.draft.protocol import HEAD_DEFAULTS, Head, head_trait
from speculative.draft.registry import UnresolvedError, find, load_object, names_object


def test_a_dotted_module_and_a_file_are_read_alike(tmp_path: Path) -> None:
    assert load_object("speculative.draft.protocol:head_trait") is head_trait
    (tmp_path / "mine.py").write_text("from speculative.draft.lookup import PromptLookupDrafter\n")
    assert (
        load_object(f"{tmp_path / 'mine.py'}:PromptLookupDrafter").__name__ == "PromptLookupDrafter"
    )
    kind = find(f"{tmp_path / 'mine.py'}:PromptLookupDrafter")  # --draft takes a file as prove does
    assert kind is not None and not kind.needs_files


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_such_module:thing", "no module named 'no_such_module'"),
        ("speculative.draft:no_such_thing", "speculative.draft has no 'no_such_thing'"),
        ("no/such/file.py:thing", "no file no/such/file.py"),
        ("speculative.draft", "expected MODULE:OBJECT"),
    ],
)
def test_what_names_nothing_is_one_line(spec: str, message: str) -> None:
    with pytest.raises(UnresolvedError, match=message):
        load_object(spec)


def test_a_folder_or_a_name_is_not_taken_for_an_object() -> None:
    assert names_object("package.module:OBJECT") and names_object("a/b.py:make")
    assert not names_object("tiny-draft") and not names_object("C:\\weights\\draft")


def test_the_heads_of_model_declare_every_attribute_of_the_head_protocol() -> None:
    declared = set(Head.__annotations__) - {"config", "dtype", "device"}
    assert declared == set(HEAD_DEFAULTS)
    for head in (FeatureHead, Eagle3Head, PEagleHead):
        assert all(hasattr(head, name) for name in HEAD_DEFAULTS), head
    assert FeatureHead.reads_features is True and FeatureHead.draft_logits is None
    assert Eagle3Head.embed is None and callable(PEagleHead.embed)
    assert {name: head_trait(object(), name) for name in HEAD_DEFAULTS} == HEAD_DEFAULTS
