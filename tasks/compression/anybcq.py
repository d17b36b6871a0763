"""AnyBCQ: binary-coded quantization with progressive precision expansion, one artifact for 2/3/4 bits.

Follows Park, Bae, Kwon, Kim, Kwon & Lee, "AnyBCQ: Hardware Efficient Flexible Binary-Coded
Quantization for Multi-Precision LLMs" (2025, arXiv:2510.10467), on binary-coded quantization
(Xu et al. 2018, "Alternating Multi-bit Quantization for Recurrent Neural Networks", arXiv:1802.00150):
``w ≈ z + Σ_{p=1..k} α_p b_p`` per (row, group), the ``min_bits`` planes fitted by alternating
minimisation, each further plane the sign of the residual with the earlier ones frozen and only the
scales re-solved, so precision ``k`` reads planes ``1..k`` and its own scales.

Deviations, each a config field: ``offset`` adds the per-group constant ``z`` (affine BCQ, as
LUT-GEMM's); the default fit starts from the min–max uniform grid (``init: uniform``) and weighs each
weight's error by its input channel's calibration ``E[x_j²]`` (``weighting: activation``), because
the paper's data-free Frobenius fit (``init: greedy, weighting: none``) collapsed on SmolLM2-135M
(the measurements and the on-disk format are in docs/compression.md).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn

from kernels.group_quant.reference import n_groups
from tasks.common.config import at_least, require
from tasks.common.registry import MethodSpec
from tasks.compression._calib import calibration_windows, input_statistics, model_seq_len, quantized_linears
from tasks.compression.packing import PackedWeights, packed_model, refuse_tied
from tasks.compression.registry import register_method
from tasks.zoo.compressed import CompressedModel, diagnostic, unique_state
from tasks.zoo.decoders import anybcq_state, bcq_dequantize, reconstruct_planes


@dataclass(frozen=True, kw_only=True)
class AnyBCQConfig(MethodSpec):
    """``min_bits``..``max_bits``: the precisions one artifact serves (1..8); ``bits``: the one the
    returned model uses and its row reports (the stage evaluates all of them); ``group_size``:
    input channels sharing scales; ``iters``: alternating sign/least-squares rounds at ``min_bits``;
    ``offset``: a per-group constant beside the planes.

    ``init``: the ``min_bits`` planes' start, ``uniform`` (the min–max grid) or ``greedy`` (signs of
    the residual). ``weighting``: ``activation`` weighs each weight's squared error by its input
    channel's calibration ``E[x_j^2]`` (normalised to mean 1, plus ``weight_floor``), ``none`` is the
    paper's plain Frobenius error and needs no calibration. ``seq_len``, ``max_windows``,
    ``batch_size``: the calibration windows cut from ``calib_tokens`` (``activation`` only).
    ``init: greedy, weighting: none`` is the paper's data-free fit; see the module docstring for why
    it is not the default."""

    method: Literal["anybcq"] = "anybcq"
    bits: int = 2
    min_bits: int = 2
    max_bits: int = 4
    group_size: int = 128
    iters: int = 6
    offset: bool = True
    init: Literal["uniform", "greedy"] = "uniform"
    weighting: Literal["activation", "none"] = "activation"
    weight_floor: float = 1e-3
    seq_len: int = 128
    max_windows: int = 0
    batch_size: int = 8
    skip: tuple[str, ...] = ("lm_head", "*.lm_head")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(1 <= self.min_bits <= self.max_bits <= 8, "max_bits",
                f"need 1 <= min_bits <= max_bits <= 8, got {self.min_bits}..{self.max_bits}")
        require(self.min_bits <= self.bits <= self.max_bits, "bits",
                f"must be in min_bits..max_bits = {self.min_bits}..{self.max_bits}, got {self.bits}")
        at_least(self.group_size, 2, "group_size")
        at_least(self.iters, 0, "iters")
        require(self.init in ("uniform", "greedy"), "init", f"must be 'uniform' or 'greedy', got {self.init!r}")
        require(self.weighting in ("activation", "none"), "weighting",
                f"must be 'activation' or 'none', got {self.weighting!r}")
        at_least(self.weight_floor, 0, "weight_floor")
        at_least(self.seq_len, 2, "seq_len")
        at_least(self.max_windows, 0, "max_windows")
        at_least(self.batch_size, 1, "batch_size")


def _grouped(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) -> values and a 0/1 mask, both (rows, groups, group_size) (padding masked out)."""
    rows, cols = w.shape
    g = n_groups(cols, group_size)
    pad = g * group_size - cols
    x = torch.nn.functional.pad(w.float(), (0, pad)).reshape(rows, g, group_size)
    m = torch.nn.functional.pad(torch.ones(rows, cols), (0, pad)).reshape(rows, g, group_size)
    return x, m


def _solve_scales(x: torch.Tensor, m: torch.Tensor, planes: torch.Tensor, offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Least-squares ``α`` (rows, groups, k) and ``z`` (rows, groups) for fixed planes (k, rows, groups, gs),
    rounded to fp16 (as stored). ``m`` weighs each weight's squared error (0 on padding; 1, or the
    calibration second moment of its input channel). The normal equations are built from plane inner
    products, no basis copy."""
    k = planes.shape[0]
    pm = planes * m
    ata = torch.einsum("prgs,qrgs->rgpq", pm, planes)
    atb = torch.einsum("prgs,rgs->rgp", pm, x)
    if offset:
        col = pm.sum(-1).permute(1, 2, 0)  # Σ m b_p: (rows, groups, k)
        n = m.sum(-1)
        ata = torch.cat([torch.cat([ata, col[..., None]], -1),
                         torch.cat([col, n[..., None]], -1)[..., None, :]], -2)
        atb = torch.cat([atb, (m * x).sum(-1)[..., None]], -1)
    ridge = 1e-6 * ata.diagonal(dim1=-2, dim2=-1).mean(-1).clamp(min=1e-12)
    eye = torch.eye(ata.shape[-1])
    sol = torch.linalg.solve(ata + ridge[..., None, None] * eye, atb[..., None])[..., 0]
    sol = sol.half().float()
    alpha = sol[..., :k]
    z = sol[..., k] if offset else torch.zeros_like(sol[..., 0])
    return alpha, z


def _uniform_planes(x: torch.Tensor, m: torch.Tensor, bits: int, offset: bool) -> torch.Tensor:
    """The min–max uniform grid of ``bits`` bits per group (round-to-nearest's) written as BCQ planes.

    Level ``lo + s·q`` with ``q = Σ_p 2^(p-1) (b_p + 1)/2`` is ``z + Σ_p s 2^(p-2) b_p``, so RTN is BCQ
    with scales ``s/2, s, 2s, …``; without ``offset`` the grid is symmetric, ``±max|w|``. Returns
    planes (bits, rows, groups, gs); the scales are solved afterwards."""
    big = torch.finfo(x.dtype).max
    if offset:
        lo = torch.where(m > 0, x, big).amin(-1, keepdim=True)
        hi = torch.where(m > 0, x, -big).amax(-1, keepdim=True)
    else:
        hi = (x * m).abs().amax(-1, keepdim=True)
        lo = -hi
    levels = 2**bits - 1
    scale = ((hi - lo) / levels).clamp(min=1e-12)
    q = ((x - lo) / scale).round().clamp(0, levels).to(torch.int64)
    return torch.stack([((q >> p) & 1).float() * 2 - 1 for p in range(bits)])


def bcq_progressive(
    w: torch.Tensor, *, min_bits: int, max_bits: int, group_size: int, iters: int = 15, offset: bool = True,
    init: str = "greedy", channel_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Fit nested BCQ planes to ``w`` (rows, cols).

    ``init``: ``greedy`` (each plane the sign of the residual, BCQ's usual start) or ``uniform``
    (the min–max grid, see :func:`_uniform_planes`). ``channel_weight`` (cols,): weigh each
    input channel's squared error in the least squares (e.g. the calibration ``E[x_j^2]``); the
    sign step is unchanged, the nearest level being nearest under any positive per-weight weight.

    Returns ``planes`` (max_bits, rows, cols) float ±1 and ``{k: (alpha (rows, groups, k), z (rows, groups))}``
    for every ``k`` in ``min_bits..max_bits`` (fp32 values on the fp16 grid).
    """
    rows, cols = w.shape
    x, m = _grouped(w, group_size)
    fit_m = m
    if channel_weight is not None:
        h, _ = _grouped(channel_weight.float().reshape(1, cols), group_size)
        fit_m = m * h
    k0 = min_bits
    if init == "uniform":
        p = _uniform_planes(x, m, k0, offset)
    elif init == "greedy":
        z = (x * fit_m).sum(-1) / fit_m.sum(-1) if offset else torch.zeros(x.shape[:2])
        r = x - z[..., None]
        planes = []
        for _ in range(k0):
            b = torch.where(r >= 0, 1.0, -1.0)
            a = (r.abs() * fit_m).sum(-1) / fit_m.sum(-1)
            planes.append(b)
            r = r - a[..., None] * b
        p = torch.stack(planes)
    else:
        raise ValueError(f"init must be 'greedy' or 'uniform', got {init!r}")
    alpha, z = _solve_scales(x, fit_m, p, offset)
    combos = torch.tensor(list(itertools.product([-1.0, 1.0], repeat=k0)))  # (2**k0, k0)
    for _ in range(iters):
        # Best sign pattern per weight given the scales: the nearest of the 2**k0 levels.
        levels = z[..., None] + alpha @ combos.T  # (rows, groups, 2**k0)
        best = (x[..., None] - levels[..., None, :]).abs().argmin(-1)  # (rows, groups, gs)
        new = combos[best].permute(3, 0, 1, 2)  # (k0, rows, groups, gs)
        if torch.equal(new, p):
            break
        p = new
        alpha, z = _solve_scales(x, fit_m, p, offset)
    scales = {k0: (alpha, z)}
    for k in range(k0 + 1, max_bits + 1):
        residual = x - reconstruct_planes(p, alpha, z)
        p = torch.cat([p, torch.where(residual >= 0, 1.0, -1.0)[None]])  # earlier planes frozen
        alpha, z = _solve_scales(x, fit_m, p, offset)
        scales[k] = (alpha, z)
    planes_flat = p.reshape(max_bits, rows, -1)[..., :cols]
    return planes_flat, scales


def pack_planes(planes: torch.Tensor) -> torch.Tensor:
    """±1 planes (P, rows, cols) -> uint8 (P, rows, ceil(cols / 8)), bit ``j % 8`` of byte ``j // 8`` = (b_j > 0)."""
    P, rows, cols = planes.shape
    nbytes = (cols + 7) // 8
    bits = torch.nn.functional.pad((planes > 0).to(torch.int32), (0, nbytes * 8 - cols)).reshape(P, rows, nbytes, 8)
    weights = 1 << torch.arange(8, dtype=torch.int32)
    return (bits * weights).sum(-1).to(torch.uint8)


def bits_per_weight(bits: int, group_size: int, offset: bool) -> float:
    """Storage read to serve ``bits``: the planes plus fp16 scales (and offset) per group."""
    return bits + 16 * (bits + int(offset)) / group_size


@register_method("anybcq", AnyBCQConfig)
def compress_anybcq(model: nn.Module, cfg: AnyBCQConfig, *, calib_tokens: np.ndarray | None = None) -> CompressedModel:
    """AnyBCQ a copy of ``model`` into one multi-precision artifact; ``calib_tokens`` are read only
    with ``weighting: activation``.

    ``model`` of the result serves ``cfg.bits``; ``meta["precisions"]`` maps every servable bit width
    to its ``bits_per_weight``; ``meta["weight_error"]`` the relative Frobenius error per precision.
    """
    qmodel = copy.deepcopy(model).eval()
    state, tied = unique_state(qmodel)
    targets = quantized_linears(qmodel, cfg.skip)
    refuse_tied(targets, tied)
    channel_weight: dict[str, torch.Tensor] = {}
    calib_windows = 0
    if cfg.weighting == "activation":
        windows = calibration_windows(calib_tokens, model_seq_len(model, cfg.seq_len), cfg.max_windows or None,
                                      method="anybcq (weighting: activation)")
        calib_windows = int(windows.shape[0])
        stats = input_statistics(qmodel, windows, dict(targets), full=False, batch_size=cfg.batch_size)
        for name, st in stats.items():
            h = st.sq_mean.double()
            channel_weight[name] = (h / h.mean().clamp(min=1e-30) + cfg.weight_floor).float()
    packed = PackedWeights()
    err = {k: 0.0 for k in range(cfg.min_bits, cfg.max_bits + 1)}
    norm = 0.0
    for name, mod in targets:
        w = mod.weight.detach()
        planes, scales = bcq_progressive(w, min_bits=cfg.min_bits, max_bits=cfg.max_bits, group_size=cfg.group_size,
                                         iters=cfg.iters, offset=cfg.offset, init=cfg.init,
                                         channel_weight=channel_weight.get(name))
        parts = {"planes": pack_planes(planes)}
        for k, (alpha, z) in scales.items():
            parts[f"scales.{k}"] = alpha.half()
            if cfg.offset:
                parts[f"offset.{k}"] = z.half()
            w_k = bcq_dequantize(planes[:k], alpha, z, group_size=cfg.group_size)
            err[k] += float(((w.float() - w_k) ** 2).sum())
        norm += float((w.float() ** 2).sum())
        packed.add(f"{name}.weight", w, parts, {"min_bits": cfg.min_bits, "max_bits": cfg.max_bits,
                                                "group_size": cfg.group_size, "offset": cfg.offset})
    n_quantized = packed.n_params
    precisions = {str(k): bits_per_weight(k, cfg.group_size, cfg.offset) for k in range(cfg.min_bits, cfg.max_bits + 1)}
    # AnyBCQ's bits per weight is what serving cfg.bits reads; every plane and scale set is counted apart.
    artifact_bits = sum(8 * v.numel() * v.element_size() for v in packed.tensors.values())
    cm = packed_model(model, qmodel, state, tied, cfg, packed, bits=cfg.bits, precisions=precisions,
                      bits_per_weight=precisions[str(cfg.bits)],
                      artifact_bits_per_weight=artifact_bits / n_quantized if n_quantized else None,
                      weight_error={str(k): diagnostic((v / norm) ** 0.5) if norm else None for k, v in err.items()},
                      calib_windows=calib_windows)
    state_k = anybcq_state(cm.tensors, cm.meta)
    with torch.no_grad():
        for name, mod in targets:
            mod.weight.copy_(state_k[f"{name}.weight"])
    return cm
