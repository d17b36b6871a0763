"""Scaling-law fits of a table of runs, and the files that report them.

``fit_points`` computes (Approach 3 with bootstrap intervals, IsoFLOP, compute-optimal
projections, variant comparisons); ``write_fit_report`` writes fits.json,
compute_optimal.csv and PNG plots.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from tasks.common.config import to_dict
from tasks.common.io import atomic_path, write_csv, write_json
from tasks.scaling.chinchilla import PARAM_NAMES, bootstrap_chinchilla, fit_chinchilla
from tasks.scaling.compute_optimal import compare_variants, compute_optimal_table
from tasks.scaling.config import FitConfig
from tasks.scaling.isoflop import isoflop_minima

REQUIRED_COLUMNS = ("N", "D", "loss")
CSV_COLUMNS = ("variant", "C", "N_opt", "D_opt", "tokens_per_param", "loss_pred")


def read_points(path: str | Path) -> pl.DataFrame:
    """Read a CSV of runs with columns N, D, loss (and optionally variant)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: points file not found")
    frame = pl.read_csv(path)
    missing = [c for c in REQUIRED_COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(f"{path}: missing column {missing[0]!r} (needs {', '.join(REQUIRED_COLUMNS)}; "
                         f"has {', '.join(frame.columns)})")
    return frame


def validate_points(points: pl.DataFrame) -> pl.DataFrame:
    """Check columns and values; return the frame with a ``row`` index and a ``variant`` column.

    Raises ``ValueError`` naming the missing column, or the first bad row (0-based) and value.
    """
    missing = [c for c in REQUIRED_COLUMNS if c not in points.columns]
    if missing:
        raise ValueError(f"points: missing column {missing[0]!r} (needs {', '.join(REQUIRED_COLUMNS)}; "
                         f"has {', '.join(points.columns) or 'none'})")
    if points.height == 0:
        raise ValueError("points: no rows")
    for col in REQUIRED_COLUMNS:
        if not points.schema[col].is_numeric():
            raise ValueError(f"points: column {col!r} must be numeric, got {points.schema[col]}")
        values = points[col].cast(pl.Float64).to_numpy()
        bad = np.flatnonzero(~np.isfinite(values) | (values <= 0))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"points: row {i} has {col}={values[i]!r}; {col} must be positive and finite "
                             f"({bad.size} bad row(s) in {col})")
    frame = points.with_row_index("row")
    if "variant" not in frame.columns:
        frame = frame.with_columns(pl.lit("all").alias("variant"))
    elif frame["variant"].null_count():
        i = int(frame.filter(pl.col("variant").is_null())["row"][0])
        raise ValueError(f"points: row {i} has no variant")
    return frame.with_columns(pl.col("variant").cast(pl.String),
                              *(pl.col(c).cast(pl.Float64) for c in REQUIRED_COLUMNS))


def _finite(x: Any) -> Any:
    """JSON-safe: non-finite floats become None (missing stays missing, never 0)."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x


def _fit_and_bootstrap(N: np.ndarray, D: np.ndarray, L: np.ndarray, cfg: FitConfig):
    fit = fit_chinchilla(N, D, L, cfg)
    return fit, bootstrap_chinchilla(N, D, L, cfg, fit=fit)


def fit_series(series: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]], cfg: FitConfig) -> dict:
    """``{name: (ChinchillaFit, BootstrapResult)}`` for each ``name: (N, D, loss)``.

    With several series and ``cfg.n_jobs > 1`` the series are spread over one pool of
    ``n_jobs`` processes (each bootstrapping in its own process), rather than each bootstrap
    starting a pool of its own: a pipeline fits a law per variant and per compression and
    sparsity setting, and a pool per law cost more in start-up than the small ladders' fits.
    Results do not depend on ``n_jobs`` (every bootstrap draws from ``cfg.bootstrap_seed``).
    """
    if cfg.n_jobs == 1 or len(series) < 2:
        return {name: _fit_and_bootstrap(*arrays, cfg) for name, arrays in series.items()}
    import dataclasses
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    inner = dataclasses.replace(cfg, n_jobs=1)
    # spawn, not fork: the parent may hold polars/BLAS thread pools that fork would copy locked.
    with ProcessPoolExecutor(max_workers=min(cfg.n_jobs, len(series)),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {name: pool.submit(_fit_and_bootstrap, *arrays, inner) for name, arrays in series.items()}
        return {name: f.result() for name, f in futures.items()}


def fit_points(points: pl.DataFrame, cfg: FitConfig) -> dict:
    """Fit every variant of ``points`` (columns N, D, loss[, variant]) and compare them.

    Returns the fits.json content: ``{"config", "variants": {name: {E, A, B, alpha, beta:
    {value, ci_low, ci_high}, n_points, residual, excluded, warnings, isoflop, compute_optimal}},
    "comparisons": [...]}``. Row numbers in ``excluded`` index ``points``.
    """
    frame = validate_points(points)
    variants: dict[str, dict] = {}
    boots = {}
    series = {}
    for name in sorted(frame["variant"].unique().to_list()):
        sub = frame.filter(pl.col("variant") == name)
        series[name] = tuple(sub[c].to_numpy() for c in (*REQUIRED_COLUMNS, "row"))
    fitted = fit_series({k: v[:3] for k, v in series.items() if len(v[0]) >= 5}, cfg)
    for name, (N, D, L, rows) in series.items():
        if name not in fitted:
            variants[name] = {"n_points": len(N), "warnings": [
                f"only {len(N)} points; Approach 3 has 5 parameters and is not fitted"]}
            continue
        fit, boot = fitted[name]
        boots[name] = boot
        entry: dict[str, Any] = {}
        for p in PARAM_NAMES:
            lo, hi = boot.intervals[p] if boot.n_requested else (None, None)
            entry[p] = {"value": getattr(fit, p), "ci_low": lo, "ci_high": hi}
        entry["allocation_exponents"] = {
            k: {"value": v, "ci_low": boot.intervals[k][0] if boot.n_requested else None,
                "ci_high": boot.intervals[k][1] if boot.n_requested else None}
            for k, v in (("a_exp", fit.beta / (fit.alpha + fit.beta)), ("b_exp", fit.alpha / (fit.alpha + fit.beta)))
        }
        entry["n_points"] = fit.n_points
        entry["n_decades_N"] = fit.n_decades_n
        entry["residual"] = {"huber_objective": fit.objective, "rmse_log_loss": fit.rmse_log}
        entry["excluded"] = [e | {"row": int(rows[e["row"]])} for e in fit.excluded]
        entry["exclusion_rule"] = (f"the {cfg.exclude_top_loss} highest-loss runs of the variant are excluded"
                                   if cfg.exclude_top_loss else "no runs excluded (exclude_top_loss=0)")
        entry["bootstrap"] = {"n_requested": boot.n_requested, "n_ok": len(boot.samples),
                              "n_failed": boot.n_failed, "n_basin_switch": boot.n_basin_switch,
                              "confidence": boot.confidence}
        entry["warnings"] = fit.warnings + boot.warnings
        keep = np.ones(len(N), dtype=bool)
        keep[[e["row"] for e in fit.excluded]] = False
        iso = isoflop_minima(N[keep], D[keep], L[keep], log10_tolerance=cfg.isoflop_log10_tolerance,
                             min_points=cfg.isoflop_min_points)
        iso_dict = iso.to_dict()
        for lv in iso_dict["levels"]:  # rows of the kept subset -> rows of `points`
            lv["rows"] = [int(rows[keep][r]) for r in lv["rows"]]
        entry["isoflop"] = iso_dict
        entry["compute_optimal"] = compute_optimal_table(fit, cfg.compute_budgets,
                                                         boot if boot.n_requested else None)
        variants[name] = entry
    comparisons = compare_variants(boots, cfg.compute_budgets, confidence=cfg.reversal_confidence) \
        if len(boots) >= 2 else []
    return _finite({"config": to_dict(cfg), "variants": variants, "comparisons": comparisons})


# --------------------------------------------------------------------------- writing


def compute_optimal_frame(report: dict) -> pl.DataFrame:
    """The compute_optimal rows of every variant as one table (CSV_COLUMNS plus ci columns)."""
    cols = ["variant", "C"]
    for name in CSV_COLUMNS[2:]:
        cols += [name, f"{name}_ci_low", f"{name}_ci_high"]
    records = [{"variant": v, **row} for v, entry in report["variants"].items()
               for row in entry.get("compute_optimal", [])]
    schema = {c: (pl.String if c == "variant" else pl.Float64) for c in cols}
    return pl.DataFrame(records, schema=schema).select(cols)


def _file_safe(name: str) -> str:
    """A series name as a file name: ``raw+teal@0.5`` -> ``raw_teal_0.5``."""
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)


def _save(fig, path: Path) -> Path:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    return path


def write_fit_report(report: dict, points: pl.DataFrame, out_dir: str | Path,
                     plots_dir: str | Path | None = None) -> list[Path]:
    """Write fits.json, compute_optimal.csv under ``out_dir`` and PNG plots under ``plots_dir``
    (default ``out_dir``); return the paths.

    Plots: ``loss_vs_compute_<variant>.png`` (runs and fitted iso-N curves),
    ``isoflop_<variant>.png`` (per-level parabolas and minima, where IsoFLOP levels exist) and
    ``frontier.png`` (projected loss at the compute-optimal allocation per data variant, with
    intervals) and ``frontier_<variant>.png`` (that variant beside its ``<variant>+<setting>`` series).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    frame = validate_points(points)
    written = [write_json(out / "fits.json", report), write_csv(out / "compute_optimal.csv",
                                                               compute_optimal_frame(report))]
    out = Path(plots_dir) if plots_dir is not None else out
    out.mkdir(parents=True, exist_ok=True)
    for name, entry in report["variants"].items():
        if "alpha" not in entry:
            continue
        safe = _file_safe(name)
        sub = frame.filter(pl.col("variant") == name)
        N, D, L = (sub[c].to_numpy() for c in REQUIRED_COLUMNS)
        p = {k: entry[k]["value"] for k in PARAM_NAMES}
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        sc = ax.scatter(6 * N * D, L, c=np.log10(N), cmap="viridis", s=14)
        d_grid = np.geomspace(D.min() / 2, D.max() * 2, 100)
        for n in np.unique(N)[:: max(1, len(np.unique(N)) // 8)]:
            pred = p["E"] + p["A"] / n ** p["alpha"] + p["B"] / d_grid ** p["beta"]
            ax.plot(6 * n * d_grid, pred, color=plt.cm.viridis(
                (np.log10(n) - np.log10(N.min())) / max(np.log10(N.max() / N.min()), 1e-9)), lw=0.8)
        ax.set(xscale="log", xlabel="compute C = 6ND (FLOPs)", ylabel="loss",
               title=f"{name}: L = {p['E']:.3g} + {p['A']:.3g}/N^{p['alpha']:.3f} + {p['B']:.3g}/D^{p['beta']:.3f}")
        fig.colorbar(sc, label="log10 N")
        written.append(_save(fig, out / f"loss_vs_compute_{safe}.png"))
        plt.close(fig)

        levels = [lv for lv in entry["isoflop"]["levels"] if lv["coeffs"]]
        if levels:
            fig, ax = plt.subplots(figsize=(6.5, 4.5))
            for k, lv in enumerate(levels):
                color = plt.cm.plasma(k / max(len(levels) - 1, 1))
                x = np.log10(N[np.isin(sub["row"].to_numpy(), lv["rows"])])
                y = L[np.isin(sub["row"].to_numpy(), lv["rows"])]
                ax.scatter(10**x, y, color=color, s=12)
                xs = np.linspace(x.min(), x.max(), 50)
                ax.plot(10**xs, np.polyval(lv["coeffs"], xs), color=color, lw=1,
                        ls="-" if lv["used"] else ":", label=f"C={lv['C']:.2g}")
                if lv["N_opt"] is not None and lv["used"]:
                    ax.plot(lv["N_opt"], lv["loss_opt"], "kx")
            ax.set(xscale="log", xlabel="N (parameters)", ylabel="loss", title=f"{name}: IsoFLOP profiles")
            ax.legend(fontsize=6, ncol=2)
            written.append(_save(fig, out / f"isoflop_{safe}.png"))
            plt.close(fig)

    # frontier.png compares the data variants (names without '+'); frontier_<variant>.png compares
    # one variant with its compressed / sparse / RePB series (<variant>+<setting>).
    fitted = [n for n, e in report["variants"].items() if e.get("compute_optimal")]
    groups = {"": [n for n in fitted if "+" not in n] or fitted}
    for base in sorted({n.split("+")[0] for n in fitted if "+" in n}):
        groups[base] = [n for n in fitted if n == base or n.startswith(base + "+")]
    for base, names in groups.items():
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for name in names:
            rows = report["variants"][name]["compute_optimal"]
            C = np.array([r["C"] for r in rows])
            y = np.array([r["loss_pred"] for r in rows], dtype=float)
            line, = ax.plot(C, y, marker="o", ms=3, label=name)
            lo = np.array([np.nan if r["loss_pred_ci_low"] is None else r["loss_pred_ci_low"] for r in rows], dtype=float)
            hi = np.array([np.nan if r["loss_pred_ci_high"] is None else r["loss_pred_ci_high"] for r in rows], dtype=float)
            if np.isfinite(lo).any():
                ax.fill_between(C, lo, hi, color=line.get_color(), alpha=0.15)
        ax.set(xscale="log", xlabel="compute C (FLOPs)", ylabel="loss at N*(C), D*(C)",
               title=f"compute-optimal frontier{': ' + base if base else ''}")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
        written.append(_save(fig, out / (f"frontier_{_file_safe(base)}.png" if base else "frontier.png")))
        plt.close(fig)
    return written
