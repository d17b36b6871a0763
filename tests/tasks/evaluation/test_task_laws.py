"""Task laws: the sigmoid on synthetic points with known parameters, the chained prediction, the curve check."""

from __future__ import annotations

import numpy as np
import pytest

from tasks.evaluation.task_laws import (
    TaskLawConfig, chained_prediction, curve_residuals, fit_bpb_law, fit_sigmoid, fit_task_laws, sigmoid,
)

TRUE = dict(a=0.55, k=-6.0, b0=1.1, c=0.25)


def _points(n=40, noise=0.004, seed=0):
    rng = np.random.default_rng(seed)
    bpb = np.linspace(0.5, 1.8, n)
    return bpb, sigmoid(bpb, **TRUE) + rng.normal(0, noise, n)


def test_sigmoid_recovers_known_parameters():
    bpb, acc = _points()
    fit = fit_sigmoid(bpb, acc, chance=0.25, cfg=TaskLawConfig(n_bootstrap=40))
    assert fit.a == pytest.approx(TRUE["a"], abs=0.03)
    assert fit.k == pytest.approx(TRUE["k"], rel=0.1)
    assert fit.b0 == pytest.approx(TRUE["b0"], abs=0.03)
    assert fit.c == pytest.approx(TRUE["c"], abs=0.02)
    assert fit.rmse < 0.01
    for name, value in TRUE.items():  # bootstrap intervals: around the estimate, the truth within reach
        lo, hi = fit.intervals[name]
        est = getattr(fit, name)
        assert lo < hi and lo - 1e-9 <= est <= hi + 1e-9, name
        assert abs(value - est) <= 3 * (hi - lo), name
    lo, hi = fit.band(np.array([0.6, 1.1, 1.7]), 0.95)
    assert (lo <= sigmoid(np.array([0.6, 1.1, 1.7]), **TRUE) + 0.01).all() and (hi >= lo).all()


def test_sigmoid_needs_enough_models():
    with pytest.raises(ValueError, match="need >= 6 models, got 3"):
        fit_sigmoid([1.0, 1.2, 1.4], [0.3, 0.28, 0.26], chance=0.25, cfg=TaskLawConfig())


def test_curve_residuals_tell_on_from_off_the_curve():
    bpb, acc = _points(seed=1)
    fit = fit_sigmoid(bpb, acc, chance=0.25, cfg=TaskLawConfig(n_bootstrap=30))
    x = np.linspace(0.7, 1.5, 12)
    on = curve_residuals(fit, x, sigmoid(x, **TRUE) + np.random.default_rng(2).normal(0, 0.004, 12), confidence=0.95)
    off = curve_residuals(fit, x, sigmoid(x, **TRUE) - 0.05, confidence=0.95)
    assert on["verdict"] == "on the curve"
    assert off["verdict"] == "below" and off["mean_residual"] == pytest.approx(-0.05, abs=0.01)


def _ladder(E=0.8, A=40.0, B=60.0, alpha=0.4, beta=0.35):
    N = np.repeat([1e4, 3e4, 1e5, 3e5], 3)
    D = np.tile([2e5, 6e5, 2e6], 4) * np.repeat([1, 1.5, 2, 3], 3)
    return N, D, E + A / N**alpha + B / D**beta


def test_bpb_law_and_chained_prediction():
    N, D, bpb = _ladder()
    cfg = TaskLawConfig(n_bootstrap=20)
    law = fit_bpb_law(N, D, bpb, cfg)
    assert law["fit"].predict(1e6, 1e7) == pytest.approx(0.8 + 40 / 1e6**0.4 + 60 / 1e7**0.35, rel=0.02)
    sig_bpb, sig_acc = _points()
    sig = fit_sigmoid(sig_bpb, sig_acc, chance=0.25, cfg=cfg)
    pred = chained_prediction(law, sig, 1e6, 1e7, 0.95)
    assert pred["acc"] == pytest.approx(float(sigmoid(pred["bpb"], sig.a, sig.k, sig.b0, sig.c)))
    lo, hi = pred["acc_ci"]
    assert lo <= pred["acc"] <= hi
    assert fit_bpb_law(N[:4], D[:4], bpb[:4], cfg)["identification_reasons"][0].startswith("too few points")


def test_fit_task_laws_on_report_rows():
    N, D, bpb = _ladder()
    rows = [dict(task="arc_easy", family="ladder", method="none", variant="raw", n_params=n, tokens=d, bpb=b,
                 primary=float(sigmoid(b, **TRUE)), chance=0.25) for n, d, b in zip(N, D, bpb)]
    rows += [dict(task="arc_easy", family="smollm2", method="none", variant="smollm2", n_params=1.3e8, tokens=2e12,
                  bpb=b, primary=float(sigmoid(b, **TRUE)), chance=0.25) for b in (0.6, 0.7)]
    rows += [dict(task="arc_easy", family="smollm2", method="rtn", variant="smollm2", n_params=1.3e8, tokens=2e12,
                  bpb=b, primary=float(sigmoid(b, **TRUE)) - 0.1, chance=0.25) for b in (0.8, 0.9, 1.0)]
    out = fit_task_laws(rows, TaskLawConfig(n_bootstrap=10, targets=((1e6, 1e7),)))
    task = out["tasks"]["arc_easy"]
    assert task["sigmoid"]["n_points"] == 14
    assert {p["kind"] for p in task["predictions"]} == {"largest ladder run", "target"}
    assert task["compressed_on_curve"]["rtn"]["verdict"] == "below"
    assert "raw" in task["laws"] and "E" in task["laws"]["raw"]
