from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tasks.lm.loss import (evaluate_loss, evaluation_windows, loss_by_document, loss_by_group, target_indices,
                                   token_losses)
from tasks.lm.model import ModelShape
from tasks.lm.model import build_model


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


class NextTokenLM(nn.Module):
    """Puts probability ``p`` on ``(x + 1) % V`` after token ``x``, the rest spread evenly: known per-token losses."""

    def __init__(self, vocab: int, p: float = 0.9) -> None:
        super().__init__()
        self.vocab, self.p = vocab, p
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, use_cache=False):
        probs = torch.full((*input_ids.shape, self.vocab), (1 - self.p) / (self.vocab - 1))
        probs.scatter_(-1, ((input_ids + 1) % self.vocab).unsqueeze(-1), self.p)
        return _Out(probs.log() + 0 * self.dummy)


def _expected_losses(tokens: np.ndarray, m: int, vocab: int, p: float) -> np.ndarray:
    hit = tokens[1 : m + 1] == (tokens[:m] + 1) % vocab
    return np.where(hit, -math.log(p), -math.log((1 - p) / (vocab - 1)))


@pytest.mark.parametrize("seq_len,max_tokens", [(16, None), (7, 300), (63, 500)], ids=["T16-all", "T7-300", "T63-500"])
def test_token_losses_match_known_logits(seq_len, max_tokens):
    vocab, p = 8, 0.9
    rng = np.random.default_rng(1)
    # Half the steps follow the model's rule, so both loss values occur.
    steps = np.where(rng.random(999) < 0.5, 1, rng.integers(2, vocab, 999))
    tokens = (np.concatenate([[0], np.cumsum(steps)]) % vocab).astype(np.uint16)
    losses = token_losses(NextTokenLM(vocab, p), tokens, seq_len, batch_size=3, max_tokens=max_tokens)
    m = evaluation_windows(len(tokens), seq_len, max_tokens) * seq_len
    assert losses.shape == (m,) and losses.dtype == np.float64
    np.testing.assert_allclose(losses, _expected_losses(tokens, m, vocab, p), rtol=1e-5)
    assert evaluate_loss(NextTokenLM(vocab, p), tokens, seq_len, 3, max_tokens=max_tokens) == losses.sum() / m


def test_evaluate_loss_is_the_mean_of_token_losses(model, tokens):
    losses = token_losses(model, tokens, 16, batch_size=5, max_tokens=300)
    assert losses.shape == (18 * 16,)
    assert evaluate_loss(model, tokens, 16, 5, max_tokens=300) == float(losses.sum() / losses.size)


def test_loss_by_group_labels_the_scored_target_tokens():
    vocab, p = 8, 0.9
    # Document "a" follows the model's rule (low loss), document "b" does not; they alternate
    # every 5 tokens, so labelling by input position instead of target position mixes them up.
    rule = np.arange(5) % vocab
    other = np.array([0, 3, 6, 1, 4])
    tokens = np.concatenate([rule if i % 2 == 0 else other for i in range(40)]).astype(np.uint16)
    token_source = np.array([["a", "b"][(i // 5) % 2] for i in range(len(tokens))])
    losses = token_losses(NextTokenLM(vocab, p), tokens, seq_len=9, batch_size=4)
    expected = _expected_losses(tokens, len(losses), vocab, p)
    idx = target_indices(len(losses))
    assert idx[0] == 1 and idx[-1] == len(losses) and idx.shape == losses.shape
    groups = loss_by_group(losses, token_source[idx])
    targets = token_source[1 : len(losses) + 1]
    assert set(groups) == {"a", "b"}
    for label in ("a", "b"):
        n, mean = groups[label]
        assert n == int(np.sum(targets == label))
        assert mean == pytest.approx(expected[targets == label].mean(), rel=1e-6)
    assert groups != loss_by_group(losses, token_source[: len(losses)])  # the off-by-one is visible
    total = sum(n * m for n, m in groups.values()) / sum(n for n, _ in groups.values())
    assert total == pytest.approx(losses.mean(), rel=1e-12)


def test_loss_by_group_shapes_and_labels():
    assert loss_by_group(np.array([1.0, 2.0, 4.0]), np.array([3, 3, 7], dtype=np.int32)) == {3: (2, 1.5), 7: (1, 4.0)}
    assert loss_by_group(np.zeros(0), np.zeros(0, dtype=np.int64)) == {}
    with pytest.raises(ValueError, match="groups"):
        loss_by_group(np.zeros(3), np.zeros(4))


def test_loss_by_document_sums_each_documents_scored_targets():
    losses = np.array([0.5, 1.0, 2.0, 4.0, 8.0, 16.0])
    docs = np.array([3, 3, 0, 3, 7, 7], dtype=np.int32)  # document 3 is split around document 0
    doc, tokens, loss_sum = loss_by_document(losses, docs)
    assert doc.tolist() == [0, 3, 7] and tokens.tolist() == [1, 3, 2]
    assert loss_sum.tolist() == [2.0, 5.5, 24.0] and loss_sum.dtype == np.float64
    # documents with no scored target (1, 2, 4..6) are absent, never a 0.0 loss
    assert loss_sum.sum() / tokens.sum() == pytest.approx(losses.mean(), rel=1e-15)
    empty = loss_by_document(np.zeros(0), np.zeros(0, dtype=np.int64))
    assert [len(a) for a in empty] == [0, 0, 0]


@pytest.mark.parametrize("docs", [np.array([0, 1]), np.array([0, -1, 2]), np.array([0.0, 1.0, 2.0])],
                         ids=["short", "negative", "float"])
def test_loss_by_document_refuses_misaligned_or_bad_indices(docs):
    with pytest.raises(ValueError, match="docs"):
        loss_by_document(np.ones(3), docs)
