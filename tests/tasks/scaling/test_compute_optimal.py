import numpy as np
import pytest

from tasks.scaling.chinchilla import bootstrap_chinchilla, fit_chinchilla
from tasks.scaling.compute_optimal import compare_variants, compute_optimal_table, optimal_allocation
from tasks.scaling.config import FitConfig

CFG = FitConfig(n_bootstrap=25, n_jobs=1, n_starts=8, bootstrap_start_spread=0.0)
GRID = [1e17, 1e25]


def test_allocation_is_the_constrained_optimum():
    E, A, B, alpha, beta, C = 1.8, 400.0, 1500.0, 0.34, 0.30, 1e21
    opt = optimal_allocation(E, A, B, alpha, beta, C)
    n = float(opt["N_opt"])
    assert 6 * n * float(opt["D_opt"]) == pytest.approx(C, rel=1e-12)
    ns = n * np.geomspace(0.5, 2, 41)
    losses = E + A / ns**alpha + B / (C / (6 * ns)) ** beta
    assert np.argmin(losses) == 20  # the middle of the scan, i.e. n itself
    assert float(opt["loss_pred"]) == pytest.approx(losses[20], rel=1e-12)
    assert float(opt["tokens_per_param"]) == pytest.approx(float(opt["D_opt"]) / n)


def _variant(ladder, noise, seed, **truth):
    N, D, L = ladder(noise=noise, seed=seed, **truth)
    fit = fit_chinchilla(N, D, L, CFG)
    return bootstrap_chinchilla(N, D, L, CFG, fit=fit)


# x: lower irreducible loss but steeper-costing data term; y: better at small scale, worse at large.
X = dict(E=1.6, A=400.0, B=3000.0, alpha=0.34, beta=0.30)
Y = dict(E=1.9, A=250.0, B=600.0, alpha=0.34, beta=0.30)


def test_reversal_flagged_when_curves_cross_with_tight_noise(ladder):
    fits = {"x": _variant(ladder, 0.002, 1, **X), "y": _variant(ladder, 0.002, 2, **Y)}
    (cmp,) = compare_variants(fits, GRID)
    assert cmp["better_at_smallest_C"] == "y" and cmp["better_at_largest_C"] == "x"
    assert cmp["reversal"] is True
    assert GRID[0] < cmp["crossover_C"] < GRID[1]
    rows = compute_optimal_table(fits["x"].point, GRID, fits["x"])
    assert rows[0]["loss_pred_ci_low"] <= rows[0]["loss_pred"] <= rows[0]["loss_pred_ci_high"]


def test_reversal_not_flagged_when_noise_is_large(ladder):
    fits = {"x": _variant(ladder, 0.15, 1, **X), "y": _variant(ladder, 0.15, 2, **Y)}
    (cmp,) = compare_variants(fits, GRID)
    assert cmp["reversal"] is False
    # at least one end's interval straddles 0, which is what withholds the flag
    assert cmp["better_at_smallest_C"] is None or cmp["better_at_largest_C"] is None
    assert cmp["diff_ci_low"][0] <= cmp["diff"][0] <= cmp["diff_ci_high"][0]
