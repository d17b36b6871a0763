"""Sparse prefill attention: QuoKA's gathered KV subset and ProxyAttn's block-sparse attention.

>>> o = gathered_attention(q, k, v, keys, chunk_size=128, scaling=d ** -0.5)      # keys (b, hs, n_chunks, m)
>>> o = block_sparse_attention(q, k, v, blocks, block_size=64, scaling=d ** -0.5)  # blocks (b, hs, n_qblocks, m)

q (b, hq, nq, d) are the last nq of the n positions of k, v (b, hkv, n, d); each query chunk / block
attends causally to its listed key positions / key blocks (see :mod:`kernels.sparse_attention.reference`
for the definition). Dispatches like every kernel (:mod:`kernels._dispatch`): compiled Triton on
CUDA, the interpreter when asked; on CPU :mod:`kernels.sparse_attention.cpu`;
``SCALELAB_TRITON=reference`` forces the torch reference.
"""

from __future__ import annotations

import torch

from kernels import _dispatch
from kernels._dispatch import implementation
from kernels.sparse_attention import cpu

__all__ = ["gathered_attention", "block_sparse_attention"]


def _module(q: torch.Tensor):
    module = implementation("sparse_attention", q.device)
    if module.__name__.endswith(".reference") and q.device.type == "cpu" and _dispatch._requested() != "reference":
        module = cpu
    return module


def gathered_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, *,
                       chunk_size: int, scaling: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Each query chunk attends to its own list of key positions (QuoKA): q (b, hq, nq, d), k, v
    (b, hkv, n, d), keys (b, hkv or hq, ceil(nq / chunk_size), m), -1 padded; mask optional
    additive (b, 1, nq, n). Returns (b, hq, nq, d) in q.dtype."""
    return _module(q).gathered_attention(q, k, v, keys, chunk_size=chunk_size, scaling=scaling, mask=mask)


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, *,
                           block_size: int, scaling: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Each query block attends to the keys of its listed key blocks (ProxyAttn): q (b, hq, nq, d),
    k, v (b, hkv, n, d), blocks (b, hkv or hq, ceil(nq / block_size), m), -1 padded; mask optional
    additive (b, 1, nq, n). Returns (b, hq, nq, d) in q.dtype."""
    return _module(q).block_sparse_attention(q, k, v, blocks, block_size=block_size, scaling=scaling, mask=mask)
