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

import contextlib
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kernels.sparse_attention import block_sparse_attention, gathered_attention
from tasks.common.config import require
from tasks.sparse.registry import SparseMethodSpec, register_sparsifier

IMPL = "scalelab_sparse_attention"
_ATTR = "_scalelab_sparse_attention"


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


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


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


def solve_keep_share(groups: Sequence[tuple[int, int]], floor: int, room: float) -> float:
    """The share ``φ`` in [0, 1] at which the pairs kept first reach ``room``, by bisection.

    Each group is ``(n, weight)``: ``n`` units to choose from (earlier keys of a chunk, candidate
    blocks of a query block), each worth ``weight`` pairs, of which ``min(n, max(min(n, floor), φ n))``
    are kept. 0 when the floors alone reach ``room``."""
    def kept(phi: float) -> float:
        return sum(min(n, max(min(n, floor), phi * n)) * w for n, w in groups)

    if kept(0.0) >= room:
        return 0.0
    lo, hi = 0.0, 1.0  # kept() is continuous and increasing in phi
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if kept(mid) < room else (lo, mid)
    return hi


class AttentionSparsity(contextlib.AbstractContextManager):
    """A reversible patch of a model's attention: the ``ActivationSparsity`` protocol (``with``,
    ``achieved_sparsity()``, ``meta``) for methods that skip KV pairs instead of input channels."""

    def __init__(self, model: nn.Module, attend: Any, *, meta: dict[str, Any]) -> None:
        self.model, self.attend, self.meta = model, attend, dict(meta)
        self.attn_modules = [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "k_proj")]
        if not self.attn_modules or not hasattr(model, "config"):
            raise ValueError(f"{type(model).__name__}: no Llama-family attention modules (q_proj/k_proj) to patch")
        self._saved: str | None = None
        self.reset_counts()

    def reset_counts(self) -> None:
        self.skipped, self.visible = 0, 0

    def __enter__(self) -> AttentionSparsity:
        if self._saved is not None:
            raise RuntimeError("this sparsity handle is already active")
        _register()
        self._saved = self.model.config._attn_implementation
        self.model.config._attn_implementation = IMPL
        for m in self.attn_modules:
            setattr(m, _ATTR, self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            self.model.config._attn_implementation = self._saved
            self._saved = None
        for m in self.attn_modules:
            if getattr(m, _ATTR, None) is self:
                delattr(m, _ATTR)

    @property
    def active(self) -> bool:
        return self._saved is not None

    def achieved_sparsity(self) -> float | None:
        return self.skipped / self.visible if self.visible else None


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The registered attention function: the active handle's method, or exact attention."""
    handle = getattr(module, _ATTR, None)
    if handle is None:  # a model that shares the config but is not patched: exact attention
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    return handle.attend(handle, query, key, value, attention_mask, scaling or query.shape[-1] ** -0.5), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(IMPL, _attention)
    AttentionMaskInterface.register(IMPL, eager_mask)


def attend_subset(handle: AttentionSparsity, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None, scaling: float, chunk_size: int, select) -> torch.Tensor:
    """Chunked causal attention where each chunk of queries attends to the keys ``select`` keeps.

    ``select(q_chunk, k_visible, n_visible) -> indices or None`` (None = all): (b, h_kv, n_keep), one
    key set per KV head shared by its GQA group, or (b, h_q, n_keep), one per query head, where ``-1``
    pads heads that keep fewer keys. Every chunk's keys are chosen first, then attended by
    :func:`attend_lists`. Returns (b, q_len, h_q, d) as transformers' attention functions do."""
    b, hq, q_len, d = q.shape
    hkv, k_len = k.shape[1], k.shape[2]
    offset = k_len - q_len
    starts = list(range(0, q_len, chunk_size))
    chosen = [select(q[:, :, s : s + chunk_size], k[:, :, : offset + min(s + chunk_size, q_len)],
                     offset + min(s + chunk_size, q_len)) for s in starts]
    hs = hq if any(x is not None and x.shape[1] == hq for x in chosen) else hkv
    lengths = [offset + min(s + chunk_size, q_len) if x is None else x.shape[-1] for s, x in zip(starts, chosen)]
    keys = torch.full((b, hs, len(starts), max(lengths, default=0)), -1, dtype=torch.long, device=q.device)
    for i, x in enumerate(chosen):
        if x is None:
            x = torch.arange(lengths[i], device=q.device).expand(b, hs, -1)
        keys[:, :, i, : x.shape[-1]] = _repeat_kv(x, hs // x.shape[1])
    return attend_lists(handle, q, k, v, mask, scaling, keys, size=chunk_size)


def attend_lists(handle: AttentionSparsity, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: torch.Tensor | None, scaling: float, lists: torch.Tensor, *, size: int,
                 blocks: bool = False) -> torch.Tensor:
    """Attention of each chunk of ``size`` queries over its list: key positions (b, h_kv or h_q,
    chunks, m), or key blocks of ``size`` positions when ``blocks``; ``-1`` pads. One call of
    :mod:`kernels.sparse_attention` (compiled Triton on CUDA; on CPU, gathered keys into fused
    attention, problems bucketed by list length so padding wastes little). Returns (b, q_len, h_q, d)
    as transformers' attention functions do; counts skipped pairs on ``handle``."""
    b, hq, q_len, _ = q.shape
    offset = k.shape[2] - q_len
    rows = None if mask is None else mask[:, :, :, : k.shape[2]].expand(b, 1, -1, -1)
    if blocks:
        out = block_sparse_attention(q, k, v, lists, block_size=size, scaling=scaling, mask=rows)
        pos = lists[..., None] * size + torch.arange(size, device=q.device)
        lists = torch.where((lists[..., None] >= 0) & (pos < k.shape[2]), pos, -1).flatten(-2)
    else:
        out = gathered_attention(q, k, v, lists, chunk_size=size, scaling=scaling, mask=rows)
    visible = b * hq * int((torch.arange(offset, offset + q_len) + 1).sum())  # causal pairs (key <= query)
    handle.visible += visible
    handle.skipped += visible - (hq // lists.shape[1]) * _allowed_pairs(lists, offset, offset + q_len, size)
    return out.transpose(1, 2).contiguous()


def _allowed_pairs(keys: torch.Tensor, start: int, end: int, chunk_size: int) -> int:
    """(query, key) pairs the causal mask allows for key lists (b, h, chunks, m) of the chunks of
    positions ``[start, end)``: a key at ``p >= 0`` is seen by the chunk's queries at ``>= p``."""
    first = start + chunk_size * torch.arange(keys.shape[2], device=keys.device)[:, None]  # (chunks, 1)
    stop = (first + chunk_size).clamp(max=end)
    seen = (stop - torch.maximum(keys, first)).clamp(min=0)
    return int(seen.masked_fill(keys < 0, 0).sum())


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
