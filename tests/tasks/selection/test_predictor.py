"""DDCF's predictor (tasks/selection/predictor.py): it learns a matrix, predicts an unseen target, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks.selection.config import PredictorConfig
from tasks.selection.predictor import DDCFPredictor, fit_predictor, predict_correct, roc_auc


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


def test_bad_input_errors_name_the_problem():
    with pytest.raises(ValueError, match="q_emb: expected"):
        fit_predictor(np.zeros((2, 5), np.int8), np.zeros((4, 3), np.float32), PredictorConfig())
