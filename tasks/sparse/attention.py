"""Sparse prefill attention shared by QuoKA (:mod:`tasks.sparse.quoka`) and ProxyAttn
(:mod:`tasks.sparse.proxyattn`): a reversible patch of a Llama-family model's attention, chunked
causal attention over the keys a method chooses, and the keep share that meets a sparsity target.

:class:`AttentionSparsity` registers an attention function with ``transformers``'
``AttentionInterface``: entering the handle sets ``config._attn_implementation`` to it, leaving
restores the previous implementation — one reversible patch. :func:`attend_subset` and
:func:`attend_lists` attend each chunk of queries to its key lists through
:mod:`kernels.sparse_attention` and count the (query, key) pairs skipped on the handle.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from kernels.sparse_attention import block_sparse_attention, gathered_attention

IMPL = "scalelab_sparse_attention"
_ATTR = "_scalelab_sparse_attention"


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


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
