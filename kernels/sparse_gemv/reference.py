"""TEAL's sparse matrix-vector product in plain fp32 torch, by gathering the active weight columns.

TEAL (Liu et al., 2024, "Training-Free Activation Sparsity in Large Language Models") zeroes the
low-magnitude entries of a linear layer's input, ``s_t(x)_i = x_i if |x_i| >= t else 0``, and computes
``y = W s_t(x)`` reading only the columns ``W[:, i]`` of active channels ``i``. During decoding the
product is memory-bound, so skipping a fraction ``s`` of the columns saves about ``s`` of the time.

Here that is done literally: per token, the indices of active channels are found and only those
columns are summed, ``y = sum_{i active} x_i W[:, i]`` (``embedding_bag`` with per-sample weights).
That is fast when the weight is stored channel-major, i.e. passed as ``w_t.t()`` with
``w_t = weight.t().contiguous()`` (shape (in, out)): an active channel is then one contiguous row of
``w_t`` — the layout TEAL's kernel uses. A row-major weight makes every column read strided.
"""

from __future__ import annotations

import torch


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 2:
        raise ValueError(f"weight: expected (out_features, in_features), got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x: expected (..., {weight.shape[1]}) to match weight {tuple(weight.shape)}, got {tuple(x.shape)}"
        )


def active_channels(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Boolean mask of the channels TEAL keeps: ``|x| >= threshold`` (same shape as ``x``)."""
    return x.abs() >= threshold


def sparse_gemv(x: torch.Tensor, weight: torch.Tensor, *, threshold: float) -> torch.Tensor:
    """``y = weight @ (x where |x| >= threshold else 0)``, reading only active columns of ``weight``.

    x: (in,) or (tokens, in) (any leading dims); weight: (out, in). Returns (..., out) in ``x.dtype``,
    computed in fp32. ``threshold = 0`` keeps every channel (a dense product).
    """
    _check(x, weight)
    lead = x.shape[:-1]
    xs = x.reshape(-1, x.shape[-1]).float()
    w_t = weight.t().float()  # (in, out): row i is the column of channel i (no copy for fp32)
    out = torch.empty((xs.shape[0], weight.shape[0]), dtype=torch.float32, device=x.device)
    for t in range(xs.shape[0]):
        idx = torch.nonzero(active_channels(xs[t], threshold)).squeeze(1)
        if idx.numel() == 0:  # nothing active: no column is read
            out[t] = 0.0
            continue
        # sum_i x_i * w_t[i, :] over active i: embedding_bag reads just those rows, without
        # materialising the gathered (k, out) matrix that index_select would copy.
        out[t] = torch.nn.functional.embedding_bag(
            idx[None], w_t, per_sample_weights=xs[t, idx][None], mode="sum"
        )[0]
    return out.reshape(*lead, weight.shape[0]).to(x.dtype)
