"""The run folder of train.py (weights/runs.py): it resumes what it saved, names the differences
when it holds a run of another shape, and logs, plots and exports."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.toy_models import random_llama
from weights import load_model
from weights.runs import RunFolder, RunFolderError

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- weights/runs.py
def test_a_run_folder_resumes_what_it_saved(tmp_path: Path) -> None:
    model = random_llama(vocab=8, dim=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = RunFolder(tmp_path / "run")
    assert run.load_state(model, optimizer, torch.Generator()) == 0  # nothing saved yet
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    optimizer.step()
    gen = torch.Generator().manual_seed(7)
    gen_state = gen.get_state()
    run.save_state(12, model, optimizer, gen)
    again, fresh_gen = random_llama(vocab=8, dim=16, seed=3), torch.Generator()
    fresh = torch.optim.AdamW(again.parameters(), lr=1e-3)
    assert RunFolder(tmp_path / "run").load_state(again, fresh, fresh_gen) == 12
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    assert fresh.state_dict()["state"][0]["step"] == 1 and torch.equal(fresh_gen.get_state(), gen_state)
    assert not (tmp_path / "run" / "state.pt.tmp").exists()


def test_a_run_folder_of_another_shape_names_the_differences(tmp_path: Path) -> None:
    run = RunFolder(tmp_path)
    model = random_llama(vocab=8, dim=16)
    run.save_state(2, model, torch.optim.AdamW(model.parameters()), torch.Generator())
    wider = random_llama(vocab=8, dim=32)
    with pytest.raises(RunFolderError, match=r"holds a run of another shape \(.*--dim 16 there, 32 now"):
        run.load_state(wider, torch.optim.AdamW(wider.parameters()), torch.Generator(), {"hidden_size": "--dim"})
    with pytest.raises(RunFolderError, match="hidden_size 16 there, 32 now"):
        run.load_state(wider, torch.optim.AdamW(wider.parameters()), torch.Generator())


def test_a_run_folder_log_plot_and_export(tmp_path: Path) -> None:
    run = RunFolder(tmp_path / "out")
    for step, loss in enumerate([5.0, 4.0, 3.0, 2.0], 1):
        run.log({"step": step, "loss": loss, **({"eval_loss": loss + 0.5} if step % 2 == 0 else {})})
    assert [row["step"] for row in run.rows()] == [1, 2, 3, 4]
    assert run.tail_loss(2) == 2.5 and run.tail_loss() == 3.5
    run.plot("a title")
    assert (tmp_path / "out" / "loss.png").stat().st_size > 1000
    run.write_json("summary.json", {"a": 1})
    assert run.read_json("summary.json") == {"a": 1} and (tmp_path / "out" / "summary.json").read_text().endswith("\n")
    model = random_llama(vocab=8, dim=16)
    tokenizer = tmp_path / "tokenizer.model"
    tokenizer.write_bytes(b"not a real tokenizer")
    hf = run.export(model, tokenizer, torch.float32)
    assert (hf / "tokenizer.model").read_bytes() == b"not a real tokenizer"
    assert torch.equal(load_model(hf).layers[0].mlp.up_proj.weight, model.layers[0].mlp.up_proj.weight)
