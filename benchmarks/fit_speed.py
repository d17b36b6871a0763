"""Approach-3 fit + 1,000 bootstraps on ~250 points vs a naive fitter.

Run: .venv/bin/python benchmarks/fit_speed.py [--repeats 3] [--naive-bootstraps 20]

Ours: vectorised grid ranking, analytic gradient, single-threaded BLAS, bootstrap over
cfg.n_jobs processes. Naive: the same starts with scipy's finite-difference gradient and
default BLAS threading, one process; its bootstrap runs --naive-bootstraps replicates and is
extrapolated linearly to 1,000 (stated in the output).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl
from scipy.optimize import minimize

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.scaling.chinchilla import (_bounds, bootstrap_chinchilla, bootstrap_starts, fit_chinchilla,  # noqa: E402
                                      grid_objective, huber_objective, initial_grid, select_points)
from tasks.scaling.config import FitConfig  # noqa: E402

CSV = Path(__file__).resolve().parents[1].parent / "shared" / "reference" / "chinchilla_epoch_svg_extracted.csv"


def load_points():
    if CSV.exists():
        d = pl.read_csv(CSV)
        N = d["Model Size"].to_numpy()
        return N, d["Training FLOP"].to_numpy() / (6 * N), d["loss"].to_numpy(), f"{CSV.name} (245 runs, top 5 excluded)"
    rng = np.random.default_rng(0)
    N = np.exp(rng.uniform(np.log(1e7), np.log(1e10), 250))
    D = N * np.exp(rng.uniform(np.log(2), np.log(200), 250))
    L = (1.8 + 400 / N**0.34 + 1500 / D**0.3) * np.exp(0.01 * rng.standard_normal(250))
    return N, D, L, "synthetic (250 runs)"


def naive(N, D, L, cfg: FitConfig, n_boot: int) -> tuple[float, float]:
    """Seconds for the point fit and for n_boot bootstrap replicates, numeric gradients."""
    keep, _ = select_points(L, cfg)
    args = (np.log(N[keep]), np.log(D[keep]), np.log(L[keep]), cfg.huber_delta)
    opts = {"ftol": cfg.lbfgs_ftol, "gtol": cfg.lbfgs_gtol, "maxiter": cfg.lbfgs_maxiter}
    f = lambda th, *a: huber_objective(th, *a)[0]  # noqa: E731
    t0 = time.perf_counter()
    grid = initial_grid(cfg)
    starts = grid[np.argsort(grid_objective(grid, *args))[:cfg.n_starts]]
    best = min((minimize(f, s, args=args, method="L-BFGS-B", bounds=_bounds(cfg), options=opts) for s in starts),
               key=lambda r: r.fun)
    t_fit = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    n = len(args[0])
    t0 = time.perf_counter()
    for _ in range(n_boot):
        idx = rng.integers(0, n, n)
        bargs = tuple(a[idx] for a in args[:3]) + (cfg.huber_delta,)
        for s in bootstrap_starts(best.x, bargs[0], bargs[1], cfg.bootstrap_start_spread):
            minimize(f, s, args=bargs, method="L-BFGS-B", bounds=_bounds(cfg), options=opts)
    return t_fit, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--naive-bootstraps", type=int, default=20)
    ap.add_argument("--n-bootstrap", type=int, default=1000)
    args = ap.parse_args()
    N, D, L, source = load_points()
    cfg = FitConfig(exclude_top_loss=5 if "excluded" in source else 0, n_bootstrap=args.n_bootstrap, n_jobs=2)
    print(f"points: {source}; n_starts={cfg.n_starts}, bootstrap starts/replicate="
          f"{1 if cfg.bootstrap_start_spread == 0 else 5}, n_jobs={cfg.n_jobs}")
    ours, naive_total = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        fit = fit_chinchilla(N, D, L, cfg)
        t_fit = time.perf_counter() - t0
        boot = bootstrap_chinchilla(N, D, L, cfg, fit=fit)
        total = time.perf_counter() - t0
        ours.append(total)
        print(f"ours : fit {t_fit:.2f}s + {cfg.n_bootstrap} bootstraps {total - t_fit:.2f}s = {total:.2f}s "
              f"(alpha {fit.alpha:.4f} [{boot.intervals['alpha'][0]:.3f}, {boot.intervals['alpha'][1]:.3f}], "
              f"beta {fit.beta:.4f} [{boot.intervals['beta'][0]:.3f}, {boot.intervals['beta'][1]:.3f}], "
              f"basin switches {boot.n_basin_switch})")
        nf, nb = naive(N, D, L, cfg, args.naive_bootstraps)
        est = nf + nb * cfg.n_bootstrap / args.naive_bootstraps
        naive_total.append(est)
        print(f"naive: fit {nf:.2f}s + {args.naive_bootstraps} bootstraps {nb:.2f}s "
              f"-> extrapolated to {cfg.n_bootstrap}: {est:.1f}s")
    mo, mn = statistics.median(ours), statistics.median(naive_total)
    print(f"median ours {mo:.2f}s, median naive (extrapolated) {mn:.1f}s, speed-up {mn / mo:.1f}x; "
          f"goal < 60 s: {'met' if mo < 60 else 'NOT met'}")


if __name__ == "__main__":
    main()
