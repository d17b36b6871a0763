"""DDCF's correctness predictor (Difficulty–Diversity Collaborative Filtering; the DDCF paper; 
public code iNLP-Lab/DDCF) and the target's difficulty it yields.

A learned embedding ``u_m`` per model and a frozen sentence embedding ``e_q`` per question
(:func:`tasks.lm.embeddings.question_embeddings`), each through residual MLP blocks,
``h_m = R_m(u_m)``, ``h_q = R_q(W e_q)``, then a linear 2-class head on ``h_m ⊙ h_q``:
``P(correct | m, q) = softmax(W_o (h_m ⊙ h_q) + b_o)[1]`` (:class:`DDCFPredictor`). Trained by
cross-entropy on the correctness matrix's observed cells, with Gaussian noise ``α · N(0, I)`` added
to ``e_q`` (:func:`fit_predictor`; the paper's defaults α = 0.01, 30 epochs, Adam lr 1e-3). A target
model seen only on the seed set gets its own row; its **difficulty** for a pool question is
``d_q = P(correct | target, q)`` (:func:`target_difficulty`), and the predictor's AUC is measured on
a random ``holdout_frac`` of the cells left out of its training (:func:`roc_auc`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tasks.selection.config import PredictorConfig
from tasks.lm.embeddings import EMBED_DIM


class ResidualBlock(nn.Module):
    """``x + W2 · GELU(W1 · LayerNorm(x))`` (a pre-norm residual MLP block, width 2·hidden)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class DDCFPredictor(nn.Module):
    """P(correct | model m, question q) from a model embedding and a frozen question embedding.

    ``forward(model_idx (B,), q_emb (B, q_dim)) -> logits (B, 2)``; class 1 is "correct".
    """

    def __init__(self, n_models: int, q_dim: int = EMBED_DIM, hidden: int = 64, n_blocks: int = 1) -> None:
        super().__init__()
        self.model_emb = nn.Embedding(n_models, hidden)
        nn.init.normal_(self.model_emb.weight, std=1.0)
        self.q_proj = nn.Linear(q_dim, hidden)
        self.model_tower = nn.Sequential(*[ResidualBlock(hidden) for _ in range(n_blocks)])
        self.q_tower = nn.Sequential(*[ResidualBlock(hidden) for _ in range(n_blocks)])
        self.head = nn.Linear(hidden, 2)

    def forward(self, model_idx: torch.Tensor, q_emb: torch.Tensor) -> torch.Tensor:
        h_m = self.model_tower(self.model_emb(model_idx))
        h_q = self.q_tower(self.q_proj(q_emb))
        return self.head(h_m * h_q)


def _check_matrix(matrix: np.ndarray, q_emb: np.ndarray) -> None:
    if matrix.ndim != 2:
        raise ValueError(f"matrix: expected a (models, questions) array, got shape {matrix.shape}")
    if q_emb.ndim != 2 or q_emb.shape[0] != matrix.shape[1]:
        raise ValueError(f"q_emb: expected ({matrix.shape[1]}, dim) to match the matrix's questions, "
                         f"got shape {q_emb.shape}")


def fit_predictor(matrix: np.ndarray, q_emb: np.ndarray, cfg: PredictorConfig,
                  train_mask: np.ndarray | None = None) -> DDCFPredictor:
    """Train :class:`DDCFPredictor` on the observed cells of ``matrix`` (models, questions), values
    0/1 or -1 for "not observed", with question embeddings ``q_emb`` (questions, dim).

    ``train_mask`` (same shape, bool) restricts training to some cells (the rest are held out).
    Row ``m`` of the matrix is model index ``m``; a target seen only on some questions is a row
    with -1 elsewhere.
    """
    _check_matrix(matrix, q_emb)
    observed = matrix >= 0
    if train_mask is not None:
        observed &= train_mask
    rows, cols = np.nonzero(observed)
    if rows.size == 0:
        raise ValueError("matrix: no observed cells to train the predictor on")
    labels = torch.from_numpy(matrix[rows, cols].astype(np.int64))
    m_idx, q_idx = torch.from_numpy(rows), torch.from_numpy(cols)
    emb = torch.from_numpy(np.ascontiguousarray(q_emb, dtype=np.float32))
    gen = torch.Generator().manual_seed(cfg.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        net = DDCFPredictor(matrix.shape[0], q_emb.shape[1], cfg.hidden, cfg.n_blocks)
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    net.train()
    for _ in range(cfg.epochs):
        perm = torch.randperm(rows.size, generator=gen)
        for s in range(0, rows.size, cfg.batch_size):
            b = perm[s : s + cfg.batch_size]
            q = emb[q_idx[b]]
            if cfg.noise > 0:
                q = q + cfg.noise * torch.randn(q.shape, generator=gen)
            loss = F.cross_entropy(net(m_idx[b], q), labels[b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return net.eval()


@torch.no_grad()
def predict_correct(net: DDCFPredictor, model_idx: int | np.ndarray, q_emb: np.ndarray) -> np.ndarray:
    """P(correct) of model ``model_idx`` (an int: one model on every question; an array: one
    model per question) on questions ``q_emb`` (n, dim); shape (n,)."""
    q = torch.from_numpy(np.ascontiguousarray(q_emb, dtype=np.float32))
    m = torch.as_tensor(np.broadcast_to(np.asarray(model_idx), (q.shape[0],)).copy(), dtype=torch.long)
    return torch.softmax(net(m, q), dim=-1)[:, 1].numpy()


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """Area under the ROC curve (the Mann–Whitney U statistic, ties counted half); None when only
    one class is present."""
    scores, labels = np.asarray(scores, float), np.asarray(labels).astype(bool)
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if n_pos == 0 or n_neg == 0:
        return None
    from scipy.stats import rankdata

    ranks = rankdata(scores)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def target_difficulty(pool_matrix: np.ndarray, target_row: np.ndarray, emb_seed: np.ndarray, emb_pool: np.ndarray,
                      cfg: PredictorConfig, holdout_key: int) -> tuple[np.ndarray, float | None]:
    """Fit the predictor on the pool models' rows and the target's seed row (the last row), leaving a
    random ``cfg.holdout_frac`` of the cells out (seeded by ``(cfg.seed, holdout_key)``); returns
    the target's predicted P(correct) on the pool, shape (n_pool,), and the AUC on the held-out
    observed cells (None when they hold one class only or none). Cells of -1 are unobserved."""
    matrix = np.vstack([pool_matrix, np.asarray(target_row)[None]]).astype(np.int8)
    held = np.random.default_rng([cfg.seed, holdout_key]).random(matrix.shape) < cfg.holdout_frac
    net = fit_predictor(matrix, emb_seed, cfg, train_mask=~held)
    r, c = np.nonzero(held & (matrix >= 0))
    auc = roc_auc(predict_correct(net, r, emb_seed[c]), matrix[r, c]) if r.size else None
    return predict_correct(net, matrix.shape[0] - 1, emb_pool), auc
