"""The joint shared-exponent fit (variable projection) against per-series Approach-3 fits, on ~250 points.

Run: .venv/bin/python benchmarks/joint_fit_speed.py [--series 5] [--bootstrap 1000] [--repeats 3]

Synthetic ladders (5 sizes x 10 token counts per series, 5 series = 250 points) drawn from known
laws with shared exponents and Gaussian noise. Joint: `fit_joint` + `bootstrap_joint` with the
given replicates (the paired bootstrap the fit stage's projections use), plus the nested test's
parametric bootstrap (`nested_bootstrap` replicates). Baseline: what the fit stage already does per
series, `fit_chinchilla` + `bootstrap_chinchilla` with the same replicates, once per series.
Prints medians over the repeats and their ratio, and the recovered exponents against the truth.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.scaling.chinchilla import bootstrap_chinchilla, fit_chinchilla  # noqa: E402
from tasks.scaling.config import FitConfig  # noqa: E402
from tasks.scaling.joint import ExponentGrid, SeriesPoints, bootstrap_joint, fit_joint, nested_test  # noqa: E402

ALPHA, BETA = 0.34, 0.28


def ladders(n_series: int, seed: int = 0) -> dict[str, SeriesPoints]:
    rng = np.random.default_rng(seed)
    n, d = np.meshgrid(np.geomspace(1e6, 1e8, 5), np.geomspace(2e7, 2e9, 10), indexing="ij")
    n, d = n.ravel(), d.ravel()
    out = {}
    for i in range(n_series):
        e, a, b = 1.7 + 0.02 * i, 400.0 * (1 + 0.05 * i), 410.0 * (1 - 0.03 * i)
        out[f"s{i}"] = SeriesPoints(n, d, e + a / n**ALPHA + b / d**BETA + rng.normal(0, 0.003, n.size))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--series", type=int, default=5)
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--nested-bootstrap", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    data = ladders(args.series)
    grid = ExponentGrid(steps=40)
    cfg = replace(FitConfig(), n_bootstrap=args.bootstrap, huber_delta_sensitivity=(), backtest_bootstrap=0)
    joint_s, nested_s, base_s = [], [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        fit = fit_joint(data, grid=grid)
        bootstrap_joint(data, fit, n_bootstrap=args.bootstrap, grid=grid)
        joint_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        nested_test(data, [k for k in data if k != "s0"], grid=grid, n_bootstrap=args.nested_bootstrap)
        nested_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        for p in data.values():
            f = fit_chinchilla(p.N, p.D, p.L, cfg)
            bootstrap_chinchilla(p.N, p.D, p.L, cfg, fit=f)
        base_s.append(time.perf_counter() - t)
    n_points = sum(len(p.L) for p in data.values())
    j, ne, b = (statistics.median(x) for x in (joint_s, nested_s, base_s))
    print(f"{n_points} points, {args.series} series, {args.bootstrap} bootstrap replicates, median of {args.repeats}")
    print(f"  joint fit + paired bootstrap (variable projection): {j:7.1f} s")
    print(f"  nested test ({args.nested_bootstrap} parametric replicates): {ne:7.1f} s")
    print(f"  per-series Approach 3 + bootstrap (the fit stage's laws): {b:7.1f} s")
    print(f"  ratio joint / per-series: {j / b:.2f}")
    p = fit.params["s0"]
    print(f"  recovered alpha {p['alpha']:.3f} (true {ALPHA}), beta {p['beta']:.3f} (true {BETA})")


if __name__ == "__main__":
    main()
