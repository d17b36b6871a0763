import numpy as np
import pytest

from tasks.scaling.isoflop import isoflop_levels, isoflop_minima


def _profiles(compute, n_per_level=7, E=1.8, A=400.0, B=1500.0, alpha=0.34, beta=0.30, jitter=0.02):
    """IsoFLOP profiles around each level's true optimum, with compute jittered within a level."""
    rng = np.random.default_rng(0)
    G = (alpha * A / (beta * B)) ** (1 / (alpha + beta))
    N, D = [], []
    for C in compute:
        n_star = G * (C / 6) ** (beta / (alpha + beta))
        for n in n_star * np.geomspace(0.2, 5, n_per_level):
            c = C * 10 ** (jitter * rng.uniform(-1, 1))
            N.append(n)
            D.append(c / (6 * n))
    N, D = np.array(N), np.array(D)
    return N, D, E + A / N**alpha + B / D**beta, G


def test_levels_group_by_log_compute():
    levels = isoflop_levels(np.array([1e18, 1.1e18, 1e19, 0.95e19, 1e20]), log10_tolerance=0.1)
    assert [sorted(lv.tolist()) for lv in levels] == [[0, 1], [2, 3], [4]]


def test_recovers_allocation_exponents():
    alpha, beta = 0.34, 0.30
    N, D, L, _ = _profiles([1e18, 1e19, 1e20, 1e21], alpha=alpha, beta=beta)
    res = isoflop_minima(N, D, L, log10_tolerance=0.1)
    assert len(res.levels) == 4 and all(lv.used for lv in res.levels)
    # Parabolas in log N only approximate the profile; exponents within a few hundredths.
    assert res.a == pytest.approx(beta / (alpha + beta), abs=0.03)
    assert res.b == pytest.approx(alpha / (alpha + beta), abs=0.03)
    assert res.a + res.b == pytest.approx(1.0, abs=0.02)


def test_skips_levels_with_too_few_points_and_says_so():
    N, D, L, _ = _profiles([1e18, 1e19, 1e20])
    keep = np.ones(len(N), dtype=bool)
    keep[7:12] = False  # the 1e19 level keeps 2 runs
    res = isoflop_minima(N[keep], D[keep], L[keep])
    assert [lv.used for lv in res.levels] == [True, False, True]
    assert "2 distinct N (< 3)" in res.levels[1].reason
    assert any("1 of 3 IsoFLOP levels not used" in w for w in res.warnings)
    assert res.a is not None


def test_no_power_law_from_one_level():
    N, D, L, _ = _profiles([1e19])
    res = isoflop_minima(N, D, L)
    assert res.a is None and any("need >= 2" in w for w in res.warnings)


def test_minimum_outside_sampled_range_is_left_out():
    N, D, L, G = _profiles([1e19, 1e20])
    res = isoflop_minima(N[:3], D[:3], L[:3])  # only the small-N side of the 1e19 profile
    assert res.levels[0].reason.startswith("minimum outside the sampled N range")
