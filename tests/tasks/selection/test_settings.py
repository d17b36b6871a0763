"""DDCF setting (a) (tasks/selection/settings.py): the question family, exact match, a small run end to end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.common.params import load_stage_config
from tasks.selection.config import QuestionFamily, SelectConfig
from tasks.selection.settings import arithmetic_questions, byte_tokenizer, encode_qa, exact_match, run_arithmetic_setting

ROOT = Path(__file__).resolve().parents[3]


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
