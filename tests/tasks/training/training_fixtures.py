"""Shared helpers for the training tests (not a conftest: basenames must be unique across test folders): a learnable synthetic token stream and a tiny config."""

from __future__ import annotations

import numpy as np
import pytest

from tasks.training.config import TrainingConfig
from tasks.lm.model import ModelShape


def markov_tokens(n: int, vocab: int = 256, branching: int = 4, seed: int = 0) -> np.ndarray:
    """A first-order Markov chain with ``branching`` successors per token: entropy log(branching),
    so a model that learns it goes from ~log(vocab) = 5.55 nats towards log(4) = 1.39."""
    rng = np.random.default_rng(seed)
    table = rng.integers(0, vocab, size=(vocab, branching))
    choice = rng.integers(0, branching, size=n)
    out = np.empty(n, dtype=np.uint16)
    t = 0
    for i in range(n):
        t = table[t, choice[i]]
        out[i] = t
    return out


@pytest.fixture(scope="session")
def tokens() -> tuple[np.ndarray, np.ndarray]:
    data = markov_tokens(60_000)
    return data[:50_000], data[50_000:]


def tiny_config(**overrides) -> TrainingConfig:
    base = dict(
        vocab_size=256, seq_len=32, sizes=(ModelShape(d_model=32, n_layers=1, n_heads=2),),
        token_budgets=(4096,), batch_size=4, lr=3e-3, eval_interval=8, eval_tokens=2048,
        log_interval=4, checkpoint_interval=0, seed=0, num_threads=1,
    )
    base.update(overrides)
    return TrainingConfig(**base)
