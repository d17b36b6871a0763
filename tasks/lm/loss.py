"""Held-out cross-entropy of a causal LM on a token stream: the loss every stage reports.

Shared by training (validation loss), compression and sparse evaluation, so their numbers are
directly comparable: same windows, same reduction, same precision rule. :func:`token_losses` keeps
every prediction's loss so a caller can split the validation loss by source (:func:`loss_by_group`)
or by document (:func:`loss_by_document`), with :func:`target_indices` aligning losses to the
tokens they score.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def evaluation_windows(n_tokens: int, seq_len: int, max_tokens: int | None = None) -> int:
    """How many non-overlapping windows of ``seq_len`` predictions fit in the first ``max_tokens`` tokens."""
    n = n_tokens if max_tokens is None else min(n_tokens, max_tokens)
    return max(0, (n - 1) // seq_len)


def token_losses(
    model: nn.Module,
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int,
    max_tokens: int | None = None,
    device: torch.device | str | None = None,
) -> np.ndarray:
    """Per-token cross-entropy in nats of every scored prediction, shape ``(M,)`` float64.

    ``M = n_windows * T`` with ``T = seq_len`` and ``n_windows = evaluation_windows(len(tokens), T,
    max_tokens)``. Window ``w`` feeds ``tokens[w*T : w*T+T]`` and scores the next tokens
    ``tokens[w*T+1 : w*T+T+1]``, so ``out[i] = -log p(tokens[i+1] | tokens[w*T : i+1])`` with
    ``w = i // T``: entry ``i`` scores target token ``i + 1`` (see :func:`target_indices`), with
    between 0 and ``T-1`` tokens of context. Deterministic: windows in order, no sampling. bf16
    autocast on CUDA (as in training), fp32 elsewhere; logits are upcast to fp32 for the loss.
    The model's train/eval mode is restored afterwards.

    >>> losses = token_losses(model, val_tokens, seq_len=128, batch_size=16, max_tokens=65536)  # doctest: +SKIP
    >>> losses.shape                                                                            # doctest: +SKIP
    (65408,)
    """
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
    n_windows = evaluation_windows(len(tokens), seq_len, max_tokens)
    if n_windows == 0:
        raise ValueError(
            f"tokens: need more than seq_len={seq_len} tokens to evaluate, got "
            f"{len(tokens) if max_tokens is None else min(len(tokens), max_tokens)}"
        )
    device = torch.device(device) if device is not None else _device_of(model)
    span = np.asarray(tokens[: n_windows * seq_len + 1]).astype(np.int64)
    data = torch.from_numpy(span)
    inputs = data[:-1].view(n_windows, seq_len)
    targets = data[1:].view(n_windows, seq_len)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
        "cpu", enabled=False
    )
    out = np.empty(n_windows * seq_len, dtype=np.float64)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), autocast:
            for start in range(0, n_windows, batch_size):
                x = inputs[start : start + batch_size].to(device, non_blocking=True)
                y = targets[start : start + batch_size].to(device, non_blocking=True)
                logits = model(input_ids=x, use_cache=False).logits
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
                out[start * seq_len : start * seq_len + loss.numel()] = loss.double().cpu().numpy()
    finally:
        model.train(was_training)
    return out


def evaluate_loss(
    model: nn.Module,
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int,
    max_tokens: int | None = None,
    device: torch.device | str | None = None,
) -> float:
    """Mean per-token cross-entropy in nats over non-overlapping windows of the first ``max_tokens`` tokens.

    ``L = -(1/M) * sum_t log p(x_{t+1} | x_{<=t})`` over the ``M = n_windows * seq_len`` predictions
    of :func:`token_losses` (same windows, precision and mode handling), summed in float64.

    >>> evaluate_loss(model, val_tokens, seq_len=128, batch_size=16, max_tokens=65536)  # doctest: +SKIP
    5.41
    """
    losses = token_losses(model, tokens, seq_len, batch_size, max_tokens=max_tokens, device=device)
    return float(losses.sum() / losses.size)


def perplexity(loss: float) -> float:
    """``exp(loss)``, ``inf`` where that overflows a float (a mean loss above ~709.8 nats, e.g. a
    diverged recovery run): the row is kept and reads as infinitely bad instead of failing the stage.

    >>> perplexity(0.0), perplexity(1e4)
    (1.0, inf)
    """
    return math.inf if loss >= _MAX_EXP else math.exp(loss)  # NaN stays NaN


_MAX_EXP = math.log(np.finfo(np.float64).max)


def target_indices(n_losses: int) -> np.ndarray:
    """Index into the token stream of the token each of :func:`token_losses`' entries scores.

    Entry ``i`` predicts ``tokens[i + 1]``, so this is ``arange(1, n_losses + 1)``, shape
    ``(n_losses,)`` int64. Label the losses by the document or source of the *predicted* token::

        losses = token_losses(model, val_tokens, T, B, max_tokens)          # (M,)
        tokens, doc = encode_corpus_segments(tok, val["text"])              # doc: (n,) int32
        source = val["source"].to_numpy()[doc[target_indices(len(losses))]]  # (M,)
        loss_by_group(losses, source)   # {"bbc": (n_tokens, mean_nats), ...}
    """
    if n_losses < 0:
        raise ValueError(f"n_losses: must be >= 0, got {n_losses}")
    return np.arange(1, n_losses + 1, dtype=np.int64)


def loss_by_group(losses: np.ndarray, groups: np.ndarray) -> dict:
    """Token count and mean loss per group label: ``{label: (n_tokens, mean_loss)}``.

    ``losses``: ``(M,)`` per-token losses (:func:`token_losses`); ``groups``: ``(M,)`` the label of
    each scored *target* token (index the token-level labels with :func:`target_indices`, not with
    the input positions). Labels may be strings or integers; they come back as Python scalars in
    sorted order; groups with no scored token are absent (never a 0.0 loss). Means are float64; the
    token-weighted mean of the group means equals ``losses.mean()``.

    >>> loss_by_group(np.array([1.0, 3.0, 2.0]), np.array(["a", "a", "b"]))
    {'a': (2, 2.0), 'b': (1, 2.0)}
    """
    losses = np.asarray(losses, dtype=np.float64)
    groups = np.asarray(groups)
    if losses.ndim != 1 or groups.shape != losses.shape:
        raise ValueError(f"groups: need one label per loss, got shapes {groups.shape} and {losses.shape}")
    if losses.size == 0:
        return {}
    labels, inverse = np.unique(groups, return_inverse=True)
    counts = np.bincount(inverse, minlength=len(labels))
    sums = np.bincount(inverse, weights=losses, minlength=len(labels))
    return {
        (lab.item() if isinstance(lab, np.generic) else lab): (int(n), float(t / n))
        for lab, n, t in zip(labels, counts, sums)
    }


def loss_by_document(losses: np.ndarray, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scored-token count and summed loss per document: ``(doc, tokens, loss_sum)``.

    ``losses``: ``(M,)`` per-token losses (:func:`token_losses`); ``docs``: ``(M,)`` non-negative
    integer document index of each scored *target* token (index the token-level document index of
    :func:`tasks.training.tokenizer.encode_corpus_segments` with :func:`target_indices`). Returns
    three arrays of one entry per document with at least one scored target, in increasing ``doc``
    order: ``doc`` int64, ``tokens`` int64, ``loss_sum`` float64 nats (``sum_{t in doc} l_t``).
    Sums, not means, so a paired difference between two models bootstraps over documents with
    each document weighted by its tokens, and ``loss_sum.sum() / tokens.sum()`` is
    ``losses.mean()`` (the full-split loss) up to float64 rounding.

    >>> loss_by_document(np.array([1.0, 3.0, 2.0]), np.array([4, 4, 7]))
    (array([4, 7]), array([2, 1]), array([4., 2.]))
    """
    losses = np.asarray(losses, dtype=np.float64)
    docs = np.asarray(docs)
    if losses.ndim != 1 or docs.shape != losses.shape:
        raise ValueError(f"docs: need one document index per loss, got shapes {docs.shape} and {losses.shape}")
    if docs.size and (not np.issubdtype(docs.dtype, np.integer) or int(docs.min()) < 0):
        raise ValueError(f"docs: need non-negative integer document indices, got dtype {docs.dtype}")
    if losses.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float64)
    docs = docs.astype(np.int64)
    counts = np.bincount(docs)
    sums = np.bincount(docs, weights=losses)
    present = np.flatnonzero(counts)
    return present.astype(np.int64), counts[present].astype(np.int64), sums[present].astype(np.float64)
