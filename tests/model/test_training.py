"""The training library behind train.py, model/training.py: initialisation, schedule, batches,
held-out loss and the shared loop, each checked against numbers worked out by hand or an
independent reference. (The run folder is tested in tests/weights/test_runs.py, the corpus
helpers in tests/weights/test_corpus.py, the drafter objectives in
tests/speculative/draft/test_distill.py.)"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from model.training import (
    decay_groups,
    evaluate,
    fit,
    init_weights,
    lr_at,
    next_token_loss,
    progress_fields,
    random_batch,
)
from tests.support.toy_models import random_llama

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- model/training.py
def test_the_schedule_by_hand() -> None:
    assert [lr_at(s, 1.0, 4, 104) for s in range(4)] == [
        0.25,
        0.5,
        0.75,
        1.0,
    ]  # linear warmup to the peak
    assert lr_at(4, 1.0, 4, 104) == pytest.approx(1.0)  # the cosine starts at the peak,
    # is halfway down at the middle,
    assert lr_at(54, 1.0, 4, 104) == pytest.approx(0.1 + 0.9 * 0.5)
    # and stays at 10%
    assert lr_at(104, 1.0, 4, 104) == pytest.approx(0.1) == lr_at(500, 1.0, 4, 104)


def test_random_windows_are_next_token_pairs_of_the_stream() -> None:
    data = np.arange(1000, dtype=np.uint16)
    x, y = random_batch(data, 5, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (5, 16) and x.dtype == torch.int64
    assert torch.equal(y, x + 1)  # in an arange, the next token is the token plus one
    assert torch.equal(x[:, 1:], x[:, :-1] + 1) and int(y.max()) < 1000


def test_initialisation_scales_the_residual_outputs() -> None:
    torch.manual_seed(0)
    model = random_llama(vocab=64, dim=128, n_layers=8, n_heads=4, n_kv_heads=2, hidden_dim=256)
    norms = {name: p.clone() for name, p in model.named_parameters() if p.dim() == 1}
    init_weights(model, 8)
    down = torch.cat([layer.mlp.down_proj.weight.flatten() for layer in model.layers])
    up = torch.cat([layer.mlp.up_proj.weight.flatten() for layer in model.layers])
    assert up.std().item() == pytest.approx(0.02, rel=0.05)
    assert down.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    # left alone
    assert all(torch.equal(p, norms[name]) for name, p in model.named_parameters() if p.dim() == 1)
    head = torch.nn.Linear(4, 4)
    init_weights(head, 1)
    assert torch.equal(head.bias, torch.zeros(4))


def test_next_token_loss_is_the_cross_entropy() -> None:
    model = random_llama(vocab=16, dim=16, max_seq_len=32)
    x = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(2))
    log_probs = torch.log_softmax(model(x).double(), -1)
    by_hand = -log_probs.gather(-1, y.unsqueeze(-1)).mean()
    assert next_token_loss(model, x, y).item() == pytest.approx(by_hand.item(), rel=1e-5)


def test_the_held_out_loss_reads_the_same_windows_every_time() -> None:
    model = random_llama(vocab=16, dim=16, max_seq_len=64).train()
    data = np.random.default_rng(0).integers(0, 16, 500).astype(np.uint16)
    first = evaluate(model, data, 16, batches=3, batch=2)
    # left in training mode
    assert evaluate(model, data, 16, batches=3, batch=2) == first and model.training
    one = evaluate(model, data, 16, batches=1, batch=2)  # the first of the three batches
    gen = torch.Generator().manual_seed(1234)
    assert one == pytest.approx(next_token_loss(model, *random_batch(data, 2, 16, gen)).item())


class Folder:
    """A run folder in memory: what fit writes, and when."""

    def __init__(self) -> None:
        self.rows, self.saved, self.plots, self.rngs = [], [], [], []

    def log(self, row: dict) -> None:
        self.rows.append(row)

    def save_state(self, step: int, model, optimizer, gen, rng) -> None:
        self.saved.append(step)
        self.rngs.append(rng)

    def plot(self, title: str) -> None:
        self.plots.append(title)


def test_fit_lowers_the_loss_logs_every_step_and_saves_on_schedule() -> None:
    torch.manual_seed(0)
    model = random_llama(vocab=8, dim=16, max_seq_len=32).train()
    data = np.tile(np.arange(8, dtype=np.uint16), 100)  # 0 1 2 ... 7 0 1 ...: easy to learn
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen, run = torch.Generator().manual_seed(0), Folder()

    def batch_loss(step: int):
        x, y = random_batch(data, 4, 12, gen)
        return next_token_loss(model, x, y), {"seen": step}, x.numel()

    rng = random.Random(0)
    last = fit(
        model,
        optimizer,
        gen,
        run,
        start=3,
        steps=40,
        lr=1e-2,
        warmup=5,
        batch_loss=batch_loss,
        after=lambda step: {"even": True} if step % 2 == 0 else {},
        save_every=10,
        title="t",
        desc="d",
        progress=False,
        rng=rng,
    )
    assert last == 40 and [row["step"] for row in run.rows] == list(range(4, 41))
    assert list(run.rows[0]) == ["step", "loss", "seen", "tokens_per_s", "even"]  # step 4: even
    assert list(run.rows[1]) == ["step", "loss", "seen", "tokens_per_s"]
    # batch_loss sees the step before it is taken
    assert [row["seen"] for row in run.rows] == list(range(3, 40))
    assert run.saved == [10, 20, 30, 40] and run.plots == ["t"] * 4
    # the batch order's generator is saved with the state
    assert all(saved is rng for saved in run.rngs)
    assert optimizer.param_groups[0]["lr"] == lr_at(39, 1e-2, 5, 40)
    assert sum(r["loss"] for r in run.rows[-5:]) / 5 < run.rows[0]["loss"] - 0.5
    # nothing left to do
    assert (
        fit(
            model,
            optimizer,
            gen,
            run,
            start=40,
            steps=40,
            lr=1e-2,
            warmup=5,
            batch_loss=batch_loss,
            save_every=10,
            title="t",
            desc="d",
            progress=False,
        )
        == 40
    )


def test_only_the_matrices_decay() -> None:
    model = random_llama(vocab=8, dim=16)
    decay, no_decay = decay_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(
        p.dim() == 1 for p in no_decay["params"]
    )
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_the_progress_bar_shows_what_the_row_logs() -> None:
    assert progress_fields({"loss": 2.0, "tokens_per_s": 99.6}) == {"loss": "2.000", "tok_s": "100"}
    assert progress_fields(
        {"loss": 1.0, "regression": 0.5, "classification": 0.25, "tokens_per_s": 1.0}
    ) == {"reg": "0.5000", "cls": "0.250", "tok_s": "1"}
    assert progress_fields(
        {"loss": 1.0, "alpha_by_depth": [0.9, 0.5, 0.25], "tokens_per_s": 1.0}
    ) == {"loss": "1.000", "a1": "0.90", "a_last": "0.25", "tok_s": "1"}
