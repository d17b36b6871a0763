"""QuoKA: query-oriented KV selection for chunked prefill (sparse attention over the top-B keys).

Prefill runs in chunks of ``chunk_size`` queries, as chunked prefill does: a chunk's own keys
(the diagonal block, causal) are always attended, and QuoKA subselects the keys of the earlier
chunks (the KV cache). Within each chunk, per attention head, the ``n_queries`` queries least
similar (cosine) to the chunk's mean query are kept as probes — the queries the mean represents
worst, which the paper argues carry the chunk's distinct needs. Every earlier key is scored by its
cosine similarity to the probes (queries and keys as attention sees them, after RoPE); the scores
are aggregated over the probes (``aggregate``: max or mean) and over the query heads of its GQA
group, and the chunk attends to the top ``B`` of them plus its own keys. The first key is always
among the ``B`` (an attention sink).

Keeping the diagonal is not optional: with one key set shared by the whole chunk and the causal
mask applied to it, a selection over every visible key (this module's first version) left a query
without its own key or its neighbours whenever they scored low — on SmolLM2-135M with 1024-token
windows and chunks of 128, 20% of queries at a 50% budget and 68% at 12% could not see themselves,
and perplexity rose +42% at sparsity 0.5 and +990% at 0.88 (ProxyAttn: +0.3%, +28%); keeping the
diagonal, +1.1% and +19% (0.86 achieved; chunks of 32 reach 0.88: +14%). Scoring un-RoPE'd queries
and keys, one key set per query head, or dot products instead of cosines (checked on every third
layer of one window) changed the dense attention mass kept by at most 3 points, and none lowered
the relative error of the attention output by more than 0.001.

Implemented as an attention function registered with ``transformers``' ``AttentionInterface``:
entering the handle sets ``config._attn_implementation`` to it for any Llama-family model (the
ladder's and SmolLM2-135M), leaving restores the previous implementation — one reversible patch.

``sparsity`` is the share of KV pairs skipped: of the (query, key) pairs the causal mask allows,
the fraction not attended; ``achieved_sparsity()`` counts them over what ran. One keep share ``φ``
of the earlier keys holds for a forward pass, ``B_i = max(min_keys, round(φ · earlier keys))``,
solved (:func:`earlier_keep_share`) so that the pairs kept — diagonal blocks included — are
``1 - sparsity`` of the causal pairs. The target is missed (sparsity falls short) only where the
diagonal blocks and ``min_keys`` alone exceed it: the first chunk of a window is dense, and with
chunks of 128 on 1024-token windows the diagonal alone holds 12.6% of the pairs.

Documented choices where the paper leaves room, each a parameter: ``chunk_size`` 32 (the ladder's
contexts are 64–128 tokens; 512–2048 on SmolLM2-scale contexts), ``n_queries`` 4, ``aggregate: max``,
``min_keys`` 8 (earlier keys kept at least, sink included).

Speed: the keys are chosen chunk by chunk (every key normalised once per forward), then
:func:`kernels.sparse_attention.gathered_attention` attends each run of chunks to its lists in one
call — a flash-style Triton kernel on CUDA, batched gathers into PyTorch's fused attention on CPU
(``benchmarks/sparse_speed.py`` times it against dense attention). Not the paper's own kernels.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tasks.common.config import require
from tasks.sparse.attention import AttentionSparsity, attend_subset, solve_keep_share
from tasks.sparse.registry import SparseMethodSpec, register_sparsifier

@dataclass(frozen=True, kw_only=True)
class QuokaConfig(SparseMethodSpec):
    """``chunk_size``: queries per prefill chunk. ``n_queries``: probes kept per chunk and head.
    ``aggregate``: how probe scores of a key combine (``max`` or ``mean``). ``min_keys``: earlier
    keys kept at least besides the chunk's own (a chunk with fewer earlier keys attends to all)."""

    method: Literal["quoka"] = "quoka"
    chunk_size: int = 32
    n_queries: int = 4
    aggregate: Literal["max", "mean"] = "max"
    min_keys: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.chunk_size >= 1, "chunk_size", f"must be >= 1, got {self.chunk_size}")
        require(self.n_queries >= 1, "n_queries", f"must be >= 1, got {self.n_queries}")
        require(self.min_keys >= 1, "min_keys", f"must be >= 1, got {self.min_keys}")


def quoka_select(q: torch.Tensor, k: torch.Tensor, n_keep: int, n_queries: int, aggregate: str, *,
                 k_normalized: bool = False) -> torch.Tensor:
    """Indices (b, h_kv, n_keep) of the keys QuoKA keeps for one chunk, in increasing order.

    ``q``: the chunk's queries (b, h_q, c, d); ``k``: the keys to choose from (b, h_kv, n, d), in
    :func:`quoka` those of the earlier chunks, already unit vectors when ``k_normalized`` (the
    caller then normalizes every key once per forward instead of once per chunk). Key 0 is always
    among the kept."""
    b, hq, c, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    qn = F.normalize(q.float(), dim=-1)
    mean = F.normalize(q.float().mean(dim=2, keepdim=True), dim=-1)
    sim = (qn * mean).sum(-1)  # (b, hq, c)
    probes = torch.topk(sim, min(n_queries, c), dim=-1, largest=False).indices
    qs = torch.gather(qn, 2, probes[..., None].expand(-1, -1, -1, d))  # (b, hq, p, d)
    kn = k.float() if k_normalized else F.normalize(k.float(), dim=-1)
    groups = hq // hkv
    scores = qs.reshape(b, hkv, groups * qs.shape[2], d) @ kn.transpose(-1, -2)  # (b, hkv, g*p, n)
    agg = scores.amax(dim=2) if aggregate == "max" else scores.mean(dim=2)  # (b, hkv, n)
    agg[..., 0] = torch.inf  # the sink
    return torch.topk(agg, n_keep, dim=-1).indices.sort(dim=-1).values


@functools.lru_cache(maxsize=256)
def earlier_keep_share(q_len: int, k_len: int, chunk_size: int, sparsity: float, min_keys: int = 0) -> float:
    """``φ``: the share of each chunk's earlier keys to keep so that a forward pass of ``q_len``
    queries over ``k_len`` keys keeps ``1 - sparsity`` of its causal pairs, counting the chunks'
    own keys (always kept) and the floor of ``min_keys`` (kept where ``φ`` gives fewer, so other
    chunks keep less). 0 when the diagonal and the floor alone exceed the target, 1 when no chunk
    has earlier keys."""
    offset, visible, diagonal, chunks = k_len - q_len, 0, 0, []
    for s in range(0, q_len, chunk_size):
        c = min(chunk_size, q_len - s)
        visible += c * (2 * (offset + s) + c + 1) // 2  # sum of (position + 1) over the chunk's queries
        diagonal += c * (c + 1) // 2
        chunks.append((offset + s, c))  # (earlier keys, queries)
    if not any(n for n, _ in chunks):
        return 1.0
    return solve_keep_share(chunks, min_keys, (1.0 - sparsity) * visible - diagonal)


@register_sparsifier("quoka", QuokaConfig)
def quoka(model: nn.Module, cfg: QuokaConfig, *, sparsity: float,
          calib_tokens: np.ndarray | None = None) -> AttentionSparsity:
    """QuoKA skipping ``sparsity`` of the causal KV pairs of each forward pass: every chunk attends
    to its own keys and to the top ``B`` earlier keys (see the module docstring); needs no calibration."""
    require(0.0 <= sparsity < 1.0, "sparsity", f"must be in [0, 1), got {sparsity}")

    def attend(handle, q, k, v, mask, scaling):
        share = earlier_keep_share(q.shape[2], k.shape[2], cfg.chunk_size, sparsity, cfg.min_keys)
        kn = F.normalize(k.float(), dim=-1) if sparsity > 0 else k

        def select(qc: torch.Tensor, kc: torch.Tensor, n_vis: int) -> torch.Tensor | None:
            n_past = n_vis - qc.shape[2]  # the chunk's own keys are the last qc.shape[2]
            n_keep = max(cfg.min_keys, round(share * n_past))
            if sparsity == 0 or n_keep >= n_past:
                return None
            past = quoka_select(qc, kn[:, :, :n_past], n_keep, cfg.n_queries, cfg.aggregate, k_normalized=True)
            own = torch.arange(n_past, n_vis, device=kc.device).expand(*past.shape[:2], -1)
            return torch.cat([past, own], dim=-1)

        return attend_subset(handle, q, k, v, mask, scaling, cfg.chunk_size, select)

    meta = {"method": "quoka", "sparsity": sparsity, "chunk_size": cfg.chunk_size, "n_queries": cfg.n_queries,
            "aggregate": cfg.aggregate, "min_keys": cfg.min_keys}
    return AttentionSparsity(model, attend, meta=meta)
