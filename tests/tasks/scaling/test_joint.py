"""Joint shared-shape fit by variable projection, and the nested test of shared exponents."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import least_squares, nnls

from tasks.scaling.compute_optimal import FlopsPerToken
from tasks.scaling.joint import (
    ExponentGrid, SeriesPoints, bootstrap_joint, fit_joint, nested_test, projected_differences, sse_surface,
)

N_SIZES = np.array([9e3, 2.1e4, 6e4, 1.05e5, 2.26e5])
D_GRID = np.array([2e5, 6e5, 2e6, 6e6])


def ladder():
    n, d = np.meshgrid(N_SIZES, D_GRID, indexing="ij")
    return n.ravel(), d.ravel()


def law(N, D, E, A, B, alpha, beta):
    return E + A / N ** alpha + B / D ** beta


def series(laws: dict, noise: float = 0.0, seed: int = 0) -> dict[str, SeriesPoints]:
    rng = np.random.default_rng(seed)
    N, D = ladder()
    return {k: SeriesPoints(N, D, law(N, D, *p) + rng.normal(0, noise, len(N))) for k, p in laws.items()}


SHARED = {"raw": (2.0, 60.0, 300.0, 0.4, 0.35), "dedup": (1.95, 55.0, 330.0, 0.4, 0.35),
          "filter": (2.05, 70.0, 280.0, 0.4, 0.35)}


def test_recovers_known_shared_exponents_without_noise():
    fit = fit_joint(series(SHARED), grid=ExponentGrid(steps=40, zoom_steps=11))
    for name, (E, A, B, a, b) in SHARED.items():
        p = fit.params[name]
        assert p["alpha"] == pytest.approx(a, abs=0.011) and p["beta"] == pytest.approx(b, abs=0.011)
        N, D = ladder()
        assert np.max(np.abs(fit.loss(name, N, D) - law(N, D, E, A, B, a, b))) < 2e-3
    assert fit.params["raw"]["alpha"] == fit.params["dedup"]["alpha"]  # shared


def test_linear_terms_are_the_exact_nnls_solution():
    data = series(SHARED, noise=0.01)
    n0, d0 = 5e4, 1e6
    sse, coef = sse_surface(data["dedup"], np.array([0.3, 0.7]), np.array([0.2, 0.5]), n0, d0)
    for i, a in enumerate([0.3, 0.7]):
        for j, b in enumerate([0.2, 0.5]):
            p = data["dedup"]
            X = np.stack([np.ones_like(p.N), (p.N / n0) ** -a, (p.D / d0) ** -b], axis=1)
            c, r = nnls(X, p.L)
            np.testing.assert_allclose(coef[i, j], c, rtol=1e-6, atol=1e-9)
            assert sse[i, j] == pytest.approx(r ** 2, rel=1e-6, abs=1e-12)


def test_one_series_agrees_with_a_direct_least_squares_fit():
    data = series({"raw": SHARED["raw"]}, noise=0.004, seed=3)
    fit = fit_joint(data, grid=ExponentGrid(steps=80, zoom_steps=21))
    p = data["raw"]

    def resid(t):
        return law(p.N, p.D, *t) - p.L

    direct = least_squares(resid, x0=[2.0, 60.0, 300.0, 0.4, 0.35], bounds=([0, 0, 0, 0.05, 0.05], [10, 1e5, 1e6, 2, 2]))
    # variable projection finds a residual at least as small (up to its grid resolution)
    assert fit.sse <= float((direct.fun ** 2).sum()) * 1.01 + 1e-9
    assert fit.params["raw"]["alpha"] == pytest.approx(direct.x[3], abs=0.05)


def test_nested_test_rejects_moved_exponents_and_keeps_shared_ones():
    moved = dict(SHARED, filter=(2.05, 70.0, 280.0, 0.7, 0.35))
    grid = ExponentGrid(steps=25)
    out = nested_test(series(moved, noise=0.004, seed=1), ["dedup", "filter"], grid=grid, n_bootstrap=60, seed=0)
    assert out["filter"]["moves_exponents"] == "yes"
    assert out["dedup"]["moves_exponents"] == "no"
    same = nested_test(series(SHARED, noise=0.004, seed=2), ["dedup", "filter"], grid=grid, n_bootstrap=60)
    assert all(v["moves_exponents"] == "no" for v in same.values())
    assert all(v["p_holm"] >= v["p_value"] for v in same.values())


def test_nested_test_cannot_tell_from_one_size():
    data = series(SHARED, noise=0.004)
    p = data["dedup"]
    one = p.N == p.N[0]
    data["dedup"] = SeriesPoints(p.N[one], p.D[one], p.L[one])
    out = nested_test(data, ["dedup"], grid=ExponentGrid(steps=20), n_bootstrap=20)
    assert out["dedup"]["moves_exponents"] == "cannot tell"
    assert any("distinct N" in r for r in out["dedup"]["reasons"])


def test_projection_interval_is_paired_and_signs_a_clear_gap():
    laws = {"raw": SHARED["raw"], "better": (1.9, 60.0, 300.0, 0.4, 0.35)}  # E lower by 0.1 everywhere
    data = series(laws, noise=0.004, seed=5)
    grid = ExponentGrid(steps=30)
    fit = fit_joint(data, grid=grid)
    boot = bootstrap_joint(data, fit, n_bootstrap=60, seed=0, grid=grid)
    rows = projected_differences(fit, boot, "raw", ["better"], [1e13, 1e14], FlopsPerToken(), 0.95, (1e3, 1e7))
    for r in rows:
        assert r["ci_high"] < 0 and r["ci_low"] <= r["delta"] <= r["ci_high"]
        assert r["delta"] == pytest.approx(-0.1, abs=0.02)


def test_unknown_own_series_is_named():
    with pytest.raises(ValueError, match="own: 'nope'"):
        fit_joint(series(SHARED), own=["nope"])


def test_optimal_point_matches_the_closed_form_inside_the_range():
    from tasks.scaling.compute_optimal import optimal_allocation
    from tasks.scaling.joint import optimal_point

    p = {"E": 2.0, "A": 60.0, "B": 300.0, "alpha": 0.4, "beta": 0.35}
    C = np.array([1e12, 1e14])
    closed = optimal_allocation(*(p[k] for k in ("E", "A", "B", "alpha", "beta")), C)
    num = optimal_point(p, C, FlopsPerToken(), (1e2, 1e9), n_grid=4096)
    np.testing.assert_allclose(num["loss"][0], closed["loss_pred"], rtol=1e-6)
    np.testing.assert_allclose(num["N_opt"][0], closed["N_opt"], rtol=0.01)
    assert not num["at_edge"].any()
    # A = 0: no closed form; the numerical optimum is the largest-D (smallest-N) end, flagged
    degenerate = optimal_point(dict(p, A=0.0), C, FlopsPerToken(), (1e2, 1e9))
    assert np.isfinite(degenerate["loss"]).all() and degenerate["at_edge"].all()
