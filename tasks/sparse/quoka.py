"""QuoKA: query-oriented KV selection for chunked prefill (sparse attention over the top-B keys).

Follows Jones, Park, Morse, Lee, Lott & Langston, "QuoKA: Query-oriented KV selection for Efficient
LLM Prefill" (2026, arXiv:2602.08722): prefill runs in chunks of ``chunk_size`` queries; per chunk and
head, the ``n_queries`` queries least similar (cosine) to the chunk's mean query are kept as probes,
every earlier key is scored by its cosine similarity to them (aggregated over probes and over the
query heads of its GQA group), and the chunk attends to the top ``B`` earlier keys (the first key
always among them, an attention sink) plus its own keys, causally.

Deviations: the chunk's own keys (the diagonal block) are always attended, because one key set per
chunk under the causal mask otherwise leaves queries unable to see themselves; one keep share of
the earlier keys per forward pass is solved so that ``sparsity`` (the share of causal (query, key)
pairs skipped) is met where the diagonal and ``min_keys`` allow. Implemented as one reversible
``AttentionInterface`` patch (:class:`tasks.sparse.attention.AttentionSparsity`) with
:mod:`kernels.sparse_attention`, not the paper's kernels. Measurements: docs/sparse.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tasks.common.config import at_least, require
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
        at_least(self.chunk_size, 1, "chunk_size")
        at_least(self.n_queries, 1, "n_queries")
        at_least(self.min_keys, 1, "min_keys")


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
