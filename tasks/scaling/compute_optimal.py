"""Compute-optimal allocation from an Approach-3 fit (Hoffmann et al. 2022, eq. 4) and
comparisons of variants' whole scaling trajectories (QualityPajama's recommendation).

Minimising ``L(N, D) = E + A/N^alpha + B/D^beta`` subject to ``C = 6 N D`` gives::

    G = (alpha A / (beta B))^(1/(alpha+beta))
    N*(C) = G (C/6)^(beta/(alpha+beta)),   D*(C) = G^-1 (C/6)^(alpha/(alpha+beta))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import combinations

import numpy as np

from tasks.scaling.chinchilla import BootstrapResult, ChinchillaFit, percentile_interval

REVERSAL_RULE = (
    "reversal iff the {conf:.0%} bootstrap interval of L_x*(C) - L_y*(C) lies entirely on one side "
    "of 0 at the smallest compute of the grid and entirely on the other side at the largest"
)


def optimal_allocation(E, A, B, alpha, beta, C) -> dict[str, np.ndarray]:
    """N*, D*, D*/N* and the loss at the optimum for compute ``C`` (FLOPs, C = 6ND).

    Parameters broadcast against each other and ``C``: pass scalars for one fit, or (k, 1)
    bootstrap columns with ``C`` of shape (m,) to get (k, m) arrays.
    """
    E, A, B, alpha, beta, C = (np.asarray(x, dtype=float) for x in (E, A, B, alpha, beta, C))
    s = alpha + beta
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        log_g = (np.log(alpha * A) - np.log(beta * B)) / s
        log_c6 = np.log(C / 6.0)
        log_n = log_g + beta / s * log_c6
        log_d = -log_g + alpha / s * log_c6
        n_opt, d_opt = np.exp(log_n), np.exp(log_d)
        loss = E + A * np.exp(-alpha * log_n) + B * np.exp(-beta * log_d)
        ratio = np.exp(log_d - log_n)  # overflows to inf for a degenerate bootstrap replicate
    return {"N_opt": n_opt, "D_opt": d_opt, "tokens_per_param": ratio, "loss_pred": loss}


def compute_optimal_table(fit: ChinchillaFit, compute: Sequence[float],
                          bootstrap: BootstrapResult | None = None,
                          confidence: float | None = None) -> list[dict[str, float | None]]:
    """One row per compute budget: C, N_opt, D_opt, tokens_per_param, loss_pred, each with
    ``<name>_ci_low`` / ``<name>_ci_high`` percentile bounds from the bootstrap samples
    (None without a bootstrap).
    """
    C = np.asarray(compute, dtype=float)
    point = optimal_allocation(fit.E, fit.A, fit.B, fit.alpha, fit.beta, C)
    samples = None
    if bootstrap is not None and len(bootstrap.samples):
        conf = bootstrap.confidence if confidence is None else confidence
        cols = [bootstrap.samples[:, k:k + 1] for k in range(5)]
        samples = optimal_allocation(*cols, C[None, :])
    rows = []
    for j, c in enumerate(C):
        row: dict[str, float | None] = {"C": float(c)}
        for name, values in point.items():
            row[name] = float(values[j])
            lo = hi = None
            if samples is not None:
                lo, hi = percentile_interval(samples[name][:, j], conf)
            row[f"{name}_ci_low"], row[f"{name}_ci_high"] = lo, hi
        rows.append(row)
    return rows


def _optimal_loss_samples(result: BootstrapResult, C: np.ndarray) -> np.ndarray:
    cols = [result.samples[:, k:k + 1] for k in range(5)]
    return optimal_allocation(*cols, C[None, :])["loss_pred"]


def compare_variants(fits: Mapping[str, BootstrapResult], compute_grid: Sequence[float], *,
                     confidence: float = 0.95) -> list[dict]:
    """For each pair (x, y) of variants, the loss difference at each one's optimal allocation.

    ``diff(C) = L_x(N_x*(C), D_x*(C)) - L_y(N_y*(C), D_y*(C))``; negative means x is better.
    Its interval pairs bootstrap replicate i of x with replicate i of y (the variants'
    bootstraps are independent, so any pairing samples the difference's distribution).
    A REVERSAL is flagged only under :data:`REVERSAL_RULE`: the interval excludes 0 at both
    ends of ``compute_grid`` (sorted), with opposite signs. ``crossover_C`` is where the point
    estimate of ``diff`` changes sign on the grid (log-interpolated), None if it does not.
    """
    C = np.sort(np.asarray(compute_grid, dtype=float))
    if len(C) < 2:
        raise ValueError(f"compute_grid needs at least 2 budgets to compare trends, got {len(C)}")
    q = 100 * (1 - confidence) / 2
    out = []
    for x, y in combinations(sorted(fits), 2):
        fx, fy = fits[x], fits[y]
        px, py = fx.point, fy.point
        diff = (optimal_allocation(px.E, px.A, px.B, px.alpha, px.beta, C)["loss_pred"]
                - optimal_allocation(py.E, py.A, py.B, py.alpha, py.beta, C)["loss_pred"])
        k = min(len(fx.samples), len(fy.samples))
        if k:
            d = _optimal_loss_samples(fx, C)[:k] - _optimal_loss_samples(fy, C)[:k]
            d = np.where(np.isfinite(d), d, np.nan)
            lo, hi = np.nanpercentile(d, q, axis=0), np.nanpercentile(d, 100 - q, axis=0)
        else:
            lo = hi = np.full(len(C), np.nan)
        sign = np.where(hi < 0, -1, np.where(lo > 0, 1, 0))  # 0: interval contains 0 (or no bootstrap)
        reversal = bool(sign[0] != 0 and sign[-1] != 0 and sign[0] != sign[-1])
        crossover = None
        s = np.sign(diff)
        idx = np.flatnonzero(s[:-1] * s[1:] < 0)
        if idx.size:
            j = int(idx[0])
            lc = np.log(C[j]) + (np.log(C[j + 1]) - np.log(C[j])) * diff[j] / (diff[j] - diff[j + 1])
            crossover = float(np.exp(lc))

        def better(sg: int) -> str | None:
            return {-1: x, 1: y}.get(int(sg))

        out.append({
            "x": x, "y": y, "compute": C.tolist(), "diff": diff.tolist(),
            "diff_ci_low": lo.tolist(), "diff_ci_high": hi.tolist(),
            "better_at_smallest_C": better(sign[0]), "better_at_largest_C": better(sign[-1]),
            "reversal": reversal, "crossover_C": crossover, "n_bootstrap_pairs": int(k),
            "rule": REVERSAL_RULE.format(conf=confidence),
        })
    return out
