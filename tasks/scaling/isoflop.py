"""Approach 2 of Hoffmann et al. (2022, "Training Compute-Optimal Large Language Models",
arXiv:2203.15556): IsoFLOP profiles. No deviation.

Runs are grouped into compute levels ``C`` (measured FLOPs, or ``6 N D``); per level a parabola
``loss = p2 x^2 + p1 x + p0`` in ``x = log10 N`` gives ``N* = 10^(-p1 / (2 p2))``;
then ``N* ∝ C^a`` and ``D* = C / f(N*) ∝ C^b`` (``f(N) = k N^gamma`` FLOPs per token, 6N by
default) are fitted by least squares in log space.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class IsoflopLevel:
    """One compute level: its geometric-mean compute, runs (row indices) and parabola."""

    C: float
    rows: list[int]
    n_distinct_n: int
    coeffs: tuple[float, float, float] | None = None  # (p2, p1, p0) in x = log10 N
    N_opt: float | None = None
    D_opt: float | None = None
    loss_opt: float | None = None
    used: bool = False
    reason: str | None = None  # why the level is skipped / left out of the power laws


@dataclass
class IsoflopResult:
    """Levels and the power laws ``N* = k_n C^a``, ``D* = k_d C^b`` (None with < 2 usable levels)."""

    levels: list[IsoflopLevel]
    a: float | None = None
    log10_k_n: float | None = None
    b: float | None = None
    log10_k_d: float | None = None
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "a": self.a, "log10_k_n": self.log10_k_n, "b": self.b, "log10_k_d": self.log10_k_d,
            "levels": [vars(lv) | {"coeffs": list(lv.coeffs) if lv.coeffs else None} for lv in self.levels],
            "warnings": list(self.warnings),
        }


def isoflop_levels(compute: np.ndarray, log10_tolerance: float) -> list[np.ndarray]:
    """Group runs by compute: sorted by log10 C, a run joins the current level while it lies
    within ``log10_tolerance`` decades of the level's first run. Returns row-index arrays."""
    log_c = np.log10(np.asarray(compute, dtype=float))
    order = np.argsort(log_c, kind="stable")
    levels: list[list[int]] = []
    start = None
    for i in order:
        if start is None or log_c[i] - start > log10_tolerance:
            levels.append([])
            start = log_c[i]
        levels[-1].append(int(i))
    return [np.array(lv) for lv in levels]


def isoflop_minima(N, D, loss, *, log10_tolerance: float = 0.1, min_points: int = 3, compute=None,
                   flops_k: float = 6.0, flops_gamma: float = 1.0) -> IsoflopResult:
    """IsoFLOP fit (Approach 2). ``N``, ``D``, ``loss``: arrays (n,); ``compute`` (n,) each run's
    training FLOPs (default ``6ND``), ``flops_k N^flops_gamma`` the FLOPs per token giving D*.

    A level is skipped, with its reason recorded, when it has fewer than ``min_points`` runs
    of distinct N (at least 3 for a parabola), when the parabola is not convex (no minimum),
    or when the minimum lies outside the level's sampled N range (an extrapolation).
    """
    N = np.asarray(N, dtype=float)
    D = np.asarray(D, dtype=float)
    loss = np.asarray(loss, dtype=float)
    C = 6.0 * N * D if compute is None else np.asarray(compute, dtype=float)
    levels = []
    for rows in isoflop_levels(C, log10_tolerance):
        x = np.log10(N[rows])
        n_distinct = len(np.unique(np.round(x, 9)))
        lv = IsoflopLevel(C=float(10 ** np.mean(np.log10(C[rows]))), rows=rows.tolist(), n_distinct_n=n_distinct)
        levels.append(lv)
        need = max(3, min_points)
        if n_distinct < need:
            lv.reason = f"{n_distinct} distinct N (< {need}); no parabola"
            continue
        p2, p1, p0 = np.polyfit(x, loss[rows], 2)
        lv.coeffs = (float(p2), float(p1), float(p0))
        if p2 <= 0:
            lv.reason = "parabola is not convex (no minimum)"
            continue
        x_opt = -p1 / (2 * p2)
        lv.N_opt = float(10**x_opt)
        lv.D_opt = float(lv.C / (flops_k * lv.N_opt**flops_gamma))
        lv.loss_opt = float(p0 - p1 * p1 / (4 * p2))
        if not (x.min() <= x_opt <= x.max()):
            lv.reason = "minimum outside the sampled N range; left out of the power laws"
            continue
        lv.used = True
    result = IsoflopResult(levels=levels)
    skipped = [lv for lv in levels if not lv.used]
    if skipped:
        result.warnings.append(f"{len(skipped)} of {len(levels)} IsoFLOP levels not used: "
                               + "; ".join(f"C={lv.C:.3g}: {lv.reason}" for lv in skipped))
    used = [lv for lv in levels if lv.used]
    if len(used) < 2:
        result.warnings.append(f"{len(used)} usable IsoFLOP level(s); need >= 2 for N*(C), D*(C) power laws")
        return result
    lc = np.log10([lv.C for lv in used])
    result.a, result.log10_k_n = (float(v) for v in np.polyfit(lc, np.log10([lv.N_opt for lv in used]), 1))
    result.b, result.log10_k_d = (float(v) for v in np.polyfit(lc, np.log10([lv.D_opt for lv in used]), 1))
    return result
