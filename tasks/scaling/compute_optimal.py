"""Compute-optimal allocation from an Approach-3 fit (Hoffmann et al. 2022, eq. 4) and
comparisons of variants' whole scaling trajectories (QualityPajama's recommendation), with
multiple-testing control by Holm's step-down procedure (Holm 1979, "A Simple Sequentially Rejective
Multiple Test Procedure", Scand. J. Statist. 6(2)). Hoffmann et al. 2022: "Training Compute-Optimal
Large Language Models", arXiv:2203.15556. No deviation beyond the fitted FLOPs-per-token law below.

Compute is ``C(N, D) = f(N) D`` with ``f(N) = k N^gamma`` training FLOPs per token, fitted to the
ladder's measured FLOPs (:func:`fit_flops_per_token`); ``k = 6, gamma = 1`` is Kaplan's / Hoffmann's
``C = 6ND``. Minimising ``L(N, D) = E + A/N^alpha + B/D^beta`` subject to ``C = k N^gamma D``:
``L(x) = E + A e^(-alpha x) + B (k/C)^beta e^(gamma beta x)`` in ``x = log N`` is a sum of two
exponentials, strictly convex, so its one stationary point is the minimum::

    log N* = (log(alpha A) - log(gamma beta B) + beta log(C / k)) / (alpha + gamma beta)
    D* = C / (k N*^gamma)

which for ``gamma = 1, k = 6`` is Hoffmann's ``N* = G (C/6)^(beta/(alpha+beta))``,
``G = (alpha A / (beta B))^(1/(alpha+beta))``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tasks.scaling.chinchilla import BootstrapResult, ChinchillaFit, percentile_interval

COMPARISON_RULE = (
    "x is called better than y at C when the two-sided bootstrap p-value of d(C) = L_x*(C) - L_y*(C), "
    "p = min(1, 2 min((1 + #{{d <= 0}}) / (n + 1), (1 + #{{d >= 0}}) / (n + 1))) over the n finite replicate "
    "differences, Holm-adjusted over all {n_tests} (pair, budget) tests at budgets inside both ladders' "
    "measured compute range, is <= {level:g}; a reversal is called when the point estimates of d at the "
    "smallest and largest tested budget have opposite signs and the intersection-union p-value "
    "p_rev = max(p(C_min), p(C_max)), Holm-adjusted over the {n_pairs} pairs with >= 2 tested budgets, "
    "is <= {level:g}"
)


@dataclass(frozen=True)
class FlopsPerToken:
    """Training FLOPs per token ``f(N) = k N^gamma``; a run's compute is ``C = f(N) D``."""

    k: float = 6.0
    gamma: float = 1.0
    source: str = "C = 6ND (Kaplan et al. 2020; Hoffmann et al. 2022)"

    def __call__(self, N) -> np.ndarray:
        return self.k * np.asarray(N, dtype=float) ** self.gamma

    def to_dict(self) -> dict:
        return {"k": self.k, "gamma": self.gamma, "source": self.source}


def fit_flops_per_token(N, D, C) -> FlopsPerToken:
    """Least squares of ``log(C / D) = log k + gamma log N`` over runs: (n,) arrays of
    parameters, tokens and measured training FLOPs.

    With one distinct N, gamma is not identified: gamma = 1 and k is the geometric mean of
    ``C / (N D)``.
    """
    N, D, C = (np.asarray(x, dtype=float) for x in (N, D, C))
    y = np.log(C / D)
    x = np.log(N)
    if len(np.unique(N)) < 2:
        return FlopsPerToken(k=float(np.exp(np.mean(y - x))), gamma=1.0,
                             source="measured FLOPs, one distinct N: gamma fixed at 1, k = geometric mean of C/(ND)")
    gamma, log_k = np.polyfit(x, y, 1)
    return FlopsPerToken(k=float(np.exp(log_k)), gamma=float(gamma),
                         source="least squares of log(flops_total / tokens) on log N over the ladder's runs")


def optimal_allocation(E, A, B, alpha, beta, C, *, flops_k=6.0, flops_gamma=1.0) -> dict[str, np.ndarray]:
    """N*, D*, D*/N* and the loss at the optimum for compute ``C`` (FLOPs, ``C = k N^gamma D``).

    Parameters broadcast against each other and ``C``: pass scalars for one fit, or (k, 1)
    bootstrap columns with ``C`` of shape (m,) to get (k, m) arrays (NaN rows stay NaN).
    """
    E, A, B, alpha, beta, C = (np.asarray(x, dtype=float) for x in (E, A, B, alpha, beta, C))
    k, gamma = float(flops_k), float(flops_gamma)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        log_ck = np.log(C / k)
        log_n = (np.log(alpha * A) - np.log(gamma * beta * B) + beta * log_ck) / (alpha + gamma * beta)
        log_d = log_ck - gamma * log_n
        n_opt, d_opt = np.exp(log_n), np.exp(log_d)
        loss = E + A * np.exp(-alpha * log_n) + B * np.exp(-beta * log_d)
        ratio = np.exp(log_d - log_n)  # overflows to inf for a degenerate bootstrap replicate
    return {"N_opt": n_opt, "D_opt": d_opt, "tokens_per_param": ratio, "loss_pred": loss}


def inside_range(C: np.ndarray, measured: tuple[float, float] | None) -> np.ndarray:
    """Whether each budget lies in the measured compute range ``[lo, hi]`` (all True without one)."""
    C = np.asarray(C, dtype=float)
    if measured is None:
        return np.ones(C.shape, dtype=bool)
    lo, hi = measured
    # relative slack: a budget written as 1e11 must count as inside a range ending at 1.0000001e11
    return (C >= lo * (1 - 1e-9)) & (C <= hi * (1 + 1e-9))


def _allocation_samples(result: BootstrapResult, C: np.ndarray, flops: FlopsPerToken) -> dict[str, np.ndarray]:
    """Allocation of every bootstrap row at budgets ``C`` (m,): (n_requested, m) arrays, NaN rows kept."""
    cols = [result.samples[:, k:k + 1] for k in range(5)]
    return optimal_allocation(*cols, C[None, :], flops_k=flops.k, flops_gamma=flops.gamma)


def compute_optimal_table(fit: ChinchillaFit, compute: Sequence[float],
                          bootstrap: BootstrapResult | None = None,
                          confidence: float | None = None, *, flops: FlopsPerToken = FlopsPerToken(),
                          measured_range: tuple[float, float] | None = None) -> list[dict[str, float | None]]:
    """One row per compute budget: C, N_opt, D_opt, tokens_per_param, loss_pred, each with
    ``<name>_ci_low`` / ``<name>_ci_high`` percentile bounds over the finite bootstrap rows
    (None without a bootstrap), and ``inside_measured_range`` (C within ``measured_range``,
    the ladder's [min C, max C]; beyond it the row is an extrapolation).
    """
    C = np.asarray(compute, dtype=float)
    point = optimal_allocation(fit.E, fit.A, fit.B, fit.alpha, fit.beta, C, flops_k=flops.k, flops_gamma=flops.gamma)
    samples = None
    if bootstrap is not None and bootstrap.n_ok:
        conf = bootstrap.confidence if confidence is None else confidence
        samples = _allocation_samples(bootstrap, C, flops)
    inside = inside_range(C, measured_range)
    rows = []
    for j, c in enumerate(C):
        row: dict[str, float | bool | None] = {"C": float(c)}
        for name, values in point.items():
            row[name] = float(values[j])
            lo = hi = None
            if samples is not None:
                lo, hi = percentile_interval(samples[name][:, j], conf)
            row[f"{name}_ci_low"], row[f"{name}_ci_high"] = lo, hi
        row["inside_measured_range"] = bool(inside[j])
        rows.append(row)
    return rows


def holm_adjust(pvalues: Sequence[float]) -> np.ndarray:
    """Holm's (1979) step-down adjusted p-values, in the input order.

    With the m finite p-values sorted, ``p_(1) <= ... <= p_(m)``:
    ``adj_(i) = max_{j <= i} min(1, (m - j + 1) p_(j))``; rejecting ``adj <= level`` controls
    the family-wise error rate at ``level`` under any dependence. NaN entries are not tests:
    they stay NaN and do not count in m.

    >>> holm_adjust([0.01, 0.04, 0.03, 0.005])
    array([0.03, 0.06, 0.06, 0.02])
    """
    p = np.asarray(pvalues, dtype=float)
    out = np.full(p.shape, np.nan)
    idx = np.flatnonzero(np.isfinite(p))
    m = len(idx)
    if m == 0:
        return out
    order = idx[np.argsort(p[idx], kind="stable")]
    scaled = np.minimum(1.0, (m - np.arange(m)) * p[order])
    out[order] = np.maximum.accumulate(scaled)
    return out


def bootstrap_pvalue(d: np.ndarray, axis: int = 0) -> np.ndarray:
    """Two-sided bootstrap p-value of ``d = 0`` from replicate differences (NaN = missing).

    ``p = min(1, 2 min((1 + #{d <= 0}) / (n + 1), (1 + #{d >= 0}) / (n + 1)))`` over the n
    finite replicates (the +1 keeps p > 0 from a finite bootstrap; Davison & Hinkley 1997,
    eq. 4.11); NaN where n = 0.
    """
    d = np.asarray(d, dtype=float)
    finite = np.isfinite(d)
    n = finite.sum(axis=axis)
    le = ((d <= 0) & finite).sum(axis=axis)
    ge = ((d >= 0) & finite).sum(axis=axis)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.minimum(1.0, 2 * np.minimum((1 + le) / (n + 1), (1 + ge) / (n + 1)))
    return np.where(n > 0, p, np.nan)


def normal_pvalue(delta: float, replicates: np.ndarray) -> float:
    """Two-sided p-value of ``delta = 0`` from the bootstrap's standard error (normal approximation):
    ``2 (1 - Phi(|delta| / sd(replicates)))``. Used where many comparisons are Holm-adjusted: a
    percentile p-value (:func:`bootstrap_pvalue`) cannot fall below ``2 / (n + 1)``, which Holm's
    factor then multiplies past any level. 0 when the replicates have no spread and delta != 0."""
    from scipy.stats import norm

    reps = np.asarray(replicates, dtype=float)
    reps = reps[np.isfinite(reps)]
    if len(reps) < 2 or not np.isfinite(delta):
        return float("nan")
    se = float(reps.std(ddof=1))
    if se == 0:
        return 1.0 if delta == 0 else 0.0
    return float(2 * norm.sf(abs(delta) / se))


def pairing(x: BootstrapResult, y: BootstrapResult) -> str:
    """``"paired_by_key"`` when both bootstraps resampled the same run keys with the same
    replicates (same ladder: replicate i is the same resample), else ``"independent"``."""
    same = (x.keys.shape == y.keys.shape and np.array_equal(x.keys, y.keys)
            and x.counts.shape == y.counts.shape and np.array_equal(x.counts, y.counts))
    return "paired_by_key" if same and len(x.keys) else "independent"


def replicate_differences(lx: np.ndarray, ly: np.ndarray, how: str) -> np.ndarray:
    """``d_i = lx_i - ly_j`` for (n_x, m) and (n_y, m) replicate losses: ``j = i`` when paired;
    otherwise ``j = (i + n_y // 2) mod n_y``, so x's replicate i meets an unrelated replicate of
    y (replicate i of two ladders share a seed, which must not couple them). NaN stays missing.
    """
    if how == "paired_by_key":
        return lx - ly
    n_y = len(ly)
    if n_y == 0 or len(lx) == 0:
        return np.full((0, lx.shape[1] if lx.ndim == 2 else 0), np.nan)
    j = (np.arange(len(lx)) + n_y // 2) % n_y
    return lx - ly[j]


def compare_variants(fits: Mapping[str, BootstrapResult], compute_grid: Sequence[float], *,
                     confidence: float = 0.95, pairs: Sequence[tuple[str, str]] | None = None,
                     flops: Mapping[str, FlopsPerToken] | None = None,
                     measured_range: Mapping[str, tuple[float, float]] | None = None) -> dict:
    """Pairwise comparisons of compute-optimal frontiers with Holm-controlled calls.

    ``diff(C) = L_x(N_x*(C), D_x*(C)) - L_y(N_y*(C), D_y*(C))``; negative means x is better.
    ``pairs`` default: every pair of ``fits`` (sorted names). Budgets are tested only inside both
    ladders' ``measured_range`` ([min C, max C]; every budget without one). Replicate i of x meets
    replicate i of y when :func:`pairing` says they resampled the same keys, else an unrelated one
    (:func:`replicate_differences`). Per (pair, tested budget) a two-sided bootstrap p-value
    (:func:`bootstrap_pvalue`), Holm-adjusted over all of them (:func:`holm_adjust`); per pair
    a reversal p-value (intersection-union: max of the two end p-values, when the point
    differences there have opposite signs, else 1), Holm-adjusted over pairs. Calls are made at
    level ``1 - confidence``; the rule is :data:`COMPARISON_RULE`. ``crossover_C`` is where the
    point estimate of ``diff`` changes sign on the tested budgets (log-interpolated), None if not.

    Returns ``{"comparisons": [per pair], "multiple_testing": {method, level, n_pairs,
    n_pairs_tested (pairs with a tested budget), n_tests, n_reversal_tests, rule}}``.
    """
    C = np.sort(np.asarray(compute_grid, dtype=float))
    if len(C) < 1:
        raise ValueError("compute_grid needs at least 1 budget")
    level = round(1 - confidence, 12)  # 1 - 0.95 is 0.05000000000000004 in floats
    q = 100 * (1 - confidence) / 2
    flops = flops or {}
    measured_range = measured_range or {}
    pairs = list(pairs) if pairs is not None else [(x, y) for i, x in enumerate(sorted(fits))
                                                   for y in sorted(fits)[i + 1:]]
    entries, pvals = [], []
    for x, y in pairs:
        fx, fy = fits[x], fits[y]
        px, py = fx.point, fy.point
        gx, gy = flops.get(x, FlopsPerToken()), flops.get(y, FlopsPerToken())
        inside = inside_range(C, measured_range.get(x)) & inside_range(C, measured_range.get(y))
        opt_x = optimal_allocation(px.E, px.A, px.B, px.alpha, px.beta, C, flops_k=gx.k, flops_gamma=gx.gamma)
        opt_y = optimal_allocation(py.E, py.A, py.B, py.alpha, py.beta, C, flops_k=gy.k, flops_gamma=gy.gamma)
        diff = opt_x["loss_pred"] - opt_y["loss_pred"]
        how = pairing(fx, fy)
        sx, sy = _allocation_samples(fx, C, gx), _allocation_samples(fy, C, gy)
        d = replicate_differences(sx["loss_pred"], sy["loss_pred"], how)
        d = np.where(np.isfinite(d), d, np.nan)
        n_pairs = int(np.isfinite(d).all(axis=1).sum()) if len(d) else 0
        lo, hi = np.full(len(C), np.nan), np.full(len(C), np.nan)
        p = np.full(len(C), np.nan)
        for j in range(len(C)):
            lo[j], hi[j] = percentile_interval(d[:, j], confidence) if len(d) else (np.nan, np.nan)
            if inside[j] and len(d):
                p[j] = bootstrap_pvalue(d[:, j])
        tested = np.flatnonzero(inside & np.isfinite(p))
        crossover = None
        if len(tested) >= 2:
            t = tested
            sgn = np.sign(diff[t])
            idx = np.flatnonzero(sgn[:-1] * sgn[1:] < 0)
            if idx.size:
                j0, j1 = t[idx[0]], t[idx[0] + 1]
                lc = np.log(C[j0]) + (np.log(C[j1]) - np.log(C[j0])) * diff[j0] / (diff[j0] - diff[j1])
                crossover = float(np.exp(lc))
        p_rev = None
        if len(tested) >= 2:
            j0, j1 = tested[0], tested[-1]
            p_rev = float(max(p[j0], p[j1])) if np.sign(diff[j0]) * np.sign(diff[j1]) < 0 else 1.0

        def tpp(s, o):
            out = []
            for j in tested:
                lo_t, hi_t = percentile_interval(s["tokens_per_param"][:, j], confidence)
                out.append({"C": float(C[j]), "value": float(o["tokens_per_param"][j]), "ci_low": lo_t, "ci_high": hi_t})
            return out

        entries.append({
            "x": x, "y": y, "pairing": how, "compute": C.tolist(), "inside_measured_range": inside.tolist(),
            "diff": diff.tolist(), "diff_ci_low": lo.tolist(), "diff_ci_high": hi.tolist(),
            "p_value": p.tolist(), "tested": [int(j) for j in tested], "p_reversal": p_rev,
            "crossover_C": crossover, "n_bootstrap_pairs": n_pairs,
            "tokens_per_param": {x: tpp(sx, opt_x), y: tpp(sy, opt_y)},
        })
        pvals.append(p)
    flat = np.concatenate([p[e["tested"]] for p, e in zip(pvals, entries)]) if entries else np.empty(0)
    adj_flat = holm_adjust(flat)
    rev = holm_adjust([np.nan if e["p_reversal"] is None else e["p_reversal"] for e in entries])
    n_tests = int(np.isfinite(flat).sum())
    n_rev = int(np.isfinite(rev).sum())
    n_pairs_tested = sum(1 for e in entries if e["tested"])
    pos = 0
    for e, p, p_rev_adj in zip(entries, pvals, rev):
        adj = np.full(len(C), np.nan)
        t = e.pop("tested")
        adj[t] = adj_flat[pos:pos + len(t)]
        pos += len(t)
        diff = np.asarray(e["diff"])
        better = [None if not (np.isfinite(adj[j]) and adj[j] <= level) else (e["x"] if diff[j] < 0 else e["y"])
                  for j in range(len(C))]
        e["p_holm"] = adj.tolist()
        e["better"] = better
        e["tested_compute"] = [float(C[j]) for j in t]
        e["better_at_smallest_C"] = better[t[0]] if t else None
        e["better_at_largest_C"] = better[t[-1]] if t else None
        e["p_reversal_holm"] = None if not np.isfinite(p_rev_adj) else float(p_rev_adj)
        e["reversal"] = bool(np.isfinite(p_rev_adj) and p_rev_adj <= level)
    rule = COMPARISON_RULE.format(n_tests=n_tests, level=level, n_pairs=n_rev)
    for e in entries:
        e["rule"] = rule
    return {"comparisons": entries,
            "multiple_testing": {"method": "holm (1979)", "level": level, "n_pairs": len(entries),
                                 "n_pairs_tested": n_pairs_tested, "n_tests": n_tests,
                                 "n_reversal_tests": n_rev, "rule": rule}}
