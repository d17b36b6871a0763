"""Wilson intervals and paired comparisons."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tasks.evaluation.stats import paired_difference, wilson_interval


def test_wilson_interval_solves_the_score_equation():
    z = 1.959963984540054
    for k, n in [(0, 10), (3, 10), (10, 10), (81, 263), (1, 1000)]:
        lo, hi = wilson_interval(k, n)
        p = k / n
        assert 0.0 <= lo <= p <= hi <= 1.0
        for bound in (lo, hi):  # each end p0 satisfies |p - p0| = z * sqrt(p0 (1 - p0) / n)
            if 0.0 < bound < 1.0:
                assert abs(p - bound) == pytest.approx(z * math.sqrt(bound * (1 - bound) / n), rel=1e-9)
        mlo, mhi = wilson_interval(n - k, n)
        assert (mlo, mhi) == pytest.approx((1 - hi, 1 - lo))
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0
    assert wilson_interval(50, 100, 0.99)[1] > wilson_interval(50, 100, 0.95)[1]


def test_paired_difference_calls_small_gaps_not_distinguishable():
    a = np.r_[np.ones(100), np.zeros(100)].astype(bool)
    assert paired_difference(a, a)["verdict"] == "not distinguishable"
    b = a.copy()
    b[:2] = False  # two discordant items in 200
    small = paired_difference(a, b)
    assert small["verdict"] == "not distinguishable" and small["discordant"] == 2 and small["diff"] == 0.01
    big = paired_difference(np.ones(60, bool), np.zeros(60, bool))
    assert big["verdict"] == "a better" and big["ci_low"] > 0
    assert paired_difference(np.zeros(60, bool), np.ones(60, bool))["verdict"] == "b better"
