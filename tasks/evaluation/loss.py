"""Held-out cross-entropy of a causal LM on a token stream: the loss every stage reports.

Shared by training (validation loss), compression and sparse evaluation, so their numbers are
directly comparable: same windows, same reduction, same precision rule.
"""

from __future__ import annotations

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


def evaluate_loss(
    model: nn.Module,
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int,
    max_tokens: int | None = None,
    device: torch.device | str | None = None,
) -> float:
    """Mean per-token cross-entropy in nats over non-overlapping windows of the first ``max_tokens`` tokens.

    Window ``w`` feeds ``tokens[w*T : w*T+T]`` and scores the next tokens ``tokens[w*T+1 : w*T+T+1]``
    (``T = seq_len``), so every scored token is predicted once, with between 0 and ``T-1`` tokens of
    context. ``L = -(1/M) * sum_t log p(x_{t+1} | x_{<=t})`` over the ``M = n_windows * T``
    predictions, accumulated in float64. Deterministic: windows in order, no sampling.
    bf16 autocast on CUDA (as in training), fp32 elsewhere; logits are upcast to fp32 for the loss.
    The model's train/eval mode is restored afterwards.

    >>> evaluate_loss(model, val_tokens, seq_len=128, batch_size=16, max_tokens=65536)  # doctest: +SKIP
    5.41
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
    was_training = model.training
    model.eval()
    total = 0.0
    try:
        with torch.inference_mode(), autocast:
            for start in range(0, n_windows, batch_size):
                x = inputs[start : start + batch_size].to(device, non_blocking=True)
                y = targets[start : start + batch_size].to(device, non_blocking=True)
                logits = model(input_ids=x, use_cache=False).logits
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
                total += float(loss.double())
    finally:
        model.train(was_training)
    return total / (n_windows * seq_len)
