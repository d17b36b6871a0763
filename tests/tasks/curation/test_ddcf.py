"""DDCF (tasks/curation/ddcf.py): predictor, greedy objective, question family, bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.common.config import ConfigError
from tasks.common.params import load_stage_config
from tasks.curation.ddcf import (
    DDCFPredictor,
    EncodedQA,
    PredictorConfig,
    QuestionFamily,
    SelectConfig,
    arithmetic_questions,
    byte_tokenizer,
    encode_qa,
    exact_match,
    fit_predictor,
    greedy_select,
    predict_correct,
    roc_auc,
    run_arithmetic_setting,
    select_questions,
)

ROOT = Path(__file__).resolve().parents[3]


def _toy(n_models: int = 8, n_questions: int = 60, dim: int = 8, seed: int = 0):
    """Two kinds of model: kind 0 answers the questions with e[0] > 0, kind 1 those with e[0] < 0."""
    rng = np.random.default_rng(seed)
    emb = rng.normal(size=(n_questions, dim)).astype(np.float32)
    kind = np.arange(n_models) % 2
    matrix = np.where(kind[:, None] == 0, emb[None, :, 0] > 0, emb[None, :, 0] < 0).astype(np.int8)
    return matrix, emb, kind


def test_predictor_learns_a_separable_matrix_on_held_out_cells():
    matrix, emb, _ = _toy()
    held = np.random.default_rng(1).random(matrix.shape) < 0.2
    net = fit_predictor(matrix, emb, PredictorConfig(hidden=16, epochs=40, lr=1e-2, batch_size=64), train_mask=~held)
    r, c = np.nonzero(held)
    p = predict_correct(net, r, emb[c])
    assert roc_auc(p, matrix[r, c]) > 0.95
    assert ((p > 0.5) == matrix[r, c].astype(bool)).mean() > 0.9


def test_unseen_target_is_predicted_from_its_seed_cells_only():
    matrix, emb, _ = _toy(n_questions=80)
    target = (emb[:, 0] < 0).astype(np.int8)  # behaves like kind 1
    seed = np.arange(80) < 16
    full = np.vstack([matrix, np.where(seed, target, -1)[None]])
    net = fit_predictor(full, emb, PredictorConfig(hidden=16, epochs=40, lr=1e-2, batch_size=64))
    p = predict_correct(net, full.shape[0] - 1, emb[~seed])
    assert roc_auc(p, target[~seed]) > 0.9


def test_predictor_shapes():
    net = DDCFPredictor(5, q_dim=384, hidden=7, n_blocks=2)
    out = net(torch.tensor([0, 4, 2]), torch.randn(3, 384))
    assert out.shape == (3, 2)
    p = predict_correct(net, 3, np.zeros((11, 384), np.float32))
    assert p.shape == (11,) and np.all((p > 0) & (p < 1))


def test_lambda_one_picks_hardest_first():
    difficulty = np.array([0.5, 0.9, 0.05, 0.3, 0.7])
    emb = np.ones((5, 3))  # identical questions: similarity would forbid nothing at lambda 1
    assert greedy_select(difficulty, emb, 5, lam=1.0).tolist() == [2, 3, 0, 4, 1]


def test_lambda_zero_covers_clusters():
    rng = np.random.default_rng(0)
    centres = np.eye(4)[:3] * 10
    emb = np.vstack([c + rng.normal(scale=0.3, size=(5, 4)) for c in centres])
    difficulty = np.linspace(0, 1, 15)  # ignored at lambda 0
    chosen = greedy_select(difficulty, emb, 3, lam=0.0)
    assert sorted(i // 5 for i in chosen) == [0, 1, 2]


def test_objective_trades_difficulty_against_redundancy():
    # q0, q1 the same direction, q2 orthogonal; lambda 0.5:
    # pick 1: 0.5*0.1 (q0) < 0.5*0.12 < 0.5*0.6;  pick 2: q1 0.5*0.12 + 0.5*1 = 0.56 > q2 0.5*0.6 + 0 = 0.3
    difficulty = np.array([0.1, 0.12, 0.6])
    emb = np.array([[1.0, 0.0], [2.0, 0.0], [0.0, 1.0]])
    assert greedy_select(difficulty, emb, 3, lam=0.5).tolist() == [0, 2, 1]
    # with a small lambda the redundancy term wins sooner, with lambda 1 it never counts
    assert greedy_select(difficulty, emb, 2, lam=1.0).tolist() == [0, 1]


def test_baselines_size_and_distinct():
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(50, 6))
    diff = rng.random(50)
    for method in ("ddcf", "random", "difficulty", "diversity"):
        idx = select_questions(method, 7, difficulty=diff, embeddings=emb, lam=0.2, rng=np.random.default_rng(1))
        assert len(idx) == 7 == len(set(idx.tolist()))
    assert len(select_questions("full", 7, difficulty=diff, embeddings=emb, lam=0.2, rng=rng)) == 50


def test_arithmetic_questions_are_distinct_and_correct():
    fam = QuestionFamily(ops=("+", "-"), min_digits=1, max_digits=3, reverse_answer=True)
    qs = arithmetic_questions(300, fam, np.random.default_rng(0))
    assert qs["question"].n_unique() == 300
    for q, a in zip(qs["question"], qs["answer"]):
        assert str(eval(q[:-1])) == a[::-1]
    with pytest.raises(ValueError, match="n: .* distinct"):
        arithmetic_questions(1000, QuestionFamily(ops=("+",), max_digits=1), np.random.default_rng(0))


class _Oracle(torch.nn.Module):
    """Logits that put all mass on a given next-token table: exact match is then known."""

    def __init__(self, next_ids: torch.Tensor, vocab: int = 257) -> None:
        super().__init__()
        self.next_ids, self.vocab = next_ids, vocab

    def forward(self, input_ids, use_cache=False):
        logits = torch.nn.functional.one_hot(self.next_ids[:, : input_ids.shape[1]], self.vocab).float()
        return type("Out", (), {"logits": logits})


def test_exact_match_is_every_answer_argmax_right():
    tok = byte_tokenizer()
    data = encode_qa(tok, ["12+3=", "7-7="], ["51", "0"], seq_len=16)
    gold = data.ids[:, 1:].clone()
    assert exact_match(_Oracle(gold), data).tolist() == [True, True]
    wrong = gold.clone()
    pos = int(data.target_mask[0].nonzero()[-1])  # the EOS after the answer: a model that keeps going
    wrong[0, pos] = 5
    assert exact_match(_Oracle(wrong), data).tolist() == [False, True]
    wrong = gold.clone()
    wrong[1, 0] = 9  # a question position: not scored
    assert exact_match(_Oracle(wrong), data).tolist() == [True, True]


def test_bad_input_errors_name_the_problem(tmp_path: Path):
    with pytest.raises(ValueError, match="k: must be in"):
        greedy_select(np.zeros(3), np.eye(3), 4)
    with pytest.raises(ValueError, match="embeddings: expected"):
        greedy_select(np.zeros(3), np.eye(4), 2)
    with pytest.raises(ValueError, match="q_emb: expected"):
        fit_predictor(np.zeros((2, 5), np.int8), np.zeros((4, 3), np.float32), PredictorConfig())
    with pytest.raises(ValueError, match="targets: expected a tag"):
        SelectConfig(targets=("big",))
    (tmp_path / "params").mkdir()
    (tmp_path / "params" / "select.yaml").write_text("select:\n  n_pool: 100\n  lamda: 0.3\n")
    with pytest.raises(ConfigError, match=r"params/select.yaml:3: select.lamda: unknown key 'lamda'"):
        load_stage_config(SelectConfig, tmp_path, "select", "demo")
    (tmp_path / "params" / "select.yaml").write_text("select:\n  lam: 1.5\n")
    with pytest.raises(ConfigError, match=r"params/select.yaml:2: select.lam: must be in \[0, 1\]"):
        load_stage_config(SelectConfig, tmp_path, "select", "demo")
    (tmp_path / "params" / "select.yaml").write_text("select:\n  pool: {shapes: [d15_l1]}\n")
    with pytest.raises(ConfigError, match=r"params/select.yaml.*select.pool.*d15_l1"):
        load_stage_config(SelectConfig, tmp_path, "select", "demo")


@pytest.mark.parametrize("preset", ["ci", "demo", "full"])
def test_params_file_loads(preset):
    cfg = load_stage_config(SelectConfig, ROOT, "select", preset)
    assert cfg.ks() and all(1 <= k < cfg.n_pool for k in cfg.ks())


def test_small_run_end_to_end_with_stand_in_embeddings():
    """The whole setting on a tiny config; embeddings stand in for MiniLM (a fixed projection of the
    question's digit counts), so the test needs no weights and stays fast."""
    import dataclasses

    cfg = load_stage_config(SelectConfig, ROOT, "select", "ci")
    cfg = dataclasses.replace(cfg, n_pool=200, n_seed=40, n_test=60,
                              pool=dataclasses.replace(cfg.pool, snapshot_steps=(10, 20)),
                              target_pretrain_steps=10, finetune=dataclasses.replace(cfg.finetune, steps=5))

    def embed(texts):
        feats = np.array([[len(t), t.count("-"), t.count("+"), sum(c.isdigit() for c in t)] for t in texts], float)
        return (feats @ np.random.default_rng(0).normal(size=(4, 16))).astype(np.float32)

    res = run_arithmetic_setting(cfg, embed=embed)
    methods = {r["method"] for r in res.rows}
    assert methods == {"base", *cfg.methods}
    assert res.matrix.shape == (cfg.pool.n_models, cfg.n_seed)
    full = next(r for r in res.rows if r["method"] == "full")
    assert full["labels_used"] == cfg.n_pool and full["k"] == cfg.n_pool
    ddcf = next(r for r in res.rows if r["method"] == "ddcf")
    assert ddcf["labels_used"] == ddcf["k"] + cfg.n_seed == 10 + 40
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in res.rows)
    # the pool trained in two worker processes: the same matrix, in the same order, and the same results
    again = run_arithmetic_setting(dataclasses.replace(cfg, pool=dataclasses.replace(cfg.pool, workers=2)), embed=embed)
    assert again.pool_models == res.pool_models and (again.matrix == res.matrix).all()
    assert [r["accuracy"] for r in again.rows] == [r["accuracy"] for r in res.rows]
