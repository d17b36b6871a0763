"""GPTQ: Hessian-based column-by-column weight quantization from calibration activations.

Frantar, Ashkboos, Hoefler & Alistarh, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers" (ICLR 2023, arXiv:2210.17323). For a linear layer with weight ``W`` (out, in) and calibration inputs ``X`` (n, in),
GPTQ minimises ``||X W^T - X W_hat^T||^2`` one input column at a time: with ``H = 2 X^T X / n``
(damped by ``λ I``, ``λ = damp * mean(diag H)``) and ``U`` the upper Cholesky factor of ``H^-1``,
column ``j`` is rounded to the grid and its error is pushed onto the columns not yet quantized::

    e_j = (w_j - q(w_j)) / U_jj            W[:, j+1:] -= e_j U_j,j+1:          (OBS update, eq. 3-4)

processed in blocks of ``block_size`` columns with lazy batch updates (Sec. 3.3). ``act_order``
visits columns by decreasing ``diag(H)``. Groups are contiguous ``group_size`` input columns of the
original order; a group's scale and zero are fixed the first time one of its columns is visited
(with act_order off this is the reference implementation's behaviour; with it on it avoids a
per-column group index at no storage cost). Blocks are calibrated in order, each seeing the
outputs of the already-quantized blocks before it (the paper's sequential setting).

Stored exactly like RTN (``qweight``/``scales``/``zeros``), so :func:`tasks.zoo.decoders.grouped_int_state`
reads it and the same dequantize kernels serve both.

When the damped Hessian is not positive definite (tiny calibration sets, dead inputs), the damping
is raised tenfold until the Cholesky succeeds (reported per layer in ``meta["damping"]``); if it
never does, the layer falls back to RTN and says so in ``meta["fallback_rtn"]`` — never a crash.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from kernels.group_quant import reference as gq
from tasks.common.config import at_least, in_interval, require
from tasks.common.registry import MethodSpec
from tasks.compression._calib import by_block, calibration_windows, input_statistics, model_seq_len, quantized_linears
from tasks.compression.packing import PackedWeights, packed_model, refuse_tied
from tasks.compression.registry import register_method
from tasks.compression.rtn import symmetric_quantize
from tasks.zoo.compressed import CompressedModel, diagnostic, unique_state


@dataclass(frozen=True, kw_only=True)
class GPTQConfig(MethodSpec):
    """``bits`` 2..8 and ``group_size`` as RTN; ``damp``: λ as a fraction of mean(diag H) (1%);
    ``act_order``: visit columns by decreasing Hessian diagonal; ``block_size``: columns per lazy
    batch; ``seq_len``/``max_windows``: calibration windows cut from ``calib_tokens`` (``seq_len``
    capped at the model's position limit; ``max_windows`` 0 = all); ``sequential``: calibrate block
    by block on the already-quantized model (else all layers from the full-precision activations)."""

    method: Literal["gptq"] = "gptq"
    bits: int = 4
    group_size: int = 128
    symmetric: bool = False
    damp: float = 0.01
    act_order: bool = True
    block_size: int = 128
    seq_len: int = 128
    max_windows: int = 0
    sequential: bool = True
    skip: tuple[str, ...] = ("lm_head", "*.lm_head")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(2 <= self.bits <= 8, "bits", f"must be in 2..8, got {self.bits}")
        at_least(self.group_size, 1, "group_size")
        in_interval(self.damp, 0, 1, "damp", "(]")
        at_least(self.block_size, 1, "block_size")
        at_least(self.seq_len, 2, "seq_len")
        at_least(self.max_windows, 0, "max_windows")


def _group_params(w: torch.Tensor, bits: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero (rows,) fp32 of one group's columns ``w`` (rows, g), on the fp16 grid."""
    fn = symmetric_quantize if symmetric else gq.quantize
    _, scale, zero = fn(w, bits=bits, group_size=w.shape[1])
    return scale[:, 0].float(), zero[:, 0].float()


def _inverse_hessian_factor(h: torch.Tensor, damp: float) -> tuple[torch.Tensor | None, float]:
    """Upper Cholesky factor of ``(H + λI)^-1``, raising λ tenfold until it exists: ``(U, damp used)``."""
    mean_diag = float(torch.diag(h).mean())
    scale = mean_diag if mean_diag > 0 else 1.0
    eye = torch.eye(h.shape[0], dtype=h.dtype)
    while damp <= 1e4:
        hd = h + damp * scale * eye
        chol, info = torch.linalg.cholesky_ex(hd)
        if int(info) == 0:
            hinv = torch.cholesky_inverse(chol)
            u, info = torch.linalg.cholesky_ex(hinv, upper=True)
            if int(info) == 0 and torch.isfinite(u).all():
                return u, damp
        damp *= 10
    return None, damp


def gptq_quantize(
    w: torch.Tensor, h: torch.Tensor, *, bits: int, group_size: int, damp: float = 0.01,
    act_order: bool = True, block_size: int = 128, symmetric: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
    """GPTQ one weight ``w`` (rows, cols) given ``h`` (cols, cols) = ``E[x x^T]`` of its inputs.

    Returns ``q`` uint8 (rows, cols) in the original column order, ``scale``/``zero`` fp16
    (rows, ceil(cols / group_size)) and ``info``: ``damp`` used, ``damp_raised``, ``fallback_rtn``,
    ``proxy_loss`` = ``sum_j e_j**2 / 2`` (the OBS estimate of the added output error).
    """
    rows, cols = w.shape
    qmax = 2**bits - 1
    W = w.detach().clone().float()
    H = h.detach().clone().float()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    u, used = _inverse_hessian_factor(H, damp)
    info: dict[str, Any] = {"damp": used, "damp_raised": used != damp, "fallback_rtn": u is None}
    if u is None:  # no damping made H positive definite: plain RTN for this layer
        fn = symmetric_quantize if symmetric else gq.quantize
        q, scale, zero = fn(w.float(), bits=bits, group_size=group_size)
        info["proxy_loss"] = None
        return q, scale, zero, info
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(cols)
    if act_order:
        # Re-factor in the permuted order (the Cholesky factor is order-dependent).
        u, used2 = _inverse_hessian_factor(H[perm][:, perm], used)
        info["damp"] = used2
        info["damp_raised"] = used2 != damp
        if u is None:
            perm = torch.arange(cols)
            u, _ = _inverse_hessian_factor(H, used)
    W = W[:, perm]
    groups = gq.n_groups(cols, group_size)
    scale = torch.zeros(rows, groups)
    zero = torch.zeros(rows, groups)
    have = torch.zeros(groups, dtype=torch.bool)
    codes = torch.zeros(rows, cols)
    group_of = perm // group_size  # original group of each visited column
    position = torch.argsort(perm)  # where each original column sits in the visiting order
    loss = 0.0
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        W1 = W[:, i1:i2].clone()
        E1 = torch.zeros_like(W1)
        U1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            g = int(group_of[i1 + i])
            if not have[g]:
                # First visit of group g: none of its columns is quantized yet; fix its parameters
                # from their current values (in-block columns carry this block's updates in W1).
                pos = position[g * group_size : min((g + 1) * group_size, cols)]
                current = W[:, pos].clone()
                inblock = pos < i2
                current[:, inblock] = W1[:, pos[inblock] - i1]
                scale[:, g], zero[:, g] = _group_params(current, bits, symmetric)
                have[g] = True
            col = W1[:, i]
            s, z = scale[:, g], zero[:, g]
            qc = torch.clamp(torch.floor(col / s + 0.5) + z, 0, qmax)
            codes[:, i1 + i] = qc
            err = (col - (qc - z) * s) / U1[i, i]
            loss += float((err * err).sum()) / 2
            W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
            E1[:, i] = err
        W[:, i2:] -= E1 @ u[i1:i2, i2:]
    q = codes[:, position].to(torch.uint8)
    info["proxy_loss"] = loss
    return q, scale.half(), zero.half(), info


@register_method("gptq", GPTQConfig)
def compress_gptq(model: nn.Module, cfg: GPTQConfig, *, calib_tokens: np.ndarray | None = None) -> CompressedModel:
    """GPTQ a copy of ``model`` using ``calib_tokens`` (training tokens, 1-D) for the Hessians.

    Returns the copy with dequantized weights in place, the RTN-format tensors and ``meta``
    (``bits_per_weight`` counts codes plus fp16 scales and zeros; ``damping`` and ``fallback_rtn``
    list the layers whose Hessian needed more damping or none worked; ``calib_windows``).
    """
    seq_len = model_seq_len(model, cfg.seq_len)
    windows = calibration_windows(calib_tokens, seq_len, cfg.max_windows or None, method="gptq")
    qmodel = copy.deepcopy(model).eval()
    state, tied = unique_state(qmodel)
    targets = quantized_linears(qmodel, cfg.skip)
    refuse_tied(targets, tied)
    packed = PackedWeights()
    damping: dict[str, float] = {}
    fallback: list[str] = []
    proxy: dict[str, float] = {}
    groups = by_block(qmodel, targets) if cfg.sequential else [(None, targets)]
    fp_stats = None if cfg.sequential else input_statistics(qmodel, windows, dict(targets), full=True)
    for block, members in groups:
        stats = fp_stats or input_statistics(qmodel, windows, dict(members), full=True, stop_after=block)
        for name, mod in members:
            key = f"{name}.weight"
            w = mod.weight.detach()
            q, scale, zero, info = gptq_quantize(
                w, stats[name].hessian, bits=cfg.bits, group_size=cfg.group_size, damp=cfg.damp,
                act_order=cfg.act_order, block_size=cfg.block_size, symmetric=cfg.symmetric)
            if info["damp_raised"]:
                damping[key] = info["damp"]
            if info["fallback_rtn"]:
                fallback.append(key)
            if info["proxy_loss"] is not None:
                proxy[key] = diagnostic(info["proxy_loss"])
            with torch.no_grad():
                mod.weight.copy_(gq.dequantize(q, scale, zero, group_size=cfg.group_size, dtype=w.dtype))
            packed.add_group_codes(key, w, q, scale, zero, bits=cfg.bits, group_size=cfg.group_size,
                                   symmetric=cfg.symmetric)
    return packed_model(model, qmodel, state, tied, cfg, packed,
                        calib_windows=int(windows.shape[0]), calib_seq_len=int(windows.shape[1]),
                        damping=damping, fallback_rtn=fallback, proxy_loss=proxy)
