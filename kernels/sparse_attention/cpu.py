"""Sparse prefill attention on CPU: gathered keys and PyTorch's fused attention, bucketed by list length.

The same two functions as :mod:`kernels.sparse_attention.reference`, with the same results (to fp32
rounding), written for speed on CPU instead of as a definition:

* one problem per (batch, list head, chunk): the chunk's rows of every query head sharing the list
  (a GQA group, for QuoKA's per-KV-head lists) against the list's keys, so a shared list is
  gathered once, not once per head;
* problems are sorted by how many keys their lists name and run in buckets whose lengths are within
  ``SPREAD`` of each other, each padded only to its own longest list (ProxyAttn's per-head budgets
  differ by up to 4x within a block; one padding for all would double the work);
* a bucket's keys are gathered as row copies (``index_select`` on the flattened k and v) and go, as
  the batch of one call, to PyTorch's fused CPU attention (``scaled_dot_product_attention``:
  scaling, additive mask, softmax and the product with v in cache-sized tiles), with an additive
  mask (causal test, list padding, the model's mask at the listed keys) built once per problem and
  copied to the rows of its query heads; a bucket's mask stays near ``SCORES_BUDGET`` floats.

``block_sparse_attention`` expands block indices to key positions and runs the same path.
``benchmarks/sparse_speed.py`` times QuoKA and ProxyAttn through it against dense attention.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels.sparse_attention.reference import _check

__all__ = ["gathered_attention", "block_sparse_attention"]

SCORES_BUDGET = 1 << 22  # additive-mask floats per fused-attention call (16 MiB)
SPREAD = 1.25  # problems whose list lengths are within this factor share one call


def gathered_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, *, chunk_size: int,
                       scaling: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`kernels.sparse_attention.reference.gathered_attention`: q (b, hq, nq, d), k, v
    (b, hkv, n, d), keys (b, hkv or hq, ceil(nq / chunk_size), m) -> (b, hq, nq, d) in ``q.dtype``.

    Each (batch, list head, chunk) is one problem: the chunk's rows of the query heads sharing the
    list against the list's keys. Problems are sorted by how many keys their list names and run in
    buckets of similar lengths, each padded only to its own longest list."""
    _check(q, k, v, keys, chunk_size, mask, lists_name="keys", size_name="chunk_size")
    b, hq, nq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    hs, n_chunks = keys.shape[1], keys.shape[2]
    c = chunk_size
    g = hq // hs  # query heads stacked per key list: the GQA group, or 1 for per-head lists
    dev = q.device
    pad = n_chunks * c - nq
    qf = q.float() if not pad else F.pad(q.float(), (0, 0, 0, pad))
    # problem p = (batch, list head, chunk): rows (g * c, d), the chunk's rows for the g query heads
    qs = qf.view(b, hs, g, n_chunks, c, d).permute(0, 1, 3, 2, 4, 5).reshape(-1, g * c, d)
    lists = keys.reshape(-1, keys.shape[-1]).long().sort(dim=-1, descending=True).values  # -1 padding last
    lengths = (lists >= 0).sum(-1)
    p_batch = torch.arange(b, device=dev).repeat_interleave(hs * n_chunks)
    p_head = torch.arange(hs, device=dev).repeat_interleave(n_chunks).repeat(b)
    p_chunk = torch.arange(n_chunks, device=dev).repeat(b * hs)
    base = (p_batch * hkv + p_head // (hs // hkv)) * n  # the problem's KV head's row 0 in the flattened k, v
    kf, vf = k.float().reshape(-1, d), v.float().reshape(-1, d)
    out = torch.zeros(qs.shape, dtype=torch.float32, device=dev)  # a problem with no key: zeros
    order = lengths.argsort()
    sizes = lengths[order].tolist()
    first = next((i for i, x in enumerate(sizes) if x > 0), len(sizes))
    while first < len(sizes):  # buckets of problems with similar list lengths
        last = first + 1
        while (last < len(sizes) and sizes[last] <= SPREAD * sizes[first]
               and (last + 1 - first) * g * c * sizes[last] <= SCORES_BUDGET):
            last += 1
        m = sizes[last - 1]
        idx = order[first:last]
        kp = lists[idx, :m]  # (B, m)
        rows_kv = (base[idx, None] + kp.clamp(min=0)).flatten()
        kg = kf.index_select(0, rows_kv).view(-1, 1, m, d)  # row copies: the fastest gather on CPU
        vg = vf.index_select(0, rows_kv).view(-1, 1, m, d)
        qrow = p_chunk[idx, None] * c + torch.arange(c, device=dev)  # (B, c) query rows (padded past nq)
        # (B, c, m) additive mask shared by the g heads: -inf past the row's position; padding counts as
        # a key after every query
        after = torch.where(kp >= 0, kp, n)[:, None, :] > ((n - nq) + qrow)[:, :, None]
        bias = torch.where(after, -math.inf, 0.0)
        if mask is not None:
            bias += mask[p_batch[idx, None, None], 0, qrow.clamp(max=nq - 1)[:, :, None], kp.clamp(min=0)[:, None, :]]
        if g > 1:
            bias = bias[:, None].expand(-1, g, c, m).reshape(-1, g * c, m)
        bias = bias[:, None]
        # PyTorch's fused CPU attention: scale, mask, softmax and the product with v in cache-sized tiles
        att = F.scaled_dot_product_attention(qs[idx][:, None], kg, vg, attn_mask=bias, scale=scaling)
        out[idx] = att[:, 0].nan_to_num_(0.0)  # a query no listed key is allowed for: zeros
        first = last
    out = out.view(b, hs, n_chunks, g, c, d).permute(0, 1, 3, 2, 4, 5).reshape(b, hq, n_chunks * c, d)
    return out[:, :, :nq].to(q.dtype)


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, *,
                           block_size: int, scaling: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`kernels.sparse_attention.reference.block_sparse_attention`: blocks (b, hkv or hq,
    ceil(nq / block_size), m) key-block indices -> (b, hq, nq, d) in ``q.dtype``."""
    _check(q, k, v, blocks, block_size, mask, lists_name="blocks", size_name="block_size")
    n = k.shape[2]
    pos = blocks.long()[..., None] * block_size + torch.arange(block_size, device=blocks.device)
    pos = torch.where((blocks[..., None] >= 0) & (pos < n), pos, -1).flatten(-2)
    return gathered_attention(q, k, v, pos, chunk_size=block_size, scaling=scaling, mask=mask)
