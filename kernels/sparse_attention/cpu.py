"""Sparse prefill attention on CPU: gathered keys, batched over groups of query chunks, fused attention.

The same two functions as :mod:`kernels.sparse_attention.reference`, with the same results (to fp32
rounding), written for speed on CPU instead of as a definition:

* each query chunk's listed keys are gathered once as row copies (``index_select`` on the flattened
  k and v), and the query heads sharing a list (a GQA group, for QuoKA's per-KV-head lists) are
  stacked into the rows of one problem, so a shared list is gathered once, not once per head;
* the chunks are the "heads" of one call of PyTorch's fused CPU attention
  (``scaled_dot_product_attention``: scaling, additive mask, softmax and the product with v in
  cache-sized tiles), ``group`` chunks at a time so the additive mask stays near ``SCORES_BUDGET``
  floats; one call serves many chunks where a per-chunk loop pays its overhead ``n / chunk_size``
  times;
* the additive mask (causal test, padding of the lists, the model's mask at the listed keys) is
  built once per list and copied to the rows of its query heads. A boolean mask would be
  converted to an additive one inside the call, twice the cost.

``block_sparse_attention`` expands block indices to key positions and runs the same path; for
query blocks as small as 16 the gather of the listed keys, not the products, is most of the cost.
On one SmolLM2 layer at 8k tokens (9 query heads, 3 KV heads, 12% of the pairs, chunks of 128), one
thread: 230-250 ms here against 990-1,540 ms for dense causal ``scaled_dot_product_attention``
(``benchmarks/sparse_speed.py`` times the methods end to end).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels.sparse_attention.reference import _check

__all__ = ["gathered_attention", "block_sparse_attention"]

SCORES_BUDGET = 1 << 22  # fp32 scores per group of chunks (16 MiB)


def gathered_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, *, chunk_size: int,
                       scaling: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`kernels.sparse_attention.reference.gathered_attention`: q (b, hq, nq, d), k, v
    (b, hkv, n, d), keys (b, hkv or hq, ceil(nq / chunk_size), m) -> (b, hq, nq, d) in ``q.dtype``."""
    _check(q, k, v, keys, chunk_size, mask, lists_name="keys", size_name="chunk_size")
    b, hq, nq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    hs, n_chunks, m = keys.shape[1], keys.shape[2], keys.shape[3]
    c = chunk_size
    g = hq // hs  # query heads stacked per key list: the GQA group, or 1 for per-head lists
    heads_kv = torch.arange(hs, device=k.device) // (hs // hkv)  # the KV head each key list reads
    pad = n_chunks * c - nq
    qf = q.float()
    if pad:
        qf = torch.nn.functional.pad(qf, (0, 0, 0, pad))
    # (b, hs, chunks, g * c, d): the rows of chunk i for the g query heads sharing list (b, s, i)
    qs = qf.view(b, hs, g, n_chunks, c, d).permute(0, 1, 3, 2, 4, 5).reshape(b, hs, n_chunks, g * c, d)
    qpos = (n - nq) + torch.arange(n_chunks * c, device=q.device).view(n_chunks, 1, c)  # (chunks, 1, c)
    out = torch.empty(b, hs, n_chunks, g * c, d, dtype=torch.float32, device=q.device)
    kf, vf = k.float().reshape(b * hkv * n, d), v.float().reshape(b * hkv * n, d)
    # the row of (batch, KV head) 0 of each key list in the flattened k, v: (b, hs, 1, 1)
    base = ((torch.arange(b, device=k.device)[:, None] * hkv + heads_kv[None, :]) * n)[:, :, None, None]
    group = max(1, SCORES_BUDGET // max(1, b * hs * g * c * m))
    for s in range(0, n_chunks, group):
        e = min(s + group, n_chunks)
        kp = keys[:, :, s:e].long()  # (b, hs, G, m)
        valid = kp >= 0
        idx = kp.clamp(min=0)
        rows_kv = (base + idx).flatten()
        kg = kf.index_select(0, rows_kv).view(b, hs, e - s, m, d)  # row copies: the fastest gather on CPU
        vg = vf.index_select(0, rows_kv).view(b, hs, e - s, m, d)
        # additive mask, built once per KV-head list (b, hs, G, c, m) and copied to its g query heads' rows
        allowed = valid[:, :, :, None, :] & (kp[:, :, :, None, :] <= qpos[None, None, s:e, 0, :, None])
        bias = torch.zeros(allowed.shape, dtype=torch.float32, device=q.device)
        if mask is not None:
            mrows = _mask_rows(mask, s * c, e * c, nq, c)  # (b, G, c, n)
            bias += torch.gather(mrows[:, None].expand(b, hs, e - s, c, n), 4,
                                 idx[:, :, :, None, :].expand(b, hs, e - s, c, m))
        bias.masked_fill_(~allowed, -math.inf)
        bias = bias[:, :, :, None].expand(b, hs, e - s, g, c, m).reshape(b * hs, e - s, g * c, m)
        # PyTorch's fused CPU attention: scale, mask, softmax and the product with v in cache-sized tiles
        att = F.scaled_dot_product_attention(
            qs[:, :, s:e].reshape(b * hs, e - s, g * c, d), kg.view(b * hs, e - s, m, d), vg.view(b * hs, e - s, m, d),
            attn_mask=bias, scale=scaling)
        out[:, :, s:e] = att.view(b, hs, e - s, g * c, d)
    out = out.nan_to_num_(0.0)  # a query with no allowed key: zeros
    out = out.view(b, hs, n_chunks, g, c, d).permute(0, 1, 3, 2, 4, 5).reshape(b, hq, n_chunks * c, d)
    return out[:, :, :nq].to(q.dtype)


def _mask_rows(mask: torch.Tensor, start: int, end: int, nq: int, c: int) -> torch.Tensor:
    """The additive mask's rows for queries [start, end) as (b, chunks, c, n), padded rows at 0."""
    rows = mask[:, 0, start:min(end, nq)]
    if end > nq:
        rows = torch.nn.functional.pad(rows, (0, 0, 0, end - nq))
    return rows.reshape(mask.shape[0], (end - start) // c, c, mask.shape[-1])


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, *,
                           block_size: int, scaling: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`kernels.sparse_attention.reference.block_sparse_attention`: blocks (b, hkv or hq,
    ceil(nq / block_size), m) key-block indices -> (b, hq, nq, d) in ``q.dtype``."""
    _check(q, k, v, blocks, block_size, mask, lists_name="blocks", size_name="block_size")
    n = k.shape[2]
    pos = blocks.long()[..., None] * block_size + torch.arange(block_size, device=blocks.device)
    pos = torch.where((blocks[..., None] >= 0) & (pos < n), pos, -1).flatten(-2)
    return gathered_attention(q, k, v, pos, chunk_size=block_size, scaling=scaling, mask=mask)
