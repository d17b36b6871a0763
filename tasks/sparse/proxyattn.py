"""ProxyAttn: block-sparse prefill attention ranked by pooled proxy heads, with a budget per head.

"ProxyAttn: Guided Sparse Attention via Representative Heads" (arXiv 2509.24745). Heads of one
group attend to much the same tokens but differ in how spread out their attention is, so one
pooled *proxy* head per group ranks key blocks for all of them at token-level precision, and each
head takes as many of the top-ranked blocks as its own attention needs.

Per layer, prefill runs in query blocks of ``block_size`` queries; keys form blocks of
``block_size`` positions. For the query block ``Q_i`` (positions ``[p, p + c)``) and group ``g``:

1. Proxy head: ``q̄ = pool_{h∈g} q_h``, ``k̄ = pool_{h∈g} k_h`` (``pooling``: mean or elementwise
   max over the group's ``group_size`` heads; default group = the GQA group, whose heads share one
   key head, so ``k̄`` is that key head).
2. Token-level proxy scores over every visible key, ``A = softmax(q̄ k̄ᵀ / √d + mask)`` (causal and
   padding masks applied), pooled into block mass ``m_g(j) = mean_{t∈Q_i} Σ_{u∈block j} A[t, u]``.
   The candidate blocks (neither the sink block 0 nor a diagonal block overlapping ``[p, p + c)``)
   are ranked by ``m_g``, the same order for every head of the group.
3. Budget per head (the rule chosen here; the paper's own rule was not at hand):
   ``w_h(j)`` is head ``h``'s own block mass, computed as in 2 from its own ``q_h, k_h`` at the
   block's last ``budget_queries`` queries (which see every key the block sees) —
   ``budget_from: head``, the default — or the proxy's ``m_g`` (``budget_from: proxy``: heads of a
   group then share one budget). With ``C_h(n) = w_h(sink ∪ diagonal) + Σ_{r≤n} w_h(r-th ranked)``,
   head ``h`` keeps the ``n_h`` top-ranked blocks, ``n_h = min{n : C_h(n) ≥ γ}`` clamped to
   ``[n_min, n_max]``, where the coverage ``γ`` is common to the layer's heads and is the highest the
   layer's budget ``K`` allows (``Σ_h n_h = K``). A head whose attention is concentrated reaches
   ``γ`` with few blocks, a spread-out head needs many: the budget goes where attention is dense.
   Equivalently the ``K`` blocks go, one at a time, to the head whose chosen blocks so far cover
   the least of its mass; a fixed ``γ`` would not meet a requested sparsity, a solved one does.
4. ``K = round(H · φ · N_i)`` for ``H`` query heads and ``N_i`` candidate blocks, with
   ``n_min = max(min_blocks, ⌊floor_ratio · φ N_i⌋)`` (every head keeps its proxy's best block(s),
   even where its own estimate looks sharp) and ``n_max = ⌈ceiling_ratio · φ N_i⌉`` (one flat head
   cannot take the whole layer's budget); both bounds scale with the requested sparsity. One keep
   share ``φ`` holds for the whole forward pass, solved (:func:`candidate_keep_share`) so that the
   pairs kept over all query blocks — sink, diagonal, and ``max(min_blocks, φ N_i)`` ranked blocks
   per head — are ``1 - sparsity`` of the causal pairs: early query blocks, where the floor binds,
   keep more and later ones less. The target is missed (sparsity falls short) only where sink,
   diagonal and floor alone exceed it: short contexts, large blocks.
5. Each query block attends (causally, masks kept) to the sink, the diagonal and its ``n_h``
   chosen blocks, per head.

Choices where the paper leaves room, each a parameter: ``pooling: mean``, ``budget_from: head`` with
``budget_queries`` 4, ``min_blocks`` 1, ``floor_ratio`` 0.5, ``ceiling_ratio`` 2, ``block_size`` 16
(params/sparse_eval.yaml sets 4 for the ladder's 128-token windows, where sink and diagonal blocks
of 16 would already hold over a third of the causal pairs).

``sparsity`` means what it means for :mod:`tasks.sparse.quoka`: the share of causal KV pairs
skipped, counted over what ran (``achieved_sparsity()``). The patch is QuoKA's: one
reversible ``AttentionInterface`` function (:class:`tasks.sparse.quoka.AttentionSparsity`).

Not implemented: the paper's block-sparse GPU kernel. The chosen blocks are gathered and attended
with dense torch ops (:func:`tasks.sparse.quoka.attend_subset`), which measures quality, not speed.
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

from tasks.common.config import require
from tasks.sparse.quoka import AttentionSparsity, _repeat_kv, attend_subset, solve_keep_share
from tasks.sparse.registry import SparseMethodSpec, register_sparsifier


@dataclass(frozen=True, kw_only=True)
class ProxyAttnConfig(SparseMethodSpec):
    """``block_size``: tokens per query and key block. ``group_size``: heads pooled into one proxy
    (None = the GQA group). ``pooling``: how the group's queries and keys are pooled. ``budget_from``:
    whose block mass sets a head's budget (``head``: its own, at the block's last ``budget_queries``
    queries; ``proxy``: the group's). ``min_blocks``, ``floor_ratio``, ``ceiling_ratio``: a head keeps
    between ``max(min_blocks, floor_ratio·B̄)`` and ``ceiling_ratio·B̄`` ranked blocks, ``B̄`` the
    mean budget (see the module docstring)."""

    method: Literal["proxyattn"] = "proxyattn"
    block_size: int = 16
    group_size: int | None = None
    pooling: Literal["mean", "max"] = "mean"
    budget_from: Literal["head", "proxy"] = "head"
    budget_queries: int = 4
    min_blocks: int = 1
    floor_ratio: float = 0.5
    ceiling_ratio: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.block_size >= 1, "block_size", f"must be >= 1, got {self.block_size}")
        require(self.group_size is None or self.group_size >= 1, "group_size",
                f"must be >= 1 or null (the GQA group), got {self.group_size}")
        require(self.budget_queries >= 1, "budget_queries", f"must be >= 1, got {self.budget_queries}")
        require(self.min_blocks >= 0, "min_blocks", f"must be >= 0, got {self.min_blocks}")
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


def block_mass(q: torch.Tensor, k: torch.Tensor, scaling: float, block_size: int,
               mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention mass per key block, averaged over queries: (b, h, J), ``J = ceil(n / block_size)``.

    ``q`` (b, h, r, d) are the last ``r`` queries of the ``n`` positions ``k`` (b, h, n, d) spans
    (query ``t`` sees keys ``<= n - r + t``); ``mask`` is the model's additive mask at those rows,
    (b, 1, r, n). Each row is ``softmax(q kᵀ · scaling + mask)`` summed within key blocks."""
    b, h, r, _ = q.shape
    n = k.shape[2]
    scores = (q.float() @ k.float().transpose(-1, -2)) * scaling  # (b, h, r, n)
    if mask is not None:
        scores = scores + mask.float()
    causal = torch.arange(n, device=q.device)[None, :] > torch.arange(n - r, n, device=q.device)[:, None]
    probs = torch.softmax(scores.masked_fill(causal, -math.inf), dim=-1).nan_to_num(0.0)
    n_blocks = -(-n // block_size)
    probs = F.pad(probs, (0, n_blocks * block_size - n))
    return probs.view(b, h, r, n_blocks, block_size).sum(-1).mean(2)


def dynamic_budgets(mass: torch.Tensor, forced: torch.Tensor, total: int, n_min: int, n_max: int) -> torch.Tensor:
    """Ranked blocks each head keeps, (b, h) integers summing to ``total`` per batch row.

    ``mass`` (b, h, N): each head's mass on the candidate blocks in the proxy's rank order;
    ``forced`` (b, h): its mass on the blocks always kept. The ``r``-th block of head ``h`` has the
    key ``C_h(r - 1)``, the coverage the head has without it; the ``total`` smallest keys win, so
    every head ends at the smallest count reaching one common coverage ``γ`` (first ``n_min`` blocks
    always, none past ``n_max``). Needs ``h·n_min <= total <= h·n_max``."""
    b, h, n = mass.shape
    before = forced[..., None].float() + mass.float().cumsum(-1) - mass.float()
    rank = torch.arange(n, device=mass.device)
    before = before.masked_fill(rank < n_min, -math.inf).masked_fill(rank >= n_max, math.inf)
    won = torch.zeros(b, h * n, dtype=torch.bool, device=mass.device)
    won.scatter_(1, before.view(b, h * n).topk(total, dim=-1, largest=False).indices, True)
    return won.view(b, h, n).sum(-1)


def proxyattn_select(q: torch.Tensor, k: torch.Tensor, cfg: ProxyAttnConfig, *, group_size: int,
                     keep_share: float, scaling: float, mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """Keys (b, h_q, m) each query head attends to for one query block, increasing, ``-1``-padded.

    ``q`` (b, h_q, c, d): the block's queries, the last ``c`` of the ``n`` positions ``k``
    (b, h_kv, n, d) spans; ``mask``: the model's additive mask at those rows, (b, 1, c, n).
    ``keep_share``: ``φ`` of :func:`candidate_keep_share`. ``None`` when every visible key is kept."""
    b, hq, c, _ = q.shape
    hkv, n = k.shape[1], k.shape[2]
    bs = cfg.block_size
    first_diag = (n - c) // bs
    n_cand = max(0, first_diag - 1)  # blocks 1 .. first_diag - 1: complete, visible to all c queries
    mean_budget = keep_share * n_cand
    n_min = min(n_cand, max(cfg.min_blocks, math.floor(cfg.floor_ratio * mean_budget)))
    n_max = min(n_cand, max(n_min, math.ceil(cfg.ceiling_ratio * mean_budget)))
    total = min(max(round(mean_budget * hq), hq * n_min), hq * n_max)
    if total >= hq * n_cand:
        return None

    kr = _repeat_kv(k, hq // hkv)  # (b, hq, n, d)
    proxy = block_mass(pool_heads(q, group_size, cfg.pooling), pool_heads(kr, group_size, cfg.pooling),
                       scaling, bs, mask)  # (b, hq / group_size, J)
    order = proxy[..., 1:first_diag].argsort(dim=-1, descending=True).repeat_interleave(group_size, dim=1)
    if cfg.budget_from == "head":
        r = min(cfg.budget_queries, c)
        own = block_mass(q[:, :, -r:], kr, scaling, bs, None if mask is None else mask[:, :, -r:])
    else:
        own = proxy.repeat_interleave(group_size, dim=1)
    cand = own[..., 1:first_diag]
    counts = dynamic_budgets(torch.gather(cand, 2, order), own.sum(-1) - cand.sum(-1), total, n_min, n_max)

    chosen = torch.arange(n_cand, device=q.device) < counts[..., None]  # (b, hq, N) in rank order
    keep_block = torch.ones(b, hq, own.shape[-1], dtype=torch.bool, device=q.device)
    keep_block[..., 1:first_diag] = torch.zeros_like(chosen).scatter(2, order, chosen)
    keep = keep_block.repeat_interleave(bs, dim=-1)[..., :n]  # (b, hq, n)
    pos = torch.arange(n, device=q.device)
    idx = torch.where(keep, pos, pos + n).sort(dim=-1).values[..., : int(keep.sum(-1).max())]
    return torch.where(idx < n, idx, -1)


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
        share = candidate_keep_share(q_len, k_len, cfg.block_size, sparsity, cfg.min_blocks)

        def select(qc: torch.Tensor, kc: torch.Tensor, n_vis: int) -> torch.Tensor | None:
            if sparsity == 0:
                return None
            s = n_vis - (k_len - q_len) - qc.shape[2]
            rows = None if mask is None else mask[:, :, s : s + qc.shape[2], :n_vis]
            return proxyattn_select(qc, kc, cfg, group_size=group, keep_share=share, scaling=scaling, mask=rows)

        return attend_subset(handle, q, k, v, mask, scaling, cfg.block_size, select)

    handle.attend = attend
    return handle
