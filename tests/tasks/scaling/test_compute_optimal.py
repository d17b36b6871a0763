import numpy as np
import pytest

from tasks.scaling.chinchilla import bootstrap_chinchilla, fit_chinchilla
from tasks.scaling.compute_optimal import (FlopsPerToken, bootstrap_pvalue, compare_variants, compute_optimal_table,
                                           fit_flops_per_token, holm_adjust, optimal_allocation)
from tasks.scaling.config import FitConfig

# 100 replicates: the smallest two-sided bootstrap p-value, 2/101, survives Holm over 2 budgets
CFG = FitConfig(n_bootstrap=100, n_jobs=1, n_starts=8, bootstrap_start_spread=0.0, bootstrap_n_starts=2)
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
    (cmp,) = compare_variants(fits, GRID)["comparisons"]
    assert cmp["better_at_smallest_C"] == "y" and cmp["better_at_largest_C"] == "x"
    assert cmp["reversal"] is True
    assert GRID[0] < cmp["crossover_C"] < GRID[1]
    rows = compute_optimal_table(fits["x"].point, GRID, fits["x"])
    assert rows[0]["loss_pred_ci_low"] <= rows[0]["loss_pred"] <= rows[0]["loss_pred_ci_high"]


def test_reversal_not_flagged_when_noise_is_large(ladder):
    fits = {"x": _variant(ladder, 0.15, 1, **X), "y": _variant(ladder, 0.15, 2, **Y)}
    (cmp,) = compare_variants(fits, GRID)["comparisons"]
    assert cmp["reversal"] is False
    # at least one end's interval straddles 0, which is what withholds the flag
    assert cmp["better_at_smallest_C"] is None or cmp["better_at_largest_C"] is None
    assert cmp["diff_ci_low"][0] <= cmp["diff"][0] <= cmp["diff_ci_high"][0]


def test_real_flops_allocation_equals_closed_form_for_6n():
    """f(N) = 6N: the general allocation is Hoffmann et al.'s eq. 4, N* = G (C/6)^(beta/(alpha+beta))."""
    E, A, B, alpha, beta = 1.8, 400.0, 1500.0, 0.34, 0.30
    C = np.geomspace(1e18, 1e24, 7)
    G = (alpha * A / (beta * B)) ** (1 / (alpha + beta))
    n_closed = G * (C / 6) ** (beta / (alpha + beta))
    d_closed = (C / 6) ** (alpha / (alpha + beta)) / G
    opt = optimal_allocation(E, A, B, alpha, beta, C, flops_k=6.0, flops_gamma=1.0)
    np.testing.assert_allclose(opt["N_opt"], n_closed, rtol=1e-12)
    np.testing.assert_allclose(opt["D_opt"], d_closed, rtol=1e-12)
    np.testing.assert_allclose(opt["loss_pred"], E + A / n_closed**alpha + B / d_closed**beta, rtol=1e-12)


def test_real_flops_allocation_minimises_loss_on_the_budget():
    """f(N) = k N^gamma with gamma != 1: N* is the minimum of L(N, C / f(N)) over a dense log-N scan."""
    E, A, B, alpha, beta, C = 1.8, 400.0, 1500.0, 0.34, 0.30, 1e21
    f = FlopsPerToken(k=9.0, gamma=1.08)
    opt = optimal_allocation(E, A, B, alpha, beta, C, flops_k=f.k, flops_gamma=f.gamma)
    n = np.geomspace(1e6, 1e13, 200001)
    losses = E + A / n**alpha + B / (C / f(n)) ** beta
    assert float(opt["N_opt"]) == pytest.approx(n[np.argmin(losses)], rel=1e-3)
    assert float(opt["loss_pred"]) == pytest.approx(losses.min(), rel=1e-10)
    assert f(float(opt["N_opt"])) * float(opt["D_opt"]) == pytest.approx(C, rel=1e-12)
    # and the optimum departs from the 6ND one: the FLOPs definition matters
    assert float(opt["N_opt"]) != pytest.approx(float(optimal_allocation(E, A, B, alpha, beta, C)["N_opt"]), rel=0.05)


def test_flops_per_token_fit_recovers_power_law():
    N = np.geomspace(1e6, 1e9, 9)
    D = 20 * N
    f = fit_flops_per_token(N, D, 7.5 * N**1.04 * D)
    assert (f.k, f.gamma) == (pytest.approx(7.5, rel=1e-9), pytest.approx(1.04, rel=1e-9))
    one = fit_flops_per_token(np.full(4, 1e8), np.geomspace(1e9, 1e10, 4), np.full(4, 6.6e8) * np.geomspace(1e9, 1e10, 4))
    assert one.gamma == 1.0 and one.k == pytest.approx(6.6)


def test_holm_adjust_hand_made():
    # sorted 0.005, 0.01, 0.03, 0.04 -> 4*0.005, 3*0.01, 2*0.03, max(1*0.04, 0.06)
    np.testing.assert_allclose(holm_adjust([0.01, 0.04, 0.03, 0.005]), [0.03, 0.06, 0.06, 0.02])
    np.testing.assert_allclose(holm_adjust([0.5, 0.9]), [1.0, 1.0])  # capped at 1
    adj = holm_adjust([0.02, np.nan, 0.01])  # NaN is not a test: m = 2
    np.testing.assert_allclose(adj[[0, 2]], [0.02, 0.02])
    assert np.isnan(adj[1])


def test_bootstrap_pvalue_counts_both_tails_with_plus_one():
    d = np.array([1.0] * 99 + [-1.0])
    assert bootstrap_pvalue(d) == pytest.approx(2 * 2 / 101)
    assert bootstrap_pvalue(np.ones(50)) == pytest.approx(2 / 51)
    assert bootstrap_pvalue(np.array([1.0, -1.0])) == 1.0
    assert np.isnan(bootstrap_pvalue(np.array([np.nan, np.nan])))


def test_budgets_outside_measured_range_are_reported_not_tested(ladder):
    fits = {"x": _variant(ladder, 0.002, 1, **X), "y": _variant(ladder, 0.002, 2, **Y)}
    out = compare_variants(fits, [1e17, 1e19, 1e21, 1e25], measured_range={"x": (1e16, 1e22), "y": (1e18, 1e23)})
    (cmp,) = out["comparisons"]
    assert cmp["inside_measured_range"] == [False, True, True, False]
    assert cmp["tested_compute"] == [1e19, 1e21] and out["multiple_testing"]["n_tests"] == 2
    assert np.isnan(cmp["p_value"][0]) and cmp["better"][0] is None and np.isfinite(cmp["diff"][0])
    assert [r["C"] for r in cmp["tokens_per_param"]["x"]] == [1e19, 1e21]
