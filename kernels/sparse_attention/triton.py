"""Sparse prefill attention in Triton: the same results as :mod:`kernels.sparse_attention.reference`.

Flash-attention style (Dao et al., "FlashAttention"): one program computes a tile of ``BLOCK_M``
queries of one (batch, query head) within one query chunk / block, walking that chunk's key list in
tiles of ``BLOCK_N`` keys with an online softmax — running row max ``m``, denominator ``l`` and
output accumulator in fp32, ``acc ← acc · 2^(m_old - m_new) + P V`` — so nothing of size
(queries × keys) is stored. Scores are computed in the log2 domain (``exp2`` with ``scaling · log2 e``).

* :func:`gathered_attention` (QuoKA): a key tile is ``BLOCK_N`` entries of the list, read as indices
  and gathered row by row from K and V.
* :func:`block_sparse_attention` (ProxyAttn): one flat loop over (listed block, key tile of that
  block); a listed block is read as contiguous key tiles of ``BLOCK_N`` positions.

Loads are masked, not branched around, so the key loop has no branch and pipelines: padding (-1),
keys past ``n`` and keys after every query of the tile are never read (the host passes each list's
length up to its last non-padding entry, so trailing padding costs no loop step at all); keys after
some queries of the tile are read and masked per pair (causal).

The head dimension is padded to a power of two >= 16 (``tl.dot``'s minimum) with masked loads, so
8, 80 or 96 work. ``tl.dot`` runs on fp32 operands for fp32 inputs (IEEE precision, not TF32) and
always in the interpreter, whose bf16 ``tl.dot`` is wrong (triton-lang/triton#11584); compiled fp16 /
bf16 inputs use the tensor cores in their own dtype, accumulating in fp32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.sparse_attention.reference import _check

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax_step(qk, allowed, m_i, l_i, acc, v, FP32_DOT: tl.constexpr):
    """Fold one tile of log2-domain scores ``qk`` (BLOCK_M, BLOCK_N) into the running (m, l, acc)."""
    qk = tl.where(allowed, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # A row with nothing allowed so far keeps m = -inf; subtracting 0 instead keeps exp2 finite (0).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP32_DOT:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _gathered_attention_kernel(
    q_ptr, k_ptr, v_ptr, keys_ptr, len_ptr, mask_ptr, o_ptr,
    HQ, HS, NQ, N, D, CHUNK, GROUPS, LIST_DIV, TILES_PER_CHUNK, N_CHUNKS,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_lb, stride_lh, stride_lc, stride_lm,
    stride_mb, stride_mt, stride_mn,
    stride_ob, stride_oh, stride_ot, stride_od,
    qk_scale,
    HAS_MASK: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(0)
    pid = tl.program_id(1)
    b = (bh // HQ).to(tl.int64)
    h = bh % HQ
    chunk = pid // TILES_PER_CHUNK
    row0 = chunk * CHUNK + (pid % TILES_PER_CHUNK) * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    row_hi = tl.minimum((chunk + 1) * CHUNK, NQ)
    row_ok = rows < row_hi
    qpos = N - NQ + rows  # absolute positions of the tile's queries
    q_last = N - NQ + tl.minimum(row0 + BLOCK_M, row_hi) - 1
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < D

    q = tl.load(
        q_ptr + b * stride_qb + h.to(tl.int64) * stride_qh + rows[:, None].to(tl.int64) * stride_qt + dd[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    if FP32_DOT:
        q = q.to(tl.float32)
    kvh = (h // GROUPS).to(tl.int64)
    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh
    hs = h // LIST_DIV
    l_base = keys_ptr + b * stride_lb + hs.to(tl.int64) * stride_lh + chunk.to(tl.int64) * stride_lc
    n_listed = tl.load(len_ptr + (b * HS + hs) * N_CHUNKS + chunk)  # trailing padding is not walked

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for j0 in range(0, n_listed, BLOCK_N):
        jj = j0 + tl.arange(0, BLOCK_N)
        idx = tl.load(l_base + jj * stride_lm, mask=jj < n_listed, other=-1).to(tl.int64)
        # Padding and keys after every query of the tile are neither read nor attended.
        valid = (idx >= 0) & (idx <= q_last)
        kt = tl.load(k_base + idx[None, :] * stride_kn + dd[:, None] * stride_kd,
                     mask=valid[None, :] & d_ok[:, None], other=0.0)  # (BLOCK_D, BLOCK_N)
        v = tl.load(v_base + idx[:, None] * stride_vn + dd[None, :] * stride_vd,
                    mask=valid[:, None] & d_ok[None, :], other=0.0)
        if FP32_DOT:
            qk = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
        else:
            qk = tl.dot(q, kt)
        qk = qk * qk_scale
        allowed = valid[None, :] & (idx[None, :] <= qpos[:, None])
        if HAS_MASK:
            add = tl.load(mask_ptr + b * stride_mb + rows[:, None].to(tl.int64) * stride_mt + idx[None, :] * stride_mn,
                          mask=allowed & row_ok[:, None], other=0.0)
            qk += add.to(tl.float32) * 1.4426950408889634
        m_i, l_i, acc = _online_softmax_step(qk, allowed, m_i, l_i, acc, v, FP32_DOT)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # no allowed key: acc is 0, so is the output
    tl.store(
        o_ptr + b * stride_ob + h.to(tl.int64) * stride_oh + rows[:, None].to(tl.int64) * stride_ot + dd[None, :] * stride_od,
        out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
    )


@triton.jit
def _block_sparse_attention_kernel(
    q_ptr, k_ptr, v_ptr, blocks_ptr, len_ptr, mask_ptr, o_ptr,
    HQ, HS, NQ, N, D, BLOCK_SIZE, GROUPS, LIST_DIV, TILES_PER_BLOCK, N_QBLOCKS, TILES_PER_KBLOCK,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_lb, stride_lh, stride_lc, stride_lm,
    stride_mb, stride_mt, stride_mn,
    stride_ob, stride_oh, stride_ot, stride_od,
    qk_scale,
    HAS_MASK: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(0)
    pid = tl.program_id(1)
    b = (bh // HQ).to(tl.int64)
    h = bh % HQ
    qblock = pid // TILES_PER_BLOCK
    row0 = qblock * BLOCK_SIZE + (pid % TILES_PER_BLOCK) * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    row_hi = tl.minimum((qblock + 1) * BLOCK_SIZE, NQ)
    row_ok = rows < row_hi
    qpos = N - NQ + rows
    q_last = N - NQ + tl.minimum(row0 + BLOCK_M, row_hi) - 1
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < D

    q = tl.load(
        q_ptr + b * stride_qb + h.to(tl.int64) * stride_qh + rows[:, None].to(tl.int64) * stride_qt + dd[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    if FP32_DOT:
        q = q.to(tl.float32)
    kvh = (h // GROUPS).to(tl.int64)
    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh
    hs = h // LIST_DIV
    l_base = blocks_ptr + b * stride_lb + hs.to(tl.int64) * stride_lh + qblock.to(tl.int64) * stride_lc
    n_listed = tl.load(len_ptr + (b * HS + hs) * N_QBLOCKS + qblock)  # trailing padding is not walked

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # One flat loop over (listed block, key tile of that block): a loop without branches pipelines.
    for step in range(0, n_listed * TILES_PER_KBLOCK):
        blk = tl.load(l_base + (step // TILES_PER_KBLOCK) * stride_lm).to(tl.int64)
        uu = (step % TILES_PER_KBLOCK) * BLOCK_N + tl.arange(0, BLOCK_N)
        pos = blk * BLOCK_SIZE + uu
        # Padding (-1), the tail past n, and keys after every query of the tile are neither read nor attended.
        valid = (blk >= 0) & (uu < BLOCK_SIZE) & (pos < N) & (pos <= q_last)
        kt = tl.load(k_base + pos[None, :] * stride_kn + dd[:, None] * stride_kd,
                     mask=valid[None, :] & d_ok[:, None], other=0.0)  # (BLOCK_D, BLOCK_N)
        v = tl.load(v_base + pos[:, None] * stride_vn + dd[None, :] * stride_vd,
                    mask=valid[:, None] & d_ok[None, :], other=0.0)
        if FP32_DOT:
            qk = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
        else:
            qk = tl.dot(q, kt)
        qk = qk * qk_scale
        allowed = valid[None, :] & (pos[None, :] <= qpos[:, None])
        if HAS_MASK:
            add = tl.load(mask_ptr + b * stride_mb + rows[:, None].to(tl.int64) * stride_mt + pos[None, :] * stride_mn,
                          mask=allowed & row_ok[:, None], other=0.0)
            qk += add.to(tl.float32) * 1.4426950408889634
        m_i, l_i, acc = _online_softmax_step(qk, allowed, m_i, l_i, acc, v, FP32_DOT)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        o_ptr + b * stride_ob + h.to(tl.int64) * stride_oh + rows[:, None].to(tl.int64) * stride_ot + dd[None, :] * stride_od,
        out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
    )


def _pow2_at_least_16(x: int) -> int:
    return max(16, triton.next_power_of_2(x))


def _tiles(group: int, d: int, dtype: torch.dtype, block_m: int | None, block_n: int | None) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D): query tile within a chunk / block, key tile, padded head dim."""
    block_d = _pow2_at_least_16(d)
    wide = block_d > 128 or (dtype == torch.float32 and not INTERPRETED)  # keep fp32 / d > 128 tiles in shared memory
    if block_m is None:
        # The interpreter pays per program and per loop step, not per element: 64 there is plenty.
        block_m = min(64 if INTERPRETED or wide else 128, _pow2_at_least_16(group))
    if block_n is None:
        block_n = 32 if wide else 64
    for name, t in (("block_m", block_m), ("block_n", block_n)):
        if t < 16 or t & (t - 1):
            raise ValueError(f"{name}: expected a power of two >= 16, got {t}")
    return block_m, block_n, block_d


def _list_lengths(lists: torch.Tensor) -> torch.Tensor:
    """(b, hs, g) int32, contiguous: 1 + the last non-padding entry of each list (0 for an all-padding list)."""
    if lists.shape[-1] == 0:
        return torch.zeros(lists.shape[:3], dtype=torch.int32, device=lists.device)
    place = torch.arange(1, lists.shape[-1] + 1, dtype=torch.int32, device=lists.device)
    return torch.where(lists >= 0, place, 0).amax(dim=-1).to(torch.int32).contiguous()


def _launch(kernel, q, k, v, lists, mask, group: int, scaling: float, bm: int, bn: int, bd: int,
            *extra: int) -> torch.Tensor:
    """Grid (b · hq, groups of queries · query tiles per group); ``group`` is chunk_size or block_size,
    ``extra`` the kernel's own integer arguments after the shared ones."""
    b, hq, nq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    o = torch.empty((b, hq, nq, d), dtype=q.dtype, device=q.device)
    if o.numel() == 0:
        return o
    tiles_per_group = triton.cdiv(min(group, nq), bm)
    hs, n_groups = lists.shape[1], lists.shape[2]
    mask_strides = (mask.stride(0), mask.stride(2), mask.stride(3)) if mask is not None else (0, 0, 0)
    grid = (b * hq, n_groups * tiles_per_group)
    kernel[grid](
        q, k, v, lists, _list_lengths(lists), mask if mask is not None else q, o,
        hq, hs, nq, n, d, group, hq // hkv, hq // hs, tiles_per_group, n_groups, *extra,
        *q.stride(), *k.stride(), *v.stride(), *lists.stride(), *mask_strides, *o.stride(),
        float(scaling) * LOG2E,
        HAS_MASK=mask is not None, FP32_DOT=INTERPRETED or q.dtype == torch.float32,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd,
        num_warps=8 if bm * bd >= 128 * 128 else 4,
        num_stages=3 if q.element_size() == 2 and bd <= 128 else 2,
    )
    return o


def gathered_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    *,
    chunk_size: int,
    scaling: float,
    mask: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Attention of each query chunk over its own list of key positions (QuoKA's gathered KV subset).

    q (b, hq, nq, d): the last nq of the n positions of k, v (b, hkv, n, d); hq a multiple of hkv
    (GQA). keys (b, hs, ceil(nq / chunk_size), m) integer positions, hs == hkv or hq, -1 padded,
    unsorted allowed, no duplicates; causal; mask: optional additive (b, 1, nq, n). Returns
    (b, hq, nq, d) in q.dtype; a query with no allowed key gives zeros (see the reference for the
    full definition). Any strides. ``block_m`` / ``block_n``: query and key tile sizes, powers of two
    >= 16 (defaults: the chunk size rounded up, at most 128 (64 interpreted); 64 keys).
    """
    _check(q, k, v, keys, chunk_size, mask, lists_name="keys", size_name="chunk_size")
    bm, bn, bd = _tiles(chunk_size, q.shape[-1], q.dtype, block_m, block_n)
    return _launch(_gathered_attention_kernel, q, k, v, keys, mask, chunk_size, scaling, bm, bn, bd)


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: torch.Tensor,
    *,
    block_size: int,
    scaling: float,
    mask: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Attention of each query block over the keys of its listed key blocks (ProxyAttn's block-sparse attention).

    q (b, hq, nq, d), k, v (b, hkv, n, d) as in :func:`gathered_attention`. blocks
    (b, hs, ceil(nq / block_size), m) integer key-block indices (block j = positions
    [j*block_size, (j+1)*block_size) ∩ [0, n)), hs == hkv or hq, -1 padded, any order, no duplicates;
    causal; mask: optional additive (b, 1, nq, n). Returns (b, hq, nq, d) in q.dtype.
    ``block_m`` / ``block_n``: query tile and key sub-tile of a listed block, powers of two >= 16
    (defaults: the block size rounded up, at most 128 (64 interpreted); 64).
    """
    _check(q, k, v, blocks, block_size, mask, lists_name="blocks", size_name="block_size")
    bm, bn, bd = _tiles(block_size, q.shape[-1], q.dtype, block_m, block_n)
    if block_n is None:  # a key tile need not exceed the block it walks
        bn = min(bn, _pow2_at_least_16(block_size))
    return _launch(_block_sparse_attention_kernel, q, k, v, blocks, mask, block_size, scaling, bm, bn, bd,
                   triton.cdiv(block_size, bn))
