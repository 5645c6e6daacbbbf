"""Session set-up for every test folder (the helpers the tests share are in tests/support/).

* One CPU thread: the suite runs next to long training jobs on a small machine, and a
  single thread also makes float32 reductions deterministic from run to run.
* The compiled-step cache (weights/step_cache.py) points at a temporary folder of the
  session's own, never the user's.
* ``chat_target``: the shipped target under a name that marks it a Llama-2 chat model (it has no
  template, so --chat and the server's chat endpoint use Llama-2's format, as they do for a
  Llama-2 chat checkpoint without one; the shipped target itself is a base model and refuses them).
* ``head_folder``: a feature head for the shipped target with random weights, saved as a
  checkpoint (the generate.py tests of tests/scripts/ use it).

Every folder under tests/ is a package, and pytest puts the repository root on ``sys.path``
(``pythonpath`` in pyproject.toml), so tests import ``tests.support.X``, the packages and the
scripts (``import generate``) from wherever pytest is started.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from model import ModelConfig
from model.feature_head import FeatureHead
from tests.support.paths import TARGET
from weights import load_model
from weights.drafters import save_feature_head

torch.set_num_threads(1)

# The compiled-step cache (weights/step_cache.py): a folder of the session's own, never the user's
# (a default run uses what it finds there), inherited by the generate.py subprocesses.
os.environ["SPECULATIVE_CACHE"] = tempfile.mkdtemp(prefix="speculative-llama-tests-")
atexit.register(shutil.rmtree, os.environ["SPECULATIVE_CACHE"], ignore_errors=True)


@pytest.fixture(scope="module")
def head_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A feature head for the shipped target with random weights (what is tested here is the
    plumbing; the shipped head's acceptance is in its model card)."""
    target = load_model(TARGET)
    torch.manual_seed(0)
    head = FeatureHead(ModelConfig(**{**vars(target.config), "n_layers": 1, "extra": {}}))
    return save_feature_head(
        head, tmp_path_factory.mktemp("head") / "head", target, target_name="tiny-target"
    )


@pytest.fixture(scope="session")
def chat_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped target's files (links) in a folder whose name marks it for chat (see above)."""
    folder = tmp_path_factory.mktemp("chat") / "tiny-target-chat"
    folder.mkdir()
    for file in TARGET.iterdir():
        (folder / file.name).symlink_to(file)
    return folder
