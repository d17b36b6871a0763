"""ProxyAttn: block-sparse prefill attention ranked by pooled proxy heads, with a budget per head.

Follows Wang, He, Bao, Wu, Wang, Zhu & Che, "ProxyAttn: Guided Sparse Attention via Representative
Heads" (2025, arXiv:2509.24745): per query block and head group, one pooled proxy head scores every
visible key at token level, the scores pooled into key-block mass rank the blocks for all heads of
the group, and each head takes as many top-ranked blocks as its own attention needs; each query
block attends causally to the sink block, its diagonal block and its chosen blocks.

Deviations: the per-head budget rule is chosen here (the paper's own rule was not at hand): a
coverage level common to a layer's heads, the highest the layer's budget allows, with a floor and a
ceiling per head; one keep share per forward pass is solved so that ``sparsity`` (the share of causal
(query, key) pairs skipped, as in :mod:`tasks.sparse.quoka`) is met where sink, diagonal and floor
allow. Scoring and attention are batched PyTorch and :mod:`kernels.sparse_attention`, not the paper's
kernels. Every choice where the paper leaves room is a config field. Details: docs/sparse.md.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tasks.common.config import at_least, require
from tasks.sparse.attention import AttentionSparsity, _repeat_kv, attend_lists, attend_subset, solve_keep_share
from tasks.sparse.registry import SparseMethodSpec, register_sparsifier


@dataclass(frozen=True, kw_only=True)
class ProxyAttnConfig(SparseMethodSpec):
    """``block_size``: tokens per query and key block. ``group_size``: heads pooled into one proxy
    (None = the GQA group). ``pooling``: how the group's queries and keys are pooled. ``budget_from``:
    whose block mass sets a head's budget (``head``: its own, at the block's last ``budget_queries``
    queries; ``proxy``: the group's). ``proxy_queries``: the block's queries whose proxy scores rank
    its key blocks (its last ``proxy_queries``; None = all of them). ``min_blocks``, ``floor_ratio``, ``ceiling_ratio``: a head keeps
    between ``max(min_blocks, floor_ratio·B̄)`` and ``ceiling_ratio·B̄`` ranked blocks, ``B̄`` the
    mean budget (see the module docstring)."""

    method: Literal["proxyattn"] = "proxyattn"
    block_size: int = 16
    group_size: int | None = None
    pooling: Literal["mean", "max"] = "mean"
    budget_from: Literal["head", "proxy"] = "head"
    budget_queries: int = 4
    proxy_queries: int | None = None
    min_blocks: int = 1
    floor_ratio: float = 0.5
    ceiling_ratio: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least(self.block_size, 1, "block_size")
        require(self.group_size is None or self.group_size >= 1, "group_size",
                f"must be >= 1 or null (the GQA group), got {self.group_size}")
        at_least(self.budget_queries, 1, "budget_queries")
        require(self.proxy_queries is None or self.proxy_queries >= 1, "proxy_queries",
                f"must be >= 1 or null (every query of the block), got {self.proxy_queries}")
        at_least(self.min_blocks, 0, "min_blocks")
        require(0.0 <= self.floor_ratio <= 1.0, "floor_ratio", f"must be in [0, 1], got {self.floor_ratio}")
        require(self.ceiling_ratio >= 1.0, "ceiling_ratio", f"must be >= 1, got {self.ceiling_ratio}")


@functools.lru_cache(maxsize=256)
def candidate_keep_share(q_len: int, k_len: int, block_size: int, sparsity: float, min_blocks: int = 0) -> float:
    """``φ``: the share of candidate blocks to keep so that a forward pass of ``q_len`` queries over
    ``k_len`` keys keeps ``1 - sparsity`` of its causal pairs, counting the sink and diagonal blocks
    (always kept) and the floor of ``min_blocks`` per head (kept where ``φ N_i`` is smaller, so the
    other query blocks keep less). 0 when those alone exceed the target, 1 when there is nothing
    to choose."""
    offset, visible, blocks = k_len - q_len, 0, []
    for s in range(0, q_len, block_size):
        e = min(s + block_size, q_len)
        c, n = e - s, offset + e
        visible += c * (offset + s + 1 + n) // 2  # sum of (position + 1) over the block's queries
        blocks.append((max(0, (n - c) // block_size - 1), block_size * c))  # (N_i, pairs per block)
    candidates = sum(n_i * pairs for n_i, pairs in blocks)
    if candidates == 0:
        return 1.0
    room = (1.0 - sparsity) * visible - (visible - candidates)  # pairs left after sink and diagonal
    return solve_keep_share(blocks, min_blocks, room)


def pool_heads(x: torch.Tensor, group_size: int, pooling: str) -> torch.Tensor:
    """(b, h, n, d) -> (b, h // group_size, n, d): one proxy per group of consecutive heads."""
    b, h, n, d = x.shape
    x = x.float().view(b, h // group_size, group_size, n, d)
    return x.mean(dim=2) if pooling == "mean" else x.amax(dim=2)


def dynamic_budgets(mass: torch.Tensor, forced: torch.Tensor, total: int, n_min: int, n_max: int) -> torch.Tensor:
    """Ranked blocks each head keeps, (b, h) integers summing to ``total`` per batch row.

    ``mass`` (b, h, N): each head's mass on the candidate blocks in the proxy's rank order;
    ``forced`` (b, h): its mass on the blocks always kept. The ``r``-th block of head ``h`` has the
    key ``C_h(r - 1)``, the coverage the head has without it; the ``total`` smallest keys win, so
    every head ends at the smallest count reaching one common coverage ``γ`` (first ``n_min`` blocks
    always, none past ``n_max``). Needs ``h·n_min <= total <= h·n_max``."""
    one = torch.tensor([total], device=mass.device), torch.tensor([n_min]), torch.tensor([n_max])
    return _budgets_per_block(mass[:, :, None], forced[:, :, None], *one)[:, :, 0]


def proxyattn_select(q: torch.Tensor, k: torch.Tensor, cfg: ProxyAttnConfig, *, group_size: int,
                     keep_share: float, scaling: float, mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """Keys (b, h_q, m) each query head attends to for one query block, increasing, ``-1``-padded.

    ``q`` (b, h_q, c, d): the block's queries (``c <= block_size``), the last ``c`` of the ``n``
    positions ``k`` (b, h_kv, n, d) spans; ``mask``: the model's additive mask at those rows,
    (b, 1, c, n). ``keep_share``: ``φ`` of :func:`candidate_keep_share`. ``None`` when every visible
    key is kept. One block of :func:`proxyattn_blocks`, as key positions."""
    n, bs = k.shape[2], cfg.block_size
    blocks, dense = proxyattn_blocks(q, k, cfg, group_size=group_size, keep_share=keep_share, scaling=scaling,
                                     mask=mask)
    if dense[0]:
        return None
    pos = blocks[:, :, 0, :, None] * bs + torch.arange(bs, device=q.device)
    pos = torch.where((blocks[:, :, 0, :, None] >= 0) & (pos < n), pos, n).flatten(-2).sort(dim=-1).values
    pos = pos[..., : int((pos < n).sum(-1).max())]
    return torch.where(pos < n, pos, -1)


def proxyattn_blocks(q: torch.Tensor, k: torch.Tensor, cfg: ProxyAttnConfig, *, group_size: int, keep_share: float,
                     scaling: float, mask: torch.Tensor | None = None,
                     rows_per_pass: int = 512) -> tuple[torch.Tensor, list[bool]]:
    """Key blocks each query head of each query block attends to: (b, h_q, n_qblocks, m), increasing,
    ``-1``-padded; and per query block whether that is every visible block.

    ``q`` (b, h_q, nq, d): the last ``nq`` of the ``n`` positions ``k`` (b, h_kv, n, d) spans, in query
    blocks of ``block_size`` from its first row (the last may be shorter); ``mask``: the model's
    additive mask at those rows, (b, 1, nq, n). The proxy and per-head block masses of about
    ``rows_per_pass`` queries come from one product over the keys the last of them sees, causally
    masked — the softmax each block would get alone — and the budgets of every query block are
    solved together (:func:`_budgets_per_block`)."""
    b, hq, nq, _ = q.shape
    hkv, n = k.shape[1], k.shape[2]
    bs, offset = cfg.block_size, n - nq
    n_qb, n_blocks = -(-nq // bs), -(-n // bs)
    dev = q.device
    kr = _repeat_kv(k, hq // hkv)  # (b, hq, n, d)
    kp = pool_heads(kr, group_size, cfg.pooling)
    qp = pool_heads(q, group_size, cfg.pooling)
    rows = torch.arange(nq, device=dev)
    block_of = rows // bs
    last_row = torch.clamp((block_of + 1) * bs, max=nq) - 1
    own_rows = rows[last_row - rows < cfg.budget_queries]  # each block's last budget_queries queries
    proxy_rows = rows if cfg.proxy_queries is None else rows[last_row - rows < cfg.proxy_queries]
    proxy = torch.zeros(b, qp.shape[1], n_qb, n_blocks, device=dev)
    own = torch.zeros(b, hq, n_qb, n_blocks, device=dev) if cfg.budget_from == "head" else None
    step = max(1, rows_per_pass // bs) * bs
    for s in range(0, nq, step):  # whole query blocks per pass
        e = min(s + step, nq)
        n_vis = offset + e
        sel = proxy_rows[(proxy_rows >= s) & (proxy_rows < e)]
        m_sel = None if mask is None else mask[:, :, sel, :n_vis]
        mass = _row_block_mass(qp[:, :, sel], kp[:, :, :n_vis], scaling, bs, offset + sel, m_sel)
        proxy[..., : mass.shape[-1]].index_add_(2, block_of[sel], mass)
        if own is not None:
            sel = own_rows[(own_rows >= s) & (own_rows < e)]
            m_sel = None if mask is None else mask[:, :, sel, :n_vis]
            mass = _row_block_mass(q[:, :, sel], kr[:, :, :n_vis], scaling, bs, offset + sel, m_sel)
            own[..., : mass.shape[-1]].index_add_(2, block_of[sel], mass)
    proxy /= torch.bincount(block_of[proxy_rows], minlength=n_qb)[:, None]  # the mean over a block's queries
    if own is None:
        own = proxy.repeat_interleave(group_size, dim=1)
    else:
        own /= torch.bincount(block_of[own_rows], minlength=n_qb)[:, None]

    first_diag = [(offset + i * bs) // bs for i in range(n_qb)]  # key blocks from here on overlap the queries
    last_block = [(offset + min((i + 1) * bs, nq) - 1) // bs for i in range(n_qb)]
    n_cand = [max(0, f - 1) for f in first_diag]  # candidates: blocks 1 .. first_diag - 1
    plan = [_budget(cfg, keep_share, c, hq) for c in n_cand]  # (n_min, n_max, total) per query block
    dense = [total >= hq * c for c, (_, _, total) in zip(n_cand, plan)]
    width = max(n_cand, default=0)
    rank = torch.arange(width, device=dev)
    in_range = rank[None, :] < torch.tensor(n_cand, device=dev)[:, None]  # (n_qb, width): candidate 1 + rank
    order = proxy[..., 1 : 1 + width].masked_fill(~in_range, -math.inf).argsort(dim=-1, descending=True)
    order = order.repeat_interleave(group_size, dim=1)  # (b, hq, n_qb, width): the group's ranking
    own_c = own[..., 1 : 1 + width].masked_fill(~in_range, 0.0)
    n_min, n_max, total = (torch.tensor([p[j] for p in plan], device=dev) for j in range(3))
    counts = _budgets_per_block(torch.gather(own_c, 3, order), own.sum(-1) - own_c.sum(-1), total, n_min, n_max)
    chosen = ((rank < counts[..., None]) | torch.tensor(dense, device=dev)[:, None]) & in_range
    picked = torch.where(chosen, 1 + order, n_blocks)  # n_blocks: not kept
    fixed = torch.tensor(_fixed_blocks(first_diag, last_block, n_blocks), device=dev)  # sink and diagonal
    lists = torch.cat([fixed.expand(b, hq, -1, -1), picked], dim=-1).sort(dim=-1).values
    lists = lists[..., : int((lists < n_blocks).sum(-1).max())]
    return torch.where(lists < n_blocks, lists, -1), dense


def _fixed_blocks(first_diag: list[int], last_block: list[int], pad: int) -> list[list[int]]:
    """Per query block, the blocks always kept — the sink (0) and the diagonal blocks ``first_diag ..
    last_block`` — padded with ``pad`` to a common length."""
    kept = [sorted({0, *range(f, last + 1)}) for f, last in zip(first_diag, last_block)]
    width = max(map(len, kept), default=0)
    return [x + [pad] * (width - len(x)) for x in kept]


def _budget(cfg: ProxyAttnConfig, keep_share: float, n_cand: int, hq: int) -> tuple[int, int, int]:
    """``(n_min, n_max, total)``: the floor and ceiling of ranked blocks per head and the layer's
    budget ``K`` for a query block with ``n_cand`` candidate blocks (see the module docstring)."""
    mean_budget = keep_share * n_cand
    n_min = min(n_cand, max(cfg.min_blocks, math.floor(cfg.floor_ratio * mean_budget)))
    n_max = min(n_cand, max(n_min, math.ceil(cfg.ceiling_ratio * mean_budget)))
    return n_min, n_max, min(max(round(mean_budget * hq), hq * n_min), hq * n_max)


def _row_block_mass(q: torch.Tensor, k: torch.Tensor, scaling: float, block_size: int, qpos: torch.Tensor,
                    mask: torch.Tensor | None) -> torch.Tensor:
    """Each query row's attention mass per key block, (b, h, r, J): ``softmax(q kᵀ · scaling + mask)``
    over the keys at or before the row's position ``qpos`` (r,), summed within key blocks of ``k``'s
    ``n`` positions. In place where it can be: the causal mask touches only the keys past the
    earliest row, and rows can only be empty (NaN) under a padding mask."""
    n = k.shape[2]
    scores = (q.float() @ k.float().transpose(-1, -2)).mul_(scaling)  # (b, h, r, n)
    if mask is not None:
        scores.add_(mask.float())
    first = int(qpos.min()) + 1 if qpos.numel() else n  # keys before this are visible to every row
    if first < n:
        scores[..., first:].masked_fill_(torch.arange(first, n, device=q.device)[None, :] > qpos[:, None], -math.inf)
    probs = torch.softmax(scores, dim=-1)
    if mask is not None:
        probs.nan_to_num_(0.0)
    full = n - n % block_size
    mass = probs[..., :full].unflatten(-1, (full // block_size, block_size)).sum(-1)
    return torch.cat([mass, probs[..., full:].sum(-1, keepdim=True)], dim=-1) if full < n else mass


def _budgets_per_block(mass: torch.Tensor, forced: torch.Tensor, total: torch.Tensor, n_min: torch.Tensor,
                       n_max: torch.Tensor) -> torch.Tensor:
    """:func:`dynamic_budgets` for every query block at once: ``mass`` (b, h, Q, N) in rank order, padded
    past each block's candidates (their ranks are beyond ``n_max``); ``forced`` (b, h, Q); ``total``,
    ``n_min``, ``n_max`` (Q,). Returns (b, h, Q) counts."""
    b, h, nqb, width = mass.shape
    if width == 0:
        return torch.zeros(b, h, nqb, dtype=torch.long, device=mass.device)
    before = forced[..., None].float() + mass.float().cumsum(-1) - mass.float()
    rank = torch.arange(width, device=mass.device)
    before = before.masked_fill(rank < n_min[:, None], -math.inf).masked_fill(rank >= n_max[:, None], math.inf)
    flat = before.permute(0, 2, 1, 3).reshape(b, nqb, h * width)
    place = torch.empty_like(flat, dtype=torch.long).scatter_(
        2, flat.argsort(dim=-1, stable=True), torch.arange(h * width, device=mass.device).expand(b, nqb, -1))
    won = place < total[None, :, None]
    return won.view(b, nqb, h, width).sum(-1).permute(0, 2, 1)


@register_sparsifier("proxyattn", ProxyAttnConfig)
def proxyattn(model: nn.Module, cfg: ProxyAttnConfig, *, sparsity: float,
              calib_tokens: np.ndarray | None = None) -> AttentionSparsity:
    """ProxyAttn skipping ``sparsity`` of the causal KV pairs of each forward pass (see the module
    docstring); needs no calibration. Raises ``ValueError`` naming the field for a sparsity outside
    [0, 1), a ``group_size`` that does not divide the heads, a smallest budget (sink, diagonal and
    ``min_blocks`` blocks) longer than the model's context, or a model without Llama-family attention."""
    require(0.0 <= sparsity < 1.0, "sparsity", f"must be in [0, 1), got {sparsity}")
    meta = {"method": "proxyattn", "sparsity": sparsity, "block_size": cfg.block_size, "pooling": cfg.pooling,
            "budget_from": cfg.budget_from}
    handle = AttentionSparsity(model, None, meta=meta)  # refuses models without q_proj/k_proj first
    heads = model.config.num_attention_heads
    group = cfg.group_size or heads // (getattr(model.config, "num_key_value_heads", None) or heads)
    require(heads % group == 0, "group_size", f"{group} must divide the model's {heads} attention heads")
    context = getattr(model.config, "max_position_embeddings", None)
    smallest = (2 + cfg.min_blocks) * cfg.block_size
    require(context is None or smallest <= context, "block_size",
            f"{cfg.block_size}: the smallest budget (sink + diagonal + min_blocks {cfg.min_blocks} blocks = "
            f"{smallest} tokens) is larger than the model's {context}-token context")
    handle.meta["group_size"] = group

    def attend(handle, q, k, v, mask, scaling):
        q_len, k_len = q.shape[2], k.shape[2]
        if sparsity == 0:
            return attend_subset(handle, q, k, v, mask, scaling, cfg.block_size, lambda *_: None)
        share = candidate_keep_share(q_len, k_len, cfg.block_size, sparsity, cfg.min_blocks)
        rows = None if mask is None else mask[:, :, :, :k_len].expand(q.shape[0], 1, -1, -1)
        blocks, _ = proxyattn_blocks(q, k, cfg, group_size=group, keep_share=share, scaling=scaling, mask=rows)
        return attend_lists(handle, q, k, v, mask, scaling, blocks, size=cfg.block_size, blocks=True)

    handle.attend = attend
    return handle
