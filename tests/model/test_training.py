"""The training library behind train.py: model/training.py (initialisation, schedule,
batches, held-out loss, the shared loop), weights/runs.py (the run folder), the corpus
helpers of weights/corpus.py and the drafter objectives of speculative/draft/distill.py, each
checked against numbers worked out by hand or an independent reference."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from toy_models import random_llama, reference_greedy

from model.training import evaluate, fit, init_weights, lr_at, next_token_loss, random_batch
from speculative.draft.distill import distill_loss, eagle_losses, sample_sequences
from speculative.engine.generation import measure_acceptance
from weights.corpus import held_out_prompts, story_openings
from weights.runs import RunFolder, RunFolderError

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- model/training.py
def test_the_schedule_by_hand() -> None:
    assert [lr_at(s, 1.0, 4, 104) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]  # linear warmup to the peak
    assert lr_at(4, 1.0, 4, 104) == pytest.approx(1.0)  # the cosine starts at the peak,
    assert lr_at(54, 1.0, 4, 104) == pytest.approx(0.1 + 0.9 * 0.5)  # is halfway down at the middle,
    assert lr_at(104, 1.0, 4, 104) == pytest.approx(0.1) == lr_at(500, 1.0, 4, 104)  # and stays at 10%


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
    assert all(torch.equal(p, norms[name]) for name, p in model.named_parameters() if p.dim() == 1)  # left alone
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
    assert evaluate(model, data, 16, batches=3, batch=2) == first and model.training  # left in training mode
    one = evaluate(model, data, 16, batches=1, batch=2)  # the first of the three batches
    gen = torch.Generator().manual_seed(1234)
    assert one == pytest.approx(next_token_loss(model, *random_batch(data, 2, 16, gen)).item())


class Folder:
    """A run folder in memory: what fit writes, and when."""

    def __init__(self) -> None:
        self.rows, self.saved, self.plots = [], [], []

    def log(self, row: dict) -> None:
        self.rows.append(row)

    def save_state(self, step: int, model, optimizer, gen) -> None:
        self.saved.append(step)

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

    last = fit(model, optimizer, gen, run, start=3, steps=40, lr=1e-2, warmup=5, batch_loss=batch_loss,
               after=lambda step: {"even": True} if step % 2 == 0 else {}, save_every=10, title="t", desc="d",
               progress=False)
    assert last == 40 and [row["step"] for row in run.rows] == list(range(4, 41))
    assert list(run.rows[0]) == ["step", "loss", "seen", "tokens_per_s", "even"]  # step 4: even
    assert list(run.rows[1]) == ["step", "loss", "seen", "tokens_per_s"]
    assert [row["seen"] for row in run.rows] == list(range(3, 40))  # batch_loss sees the step before it is taken
    assert run.saved == [10, 20, 30, 40] and run.plots == ["t"] * 4
    assert optimizer.param_groups[0]["lr"] == lr_at(39, 1e-2, 5, 40)
    assert sum(r["loss"] for r in run.rows[-5:]) / 5 < run.rows[0]["loss"] - 0.5
    assert fit(model, optimizer, gen, run, start=40, steps=40, lr=1e-2, warmup=5, batch_loss=batch_loss,
               save_every=10, title="t", desc="d", progress=False) == 40  # nothing left to do


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
    from weights import load_model

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


# ----------------------------------------------------------------------------- weights/corpus.py
class Words:
    """A stand-in tokenizer: one id per word, BOS 1."""

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([1] if bos else []) + [len(word) + 10 for word in text.split()]


def test_story_openings_and_held_out_prompts(tmp_path: Path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("a bb ccc dddd<|endoftext|>e ff<|endoftext|>ggg hhhh i jj kk", encoding="utf-8")
    assert story_openings([corpus], Words(), 4) == [[1, 11, 12, 13], [1, 13, 14, 11]]  # the two-word story is short
    prompts = held_out_prompts([corpus], Words(), 2, 3, seed=5)
    assert len(prompts) == 2 and all(len(p) == 3 and p[0] == 1 for p in prompts)
    assert prompts == held_out_prompts([corpus], Words(), 2, 3, seed=5)  # the same prompts for the same seed
    assert sorted(held_out_prompts([corpus], Words(), 9, 3, seed=5)) == sorted(
        [[1, 11, 12], [1, 11, 12], [1, 13, 14]])  # all of them when there are fewer


# ----------------------------------------------------------------------------- speculative/draft/distill.py
def test_sampled_sequences_greedy_are_the_model_s_own_greedy_output() -> None:
    model = random_llama(vocab=16, dim=32, max_seq_len=64, dtype=torch.float64)
    prompts = [[1, 2, 3], [4, 5, 6]]
    out = sample_sequences(model, prompts, 8, torch.Generator(), greedy=True)
    assert out.shape == (2, 11) and out[:, :3].tolist() == prompts
    for row, prompt in zip(out.tolist(), prompts):
        assert row[3:] == reference_greedy(model, prompt, 8)
    again = sample_sequences(model, prompts, 8, torch.Generator().manual_seed(3))
    assert torch.equal(again, sample_sequences(model, prompts, 8, torch.Generator().manual_seed(3)))


def test_the_distillation_loss_is_the_divergence_over_the_generated_positions() -> None:
    target = random_llama(vocab=16, dim=32, max_seq_len=64, seed=1, dtype=torch.float64)
    draft = random_llama(vocab=16, dim=32, max_seq_len=64, seed=2, dtype=torch.float64).train()
    seqs = torch.randint(0, 16, (2, 10), generator=torch.Generator().manual_seed(0))
    loss = distill_loss("tv", target, draft, seqs, prompt_tokens=4)
    p = F.softmax(target(seqs)[:, 3:-1], -1)
    q = F.softmax(draft(seqs)[:, 3:-1], -1)
    assert loss.item() == pytest.approx((0.5 * (p - q).abs().sum(-1)).mean().item())  # positions 4..9 predicted
    loss.backward()
    assert all(param.grad is None for param in target.parameters())
    assert any(param.grad is not None and param.grad.abs().sum() > 0 for param in draft.parameters())
    assert distill_loss("tv", target, target, seqs, 4).item() == pytest.approx(0.0, abs=1e-12)


def test_eagle_losses_train_the_head_only() -> None:
    from test_drafters import random_head

    target = random_llama(vocab=16, dim=32, max_seq_len=64, n_heads=4, n_kv_heads=2).requires_grad_(False)
    head = random_head(target).train()
    tokens = torch.randint(0, 16, (2, 9), generator=torch.Generator().manual_seed(0))
    regression, classification = eagle_losses(head, target, tokens, 0.0, torch.Generator())
    with torch.no_grad():  # by hand: the head reads f_j and e(x_{j+1}) and predicts f_{j+1}
        _, feats = target(tokens, return_hidden=True)
        predicted = head(feats[:, :-1], target.embed_tokens(tokens[:, 1:]))
        wanted = F.softmax(target.lm_head(feats[:, 1:]), -1)
        log_q = F.log_softmax(target.lm_head(predicted), -1)
    assert regression.item() == pytest.approx(F.smooth_l1_loss(predicted, feats[:, 1:]).item(), rel=1e-5)
    assert classification.item() == pytest.approx(-(wanted * log_q).sum(-1).mean().item(), rel=1e-5)
    (regression + classification).backward()
    assert all(p.grad is not None for p in head.parameters()) and all(p.grad is None for p in target.parameters())
    noisy = eagle_losses(head, target, tokens, 0.5, torch.Generator().manual_seed(1))[0]
    assert noisy.item() != regression.item()


def test_a_draft_equal_to_its_target_is_always_accepted() -> None:
    target = random_llama(vocab=16, dim=32, max_seq_len=64, dtype=torch.float64)
    twin = random_llama(vocab=16, dim=32, max_seq_len=64, dtype=torch.float64)  # the same weights, another cache
    got = measure_acceptance(target, twin, [[1, 2, 3], [4, 5]], new_tokens=10, gamma=3, seed=0)
    assert set(got) == {f"{k}_{t}" for k in ("alpha", "acceptance", "tau") for t in ("greedy", "t1")}
    for name in ("greedy", "t1"):
        assert got[f"alpha_{name}"] == pytest.approx(1.0) and got[f"acceptance_{name}"] == pytest.approx(1.0)
        assert got[f"tau_{name}"] > 3  # gamma + 1 per call, less where the output ends
    json.dumps(got)
