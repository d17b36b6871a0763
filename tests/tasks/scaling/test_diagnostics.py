import numpy as np
import polars as pl
import pytest

from tasks.scaling.config import FitConfig
from tasks.scaling.diagnostics import backtest, top_compute_level
from tasks.scaling.report import fit_points

TRUTH = dict(E=1.7, A=400.0, B=2000.0, alpha=0.34, beta=0.28)


def test_backtest_recovers_small_error_on_known_law(ladder):
    N, D, L = ladder(noise=0.002, seed=4, **TRUTH)
    cfg = FitConfig(n_starts=8, backtest_bootstrap=8, n_jobs=1, bootstrap_n_starts=2)
    bt = backtest(N, D, L, 6 * N * D, None, cfg)
    assert bt["available"] and bt["n_held_out"] >= 1 and bt["n_train"] == len(N) - bt["n_held_out"]
    # the held-out runs are the largest-compute ones
    C = 6 * N * D
    assert C[bt["held_out_rows"]].min() >= np.sort(C)[-bt["n_held_out"]] * (1 - 1e-12)
    assert bt["median_rel_error"]["value"] < 0.01 and bt["max_rel_error"]["value"] < 0.02
    lo, hi = bt["median_rel_error"]["ci_low"], bt["median_rel_error"]["ci_high"]
    assert lo is not None and lo <= hi


def test_backtest_holds_out_the_largest_design_budget():
    C = np.array([1e18, 1e18, 3e18, 3e18, 1e19, 1.2e19])
    budget = np.array([1e18, 1e18, 3e18, 3e18, 1e19, 1e19])
    hold, how = top_compute_level(C, budget, 0.01)
    assert hold.tolist() == [False] * 4 + [True, True] and "compute_budget" in how
    hold, how = top_compute_level(C, None, 0.01)  # no design budget: the level rule splits 1e19 / 1.2e19
    assert hold.tolist() == [False] * 5 + [True] and "top compute level" in how


def test_single_n_law_is_not_identified(ladder):
    D = np.geomspace(1e9, 1e11, 8)
    N = np.full(8, 1e8)
    L = TRUTH["E"] + TRUTH["A"] / N ** TRUTH["alpha"] + TRUTH["B"] / D ** TRUTH["beta"]
    cfg = FitConfig(n_bootstrap=5, n_jobs=1, n_starts=8, bootstrap_n_starts=2, backtest_bootstrap=0,
                    compute_budgets=(1e18,))
    entry = fit_points(pl.DataFrame({"N": N, "D": D, "loss": L}), cfg)["variants"]["all"]
    assert entry["identified"] is False
    assert any("N has a single distinct value" in r for r in entry["identification_reasons"])


def test_comparisons_skip_unidentified_laws_and_say_why(ladder):
    N, D, L = ladder(noise=0.003, seed=1, n_sizes=5, n_tokens=4, **TRUTH)
    Ns = np.full(8, 1e8)
    Ds = np.geomspace(1e9, 1e11, 8)
    Ls = TRUTH["E"] + TRUTH["A"] / Ns ** TRUTH["alpha"] + TRUTH["B"] / Ds ** TRUTH["beta"]
    points = pl.concat([pl.DataFrame({"N": N, "D": D, "loss": L, "variant": ["good"] * len(N)}),
                        pl.DataFrame({"N": Ns, "D": Ds, "loss": Ls, "variant": ["one_n"] * 8})])
    cfg = FitConfig(n_bootstrap=5, n_jobs=1, n_starts=8, bootstrap_n_starts=2, backtest_bootstrap=0,
                    compute_budgets=(1e18, 1e20))
    report = fit_points(points, cfg)
    assert report["comparisons"] == []
    (skip,) = report["comparisons_skipped"]
    assert (skip["x"], skip["y"]) == ("good", "one_n") and "one_n is not identified" in skip["reason"]
    diag = report["variants"]["good"]["diagnostics"]
    assert set(diag) == {"at_bound", "rho_alpha_beta", "basins", "huber_delta_sensitivity", "backtest"}
    assert diag["basins"] and diag["basins"][0]["n_starts"] >= 1
    assert diag["at_bound"]["alpha"]["point"] is False
