"""DDCF's greedy selection (tasks/selection/selection.py): the objective, the baselines, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from tasks.selection.selection import greedy_select, select_questions


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


def test_bad_input_errors_name_the_problem():
    with pytest.raises(ValueError, match="k: must be in"):
        greedy_select(np.zeros(3), np.eye(3), 4)
    with pytest.raises(ValueError, match="embeddings: expected"):
        greedy_select(np.zeros(3), np.eye(4), 2)
