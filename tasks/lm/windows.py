"""Token windows: a token stream cut into the (n, T) model inputs that calibration, distillation and
sparse-inference thresholds run on."""

from __future__ import annotations

import numpy as np
import torch


def token_windows(tokens: np.ndarray | torch.Tensor, seq_len: int) -> torch.Tensor:
    """(n, T) int64 windows: ``tokens`` as given when 2-D, else a 1-D stream cut into
    ``len(tokens) // seq_len`` non-overlapping windows of ``seq_len`` (the remainder dropped; none
    when the stream is shorter than one window). Callers decide what too few windows means.

    >>> token_windows(np.arange(7), 3)
    tensor([[0, 1, 2],
            [3, 4, 5]])
    """
    t = torch.as_tensor(np.asarray(tokens) if not isinstance(tokens, torch.Tensor) else tokens).long()
    if t.dim() == 2:
        return t
    if t.dim() != 1:
        raise ValueError(f"tokens: expected a 1-D stream or (n, T) windows, got shape {tuple(t.shape)}")
    return t[: (t.numel() // seq_len) * seq_len].view(-1, seq_len)
