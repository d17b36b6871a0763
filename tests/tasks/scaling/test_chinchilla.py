import numpy as np
import pytest

from tasks.scaling.chinchilla import (bootstrap_chinchilla, bootstrap_starts, fit_chinchilla,
                                      grid_objective, huber_objective, huber_objective_batched,
                                      initial_grid, minimise_batched, minimise_starts)
from tasks.scaling.config import FitConfig

CFG = FitConfig(n_bootstrap=30, n_jobs=1, n_starts=16)


def _logs(N, D, L):
    return np.log(N), np.log(D), np.log(L)


@pytest.mark.parametrize("delta", [1e-3, 1e-1], ids=["delta=1e-3(linear branch)", "delta=0.1(quadratic)"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "bootstrap-weights"])
def test_gradient_matches_finite_differences(delta, weighted, ladder):
    N, D, L = ladder(noise=0.02, n_sizes=7, n_tokens=9)  # 63 points
    args = _logs(N, D, L)
    w = np.random.default_rng(1).integers(0, 4, len(N)).astype(float) if weighted else None
    for theta in (np.array([6.0, 7.5, 0.6, 0.33, 0.31]), np.array([4.0, 9.0, 0.2, 0.5, 0.2])):
        f, g = huber_objective(theta, *args, delta, w)
        num = np.empty(5)
        for k in range(5):
            h = 1e-6 * max(1.0, abs(theta[k]))
            tp, tm = theta.copy(), theta.copy()
            tp[k] += h
            tm[k] -= h
            num[k] = (huber_objective(tp, *args, delta, w)[0] - huber_objective(tm, *args, delta, w)[0]) / (2 * h)
        np.testing.assert_allclose(g, num, rtol=1e-4, atol=1e-9 * max(1.0, abs(f)))


def test_grid_objective_matches_pointwise(ladder):
    N, D, L = ladder()
    args = _logs(N, D, L)
    grid = initial_grid(FitConfig())
    assert grid.shape == (4500, 5)
    idx = [0, 17, 2222, 4499]
    vec = grid_objective(grid[idx], *args, 1e-3, chunk=3)
    np.testing.assert_allclose(vec, [huber_objective(grid[i], *args, 1e-3)[0] for i in idx], rtol=1e-12)


def test_recovers_known_parameters_from_noisy_ladder(ladder):
    truth = dict(E=1.8, A=400.0, B=1500.0, alpha=0.34, beta=0.30)
    N, D, L = ladder(noise=0.003, seed=3, **truth)
    fit = fit_chinchilla(N, D, L, CFG)
    assert fit.alpha == pytest.approx(truth["alpha"], abs=0.03)
    assert fit.beta == pytest.approx(truth["beta"], abs=0.03)
    assert fit.E == pytest.approx(truth["E"], abs=0.05)
    # the fitted surface matches the truth within the noise, on and off the sampled points
    for n, d in ((1e8, 2e10), (3e9, 6e10)):
        true = truth["E"] + truth["A"] / n ** truth["alpha"] + truth["B"] / d ** truth["beta"]
        assert fit.predict(n, d) == pytest.approx(true, rel=0.01)
    assert fit.warnings == []
    assert fit.converged


def test_noise_free_fit_is_exact(ladder):
    N, D, L = ladder(noise=0.0)
    fit = fit_chinchilla(N, D, L, CFG)
    assert fit.rmse_log < 1e-5
    assert fit.alpha == pytest.approx(0.34, abs=2e-3) and fit.beta == pytest.approx(0.30, abs=2e-3)


def test_bootstrap_interval_covers_truth_and_is_reproducible(ladder):
    N, D, L = ladder(noise=0.01, seed=5)
    fit = fit_chinchilla(N, D, L, CFG)
    b1 = bootstrap_chinchilla(N, D, L, CFG, fit=fit)
    assert len(b1.samples) == 30 and b1.n_failed == 0
    lo, hi = b1.intervals["alpha"]
    assert lo < 0.34 < hi and lo < fit.alpha < hi
    assert hi - lo < 0.2
    # the same replicates in 2 worker processes give the same samples (drawn in the parent)
    cfg2 = FitConfig(n_bootstrap=8, n_jobs=2, n_starts=16, bootstrap_start_spread=0.0)
    b2 = bootstrap_chinchilla(N, D, L, cfg2, fit=fit)
    b3 = bootstrap_chinchilla(N, D, L, FitConfig(n_bootstrap=8, n_jobs=1, n_starts=16,
                                                 bootstrap_start_spread=0.0), fit=fit)
    np.testing.assert_allclose(b2.samples, b3.samples, rtol=1e-10)


def test_warns_on_narrow_n_and_few_points_and_excludes_top_loss(ladder):
    N, D, L = ladder(n_lo=1e8, n_hi=4e8, n_sizes=3, n_tokens=2)
    fit = fit_chinchilla(N, D, L, FitConfig(n_starts=8, exclude_top_loss=0, min_points=8))
    assert any("decades" in w and "unidentifiable" in w for w in fit.warnings)
    assert any("min_points=8" in w for w in fit.warnings)
    N, D, L = ladder()
    fit = fit_chinchilla(N, D, L, FitConfig(n_starts=8, exclude_top_loss=3))
    top = set(np.argsort(-L)[:3].tolist())
    assert {e["row"] for e in fit.excluded} == top and fit.n_points == len(N) - 3
    assert all("exclude_top_loss=3" in e["reason"] for e in fit.excluded)


def test_warns_when_parameter_hits_bound(ladder):
    N, D, L = ladder(noise=0.0)
    fit = fit_chinchilla(N, D, L, FitConfig(n_starts=8, bound_alpha=(0.0, 2.0), grid_alpha=(0.0, 0.5, 1.0),
                                            bound_e=(-1.0, 0.3), grid_e=(-1.0, 0.0)))
    # log(1.8) = 0.588 > 0.3: e is pinned at its upper bound
    assert any(w.startswith("e = 0.3 is at its bound") for w in fit.warnings)


def test_bootstrap_starts_keep_terms_at_data_centre(ladder):
    theta = np.array([6.0, 7.0, 0.5, 0.34, 0.3])
    ln, ld = np.log([1e8, 1e9]), np.log([1e10, 1e11])
    s = bootstrap_starts(theta, ln, ld, 0.25)
    assert s.shape == (5, 5)
    np.testing.assert_allclose(s[:, 0] - s[:, 3] * ln.mean(), theta[0] - theta[3] * ln.mean())
    np.testing.assert_allclose(s[:, 1] - s[:, 4] * ld.mean(), theta[1] - theta[4] * ld.mean())


def test_rejects_bad_input(ladder):
    with pytest.raises(ValueError, match="loss must be positive and finite; row 2"):
        fit_chinchilla([1e8] * 6, [1e9] * 6, [3.0, 3.0, np.nan, 3.0, 3.0, 3.0], CFG)
    with pytest.raises(ValueError, match="needs at least 5 points"):
        fit_chinchilla([1e8] * 4, [1e9] * 4, [3.0] * 4, CFG)


def _bootstrap_weights(n, k, seed=0):
    return np.random.default_rng(seed).multinomial(n, np.full(n, 1.0 / n), size=k).astype(float)


@pytest.mark.parametrize("delta", [1e-3, 1e-1], ids=["delta=1e-3(linear branch)", "delta=0.1(quadratic)"])
def test_batched_objective_gradient_and_hessian(delta, ladder):
    N, D, L = ladder(noise=0.02, n_sizes=7, n_tokens=9)  # 63 points
    args = _logs(N, D, L)
    thetas = np.array([[6.0, 7.5, 0.6, 0.33, 0.31], [4.0, 9.0, 0.2, 0.5, 0.2], [5.5, 6.0, 0.55, 0.3, 0.28]])
    w = _bootstrap_weights(len(N), len(thetas), seed=2)
    f, g, H = huber_objective_batched(thetas, *args, delta, w)
    for k, theta in enumerate(thetas):
        fk, gk = huber_objective(theta, *args, delta, w[k])
        assert f[k] == pytest.approx(fk, rel=1e-12)
        np.testing.assert_allclose(g[k], gk, rtol=1e-10, atol=1e-14 * max(1.0, abs(fk)))
        num = np.empty((5, 5))
        for j in range(5):
            h = 1e-7 * max(1.0, abs(theta[j]))
            tp, tm = theta.copy(), theta.copy()
            tp[j] += h
            tm[j] -= h
            num[:, j] = (huber_objective(tp, *args, delta, w[k])[1] - huber_objective(tm, *args, delta, w[k])[1]) / (2 * h)
        np.testing.assert_allclose(H[k], H[k].T, rtol=0, atol=1e-12 * np.abs(H[k]).max())
        np.testing.assert_allclose(H[k], num, rtol=0, atol=1e-5 * np.abs(num).max())


def test_batched_optimiser_lands_on_scipys_optimum(ladder):
    """Bootstrap-weighted problems from the estimate and perturbed starts: the batched Newton
    method certifies the same minima L-BFGS-B reaches, objectives equal within 1e-10."""
    N, D, L = ladder(noise=0.02, seed=7, n_sizes=9, n_tokens=7)  # 63 points
    log_n, log_d, log_loss = _logs(N, D, L)
    fit = fit_chinchilla(N, D, L, FitConfig(n_starts=16, optimizer="scipy"))
    starts = bootstrap_starts(fit.theta, log_n, log_d, 0.25)
    w = np.repeat(_bootstrap_weights(len(N), 6, seed=3), len(starts), axis=0)
    starts = np.tile(starts, (6, 1))
    lo = np.array([-30.0, -30.0, -5.0, 0.0, 0.0])
    hi = np.array([60.0, 60.0, 5.0, 5.0, 5.0])
    th_b, f_b, ok_b = minimise_batched(starts, log_n, log_d, log_loss, 1e-3, w, lo, hi, 300)
    assert ok_b.mean() > 0.9  # most rows certified without L-BFGS-B
    th_s, f_s, ok_s = minimise_starts(starts, log_n, log_d, log_loss, FitConfig(optimizer="scipy"), weights=w)
    assert ok_s.all()
    for k in np.flatnonzero(ok_b):
        # certified batched optima are never worse than L-BFGS-B's, and the same minimum
        assert f_b[k] <= f_s[k] * (1 + 1e-10)
        assert f_b[k] == pytest.approx(f_s[k], rel=1e-10)
        np.testing.assert_allclose(th_b[k, 3:], th_s[k, 3:], atol=1e-4)  # alpha, beta
        np.testing.assert_allclose(th_b[k, :3], th_s[k, :3], atol=2e-3)  # a, b, e (flatter)


def test_batched_and_scipy_fits_agree(ladder):
    N, D, L = ladder(noise=0.01, seed=5)
    cfg_b = FitConfig(n_starts=16, n_bootstrap=20, n_jobs=1, optimizer="batched")
    cfg_s = FitConfig(n_starts=16, n_bootstrap=20, n_jobs=1, optimizer="scipy")
    fb, fs = fit_chinchilla(N, D, L, cfg_b), fit_chinchilla(N, D, L, cfg_s)
    assert fb.converged and fs.converged
    assert fb.objective <= fs.objective * (1 + 1e-10)
    assert fb.objective == pytest.approx(fs.objective, rel=1e-10)
    np.testing.assert_allclose(fb.theta[3:], fs.theta[3:], atol=1e-4)
    bb, bs = bootstrap_chinchilla(N, D, L, cfg_b, fit=fs), bootstrap_chinchilla(N, D, L, cfg_s, fit=fs)
    assert bb.n_failed == bs.n_failed == 0
    np.testing.assert_allclose(bb.objectives, bs.objectives, rtol=1e-10)
    np.testing.assert_allclose(bb.column("alpha"), bs.column("alpha"), atol=1e-4)
    np.testing.assert_allclose(bb.column("beta"), bs.column("beta"), atol=1e-4)


def test_batched_optimiser_hands_bound_solutions_to_lbfgs(ladder):
    """A minimum on a bound is not certified by Newton; L-BFGS-B finishes it (the fit still ends there)."""
    N, D, L = ladder(noise=0.0)
    log_n, log_d, log_loss = _logs(N, D, L)
    lo = np.array([-30.0, -30.0, -1.0, 0.0, 0.0])
    hi = np.array([60.0, 60.0, 0.3, 2.0, 5.0])
    starts = np.array([[6.0, 7.3, 0.2, 0.34, 0.30]])
    _, _, ok = minimise_batched(starts, log_n, log_d, log_loss, 1e-3, None, lo, hi, 50)
    assert not ok[0]
    cfg = FitConfig(n_starts=1, bound_alpha=(0.0, 2.0), grid_alpha=(0.0, 0.5, 1.0), bound_e=(-1.0, 0.3),
                    grid_e=(-1.0, 0.0))
    th, _, _ = minimise_starts(starts, log_n, log_d, log_loss, cfg)
    assert th[0, 2] == pytest.approx(0.3)


def test_newton_step_survives_non_finite_rows():
    """A row whose Hessian overflowed gets no step and no PD flag instead of failing the batch."""
    from tasks.scaling.chinchilla import _newton_step

    good = np.eye(5) * 2.0
    bad = np.full((5, 5), np.inf)
    step, dec, pd, finite = _newton_step(np.ones((2, 5)), np.stack([good, bad]), np.zeros(2))
    assert finite.tolist() == [True, False] and pd.tolist() == [True, False]
    assert np.allclose(step[0], -0.5) and np.all(step[1] == 0)


def test_degenerate_replicates_are_redrawn(ladder):
    """Six runs, one of them the only run at the larger N: a plain multinomial draw often misses it
    (one distinct N) or has < 5 distinct runs; those draws are redrawn and counted."""
    from tasks.scaling.chinchilla import resample_keys, run_keys

    N = np.array([1e8] * 5 + [1e9])
    D = np.geomspace(1e9, 1e11, 6)
    keys, _ = run_keys(N, D)
    counts, n_redrawn, failed = resample_keys(keys, 40, seed=0)
    assert n_redrawn > 0 and not failed.any()
    for c in counts:
        used = keys[c > 0]
        assert len(np.unique(used[:, 0])) >= 2 and len(np.unique(used[:, 1])) >= 2 and len(used) >= 5
        assert c.sum() == len(keys)
    # the same through the bootstrap, which reports the count
    N, D, L = ladder(n_sizes=3, n_tokens=2, noise=0.002)  # 6 runs
    boot = bootstrap_chinchilla(N, D, L, FitConfig(n_bootstrap=6, n_jobs=1, n_starts=8, bootstrap_n_starts=2))
    assert boot.n_redrawn > 0 and boot.counts.shape == (6, 6)
    assert all(len(np.unique(boot.keys[c > 0, 0])) >= 2 for c in boot.counts)


def test_replicates_are_paired_by_run_key_whatever_the_row_order(ladder):
    """Two variants on the same ladder, rows in different orders and with different losses: replicate
    i resamples the same runs for both (common random numbers); a different ladder does not pair."""
    from tasks.scaling.compute_optimal import pairing

    cfg = FitConfig(n_bootstrap=6, n_jobs=1, n_starts=8, bootstrap_start_spread=0.0, bootstrap_n_starts=2)
    N, D, L = ladder(noise=0.004, seed=1, n_sizes=5, n_tokens=4)
    perm = np.random.default_rng(9).permutation(len(N))
    Ly = ladder(noise=0.004, seed=2, n_sizes=5, n_tokens=4, E=1.7)[2]
    bx = bootstrap_chinchilla(N, D, L, cfg)
    by = bootstrap_chinchilla(N[perm], D[perm], Ly[perm], cfg)
    np.testing.assert_array_equal(bx.keys, by.keys)
    np.testing.assert_array_equal(bx.counts, by.counts)
    # multiplicity of each row's run, looked up by (N, D), is the same in both
    wx = {tuple(k): bx.counts[:, j] for j, k in enumerate(bx.keys)}
    wy = {tuple(k): by.counts[:, j] for j, k in enumerate(by.keys)}
    for n, d in zip(N, D):
        np.testing.assert_array_equal(wx[(n, d)], wy[(n, d)])
    assert pairing(bx, by) == "paired_by_key"
    bz = bootstrap_chinchilla(N[1:], D[1:], L[1:], cfg)  # one run fewer: another ladder
    assert pairing(bx, bz) == "independent"


def test_failed_replicates_stay_as_missing_rows(ladder):
    N, D, L = ladder(noise=0.01, seed=5, n_sizes=5, n_tokens=4)
    boot = bootstrap_chinchilla(N, D, L, FitConfig(n_bootstrap=5, n_jobs=1, n_starts=8, bootstrap_n_starts=2))
    assert boot.samples.shape == (5, 5) and boot.objectives.shape == (5,) and boot.n_ok == 5
    # the bootstrap's own draws never leave a replicate degenerate on this ladder; fake one failure
    samples = boot.samples.copy()
    samples[2] = np.nan
    from tasks.scaling.chinchilla import percentile_interval

    lo, hi = percentile_interval(samples[:, 3], 0.9)
    assert np.isfinite(lo) and np.isfinite(hi)
