"""NuBitQ: non-uniform weight quantization with learned codebooks, per-layer bit widths to a budget,
and the Outlier Compensation Plugin (OCP).

Follows Mao, Zhang, Li, Qiao, Cai, Wu & Liu, "No Outlier Channels but with Outlier Blocks" (ICLR
2026; code maoshanwen/NuBitQ-OCP): activation-weighted Lloyd codebooks per row, group or tensor,
bit widths shared out to ``budget_bits`` by marginal analysis on a diagonal second-order loss
estimate ``½ Σ_ij f_i d_j ΔW_ij²`` (``d_j = E[x_j²]``, ``f_i = E[(∂L/∂y_i)²]``), and the OCP's
linear-level sparse outliers and least-squares codebook correction and block-level output factors.
No Hessian inversion, no fine-tuning. Deviation: the OCP's model-level compensation (the whole
model's output divergence) is not implemented. Details and the on-disk format: docs/compression.md.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from torch import nn

from kernels.group_quant import pack_codes, packed_cols
from kernels.group_quant.reference import n_groups
from tasks.common.config import at_least, require
from tasks.common.registry import MethodSpec
from tasks.compression._calib import calibration_windows, decoder_blocks, model_seq_len, quantized_linears
from tasks.compression.packing import PackedWeights, packed_model, refuse_tied
from tasks.compression.registry import register_method
from tasks.zoo.compressed import CompressedModel, diagnostic, unique_state
from tasks.zoo.decoders import LayerCode, Scope, decode_layer, nubitq_state

@dataclass(frozen=True, kw_only=True)
class NuBitQConfig(MethodSpec):
    """``bits``: every layer's width when ``budget_bits`` is None; ``budget_bits``: average stored
    bits per quantized weight, all overheads counted, shared out per layer among ``bit_choices``;
    ``codebook``/``group_size``: where codebooks live (see the module docstring); ``lloyd_iters``;
    ``activation_weighted``: Lloyd weighted by ``E[x_j^2]`` (False: plain k-means); ``propagation``:
    include the output-gradient factor ``f_i`` in scores and bit allocation; ``outlier_frac``,
    ``outlier_score``, ``lsq_correction``, ``block_correction``: the OCP parts; ``seq_len``,
    ``max_windows``, ``batch_size``: calibration windows cut from ``calib_tokens``.
    ``infeasible_budget``: when even the narrowest widths cost more than ``budget_bits`` (small
    rows pay a large share for their row scale or codebook), ``narrowest`` stores every layer at the
    narrowest width and records ``budget_met: false`` with the measured ``bits_per_weight``;
    ``error`` refuses."""

    method: Literal["nubitq"] = "nubitq"
    bits: int = 3
    budget_bits: float | None = None
    bit_choices: tuple[int, ...] = (2, 3, 4)
    codebook: Scope = "row"
    group_size: int = 128
    lloyd_iters: int = 20
    activation_weighted: bool = True
    propagation: bool = True
    outlier_frac: float = 0.0
    outlier_score: Literal["ocp", "magnitude"] = "ocp"
    lsq_correction: bool = True
    block_correction: bool = False
    seq_len: int = 128
    max_windows: int = 0
    batch_size: int = 8
    skip: tuple[str, ...] = ("lm_head", "*.lm_head")
    infeasible_budget: Literal["narrowest", "error"] = "narrowest"

    def __post_init__(self) -> None:
        super().__post_init__()
        require(1 <= self.bits <= 8, "bits", f"must be in 1..8, got {self.bits}")
        require(len(self.bit_choices) > 0 and all(1 <= b <= 8 for b in self.bit_choices), "bit_choices",
                f"must be widths in 1..8, got {list(self.bit_choices)}")
        require(list(self.bit_choices) == sorted(set(self.bit_choices)), "bit_choices",
                f"must be increasing without repeats, got {list(self.bit_choices)}")
        require(self.budget_bits is None or self.budget_bits > 0, "budget_bits", f"must be > 0, got {self.budget_bits}")
        at_least(self.group_size, 2, "group_size")
        at_least(self.lloyd_iters, 0, "lloyd_iters")
        require(0.0 <= self.outlier_frac < 0.5, "outlier_frac", f"must be in [0, 0.5), got {self.outlier_frac}")
        at_least(self.seq_len, 2, "seq_len")
        at_least(self.max_windows, 0, "max_windows")
        at_least(self.batch_size, 1, "batch_size")


# ---------------------------------------------------------------------------------------------
# Weighted 1-D Lloyd, batched over segments (each segment has its own codebook)


class SortedSegments(NamedTuple):
    """What every Lloyd fit of the same segments shares, whatever the number of levels: the values
    ``x`` (S, n) fp32, sorted per segment ``xs``, and prefix sums (S, n + 1) float64 over the sorted
    values of (w, w x, w x^2) (``prefix``) and of (1, x, x^2) (``ones``)."""

    x: torch.Tensor
    xs: torch.Tensor
    prefix: list[torch.Tensor]
    ones: list[torch.Tensor]


def sort_segments(x: torch.Tensor, weight: torch.Tensor) -> SortedSegments:
    """Sort ``x`` (S, n) per segment and take the prefix sums :func:`weighted_lloyd` steps on.

    The sort is most of a fit's cost, so a layer fitted at several widths sorts once."""
    S, n = x.shape
    x = x.float()
    wt = weight.float().clamp(min=0) + 1e-12  # a zero-weight segment still gets sensible levels
    order = torch.argsort(x, dim=1)
    xs = torch.gather(x, 1, order).contiguous()
    ws = torch.gather(wt, 1, order).double()
    xd = xs.double()
    zero = torch.zeros(S, 1, dtype=torch.float64)
    prefix = [torch.cat([zero, torch.cumsum(v, 1)], 1) for v in (ws, ws * xd, ws * xd * xd)]
    ones = [torch.cat([zero, torch.cumsum(v, 1)], 1) for v in (torch.ones_like(xd), xd, xd * xd)]
    return SortedSegments(x=x, xs=xs, prefix=prefix, ones=ones)


def weighted_lloyd(x: torch.Tensor, weight: torch.Tensor, levels: int, iters: int, *,
                   segments: SortedSegments | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd / k-means in 1-D per segment: ``x``, ``weight`` (S, n) -> codebook (S, levels) sorted
    ascending (fp16 grid) and codes (S, n) int64 minimising ``Σ weight (x - codebook[code])^2``.

    In 1-D a level's cell is an interval of the sorted values, so after one sort each Lloyd step is
    ``levels`` binary searches and prefix-sum differences (``O(levels log n)`` per segment, not
    ``O(n)``). Lloyd only finds a local optimum (with very uneven weights, heavy points pin levels
    early), so it runs from three starts and keeps, per segment, the best: the weighted quantiles
    ``(k + ½) / levels``, a uniform grid over ``[min, max]`` (RTN's grid, good for heavy tails) and
    the unweighted k-means solution. An empty level keeps its value.

    ``segments``: :func:`sort_segments` of the same ``x`` and ``weight``, when several widths share it.
    """
    x, xs, prefix, ones = segments if segments is not None else sort_segments(x, weight)
    n = xs.shape[1]
    cw = prefix[0][:, 1:]
    targets = ((torch.arange(levels, dtype=torch.float64) + 0.5) / levels * cw[:, -1:]).contiguous()
    quantile_start = torch.gather(xs, 1, torch.searchsorted(cw.contiguous(), targets).clamp(max=n - 1))
    lo, hi = xs[:, :1], xs[:, -1:]
    grid_start = lo + (hi - lo) * (torch.arange(levels, dtype=torch.float32) + 0.5) / levels
    plain_start = _sorted_lloyd(xs, ones, quantile_start, iters)[0]
    best_c, best_err = None, None
    for start in (quantile_start, grid_start, plain_start):
        c, err = _sorted_lloyd(xs, prefix, start, iters)
        if best_c is None:
            best_c, best_err = c, err
        else:
            better = err < best_err
            best_c = torch.where(better[:, None], c, best_c)
            best_err = torch.minimum(err, best_err)
    return best_c, _assign(x, best_c)


def _cells(xs: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Cell boundaries (S, levels + 1) in the sorted values for the sorted codebook ``c`` (ties go down, as :func:`_assign`)."""
    S, n = xs.shape
    mid = ((c[:, 1:] + c[:, :-1]) / 2).contiguous()
    inner = torch.searchsorted(xs, mid, right=True)
    return torch.cat([torch.zeros(S, 1, dtype=torch.long), inner, torch.full((S, 1), n, dtype=torch.long)], 1)


def _sorted_lloyd(xs: torch.Tensor, prefix: list[torch.Tensor], c: torch.Tensor, iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd on sorted values with prefix sums of (w, w x, w x^2): ``(codebook on the fp16 grid, error (S,))``."""
    p0, p1, p2 = prefix

    def sums(b, p):
        return torch.gather(p, 1, b[:, 1:]) - torch.gather(p, 1, b[:, :-1])

    c = torch.sort(c.float(), dim=1).values
    bounds = _cells(xs, c)
    for _ in range(iters):
        w, wx = sums(bounds, p0), sums(bounds, p1)
        c = torch.sort(torch.where(w > 0, wx / w.clamp(min=1e-300), c.double()).float(), dim=1).values
        new = _cells(xs, c)
        if torch.equal(new, bounds):
            break
        bounds = new
    c = c.half().float()
    b = _cells(xs, c)
    cd = c.double()
    err = (sums(b, p2) - 2 * cd * sums(b, p1) + cd * cd * sums(b, p0)).sum(1)
    return c, err


def _assign(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Nearest level of the sorted codebook ``c`` (S, K) for every ``x`` (S, n)."""
    if c.shape[1] == 1:
        return torch.zeros_like(x, dtype=torch.int64)
    mid = (c[:, 1:] + c[:, :-1]) / 2
    return torch.searchsorted(mid.contiguous(), x.contiguous())


# ---------------------------------------------------------------------------------------------
# Codebook scopes: segments of a weight matrix sharing one codebook


def _segments(w: torch.Tensor, imp: torch.Tensor, scope: Scope, group_size: int):
    """(values, weights) as (S, n) segments, and the row scale for ``tensor`` scope."""
    rows, cols = w.shape
    if scope == "row":
        return w, imp, None
    if scope == "group":
        g = n_groups(cols, group_size)
        pad = g * group_size - cols
        # Padding gets weight 0 (it is dropped after assignment).
        x = torch.nn.functional.pad(w, (0, pad)).reshape(rows * g, group_size)
        m = torch.nn.functional.pad(imp, (0, pad)).reshape(rows * g, group_size)
        return x, m, None
    scale = w.abs().amax(dim=1).clamp(min=1e-8)
    scale = (scale * (1 + 2.0**-10)).half().float()
    xs = w / scale[:, None]
    return xs.reshape(1, -1), (imp * scale[:, None] ** 2).reshape(1, -1), scale


def fit_layer(w: torch.Tensor, imp: torch.Tensor, bits: int, scope: Scope, group_size: int, iters: int) -> LayerCode:
    """Codebooks and codes of ``w`` (rows, cols) at ``bits`` under per-weight importance ``imp`` (rows, cols)."""
    return fit_layer_widths(w, imp, (bits,), scope, group_size, iters)[bits]


def fit_layer_widths(w: torch.Tensor, imp: torch.Tensor, widths: tuple[int, ...], scope: Scope, group_size: int,
                     iters: int) -> dict[int, LayerCode]:
    """:func:`fit_layer` at every width of ``widths``, sorting the weights once for all of them."""
    rows, cols = w.shape
    x, m, scale = _segments(w.float(), imp.float(), scope, group_size)
    segments = sort_segments(x, m)
    out = {}
    for bits in widths:
        c, codes = weighted_lloyd(x, m, 2**bits, iters, segments=segments)
        out[bits] = LayerCode(bits=bits, codes=codes.reshape(rows, -1)[:, :cols].to(torch.uint8), codebook=c,
                              row_scale=scale)
    return out


def codebook_bits(rows: int, cols: int, bits: int, scope: Scope, group_size: int) -> int:
    """Stored bits of one weight's codebooks (fp16 levels) and row scales."""
    levels = 2**bits
    if scope == "row":
        return 16 * rows * levels
    if scope == "group":
        return 16 * rows * n_groups(cols, group_size) * levels
    return 16 * levels + 16 * rows


def outlier_bits(rows: int, cols: int, nnz: int) -> int:
    """CSR side matrix: fp16 value + int16 (int32 past 32767 columns) column per outlier, int32 row pointers."""
    if nnz == 0:
        return 0
    return nnz * (16 + (16 if cols <= 32767 else 32)) + 32 * (rows + 1)


def layer_bits(rows: int, cols: int, bits: int, scope: Scope, group_size: int, nnz: int = 0) -> int:
    """Every stored bit of one quantized weight: packed codes, codebooks, row scales, outliers."""
    return 8 * rows * packed_cols(cols, bits) + codebook_bits(rows, cols, bits, scope, group_size) + outlier_bits(rows, cols, nnz)


# ---------------------------------------------------------------------------------------------
# Calibration: d_j (activation) and f_i (propagation) per layer, and H for the LSQ correction


def sensitivities(model: nn.Module, windows: torch.Tensor, modules: dict[str, nn.Linear], *, fisher: bool,
                  full: bool, batch_size: int) -> dict[str, dict[str, torch.Tensor]]:
    """Per module: ``d`` (in,) = E[x_j^2]; ``f`` (out,) = E[(∂L/∂y_i)^2] of the summed token loss
    (ones without ``fisher``); ``h`` (in, in) = E[x x^T] when ``full``."""
    acc = {n: {"d": torch.zeros(m.in_features, dtype=torch.float64), "f": torch.zeros(m.out_features, dtype=torch.float64),
               "h": torch.zeros(m.in_features, m.in_features, dtype=torch.float64) if full else None, "n": 0}
           for n, m in modules.items()}

    def hook_for(name):
        def hook(mod, args, out):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            a = acc[name]
            a["d"] += (x * x).sum(0)
            if full:
                a["h"] += x.T @ x
            a["n"] += x.shape[0]
            if fisher and out.requires_grad:
                def grad_hook(g: torch.Tensor) -> None:
                    a["f"].add_((g.detach().reshape(-1, g.shape[-1]).double() ** 2).sum(0))

                out.register_hook(grad_hook)
        return hook

    handles = [m.register_forward_hook(hook_for(n)) for n, m in modules.items()]
    params = list(model.parameters())
    was = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(fisher)
        for start in range(0, len(windows), batch_size):
            x = windows[start : start + batch_size]
            if fisher:
                with torch.enable_grad():
                    logits = model(input_ids=x, use_cache=False).logits
                    loss = torch.nn.functional.cross_entropy(
                        logits[:, :-1].float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
                    loss.backward()
                for p in params:
                    p.grad = None
            else:
                with torch.no_grad():
                    model(input_ids=x, use_cache=False)
    finally:
        for h in handles:
            h.remove()
        for p, r in zip(params, was):
            p.requires_grad_(r)
    out = {}
    for name, a in acc.items():
        n = max(a["n"], 1)
        out[name] = {"d": (a["d"] / n).float(), "f": (a["f"] / n).float() if fisher else torch.ones(len(a["f"])),
                     "h": (a["h"] / n).float() if full else None}
    return out


# ---------------------------------------------------------------------------------------------
# Bit allocation and the OCP parts


def allocate_bits(errors: dict[str, dict[int, float]], costs: dict[str, dict[int, int]], budget: float) -> dict[str, int]:
    """Per-layer widths minimising ``Σ errors[l][b_l]`` with ``Σ costs[l][b_l] <= budget`` (greedy marginal analysis).

    Raises ``ValueError`` when even the narrowest widths exceed the budget.
    """
    choice = {l: min(c) for l, c in costs.items()}
    total = sum(costs[l][b] for l, b in choice.items())
    if total > budget:
        raise ValueError(f"budget_bits too small: the narrowest widths already need {total} bits, budget {budget:.0f}")
    while True:
        best, best_gain = None, 0.0
        for l, b in choice.items():
            wider = [c for c in costs[l] if c > b]
            if not wider:
                continue
            nb = min(wider)
            extra = costs[l][nb] - costs[l][b]
            if total + extra > budget:
                continue
            gain = (errors[l][b] - errors[l][nb]) / max(extra, 1)
            if gain > best_gain:
                best, best_gain = (l, nb, extra), gain
        if best is None:
            return choice
        l, nb, extra = best
        choice[l] = nb
        total += extra


def lsq_codebook(w: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor, h: torch.Tensor,
                 keep: torch.Tensor | None = None, damp: float = 0.01) -> torch.Tensor:
    """Row codebooks re-solved against the input covariance: per row ``argmin_c (w - A c)^T H (w - A c)``.

    w (rows, cols), codes (rows, cols) int, codebook (rows, K), h (cols, cols); ``keep`` (rows, cols)
    bool marks the weights the codebook represents (False: stored exactly elsewhere). Returns the new
    codebook (rows, K) on the fp16 grid; a level no weight uses keeps its old value.
    """
    rows, cols = w.shape
    K = codebook.shape[1]
    hd = h + damp * h.diagonal().mean().clamp(min=1e-12) * torch.eye(cols)
    a = torch.nn.functional.one_hot(codes.long(), K).float()  # (rows, cols, K)
    if keep is not None:
        a = a * keep[..., None]
    ha = torch.matmul(hd, a)  # (rows, cols, K)
    m = a.transpose(1, 2) @ ha  # (rows, K, K)
    wk = w.float() * keep if keep is not None else w.float()
    rhs = (ha * wk[..., None]).sum(1)  # A^T H w: (rows, K)
    lam = 1e-6 * m.diagonal(dim1=1, dim2=2).mean(1).clamp(min=1e-12)
    eye = torch.eye(K)
    sol = torch.linalg.solve(m + lam[:, None, None] * eye, (rhs + lam[:, None] * codebook)[..., None])[..., 0]
    used = a.sum(1) > 0
    sol = torch.where(used & torch.isfinite(sol), sol, codebook)
    return sol.half().float()


def to_csr(mask: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Outliers as CSR: values fp16 (nnz,), column indices int16/int32 (nnz,), row pointers int32 (rows + 1,)."""
    rows, cols = mask.shape
    r, c = mask.nonzero(as_tuple=True)
    rowptr = torch.zeros(rows + 1, dtype=torch.int32)
    rowptr[1:] = torch.cumsum(torch.bincount(r, minlength=rows), 0).to(torch.int32)
    idx_dtype = torch.int16 if cols <= 32767 else torch.int32
    return values[r, c].half(), c.to(idx_dtype), rowptr


def branch_outputs(model: nn.Module) -> list[nn.Linear]:
    """The last ``nn.Linear`` of each residual branch in every decoder block (``o_proj``, ``down_proj``)."""
    blocks = decoder_blocks(model)
    out = []
    for block in blocks or []:
        for child in block.children():
            linears = [m for m in child.modules() if isinstance(m, nn.Linear)]
            if linears:
                out.append(linears[-1])
    return out


def _capture_outputs(model: nn.Module, windows: torch.Tensor, module: nn.Module, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums over calibration tokens of ``<y, y>`` per output channel, and the outputs themselves (tokens, out)."""
    ys = []

    def hook(mod, args, out):
        ys.append(out.detach().reshape(-1, out.shape[-1]).float())

    h = module.register_forward_hook(hook)
    try:
        with torch.no_grad():
            for start in range(0, len(windows), batch_size):
                model(input_ids=windows[start : start + batch_size], use_cache=False)
    finally:
        h.remove()
    y = torch.cat(ys)
    return (y * y).sum(0), y


# ---------------------------------------------------------------------------------------------


@register_method("nubitq", NuBitQConfig)
def compress_nubitq(model: nn.Module, cfg: NuBitQConfig, *, calib_tokens: np.ndarray | None = None) -> CompressedModel:
    """NuBitQ (+ the enabled OCP parts) on a copy of ``model``, calibrated on ``calib_tokens``.

    ``meta``: ``bits_per_weight`` (everything stored, per quantized weight), ``layer_bits`` (the
    width chosen per weight), ``outliers`` (count), ``estimated_loss_increase`` (the diagonal
    second-order estimate after quantization, before the LSQ/block corrections).
    """
    seq_len = model_seq_len(model, cfg.seq_len)
    windows = calibration_windows(calib_tokens, seq_len, cfg.max_windows or None, method="nubitq")
    qmodel = copy.deepcopy(model).eval()
    state, tied = unique_state(qmodel)
    targets = quantized_linears(qmodel, cfg.skip)
    refuse_tied(targets, tied)
    mods = dict(targets)
    lsq = cfg.lsq_correction and cfg.codebook == "row"
    sens = sensitivities(qmodel, windows, mods, fisher=cfg.propagation, full=lsq, batch_size=cfg.batch_size)
    choices = cfg.bit_choices if cfg.budget_bits is not None else (cfg.bits,)
    weights = {n: m.weight.detach().float() for n, m in targets}
    n_total = sum(w.numel() for w in weights.values())
    n_outliers = int(round(cfg.outlier_frac * n_total))

    def importance(name: str) -> torch.Tensor:
        d = sens[name]["d"] if cfg.activation_weighted else torch.ones_like(sens[name]["d"])
        return sens[name]["f"][:, None] * d[None, :] if cfg.propagation else d[None, :].expand_as(weights[name])

    fits: dict[str, dict[int, LayerCode]] = {}
    errors: dict[str, dict[int, float]] = {}
    costs: dict[str, dict[int, int]] = {}
    for name, w in weights.items():
        imp = importance(name)
        fits[name], errors[name], costs[name] = {}, {}, {}
        for b, code in fit_layer_widths(w, imp, choices, cfg.codebook, cfg.group_size, cfg.lloyd_iters).items():
            deq = decode_layer(code, w.shape[1], cfg.codebook, cfg.group_size)
            fits[name][b] = code
            errors[name][b] = 0.5 * float((imp * (w - deq) ** 2).sum())
            costs[name][b] = layer_bits(*w.shape, b, cfg.codebook, cfg.group_size)
    budget_met = True
    if cfg.budget_bits is not None:
        # Outliers are paid for first: 32 bits each, plus row pointers for every layer (an upper bound).
        outlier_cost = n_outliers * 32 + (sum(32 * (w.shape[0] + 1) for w in weights.values()) if n_outliers else 0)
        budget = cfg.budget_bits * n_total - outlier_cost
        narrowest = {name: min(c) for name, c in costs.items()}
        budget_met = sum(costs[n][b] for n, b in narrowest.items()) <= budget
        if budget_met or cfg.infeasible_budget == "error":
            chosen = allocate_bits(errors, costs, budget)
        else:
            warnings.warn(f"nubitq: budget_bits={cfg.budget_bits} is below what the narrowest widths store on "
                          f"this model; every layer at {min(choices)} bits (budget_met: false)", stacklevel=2)
            chosen = narrowest
    else:
        chosen = {name: cfg.bits for name in weights}
    # OCP linear level: global top outliers by score, then codebooks refitted without them.
    keep: dict[str, torch.Tensor | None] = {name: None for name in weights}
    if n_outliers:
        scores = []
        for name, w in weights.items():
            deq = decode_layer(fits[name][chosen[name]], w.shape[1], cfg.codebook, cfg.group_size)
            s = importance(name) * (w - deq) ** 2 if cfg.outlier_score == "ocp" else w.abs()
            scores.append(s.flatten())
        flat = torch.cat(scores)
        threshold = torch.topk(flat, n_outliers, sorted=True).values[-1]
        offset = 0
        for name, w in weights.items():
            s = flat[offset : offset + w.numel()].reshape(w.shape)
            offset += w.numel()
            mask = s >= threshold
            if mask.any():
                keep[name] = ~mask
                imp = importance(name) * keep[name]
                fits[name][chosen[name]] = fit_layer(w, imp, chosen[name], cfg.codebook, cfg.group_size, cfg.lloyd_iters)
    estimated = 0.0
    packed = PackedWeights()
    total_outliers = 0
    for name, w in weights.items():
        key = f"{name}.weight"
        code = fits[name][chosen[name]]
        deq = decode_layer(code, w.shape[1], cfg.codebook, cfg.group_size)
        kept = keep[name]
        resid = (w - deq) if kept is None else (w - deq) * kept
        estimated += 0.5 * float((importance(name) * resid**2).sum())
        if lsq and chosen[name] <= 4:
            code.codebook = lsq_codebook(w, code.codes, code.codebook, sens[name]["h"], keep=kept)
        parts: dict[str, torch.Tensor] = {}
        nnz = 0
        if kept is not None:
            vals, cols_idx, rowptr = to_csr(~kept, w)
            parts.update(outlier_values=vals, outlier_cols=cols_idx, outlier_rowptr=rowptr)
            nnz = vals.numel()
            total_outliers += nnz
        parts.update(codes=pack_codes(code.codes, code.bits), codebook=code.codebook.half())
        if code.row_scale is not None:
            parts["row_scale"] = code.row_scale.half()
        packed.add(key, mods[name].weight, parts, {"bits": code.bits, "codebook": cfg.codebook,
                                                   "group_size": cfg.group_size, "outliers": nnz},
                   stored_bits=layer_bits(*w.shape, code.bits, cfg.codebook, cfg.group_size, nnz))
    cm = packed_model(model, qmodel, state, tied, cfg, packed,
                      layer_bits={f"{n}.weight": b for n, b in chosen.items()}, outliers=total_outliers,
                      budget_met=budget_met, estimated_loss_increase=diagnostic(estimated),
                      calib_windows=int(windows.shape[0]))
    _load_into(qmodel, cm.tensors, cm.meta)
    if cfg.block_correction:
        _block_correction(model, qmodel, windows, cm.tensors, cm.meta, cfg)
    return cm


def _load_into(qmodel: nn.Module, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    state = nubitq_state(tensors, meta)
    with torch.no_grad():
        params = dict(qmodel.named_parameters())
        for key in meta["quantized"]:
            params[key].copy_(state[key])


def _block_correction(model: nn.Module, qmodel: nn.Module, windows: torch.Tensor, tensors: dict[str, torch.Tensor],
                      meta: dict[str, Any], cfg: NuBitQConfig) -> None:
    """OCP block level: per-output-channel factors on each branch's output linear, folded into its row codebook.

    In block order, so each factor sees the inputs the already-corrected blocks produce.
    """
    if cfg.codebook != "row":
        raise ValueError("block_correction folds factors into row codebooks: set codebook: row")
    fp_names = {id(m): n for n, m in model.named_modules()}
    q_by_name = dict(qmodel.named_modules())
    gammas: dict[str, float] = {}
    for fp_mod in branch_outputs(model):
        name = fp_names[id(fp_mod)]
        key = f"{name}.weight"
        if key not in meta["quantized"]:
            continue
        _, y = _capture_outputs(model, windows, fp_mod, cfg.batch_size)
        yy, yq = _capture_outputs(qmodel, windows, q_by_name[name], cfg.batch_size)
        gamma = ((y * yq).sum(0) / yy.clamp(min=1e-12)).clamp(0.5, 2.0)
        book = tensors[f"{key}.codebook"].float() * gamma[:, None]
        tensors[f"{key}.codebook"] = book.half()  # outliers are written after the lookup: they stay exact
        gammas[key] = float((gamma - 1).abs().mean())
        _load_into(qmodel, tensors, meta)
    meta["block_correction_mean_abs_change"] = gammas


def expected_bits_per_weight(rows: int, cols: int, bits: int, scope: Scope = "row", group_size: int = 128) -> float:
    """Stored bits per weight of one (rows, cols) weight at ``bits`` without outliers (for planning budgets)."""
    return layer_bits(rows, cols, bits, scope, group_size) / (rows * cols)

