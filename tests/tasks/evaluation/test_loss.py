from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tasks.evaluation.loss import evaluate_loss, evaluation_windows
from tasks.training.config import ModelShape
from tasks.training.model import build_model


class _Out:
    def __init__(self, logits):
        self.logits = logits


class UniformLM(nn.Module):
    """Logits all zero: every next token has probability 1/V, so the loss is exactly log V."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, use_cache=False):
        return _Out(torch.zeros(*input_ids.shape, self.vocab) + 0 * self.dummy)


@pytest.fixture(scope="module")
def model():
    return build_model(ModelShape(d_model=32, n_layers=1, n_heads=2), 256, 16, seed=3)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, 256, size=1000).astype(np.uint16)


def test_uniform_model_gives_log_vocab(tokens):
    assert evaluate_loss(UniformLM(256), tokens, seq_len=16, batch_size=7) == pytest.approx(math.log(256), rel=1e-6)  # fp32 logsumexp


def test_matches_manual_windows(model, tokens):
    seq, max_tokens = 16, 300  # 299 // 16 = 18 windows; the tail is dropped
    assert evaluation_windows(len(tokens), seq, max_tokens) == 18
    n = 18 * seq
    x = torch.from_numpy(tokens[:n].astype(np.int64)).view(18, seq)
    y = torch.from_numpy(tokens[1 : n + 1].astype(np.int64)).view(18, seq)
    with torch.no_grad():
        logits = model(input_ids=x, use_cache=False).logits
    expected = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)).item()
    got = evaluate_loss(model, tokens, seq_len=seq, batch_size=5, max_tokens=max_tokens)
    assert got == pytest.approx(expected, rel=1e-6)


def test_batch_size_does_not_change_result_and_mode_is_restored(model, tokens):
    model.train()
    a = evaluate_loss(model, tokens, 16, batch_size=1, max_tokens=500)
    b = evaluate_loss(model, tokens, 16, batch_size=64, max_tokens=500)
    assert a == pytest.approx(b, rel=1e-6)
    assert model.training
    assert evaluate_loss(model, tokens, 16, batch_size=64, max_tokens=500) == b  # deterministic


def test_max_tokens_limits_the_data(model, tokens):
    corrupted = tokens.copy()
    corrupted[200:] = 0
    assert evaluate_loss(model, tokens, 16, 8, max_tokens=193) == evaluate_loss(model, corrupted, 16, 8, max_tokens=193)
    assert evaluate_loss(model, tokens, 16, 8, max_tokens=500) != evaluate_loss(model, corrupted, 16, 8, max_tokens=500)


def test_too_few_tokens_raises(model):
    with pytest.raises(ValueError, match="tokens"):
        evaluate_loss(model, np.zeros(16, dtype=np.uint16), 16, 4)
