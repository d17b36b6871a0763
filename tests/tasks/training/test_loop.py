from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import polars as pl
import pytest
import torch
from training_fixtures import markov_tokens, tiny_config

from tasks.lm.loss import evaluate_loss, target_indices, token_losses
from tasks.training.design import cosine_warmup_steps
from tasks.training.loop import TrainResult, WindowSampler, read_doc_losses, train_model
from tasks.training.design import ladder, lr_at
from tasks.zoo.ladder import load_model


@pytest.fixture(scope="module")
def data():
    d = markov_tokens(60_000)
    return d[:50_000], d[50_000:]


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    """The golden run: tiny config, 32 steps, seed 0."""
    cfg = tiny_config()
    spec = ladder(cfg)[0]
    out = tmp_path_factory.mktemp("golden")
    calls = []
    progress = []
    result = train_model(spec, cfg, *data, out, on_metrics=lambda m, s: calls.append((s, dict(m))),
                         progress=lambda s, n: progress.append((s, n)))
    return cfg, spec, out, result, calls, progress


# Pinned from one run of `trained` on CPU (torch 2.13.0, transformers 5.24.0, fp32). The run is
# deterministic; the tolerance covers float summation-order differences between CPU builds and
# thread counts. A change here means the init, data order, schedule, optimizer or loss changed.
# GOLDEN_CURVE_VAL_LOSS is the last curve point (first eval_tokens), the point's val_loss before it
# was scored over the whole split; GOLDEN_VAL_LOSS is the full-split val_loss of the same weights.
GOLDEN_CURVE_VAL_LOSS = 5.083845471578931
GOLDEN_VAL_LOSS = 5.07292705688339


def test_golden_final_loss(trained):
    _, _, _, result, _, _ = trained
    assert result.history[-1][2] == pytest.approx(GOLDEN_CURVE_VAL_LOSS, rel=1e-4)
    assert result.val_loss == pytest.approx(GOLDEN_VAL_LOSS, rel=1e-4)
    assert result.val_tokens == ((10_000 - 1) // 32) * 32  # every whole window of the 10k-token split


def test_loss_goes_down(trained):
    _, _, _, result, _, _ = trained
    vals = [v for _, _, v in result.history if v is not None]
    trains = [t for _, t, _ in result.history]
    assert vals == sorted(vals, reverse=True) and vals[-1] < math.log(256) - 0.4
    assert trains[-1] < trains[0] - 0.3
    assert result.ppl == pytest.approx(math.exp(result.val_loss))


def test_result_fields_and_callbacks(trained):
    cfg, spec, out, result, calls, progress = trained
    assert result.steps == spec.steps == 32 and result.tokens == 32 * 4 * 32
    assert result.n_params == spec.n_params == 13408
    assert result.n_params_total == 13408 + 2 * 256 * 32  # untied embedding and head
    assert result.flops_total == (6 * result.n_params_total + 12 * 1 * 32 * 32) * result.tokens
    assert result.epochs == pytest.approx(result.tokens / (((50_000 - 32) // 32) * 32))
    assert result.unique_tokens == result.tokens and not result.diverged
    assert result.mfu is None and result.tokens_per_s > 0 and result.wall_s > 0
    assert [s for s, _ in calls] == [4, 8, 12, 16, 20, 24, 28, 32]
    assert all({"train_loss", "lr", "tokens_per_s"} <= set(m) for _, m in calls)
    assert [s for s, m in calls if "val_loss" in m] == [8, 16, 24, 32]
    assert progress[-1] == (32, 32) and len(progress) == 32
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "result.json"}
    stored = json.loads((out / "config.json").read_text())
    assert stored["spec"]["name"] == spec.name and stored["model_config"]["hidden_size"] == 32
    assert stored["training"]["lr"] == cfg.lr


def test_load_model_reproduces_val_loss(trained, data):
    cfg, _, out, result, _, _ = trained
    model, meta = load_model(out)
    assert meta["result"]["val_loss"] == result.val_loss
    again = evaluate_loss(model, data[1], cfg.seq_len, cfg.batch_size, max_tokens=None)
    assert again == pytest.approx(result.val_loss, rel=1e-6)
    curve = evaluate_loss(model, data[1], cfg.seq_len, cfg.batch_size, cfg.eval_tokens)
    assert curve == pytest.approx(result.history[-1][2], rel=1e-6)


def test_doc_losses_sum_to_the_full_split_loss(data, tmp_path):
    """Per-document sums of the final model's losses: a partition of the full-split loss."""
    cfg = tiny_config(token_budgets=(1024,))
    spec = ladder(cfg)[0]
    val = data[1]
    docs = (np.arange(len(val)) // 97).astype(np.int32)  # 104 documents of 97 tokens (the last shorter)
    result = train_model(spec, cfg, data[0], val, tmp_path, val_docs=docs)
    table = read_doc_losses(tmp_path)
    assert table.columns == ["doc", "tokens", "loss_sum"]
    # 9984 targets are scored (tokens 1..9984, whole windows): document 0 loses its first token (never
    # a target), document 102 ends at the last window (9894..9984) and document 103 lies past it
    assert table["doc"].to_list() == list(range(103))
    assert table["tokens"][0] == 96 and table["tokens"][102] == 9984 - 102 * 97 + 1
    assert table["tokens"].sum() == result.val_tokens == 9984
    model, _ = load_model(tmp_path)
    full = evaluate_loss(model, val, cfg.seq_len, cfg.batch_size, max_tokens=None)
    assert table["loss_sum"].sum() / table["tokens"].sum() == pytest.approx(full, rel=1e-12)
    assert result.val_loss == pytest.approx(full, rel=1e-12)
    # each document's sum is its targets' losses: the third document, recomputed by hand
    losses = token_losses(model, val, cfg.seq_len, cfg.batch_size)
    in_doc = docs[target_indices(len(losses))] == 2
    assert table.filter(pl.col("doc") == 2)["loss_sum"][0] == pytest.approx(losses[in_doc].sum(), rel=1e-12)


def test_existing_result_is_returned_without_training(trained, data):
    cfg, spec, out, result, _, _ = trained
    again = train_model(spec, cfg, *data, out, progress=lambda s, n: pytest.fail("trained again"))
    assert again == result
    with pytest.raises(ValueError, match="different config"):
        train_model(spec, dataclasses.replace(cfg, lr=1e-3), *data, out)


def test_result_dict_roundtrip(trained):
    result = trained[3]
    assert TrainResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result


def test_token_ids_beyond_vocab_rejected(data, tmp_path):
    cfg = tiny_config()
    bad = data[0].copy()
    bad[10] = 300
    with pytest.raises(ValueError, match="vocab_size"):
        train_model(ladder(cfg)[0], cfg, bad, data[1], tmp_path)


def test_lr_schedule_warmup_then_cosine_to_min():
    cfg = tiny_config(lr=1e-3, warmup_frac=0.1, min_lr_ratio=0.1)
    spec = dataclasses.replace(ladder(cfg)[0], steps=100, warmup_steps=cosine_warmup_steps(100, 0.1), lr=1e-3)
    lrs = [lr_at(s, spec, cfg) for s in range(100)]
    assert cosine_warmup_steps(100, 0.1) == 10
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))  # monotone decay after warmup
    assert lrs[-1] == pytest.approx(1e-4)
    assert lrs[10 + 89 // 2] == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 44 / 89)))
    # each run's schedule spans its own length
    short = dataclasses.replace(spec, steps=10, warmup_steps=cosine_warmup_steps(10, 0.1))
    single = dataclasses.replace(spec, steps=1, warmup_steps=cosine_warmup_steps(1, 0.1))
    assert lr_at(9, short, cfg) == pytest.approx(1e-4) and lr_at(0, single, cfg) == pytest.approx(1e-4)


def test_sampler_reproducible_and_epoch_is_a_permutation():
    s = WindowSampler(n_tokens=1000, seq_len=10, seed=5)
    assert s.n_windows == 99
    ids_a, off_a = s.windows(0, 99)
    assert sorted(ids_a.tolist()) == list(range(99))  # one epoch visits every window once
    assert off_a.max() + 11 <= 1000
    fresh = WindowSampler(n_tokens=1000, seq_len=10, seed=5)
    ids_b, off_b = fresh.windows(150, 20)  # random access: no generator state to replay
    s.windows(0, 150)
    ids_c, off_c = s.windows(150, 20)
    assert np.array_equal(ids_b, ids_c) and np.array_equal(off_b, off_c)
    other = WindowSampler(n_tokens=1000, seq_len=10, seed=6).windows(0, 99)[0]
    assert not np.array_equal(ids_a, other)
    tokens = np.arange(1000, dtype=np.uint16)
    _, x, y = s.batch(tokens, 3, 4)
    assert x.shape == (4, 10) and torch.equal(y[:, :-1], x[:, 1:]) and x.dtype == torch.int64


def test_grad_accum_matches_larger_batch(data, tmp_path):
    """accum=2 x batch 2 sees the same samples as batch 4 and averages the same loss."""
    a = train_model(ladder(tiny_config(token_budgets=(1024,)))[0], tiny_config(token_budgets=(1024,)),
                    *data, tmp_path / "a")
    cfg_b = tiny_config(token_budgets=(1024,), batch_size=2, grad_accum=2)
    b = train_model(ladder(cfg_b)[0], cfg_b, *data, tmp_path / "b")
    assert a.steps == b.steps == 8
    assert b.val_loss == pytest.approx(a.val_loss, rel=1e-5)


def test_epochs_are_counted_when_the_budget_exceeds_the_corpus(data, tmp_path):
    """32 steps x 128 tokens = 4,096 tokens from a 2,048-token stream: two passes, recorded."""
    cfg = tiny_config()
    result = train_model(ladder(cfg)[0], cfg, data[0][:2048], data[1], tmp_path)
    available = ((2048 - 32) // 32) * 32
    assert result.train_tokens_available == available and result.unique_tokens == available
    assert result.epochs == pytest.approx(4096 / available) and result.epochs > 2


def test_a_diverged_run_is_recorded_not_raised(data, tmp_path):
    """An lr of 1e6 without clipping blows the loss up: the run stops, is written as diverged with no
    loss and no weights, and a rerun returns the stored record instead of training again."""
    cfg = tiny_config(lr=1e6, grad_clip=0.0, warmup_frac=0.0)
    spec = ladder(cfg)[0]
    result = train_model(spec, cfg, *data, tmp_path)
    assert result.diverged and result.val_loss is None and result.ppl is None
    assert "loss" in result.diverged_reason
    assert not (tmp_path / "model.safetensors").exists()
    stored = json.loads((tmp_path / "result.json").read_text())
    assert stored["diverged"] is True and stored["val_loss"] is None  # valid JSON: no NaN
    assert train_model(spec, cfg, *data, tmp_path) == result
