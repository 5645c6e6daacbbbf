"""Short names for checkpoints: ``7b`` -> a Llama-2-7b-hf directory, ``tiny-target`` -> the shipped pair.

Real Llama-2 checkpoints are looked up, in order, under the directory named by the
environment variable ``SPECULATIVE_WEIGHTS`` and under this ``weights/`` folder. Anything
that is not a short name is treated as a path to an HF-layout directory.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from model.host import setting

WEIGHTS_DIR = Path(__file__).resolve().parent
ENV_VAR = "SPECULATIVE_WEIGHTS"  # read by model.host.setting: $SPECDEC_WEIGHTS too, for one release

# short name -> (directory name, Hugging Face repository to download it from)
LLAMA2 = {
    "7b": ("Llama-2-7b-hf", "meta-llama/Llama-2-7b-hf"),
    "13b": ("Llama-2-13b-hf", "meta-llama/Llama-2-13b-hf"),
    "70b": ("Llama-2-70b-hf", "meta-llama/Llama-2-70b-hf"),
    "7b-chat": ("Llama-2-7b-chat-hf", "meta-llama/Llama-2-7b-chat-hf"),
    "13b-chat": ("Llama-2-13b-chat-hf", "meta-llama/Llama-2-13b-chat-hf"),
    "70b-chat": ("Llama-2-70b-chat-hf", "meta-llama/Llama-2-70b-chat-hf"),
}
# The tiny pair trained by train.py and committed in this folder, the feature heads for its target, and the
# drafter trained here for a real model that is not (SmolLM2-135M-Instruct: its README says where to get it).
SHIPPED_MODELS = ("tiny-target", "tiny-draft", "tiny-draft-undistilled", "tiny-draft-parallel")
SHIPPED_HEADS = ("tiny-eagle", "tiny-eagle3", "smollm2-eagle3")
# each the default --draft of a target of its target's shape
FOR_OTHER_TARGETS = ("smollm2-eagle3",)
# of those, the ones whose target runs another set-up by default: the fastest exact one measured for that
# target on Spec-Bench (docs/results/README.md lists the page), "suffix" (suffix decoding alone) or "hybrid"
# (the head beside suffix decoding, speculative/draft/hybrid.py)
MEASURED_DEFAULTS = {"smollm2-eagle3": "suffix"}
SHIPPED = SHIPPED_MODELS + SHIPPED_HEADS


class UnknownCheckpointError(ValueError):
    """A name is neither a registry short name nor an existing directory."""


def search_dirs() -> list[Path]:
    dirs = []
    folder = setting(ENV_VAR)
    if folder:
        dirs.append(Path(folder).expanduser())
    dirs.append(WEIGHTS_DIR)
    return dirs


# a Hugging Face Hub id: owner/name, as the Hub allows them (letters, digits, -, _, .)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def hub_cache() -> Path:
    """Where huggingface_hub keeps downloaded repositories: $HF_HUB_CACHE, else $HF_HOME/hub, else
    ~/.cache/huggingface/hub (read here without importing it: nothing is ever downloaded)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or "~/.cache/huggingface"
    return Path(home).expanduser() / "hub"


def hub_snapshot(repo_id: str) -> Path:
    """The local copy of Hub repository ``repo_id`` in the Hugging Face cache: the snapshot its
    ``main`` ref names (or the only one there is), when it holds a config.json or a GGUF file.
    Otherwise one line saying how to get the files."""
    root = hub_cache() / f"models--{repo_id.replace('/', '--')}"
    snapshots = root / "snapshots"
    ref = root / "refs" / "main"
    candidates = []
    if ref.is_file():
        candidates.append(snapshots / ref.read_text().strip())
    if snapshots.is_dir():
        candidates += sorted(p for p in snapshots.iterdir() if p.is_dir())
    for snapshot in candidates:
        if (snapshot / "config.json").is_file():
            return snapshot
        ggufs = sorted(snapshot.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    raise UnknownCheckpointError(
        f"{repo_id} is neither a folder here nor in the Hugging Face cache ({hub_cache()}): nothing is "
        f"downloaded at run time; get it with `hf download {repo_id}` (huggingface_hub), then pass the "
        "same id or the folder"
    )


def resolve(name_or_path: str | os.PathLike) -> Path:
    """The checkpoint directory (or GGUF file) for a short name or a path; a clear error when it is not there."""
    name = str(name_or_path)
    if name in SHIPPED:
        path = WEIGHTS_DIR / name
        if not path.is_dir():
            raise UnknownCheckpointError(
                f"the shipped checkpoint {path} is missing; restore it with git checkout"
            )
        return path
    if name in LLAMA2:
        dirname, repo = LLAMA2[name]
        for base in search_dirs():
            if (base / dirname).is_dir():
                return base / dirname
        where = " or ".join(str(d / dirname) for d in search_dirs())
        raise UnknownCheckpointError(
            f"checkpoint '{name}' not found: download {repo} from Hugging Face (after accepting Meta's "
            f"license) and put it at {where}, or set {ENV_VAR} to the folder that holds {dirname}"
        )
    path = Path(name).expanduser()
    # a GGUF file is a checkpoint too
    if path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf"):
        return path
    if path.suffix.lower() == ".gguf":
        raise UnknownCheckpointError(f"GGUF file {name} does not exist")
    if HUB_ID.fullmatch(name):
        return hub_snapshot(name)
    if os.sep in name or name.startswith("."):
        raise UnknownCheckpointError(f"checkpoint directory {name} does not exist")
    known = ", ".join(list(LLAMA2) + list(SHIPPED))
    raise UnknownCheckpointError(
        f"unknown checkpoint '{name}': use one of {known}, or a path to an HF-layout directory"
    )


CHAT_MARKERS = ("chat", "instruct")


def marked_for_chat(name_or_path: str | os.PathLike) -> bool:
    """Whether anything marks a checkpoint as trained for chat: "chat" or "instruct" in its
    short name, its folder's name or config.json's ``_name_or_path``, or a ``chat_template`` in
    its tokenizer_config.json. A base model does not follow the chat template."""
    directory = resolve(name_or_path)
    labels = [
        Path(name_or_path).name,
        directory.name,
    ]  # the folders above say nothing about the model
    try:
        labels.append(
            str(json.loads((directory / "config.json").read_text()).get("_name_or_path", ""))
        )
        tokenizer_config = directory / "tokenizer_config.json"
        if tokenizer_config.is_file() and "chat_template" in json.loads(
            tokenizer_config.read_text()
        ):
            return True
    except (OSError, ValueError, AttributeError):
        pass  # read_config reports a broken config.json properly, later
    return any(marker in label.lower() for label in labels for marker in CHAT_MARKERS)
