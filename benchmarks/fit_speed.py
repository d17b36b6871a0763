"""Approach-3 fit + 1,000 bootstraps on ~250 points: batched Newton vs L-BFGS-B vs a naive fitter.

Run: .venv/bin/python benchmarks/fit_speed.py [--repeats 3] [--before-repeats 1] [--naive-bootstraps 20]

After (optimizer="batched"): every start of every replicate in one damped-Newton batch, rows
it cannot certify finished by L-BFGS-B. Before (optimizer="scipy"): L-BFGS-B per start, one at
a time. Both: vectorised grid ranking, analytic gradient, single-threaded BLAS, bootstrap over
cfg.n_jobs processes, same seed and replicates; printed side by side with their ratio (medians
of the repeats). Naive (skipped with --naive-bootstraps 0): the same starts with scipy's
finite-difference gradient and default BLAS threading, one process; its bootstrap runs
--naive-bootstraps replicates and is extrapolated linearly to 1,000 (stated in the output).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
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


def timed_fit(N, D, L, cfg: FitConfig) -> tuple[float, float, str]:
    """Seconds for the point fit and for fit + bootstrap, and a line describing the result."""
    t0 = time.perf_counter()
    fit = fit_chinchilla(N, D, L, cfg)
    t_fit = time.perf_counter() - t0
    boot = bootstrap_chinchilla(N, D, L, cfg, fit=fit)
    total = time.perf_counter() - t0
    (alo, ahi), (blo, bhi) = boot.intervals["alpha"], boot.intervals["beta"]
    desc = (f"alpha {fit.alpha:.4f} [{alo:.3f}, {ahi:.3f}], beta {fit.beta:.4f} [{blo:.3f}, {bhi:.3f}], "
            f"objective {fit.objective:.12g}, basin switches {boot.n_basin_switch}, failed {boot.n_failed}")
    return t_fit, total, desc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=1, help="repeats of the batched (after) fit")
    ap.add_argument("--before-repeats", type=int, default=1, help="repeats of the L-BFGS-B (before) fit")
    ap.add_argument("--naive-bootstraps", type=int, default=20)
    ap.add_argument("--n-bootstrap", type=int, default=1000)
    args = ap.parse_args()
    N, D, L, source = load_points()
    base = FitConfig(exclude_top_loss=5 if "excluded" in source else 0, n_bootstrap=args.n_bootstrap, n_jobs=2)
    print(f"points: {source}; n_starts={base.n_starts}, bootstrap starts/replicate="
          f"{1 if base.bootstrap_start_spread == 0 else 5}, n_jobs={base.n_jobs}")
    times: dict[str, list[float]] = {"batched": [], "scipy": []}
    args.repeats, args.before_repeats = max(1, args.repeats), max(1, args.before_repeats)
    for i in range(max(args.repeats, args.before_repeats)):
        # alternate so both see the same machine load as far as possible
        for opt, reps in (("batched", args.repeats), ("scipy", args.before_repeats)):
            if i >= reps:
                continue
            t_fit, total, desc = timed_fit(N, D, L, replace(base, optimizer=opt))
            times[opt].append(total)
            label = "after " if opt == "batched" else "before"
            print(f"{label} ({opt:7s}): fit {t_fit:.2f}s + {base.n_bootstrap} bootstraps {total - t_fit:.2f}s "
                  f"= {total:.2f}s ({desc})", flush=True)
    after, before = statistics.median(times["batched"]), statistics.median(times["scipy"])
    print(f"median before (scipy L-BFGS-B, {len(times['scipy'])} run(s)) {before:.2f}s, median after (batched "
          f"Newton, {len(times['batched'])} run(s)) {after:.2f}s, speed-up {before / after:.1f}x; "
          f"goal < 60 s: {'met' if after < 60 else 'NOT met'}")
    if args.naive_bootstraps:
        nf, nb = naive(N, D, L, base, args.naive_bootstraps)
        est = nf + nb * base.n_bootstrap / args.naive_bootstraps
        print(f"naive: fit {nf:.2f}s + {args.naive_bootstraps} bootstraps {nb:.2f}s "
              f"-> extrapolated to {base.n_bootstrap}: {est:.1f}s ({est / after:.1f}x the batched fit)")


if __name__ == "__main__":
    main()
