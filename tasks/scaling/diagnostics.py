"""Is an Approach-3 law identified? Diagnostics of a fit and its bootstrap, and a backtest.

Hoffmann et al. (2022, "Training Compute-Optimal Large Language Models", arXiv:2203.15556) Approach 3
fits five parameters to a few dozen runs; Epoch AI's replication (Besiroglu et al. 2024, "Chinchilla
Scaling: A replication attempt") showed how far the reported exponents can be from what the
data support. Here each law gets: which parameters sit on their box bound (point estimate and
share of bootstrap replicates), the correlation of alpha and beta across the bootstrap (a ridge
in the objective when |rho| is near 1), the distinct local optima the point fit's starts reached,
the refit at other Huber deltas, and a backtest that refits without the largest compute level and
predicts it. :func:`identification` turns them into ``identified`` and its reasons.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tasks.scaling.chinchilla import (PARAM_NAMES, THETA_NAMES, BootstrapResult, ChinchillaFit, at_bound,
                                      bootstrap_chinchilla, fit_chinchilla, percentile_interval, theta_to_params)
from tasks.scaling.config import FitConfig
from tasks.scaling.isoflop import isoflop_levels

# theta coordinate -> the parameter it is the log of (a = log A, ...)
THETA_TO_PARAM = {"a": "A", "b": "B", "e": "E", "alpha": "alpha", "beta": "beta"}


def top_compute_level(C: np.ndarray, budget: np.ndarray | None, log10_tolerance: float) -> tuple[np.ndarray, str]:
    """The rows of the largest compute level (bool mask (n,)) and how it was chosen.

    When ``budget`` (the ladder design's compute budget per run, NaN for grid designs) has finite
    values, the rows of the largest budget; otherwise the top IsoFLOP level of ``C``
    (:func:`tasks.scaling.isoflop.isoflop_levels`: runs within ``log10_tolerance`` decades).
    """
    C = np.asarray(C, dtype=float)
    hold = np.zeros(len(C), dtype=bool)
    if budget is not None and np.isfinite(budget).any():
        top = np.nanmax(budget)
        hold = np.isclose(budget, top, rtol=1e-9, atol=0)
        return hold, f"compute_budget = {top:.4g} (the ladder's largest design budget)"
    levels = isoflop_levels(C, log10_tolerance)
    hold[levels[-1]] = True
    c = 10 ** np.mean(np.log10(C[levels[-1]]))
    return hold, f"top compute level C ~ {c:.4g} (runs within {log10_tolerance} decades)"


def backtest(N, D, loss, C, budget, cfg: FitConfig) -> dict:
    """Refit without the largest compute level (:func:`top_compute_level`) and predict it.

    Reports ``|pred - obs| / obs`` per held-out point, its median and max, with percentile
    intervals from ``cfg.backtest_bootstrap`` bootstrap replicates of the training part (each
    refitted, each predicting every held-out point). Indices in ``held_out_rows`` index the arrays
    given. ``available`` False (with ``reason``) when the split leaves < 5 training points or
    nothing to hold out.
    """
    N, D, loss, C = (np.asarray(x, dtype=float) for x in (N, D, loss, C))
    hold, how = top_compute_level(C, budget, cfg.isoflop_log10_tolerance)
    train = ~hold
    out: dict = {"held_out": how, "held_out_rows": np.flatnonzero(hold).tolist(),
                 "n_train": int(train.sum()), "n_held_out": int(hold.sum())}
    if hold.all() or not hold.any():
        return out | {"available": False, "reason": "every run is at one compute level; nothing to extrapolate to"}
    if train.sum() < 5:
        return out | {"available": False, "reason": f"{int(train.sum())} runs below the top compute level "
                                                     "(< 5, the parameters of Approach 3)"}
    bt_cfg = dataclasses.replace(cfg, exclude_top_loss=0, n_bootstrap=cfg.backtest_bootstrap, n_jobs=1)
    fit = fit_chinchilla(N[train], D[train], loss[train], bt_cfg)
    obs = loss[hold]
    pred = fit.predict(N[hold], D[hold])
    rel = np.abs(pred - obs) / obs
    med_ci = max_ci = (None, None)
    pred_ci = np.full((len(obs), 2), np.nan)
    if cfg.backtest_bootstrap:
        boot = bootstrap_chinchilla(N[train], D[train], loss[train], bt_cfg, fit=fit)
        E, A, B, alpha, beta = (boot.samples[:, k:k + 1] for k in range(5))
        with np.errstate(over="ignore", invalid="ignore"):
            preds = E + A / N[hold] ** alpha + B / D[hold] ** beta  # (R, h), NaN rows stay NaN
            rels = np.abs(preds - obs) / obs
        ok = np.isfinite(rels).all(axis=1)
        med_ci = percentile_interval(np.median(rels[ok], axis=1), cfg.confidence) if ok.any() else med_ci
        max_ci = percentile_interval(rels[ok].max(axis=1), cfg.confidence) if ok.any() else max_ci
        pred_ci = np.array([percentile_interval(preds[:, j], cfg.confidence) for j in range(len(obs))])
    points = [{"row": int(i), "N": float(N[i]), "D": float(D[i]), "C": float(C[i]), "observed": float(o),
               "predicted": float(p), "predicted_ci_low": float(lo), "predicted_ci_high": float(hi),
               "rel_error": float(r)}
              for i, o, p, r, (lo, hi) in zip(np.flatnonzero(hold), obs, pred, rel, pred_ci)]
    return out | {
        "available": True, "points": points,
        "median_rel_error": {"value": float(np.median(rel)), "ci_low": med_ci[0], "ci_high": med_ci[1]},
        "max_rel_error": {"value": float(rel.max()), "ci_low": max_ci[0], "ci_high": max_ci[1]},
        "fit": fit.params(), "n_bootstrap": cfg.backtest_bootstrap,
    }


def alpha_beta_correlation(boot: BootstrapResult) -> float | None:
    """Pearson correlation of alpha and beta over the finite bootstrap replicates (None: < 3 or constant)."""
    a, b = boot.column("alpha"), boot.column("beta")
    ok = np.isfinite(a) & np.isfinite(b)
    if ok.sum() < 3 or np.std(a[ok]) == 0 or np.std(b[ok]) == 0:
        return None
    return float(np.corrcoef(a[ok], b[ok])[0, 1])


def law_diagnostics(N, D, loss, C, budget, fit: ChinchillaFit, boot: BootstrapResult, cfg: FitConfig) -> dict:
    """Every diagnostic of one law: ``at_bound``, ``rho_alpha_beta``, ``basins``,
    ``huber_delta_sensitivity`` and ``backtest`` (on the rows the fit kept; row indices index
    the arrays given)."""
    N, D, loss, C = (np.asarray(x, dtype=float) for x in (N, D, loss, C))
    keep = np.ones(len(N), dtype=bool)
    keep[[e["row"] for e in fit.excluded]] = False
    point_bound = at_bound(fit.theta, cfg)
    ok = np.isfinite(boot.objectives)
    frac = boot.at_bound[ok].mean(axis=0) if ok.any() else np.full(5, np.nan)
    bounds = {THETA_TO_PARAM[t]: {"theta": t, "point": bool(pb), "fraction_of_replicates": float(f)}
              for t, pb, f in zip(THETA_NAMES, point_bound, frac)}
    rho = alpha_beta_correlation(boot)
    basins = [dict(zip(PARAM_NAMES, map(float, theta_to_params(th)))) | {"objective": float(obj), "n_starts": int(n)}
              for th, obj, n in zip(fit.local_optima, fit.local_optima_objectives, fit.local_optima_starts)]
    sensitivity = []
    for delta in cfg.huber_delta_sensitivity:
        f = fit if delta == cfg.huber_delta else fit_chinchilla(N, D, loss, dataclasses.replace(cfg, huber_delta=delta))
        sensitivity.append({"huber_delta": float(delta), "E": f.E, "alpha": f.alpha, "beta": f.beta,
                            "objective": f.objective})
    bt = backtest(N[keep], D[keep], loss[keep], C[keep], None if budget is None else np.asarray(budget, float)[keep], cfg)
    kept_rows = np.flatnonzero(keep)
    bt["held_out_rows"] = [int(kept_rows[i]) for i in bt["held_out_rows"]]
    for p in bt.get("points", []):
        p["row"] = int(kept_rows[p["row"]])
    warnings = []
    if rho is not None and abs(rho) > cfg.max_abs_rho_alpha_beta:
        warnings.append(f"corr(alpha, beta) over the bootstrap is {rho:.3f} (|rho| > {cfg.max_abs_rho_alpha_beta}): "
                        "the data constrain a combination of the exponents, not each one")
    return {"at_bound": bounds, "rho_alpha_beta": rho, "basins": basins, "huber_delta_sensitivity": sensitivity,
            "backtest": bt, "warnings": warnings}


def identification(fit: ChinchillaFit, boot: BootstrapResult, diagnostics: dict, N: np.ndarray,
                   cfg: FitConfig) -> tuple[bool, list[str]]:
    """``(identified, reasons)``: a law is identified when none of these holds (each a reason):
    too few points; N with one distinct value or spanning < ``min_n_decades``; E, alpha or beta
    on a bound at the point estimate; no bootstrap, or alpha's / beta's interval wider than
    ``max_ci_width``; ``|corr(alpha, beta)| > max_abs_rho_alpha_beta``; no backtest, or its
    median relative error above ``max_backtest_rel_error``.
    """
    reasons = []
    N = np.asarray(N, dtype=float)
    if fit.n_points < cfg.min_points:
        reasons.append(f"too few points: {fit.n_points} (< min_points={cfg.min_points})")
    n_distinct = len(np.unique(N))
    if n_distinct == 1:
        reasons.append(f"N has a single distinct value ({N[0]:.4g}): A/N^alpha cannot be told from E")
    elif fit.n_decades_n < cfg.min_n_decades:
        reasons.append(f"N spans {fit.n_decades_n:.2f} decades (< min_n_decades={cfg.min_n_decades})")
    for name in ("E", "alpha", "beta"):
        if diagnostics["at_bound"][name]["point"]:
            reasons.append(f"{name} is at its bound at the point estimate")
    if not boot.n_ok:
        reasons.append("no bootstrap replicates: interval widths unknown")
    else:
        for name in ("alpha", "beta"):
            lo, hi = boot.intervals[name]
            if not (hi - lo <= cfg.max_ci_width):
                reasons.append(f"{name}'s {boot.confidence:.0%} interval [{lo:.3g}, {hi:.3g}] is wider than "
                               f"max_ci_width={cfg.max_ci_width}")
    rho = diagnostics["rho_alpha_beta"]
    if rho is not None and abs(rho) > cfg.max_abs_rho_alpha_beta:
        reasons.append(f"|corr(alpha, beta)| = {abs(rho):.3f} > max_abs_rho_alpha_beta={cfg.max_abs_rho_alpha_beta}")
    bt = diagnostics["backtest"]
    if not bt["available"]:
        reasons.append(f"no backtest: {bt['reason']}")
    elif bt["median_rel_error"]["value"] > cfg.max_backtest_rel_error:
        reasons.append(f"backtest median relative error {bt['median_rel_error']['value']:.3%} on {bt['held_out']} "
                       f"> max_backtest_rel_error={cfg.max_backtest_rel_error:.1%}")
    return not reasons, reasons
