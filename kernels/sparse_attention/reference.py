"""Sparse prefill attention in plain fp32 torch: a dense "allowed" mask built from key lists, then a masked softmax.

Two ways of naming the (query, key) pairs a prefill attends to, one per method of issue 10:

* QuoKA ("Query-oriented KV selection for efficient LLM prefill") runs prefill in chunks of
  ``chunk_size`` queries; each chunk attends to its own list of key positions (its diagonal plus
  the earlier keys that score highest against its probe queries): :func:`gathered_attention`.
* ProxyAttn ("Guided Sparse Attention via Representative Heads", arXiv 2509.24745) splits queries
  and keys into blocks of ``block_size`` and lets each query block attend to a list of key blocks:
  :func:`block_sparse_attention`.

Both compute, for query ``t`` (at position ``p_t = n - nq + t``) of head ``h``,

    o_t = Σ_{u ∈ A(t)} softmax_u(s_tu) v_u,   s_tu = scaling · q_t·k_u + mask[t, u],

over the allowed set ``A(t)`` = listed positions ``u`` with ``0 <= u <= p_t``; an empty ``A(t)``
(or one whose scores are all ``-inf``) gives ``o_t = 0``. Here that is done literally: the lists
become a dense boolean mask (b, hq, nq, n) and the scores of every other pair are set to ``-inf``.
Simple, obviously right, and O(nq · n) memory: the definition the kernels are tested against.
"""

from __future__ import annotations

import math

import torch


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lists: torch.Tensor,
    size: int,
    mask: torch.Tensor | None,
    *,
    lists_name: str,
    size_name: str,
) -> None:
    """ValueError naming the argument for inputs outside the interface of both functions.

    ``lists`` are key positions (``lists_name="keys"``, ``size_name="chunk_size"``) or key-block
    indices (``"blocks"``, ``"block_size"``); their values must lie in [-1, n) or [-1, ceil(n / size)).
    Reads the lists' min and max (one device sync on CUDA)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{size_name}: expected an int >= 1, got {size!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name}: expected rank 4 (batch, heads, positions, head_dim), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating dtype, got {t.dtype}")
    b, hq, nq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"v: expected the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    _, hkv, n, _ = k.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k: expected ({b}, hkv, n, {d}) to match q {tuple(q.shape)}, got {tuple(k.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"k, v: expected q's dtype {q.dtype}, got {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device or lists.device != q.device:
        raise ValueError(f"k, v, {lists_name}: expected q's device {q.device}, got {k.device}, {v.device}, {lists.device}")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"q: the number of query heads {hq} must be a multiple of k's KV heads {hkv}")
    if nq > n:
        raise ValueError(f"q: {nq} queries but k, v span only {n} positions (queries are the last nq positions)")
    units = n if lists_name == "keys" else -(-n // size)
    n_groups = -(-nq // size)
    if lists.dim() != 4:
        raise ValueError(f"{lists_name}: expected rank 4 (batch, heads, {-(-nq // size)}, m), got shape {tuple(lists.shape)}")
    if lists.is_floating_point() or lists.is_complex() or lists.dtype == torch.bool:
        raise ValueError(f"{lists_name}: expected an integer dtype, got {lists.dtype}")
    if lists.shape[0] != b:
        raise ValueError(f"{lists_name}: expected batch {b}, got shape {tuple(lists.shape)}")
    if lists.shape[1] not in (hkv, hq):
        raise ValueError(f"{lists_name}: expected {hkv} (KV) or {hq} (query) heads, got shape {tuple(lists.shape)}")
    if lists.shape[2] != n_groups:
        raise ValueError(
            f"{lists_name}: expected ceil(nq / {size_name}) = ceil({nq} / {size}) = {n_groups} rows in dim 2, "
            f"got shape {tuple(lists.shape)}"
        )
    if lists.numel():
        lo, hi = (int(x) for x in torch.aminmax(lists))
        if lo < -1 or hi >= units:
            what = "positions" if lists_name == "keys" else f"blocks of {size} of the {n} positions"
            raise ValueError(f"{lists_name}: values must be -1 (padding) or in [0, {units}) ({what}), got [{lo}, {hi}]")
    if mask is not None:
        if tuple(mask.shape) != (b, 1, nq, n):
            raise ValueError(f"mask: expected (b, 1, nq, n) = {(b, 1, nq, n)}, got {tuple(mask.shape)}")
        if not mask.is_floating_point():
            raise ValueError(f"mask: expected an additive floating mask, got {mask.dtype}")
        if mask.device != q.device:
            raise ValueError(f"mask: expected q's device {q.device}, got {mask.device}")


def _per_query_head(lists: torch.Tensor, hq: int) -> torch.Tensor:
    """Lists (b, hs, g, m) with hs == hkv or hq, as (b, hq, g, m): a KV head's list serves its GQA group."""
    return lists if lists.shape[1] == hq else lists.repeat_interleave(hq // lists.shape[1], dim=1)


def _listed(lists: torch.Tensor, units: int) -> torch.Tensor:
    """Boolean (b, h, g, units): which units (positions or blocks) each list names; -1 names none."""
    idx = torch.where(lists < 0, units, lists).long()  # padding goes to a spare column, dropped below
    listed = torch.zeros(*lists.shape[:3], units + 1, dtype=torch.bool, device=lists.device)
    return listed.scatter_(3, idx, True)[..., :units]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scaling: float,
            mask: torch.Tensor | None) -> torch.Tensor:
    """``softmax(scaling · q kᵀ + mask)`` over the ``allowed`` (b, hq, nq, n) pairs, times v, in fp32;
    causality is applied here. Rows with no allowed finite score give 0."""
    _, hq, nq, _ = q.shape
    n = k.shape[2]
    groups = hq // k.shape[1]
    kf = k.float().repeat_interleave(groups, dim=1)
    vf = v.float().repeat_interleave(groups, dim=1)
    qpos = torch.arange(n - nq, n, device=q.device)
    causal = torch.arange(n, device=q.device)[None, :] <= qpos[:, None]  # (nq, n)
    scores = (q.float() @ kf.transpose(-1, -2)) * scaling
    if mask is not None:
        scores = scores + mask.float()
    scores = scores.masked_fill(~(allowed & causal), -math.inf)
    some = (scores > -math.inf).any(dim=-1, keepdim=True)  # else softmax is NaN: output 0 instead
    probs = torch.softmax(scores, dim=-1).masked_fill(~some, 0.0)
    return (probs @ vf).to(q.dtype)


def gathered_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    *,
    chunk_size: int,
    scaling: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each query chunk over its own list of key positions (QuoKA's gathered KV subset).

    q (b, hq, nq, d): queries, the last nq of the n positions that k, v (b, hkv, n, d) span, so query t
    sits at position n - nq + t. hq must be a multiple of hkv (GQA: query head h reads KV head
    h // (hq // hkv)). keys (b, hs, n_chunks, m) integer key positions, hs == hkv (one list per KV
    head, shared by its query heads) or hs == hq (one per query head); n_chunks == ceil(nq / chunk_size);
    chunk i holds queries [i*chunk_size, (i+1)*chunk_size). -1 pads a list; a list has no duplicates
    (not checked) and need not be sorted. A query attends to a listed key at position p iff
    0 <= p <= its own position (causal). mask: optional additive float (b, 1, nq, n) (a model's
    padding mask), added to the score of (query, key position); -inf entries remove pairs.
    A query with no allowed key outputs zeros. Returns (b, hq, nq, d) in q.dtype;
    softmax(q·kᵀ·scaling + mask) v, computed in fp32.

    >>> q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    >>> keys = torch.tensor([[[[0, 4, 5, 6, -1], [0, 6, 7, 8, 2]]] * 2])   # (1, 2 KV heads, 2 chunks, 5)
    >>> gathered_attention(q, k, v, keys, chunk_size=3, scaling=8 ** -0.5).shape
    torch.Size([1, 4, 5, 8])
    """
    _check(q, k, v, keys, chunk_size, mask, lists_name="keys", size_name="chunk_size")
    _, hq, nq, _ = q.shape
    n = k.shape[2]
    listed = _listed(_per_query_head(keys, hq), n)  # (b, hq, n_chunks, n)
    chunk_of_query = torch.arange(nq, device=q.device) // chunk_size
    return _attend(q, k, v, listed[:, :, chunk_of_query], scaling, mask)


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: torch.Tensor,
    *,
    block_size: int,
    scaling: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each query block over the keys of its listed key blocks (ProxyAttn's block-sparse attention).

    q (b, hq, nq, d), k, v (b, hkv, n, d) as in :func:`gathered_attention` (query t at position
    n - nq + t; GQA). blocks (b, hs, n_qblocks, m) integer key-block indices, hs == hkv or hq,
    n_qblocks == ceil(nq / block_size); query block i (queries [i*block_size, (i+1)*block_size))
    attends to the keys of its listed blocks, key block j = positions [j*block_size, (j+1)*block_size)
    ∩ [0, n); causal, -1 padding, no duplicates, any order. mask: optional additive float (b, 1, nq, n).
    A query with no allowed key outputs zeros. Returns (b, hq, nq, d) in q.dtype, computed in fp32.
    """
    _check(q, k, v, blocks, block_size, mask, lists_name="blocks", size_name="block_size")
    _, hq, nq, _ = q.shape
    n = k.shape[2]
    listed = _listed(_per_query_head(blocks, hq), -(-n // block_size))  # (b, hq, n_qblocks, n_kblocks)
    block_of_key = torch.arange(n, device=q.device) // block_size
    block_of_query = torch.arange(nq, device=q.device) // block_size
    return _attend(q, k, v, listed[:, :, block_of_query][..., block_of_key], scaling, mask)
