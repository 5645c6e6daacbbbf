"""The run folder of train.py (weights/runs.py): it resumes what it saved (the batch order
too), names the differences when it holds a run of another shape before anything is written,
keeps data.pt for what it was made from, and logs, plots and exports."""

from __future__ import annotations

import random
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
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values())
    )
    assert fresh.state_dict()["state"][0]["step"] == 1 and torch.equal(
        fresh_gen.get_state(), gen_state
    )
    assert not (tmp_path / "run" / "state.pt.tmp").exists()


def test_a_run_folder_of_another_shape_names_the_differences(tmp_path: Path) -> None:
    run = RunFolder(tmp_path)
    model = random_llama(vocab=8, dim=16)
    run.save_state(2, model, torch.optim.AdamW(model.parameters()), torch.Generator())
    wider = random_llama(vocab=8, dim=32)
    with pytest.raises(
        RunFolderError, match=r"holds a run of another shape \(.*--dim 16 there, 32 now"
    ):
        run.load_state(
            wider,
            torch.optim.AdamW(wider.parameters()),
            torch.Generator(),
            {"hidden_size": "--dim"},
        )
    with pytest.raises(RunFolderError, match="hidden_size 16 there, 32 now"):
        run.load_state(wider, torch.optim.AdamW(wider.parameters()), torch.Generator())


def test_a_run_folder_log_plot_and_export(tmp_path: Path) -> None:
    run = RunFolder(tmp_path / "out")
    for step, loss in enumerate([5.0, 4.0, 3.0, 2.0], 1):
        run.log(
            {"step": step, "loss": loss, **({"eval_loss": loss + 0.5} if step % 2 == 0 else {})}
        )
    assert [row["step"] for row in run.rows()] == [1, 2, 3, 4]
    assert run.tail_loss(2) == 2.5 and run.tail_loss() == 3.5
    run.plot("a title")
    assert (tmp_path / "out" / "loss.png").stat().st_size > 1000
    run.write_json("summary.json", {"a": 1})
    assert run.read_json("summary.json") == {"a": 1} and (
        tmp_path / "out" / "summary.json"
    ).read_text().endswith("\n")
    model = random_llama(vocab=8, dim=16)
    tokenizer = tmp_path / "tokenizer.model"
    tokenizer.write_bytes(b"not a real tokenizer")
    hf = run.export(model, tokenizer, torch.float32)
    assert (hf / "tokenizer.model").read_bytes() == b"not a real tokenizer"
    assert torch.equal(
        load_model(hf).layers[0].mlp.up_proj.weight, model.layers[0].mlp.up_proj.weight
    )


def test_a_run_folder_is_checked_before_it_is_made(tmp_path: Path) -> None:
    """check reads only: a new folder is not even created until the first write, and a state
    whose weights differ from the model's (a config does not say everything: a head's draft
    vocabulary) is refused as one error, naming the first difference."""
    model = random_llama(vocab=8, dim=16)
    RunFolder(tmp_path / "new").check(model)
    assert not (tmp_path / "new").exists()
    run = RunFolder(tmp_path / "run")
    run.save_state(1, model, torch.optim.AdamW(model.parameters()), torch.Generator())
    grown = random_llama(vocab=8, dim=16)
    grown.extra_weight = torch.nn.Parameter(torch.zeros(3))  # same config, one more weight
    with pytest.raises(
        RunFolderError, match=r"does not fit this model \(extra_weight: absent there, \(3,\) now\)"
    ):
        RunFolder(tmp_path / "run").check(grown)
    with pytest.raises(RunFolderError, match="does not fit"):
        RunFolder(tmp_path / "run").load_state(
            grown, torch.optim.AdamW(grown.parameters()), torch.Generator()
        )


def test_a_resumed_run_gets_its_batch_order_back(tmp_path: Path) -> None:
    """The random.Random a run draws its batches from is saved with the state and restored: the
    draws after resuming are those an uninterrupted run makes."""
    model = random_llama(vocab=8, dim=16)
    rng = random.Random(0)
    rng.random()
    RunFolder(tmp_path).save_state(
        1, model, torch.optim.AdamW(model.parameters()), torch.Generator(), rng
    )
    uninterrupted = [rng.random() for _ in range(3)]
    resumed = random.Random(0)
    RunFolder(tmp_path).load_state(
        model, torch.optim.AdamW(model.parameters()), torch.Generator(), rng=resumed
    )
    assert [resumed.random() for _ in range(3)] == uninterrupted


def test_data_is_made_once_for_what_it_was_made_from(tmp_path: Path) -> None:
    """data.pt is read back for the same made_from when it holds enough rows, and made again (and
    replaced) for another made_from (another target), for more rows, or from an older version's
    bare tensor, which does not say what it was made from."""
    run, made = RunFolder(tmp_path / "run"), []

    def data(target: float, rows: int, made_rows: int, value: int) -> torch.Tensor:
        def make() -> torch.Tensor:
            made.append(value)
            return torch.full((made_rows, 4), value)

        return run.data({"target": [target]}, rows, make, "four columns")

    assert torch.equal(data(1.0, 3, 5, 1), torch.full((3, 4), 1))
    assert torch.equal(data(1.0, 5, 5, 2), torch.full((5, 4), 1))  # read back
    assert torch.equal(data(2.0, 5, 5, 3), torch.full((5, 4), 3))  # another target: made again
    assert torch.equal(data(2.0, 6, 6, 4), torch.full((6, 4), 4))  # too few rows: made again
    torch.save(torch.zeros(6, 4, dtype=torch.long), tmp_path / "run" / "data.pt")
    assert torch.equal(data(2.0, 6, 6, 5), torch.full((6, 4), 5))
    assert made == [1, 3, 4, 5] and not (tmp_path / "run" / "data.pt.tmp").exists()


def test_grown_data_goes_on_where_it_stopped_and_grows_on_demand(tmp_path: Path) -> None:
    """data.pt grown in pieces: a run stopped after a piece goes on from it, a later run asking for
    more adds only the new items, one asking for fewer reads a prefix, and another made_from
    starts over."""
    run, asked = RunFolder(tmp_path / "run"), []

    def make(start: int, end: int) -> list[list[int]]:
        asked.append((start, end))
        return [[i] * (i % 3 + 1) for i in range(start, end)]  # item i: i, repeated 1 to 3 times

    def stream(count: int) -> list[int]:
        return [i for i in range(count) for _ in range(i % 3 + 1)]

    class StoppedError(Exception):
        pass

    def stop_after_two(start: int, end: int) -> list[list[int]]:
        if start >= 4:
            raise StoppedError
        return make(start, end)

    with pytest.raises(StoppedError):
        run.grown({"target": 1}, 10, stop_after_two, "items", every=2)
    assert asked == [(0, 2), (2, 4)]
    assert run.grown({"target": 1}, 10, make, "items", every=2).tolist() == stream(10)
    assert asked[2:] == [(4, 6), (6, 8), (8, 10)]  # went on from item 4
    assert run.grown({"target": 1}, 13, make, "items", every=4).tolist() == stream(13)
    assert asked[5:] == [(10, 13)]
    assert run.grown({"target": 1}, 5, make, "items").tolist() == stream(5) and len(asked) == 6
    assert run.grown({"target": 2}, 3, make, "items").tolist() == stream(3) and asked[6:] == [
        (0, 3)
    ]


def test_export_writes_a_tokenizer_json_model_s_tokenizer_beside_it(tmp_path: Path) -> None:
    """A draft of a model whose tokenizer is a tokenizer.json (Llama-3's): hf/ holds that text and
    the BOS and EOS tokens in tokenizer_config.json, and reads back as the same tokenizer; a
    SentencePiece tokenizer.model is copied as before."""
    from tests.support.checkpoints import llama31_tokenizer_json
    from weights import load_tokenizer
    from weights.tokenizer import JsonTokenizer

    text = llama31_tokenizer_json()
    tokenizer = JsonTokenizer(
        text, {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    )
    hf = RunFolder(tmp_path / "run").export(
        random_llama(vocab=128256, dim=8, n_layers=1, n_heads=2), tokenizer, torch.float32
    )
    back = load_tokenizer(hf)
    assert (hf / "tokenizer.json").read_text(encoding="utf-8") == text
    assert (back.bos_id, back.eos_id) == (128000, 128001)
    assert back.encode("Speculative decoding, exactly.") == tokenizer.encode(
        "Speculative decoding, exactly."
    )
    assert not (hf / "tokenizer.model").exists()
