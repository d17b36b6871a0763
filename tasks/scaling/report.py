"""Scaling-law fits of a table of runs, and the files that report them.

``fit_points`` computes (Approach 3 of Hoffmann et al. 2022 with Epoch AI's bootstrap intervals,
identification diagnostics and a backtest, IsoFLOP, compute-optimal projections under the
ladder's measured FLOPs, Holm-controlled variant comparisons); ``write_fit_report`` writes
fits.json, compute_optimal.csv and PNG plots. ``exclude_runs`` decides which training runs a
law may use.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from tasks.common.config import to_dict
from tasks.common.io import atomic_path, write_csv, write_json
from tasks.common.parallel import map_processes
from tasks.scaling.chinchilla import PARAM_NAMES, bootstrap_chinchilla, fit_chinchilla, percentile_interval
from tasks.scaling.compute_optimal import (FlopsPerToken, compare_variants, compute_optimal_table,
                                           fit_flops_per_token, optimal_allocation)
from tasks.scaling.config import FitConfig, derived_config
from tasks.scaling.diagnostics import identification, law_diagnostics
from tasks.scaling.isoflop import isoflop_minima

REQUIRED_COLUMNS = ("N", "D", "loss")
# C: a run's training FLOPs (6ND when absent); compute_budget: the ladder design's budget (null
# for grid designs), which picks the backtest's held-out level.
OPTIONAL_COLUMNS = ("C", "compute_budget")
CSV_COLUMNS = ("variant", "C", "N_opt", "D_opt", "tokens_per_param", "loss_pred")


def read_points(path: str | Path) -> pl.DataFrame:
    """Read and check a CSV of runs with columns N, D, loss (optionally variant, C, compute_budget).

    Every problem is a ``ValueError`` naming the file and the CSV line (the header is line 1):
    a missing column, a value that is not a number, NaN, zero or negative, duplicated rows, a
    variant with a single model size or a single token count.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: points file not found")
    if path.is_dir():
        raise ValueError(f"{path}: is a directory, not a points CSV")
    try:
        frame = pl.read_csv(path, infer_schema_length=None)
    except (pl.exceptions.PolarsError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a readable CSV ({exc})") from None
    validate_points(frame, source=str(path), first_line=2, single_size=False)
    return frame


def validate_points(points: pl.DataFrame, *, source: str = "points", first_line: int | None = None,
                    single_size: bool = True) -> pl.DataFrame:
    """Check columns and values; return the frame with a ``row`` index and a ``variant`` column.

    Raises ``ValueError`` starting with ``source`` and naming the missing column or the first bad
    row: ``line k`` when ``first_line`` (the line of row 0) is given, else ``row i`` (0-based).
    Refused: non-numeric, non-finite or non-positive N, D, loss (C and compute_budget may be
    empty); rows repeated exactly; with ``single_size=False``, a variant with one model size or one
    token count (its law's N or D term cannot be told apart from E). :func:`fit_points` accepts such
    a variant and reports its law as not identified; a points file given to ``scalelab fit`` is
    refused.
    """
    def at(i: int) -> str:
        return f"line {i + first_line}" if first_line is not None else f"row {i}"

    missing = [c for c in REQUIRED_COLUMNS if c not in points.columns]
    if missing:
        raise ValueError(f"{source}: missing column {missing[0]!r} (needs {', '.join(REQUIRED_COLUMNS)}; "
                         f"has {', '.join(points.columns) or 'none'})")
    if points.height == 0:
        raise ValueError(f"{source}: no rows")
    numeric = {}
    for col in (*REQUIRED_COLUMNS, *(c for c in OPTIONAL_COLUMNS if c in points.columns)):
        required = col in REQUIRED_COLUMNS
        raw = points[col]
        values = raw.cast(pl.Float64, strict=False).to_numpy().astype(float)
        unparsed = np.flatnonzero(raw.is_not_null().to_numpy() & np.isnan(values)
                                  & ~(raw.cast(pl.String).str.to_lowercase().is_in(["nan"]).fill_null(False).to_numpy()))
        if unparsed.size:
            i = int(unparsed[0])
            raise ValueError(f"{source}: {at(i)}: {col}={raw[i]!r} is not a number")
        given = ~(raw.is_null().to_numpy()) if not required else np.ones(len(values), bool)
        bad = np.flatnonzero(given & (~np.isfinite(values) | (values <= 0)))
        if bad.size:
            i = int(bad[0])
            shown = f"{col} is empty" if raw[i] is None else f"{col}={float(values[i]):g}"
            raise ValueError(f"{source}: {at(i)}: {shown}; {col} must be positive and finite"
                             f"{'' if required else ' or empty'} ({bad.size} bad row(s) in {col})")
        numeric[col] = values
    frame = points.with_row_index("row")
    if "variant" not in frame.columns:
        frame = frame.with_columns(pl.lit("all").alias("variant"))
    elif frame["variant"].null_count():
        i = int(frame.filter(pl.col("variant").is_null())["row"][0])
        raise ValueError(f"{source}: {at(i)}: no variant")
    frame = frame.with_columns(pl.col("variant").cast(pl.String),
                               *(pl.Series(c, v) for c, v in numeric.items()))
    key = [c for c in points.columns]
    dup = (frame.group_by(key, maintain_order=True).agg(pl.col("row")).filter(pl.col("row").list.len() > 1))
    if dup.height:
        rows = dup["row"][0].to_list()
        raise ValueError(f"{source}: {at(rows[0])} is repeated at {', '.join(at(r) for r in rows[1:])} "
                         f"({dup.height} duplicated row(s)); a repeated run would count twice in the fit")
    for (name,), sub in ([] if single_size else frame.group_by("variant", maintain_order=True)):
        for col, what in (("N", "model size"), ("D", "token count")):
            if sub[col].n_unique() < 2:
                lines = ", ".join(at(int(r)) for r in sub["row"].head(3))
                raise ValueError(f"{source}: variant {name!r} has a single {what} ({col}={sub[col][0]:g} at "
                                 f"{lines}{', ...' if sub.height > 3 else ''}); a law in N and D needs at "
                                 f"least two")
    return frame


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


def exclude_runs(runs: pl.DataFrame, max_epochs: float | None) -> tuple[pl.DataFrame, list[dict]]:
    """Keep the runs a law may use; return them and one ``{variant, run, reason}`` per dropped run.

    Dropped: ``diverged`` true; ``epochs > max_epochs`` (None keeps all); a missing or
    non-finite ``loss``. Columns that are absent (older reports) exclude nothing.
    """
    cols = runs.columns
    reasons = []
    if "diverged" in cols:
        reasons.append((pl.col("diverged").cast(pl.Boolean).fill_null(False), pl.lit("diverged")))
    if max_epochs is not None and "epochs" in cols:
        reasons.append((pl.col("epochs").cast(pl.Float64) > max_epochs,
                        pl.format("epochs={} > max_epochs={}", pl.col("epochs"), pl.lit(max_epochs))))
    if "loss" in cols:
        loss = pl.col("loss").cast(pl.Float64)
        reasons.append((loss.is_null() | loss.is_nan() | loss.is_infinite(), pl.lit("no finite loss")))
    if not reasons:
        return runs, []
    expr = pl.when(reasons[0][0].fill_null(False)).then(reasons[0][1])
    for cond, why in reasons[1:]:
        expr = expr.when(cond.fill_null(False)).then(why)
    tagged = runs.with_columns(expr.otherwise(None).cast(pl.String).alias("_reason"))
    dropped = tagged.filter(pl.col("_reason").is_not_null())
    excluded = [{"variant": r.get("variant"), "run": r.get("run"), "reason": r["_reason"]}
                for r in dropped.select([c for c in ("variant", "run", "_reason") if c in tagged.columns]).to_dicts()]
    return tagged.filter(pl.col("_reason").is_null()).drop("_reason"), excluded


def law_pairs(names: Sequence[str]) -> list[tuple[str, str]]:
    """The comparisons worth making: every pair of data variants (names without '+'), then each
    data variant with its own ``<variant>+<setting>`` series (compressed, sparse, RePB) — not
    every compressed series with every other variant's, which would only dilute the Holm family.
    Without any '+'-free name, every pair."""
    names = sorted(names)
    base = [n for n in names if "+" not in n]
    if not base:
        return [(x, y) for i, x in enumerate(names) for y in names[i + 1:]]
    pairs = [(x, y) for i, x in enumerate(base) for y in base[i + 1:]]
    pairs += [(b, n) for b in base for n in names if n.startswith(b + "+")]
    return pairs


def _fit_law(N: np.ndarray, D: np.ndarray, L: np.ndarray, C: np.ndarray, budget: np.ndarray | None, cfg: FitConfig):
    fit = fit_chinchilla(N, D, L, cfg)
    boot = bootstrap_chinchilla(N, D, L, cfg, fit=fit)
    return fit, boot, law_diagnostics(N, D, L, C, budget, fit, boot, cfg)


def fit_series(series: dict[str, tuple], cfg: FitConfig, configs: Mapping[str, FitConfig] | None = None) -> dict:
    """``{name: (ChinchillaFit, BootstrapResult, diagnostics)}`` for each
    ``name: (N, D, loss, C, compute_budget or None)``.

    With several series and ``cfg.n_jobs > 1`` the series are spread over one pool of
    ``n_jobs`` processes (each bootstrapping in its own process), rather than each bootstrap
    starting a pool of its own: a pipeline fits a law per variant and per compression and
    sparsity setting, and a pool per law cost more in start-up than the small ladders' fits.
    Results do not depend on ``n_jobs`` (replicate i draws from ``(cfg.bootstrap_seed, i)``).
    ``configs``: a config per series name where it differs from ``cfg`` (same ``n_jobs``).
    """
    configs = configs or {}
    many = cfg.n_jobs > 1 and len(series) > 1  # a lone series keeps n_jobs for its own bootstrap
    jobs = {name: (*arrays, dataclasses.replace(configs.get(name, cfg), n_jobs=1) if many else configs.get(name, cfg))
            for name, arrays in series.items()}
    return map_processes(_fit_law, jobs, cfg.n_jobs)


def _law_compute(sub: pl.DataFrame) -> tuple[np.ndarray, FlopsPerToken, list[str]]:
    """Each run's compute and the FLOPs-per-token law: measured ``C`` when every run has it, else 6ND."""
    N, D = sub["N"].to_numpy(), sub["D"].to_numpy()
    if "C" in sub.columns:
        C = sub["C"].to_numpy()
        if np.isfinite(C).all():
            return C, fit_flops_per_token(N, D, C), []
        if np.isfinite(C).any():
            return 6.0 * N * D, FlopsPerToken(), [f"{int((~np.isfinite(C)).sum())} of {len(C)} runs have no "
                                                  "measured FLOPs (C); the law uses C = 6ND for all of them"]
    return 6.0 * N * D, FlopsPerToken(), []


def _interval(boot, name: str) -> tuple[float | None, float | None]:
    return boot.intervals[name] if boot.n_requested else (None, None)


def fit_points(points: pl.DataFrame, cfg: FitConfig, *, excluded_runs: Sequence[dict] = ()) -> dict:
    """Fit every variant of ``points`` (columns N, D, loss[, variant, C, compute_budget]) and
    compare the identified ones.

    Returns the fits.json content: ``{"config", "n_definition", "excluded_runs", "variants":
    {name: {E, A, B, alpha, beta: {value, ci_low, ci_high}, n_points, residual, excluded,
    warnings, compute, bootstrap, diagnostics, identified, identification_reasons, isoflop,
    compute_optimal, frontier}}, "comparisons": [...], "comparisons_skipped": [...],
    "multiple_testing": {...}}``. Row numbers in ``excluded`` and the diagnostics index
    ``points``; ``excluded_runs`` (runs dropped before fitting, from :func:`exclude_runs`) are
    recorded as given.
    """
    frame = validate_points(points)
    variants: dict[str, dict] = {}
    series, meta = {}, {}
    for name in sorted(frame["variant"].unique().to_list()):
        sub = frame.filter(pl.col("variant") == name)
        C, flops, c_warn = _law_compute(sub)
        budget = sub["compute_budget"].to_numpy() if "compute_budget" in sub.columns else None
        series[name] = (*(sub[c].to_numpy() for c in REQUIRED_COLUMNS), C, budget)
        meta[name] = (sub["row"].to_numpy(), flops, c_warn, "C" in sub.columns and not c_warn)
    derived = set(frame.filter(pl.col("series") != "trained")["variant"].to_list()) if "series" in frame.columns else set()
    fitted = fit_series({k: v for k, v in series.items() if len(v[0]) >= 5}, cfg,
                        {k: derived_config(cfg) for k in derived})
    boots, flops_by, ranges, identified = {}, {}, {}, {}
    for name, (N, D, L, C, budget) in series.items():
        rows, flops, c_warn, measured = meta[name]
        if name not in fitted:
            variants[name] = {"n_points": len(N), "identified": False,
                              "identification_reasons": [f"too few points: {len(N)} (< 5, the parameters of Approach 3)"],
                              "warnings": [f"only {len(N)} points; Approach 3 has 5 parameters and is not fitted"]}
            continue
        fit, boot, diag = fitted[name]
        keep = np.ones(len(N), dtype=bool)
        keep[[e["row"] for e in fit.excluded]] = False
        measured_range = (float(C[keep].min()), float(C[keep].max()))
        boots[name], flops_by[name], ranges[name] = boot, flops, measured_range
        entry: dict[str, Any] = {}
        for p in PARAM_NAMES:
            lo, hi = _interval(boot, p)
            entry[p] = {"value": getattr(fit, p), "ci_low": lo, "ci_high": hi}
        entry["allocation_exponents"] = {
            k: {"value": v, "ci_low": _interval(boot, k)[0], "ci_high": _interval(boot, k)[1]}
            for k, v in (("a_exp", fit.beta / (fit.alpha + fit.beta)), ("b_exp", fit.alpha / (fit.alpha + fit.beta)))
        }
        entry["n_points"] = fit.n_points
        entry["n_distinct_N"] = int(len(np.unique(N[keep])))
        entry["n_decades_N"] = fit.n_decades_n
        entry["residual"] = {"huber_objective": fit.objective, "rmse_log_loss": fit.rmse_log}
        entry["excluded"] = [e | {"row": int(rows[e["row"]])} for e in fit.excluded]
        entry["exclusion_rule"] = (f"the {cfg.exclude_top_loss} highest-loss runs of the variant are excluded"
                                   if cfg.exclude_top_loss else "no runs excluded (exclude_top_loss=0)")
        entry["compute"] = {"definition": "flops_total (measured training FLOPs)" if measured else "6ND",
                            "flops_per_token": flops.to_dict(), "measured_range": list(measured_range)}
        entry["bootstrap"] = {"n_requested": boot.n_requested, "n_ok": boot.n_ok, "n_failed": boot.n_failed,
                              "n_redrawn": boot.n_redrawn, "n_basin_switch": boot.n_basin_switch,
                              "n_run_keys": int(len(boot.keys)), "confidence": boot.confidence,
                              "unit": "distinct (N, D) run", "starts_per_replicate": {
                                  "point_and_spread_corners": 1 if cfg.bootstrap_start_spread == 0 else 5,
                                  "best_grid_points": min(cfg.bootstrap_n_starts, cfg.grid_size)}}
        diag = _rows_to_points(diag, rows)
        ok, reasons = identification(fit, boot, diag, N[keep], cfg)
        identified[name] = (ok, reasons)
        entry["identified"], entry["identification_reasons"] = ok, reasons
        entry["diagnostics"] = {k: v for k, v in diag.items() if k != "warnings"}
        entry["warnings"] = fit.warnings + boot.warnings + c_warn + diag["warnings"]
        iso = isoflop_minima(N[keep], D[keep], L[keep], log10_tolerance=cfg.isoflop_log10_tolerance,
                             min_points=cfg.isoflop_min_points, compute=C[keep], flops_k=flops.k,
                             flops_gamma=flops.gamma)
        iso_dict = iso.to_dict()
        for lv in iso_dict["levels"]:  # rows of the kept subset -> rows of `points`
            lv["rows"] = [int(rows[keep][r]) for r in lv["rows"]]
        entry["isoflop"] = iso_dict
        entry["compute_optimal"] = compute_optimal_table(fit, cfg.compute_budgets, boot if boot.n_requested else None,
                                                         flops=flops, measured_range=measured_range)
        entry["frontier"] = _frontier(fit, boot, flops, measured_range)
        variants[name] = entry
    pairs = law_pairs(list(boots))
    tested, skipped = [], []
    for x, y in pairs:
        why = [f"{v} is not identified: " + "; ".join(identified[v][1]) for v in (x, y) if not identified[v][0]]
        (skipped.append({"x": x, "y": y, "reason": " | ".join(why)}) if why else tested.append((x, y)))
    result = compare_variants(boots, cfg.compute_budgets, confidence=cfg.reversal_confidence, pairs=tested,
                              flops=flops_by, measured_range=ranges)
    return _finite({"config": to_dict(cfg), "n_definition": cfg.n_definition, "excluded_runs": list(excluded_runs),
                    "variants": variants, "comparisons": result["comparisons"], "comparisons_skipped": skipped,
                    "multiple_testing": result["multiple_testing"]})


def _rows_to_points(diag: dict, rows: np.ndarray) -> dict:
    """Diagnostics' row indices (into a variant's arrays) -> rows of ``points``."""
    bt = dict(diag["backtest"])
    bt["held_out_rows"] = [int(rows[i]) for i in bt["held_out_rows"]]
    if "points" in bt:
        bt["points"] = [p | {"row": int(rows[p["row"]])} for p in bt["points"]]
    return diag | {"backtest": bt}


def _frontier(fit, boot, flops: FlopsPerToken, measured_range: tuple[float, float], n: int = 40) -> dict:
    """The compute-optimal loss over the measured compute range, with its bootstrap band (for plots)."""
    C = np.geomspace(*measured_range, n) if measured_range[1] > measured_range[0] else np.array(measured_range[:1])
    point = optimal_allocation(fit.E, fit.A, fit.B, fit.alpha, fit.beta, C, flops_k=flops.k,
                               flops_gamma=flops.gamma)["loss_pred"]
    lo = hi = [None] * len(C)
    if boot.n_ok:
        cols = [boot.samples[:, k:k + 1] for k in range(5)]
        s = optimal_allocation(*cols, C[None, :], flops_k=flops.k, flops_gamma=flops.gamma)["loss_pred"]
        lo, hi = zip(*(percentile_interval(s[:, j], boot.confidence) for j in range(len(C))))
    return {"C": C.tolist(), "loss_pred": point.tolist(), "ci_low": list(lo), "ci_high": list(hi)}


# --------------------------------------------------------------------------- writing


def compute_optimal_frame(report: dict) -> pl.DataFrame:
    """The compute_optimal rows of every variant as one table (CSV_COLUMNS plus ci columns and
    ``inside_measured_range``); C is the law's own compute definition (measured FLOPs or 6ND)."""
    cols = ["variant", "C"]
    for name in CSV_COLUMNS[2:]:
        cols += [name, f"{name}_ci_low", f"{name}_ci_high"]
    cols.append("inside_measured_range")
    records = [{"variant": v, **row} for v, entry in report["variants"].items()
               for row in entry.get("compute_optimal", [])]
    schema = {c: (pl.String if c == "variant" else pl.Boolean if c == "inside_measured_range" else pl.Float64)
              for c in cols}
    return pl.DataFrame(records, schema=schema).select(cols)


def file_safe(name: str) -> str:
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
    intervals), ``frontier_<variant>.png`` (that variant beside its ``<variant>+<setting>`` series)
    and ``compare_<x>__<y>.png`` per compared pair (both frontiers with bands over their runs).
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
        safe = file_safe(name)
        sub = frame.filter(pl.col("variant") == name)
        N, D, L = (sub[c].to_numpy() for c in REQUIRED_COLUMNS)
        p = {k: entry[k]["value"] for k in PARAM_NAMES}
        fpt = entry["compute"]["flops_per_token"]
        flops = FlopsPerToken(k=fpt["k"], gamma=fpt["gamma"])
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        sc = ax.scatter(_run_compute(sub), L, c=np.log10(N), cmap="viridis", s=14)
        d_grid = np.geomspace(D.min() / 2, D.max() * 2, 100)
        for n in np.unique(N)[:: max(1, len(np.unique(N)) // 8)]:
            pred = p["E"] + p["A"] / n ** p["alpha"] + p["B"] / d_grid ** p["beta"]
            ax.plot(flops(n) * d_grid, pred, color=plt.cm.viridis(
                (np.log10(n) - np.log10(N.min())) / max(np.log10(N.max() / max(N.min(), 1e-300)), 1e-9)), lw=0.8)
        ax.set(xscale="log", xlabel=f"compute C ({entry['compute']['definition']}, FLOPs)", ylabel="loss",
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
        written.append(_save(fig, out / (f"frontier_{file_safe(base)}.png" if base else "frontier.png")))
        plt.close(fig)

    # compare_<x>__<y>.png: the compared pairs (law_pairs among identified laws): both frontiers
    # with their bands over the measured runs.
    for cmp in report.get("comparisons", []):
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for name in (cmp["x"], cmp["y"]):
            entry = report["variants"][name]
            sub = frame.filter(pl.col("variant") == name)
            fr = entry["frontier"]
            C = np.array(fr["C"], dtype=float)
            line, = ax.plot(C, fr["loss_pred"], label=f"{name} frontier L*(C)")
            lo = np.array([np.nan if v is None else v for v in fr["ci_low"]], dtype=float)
            hi = np.array([np.nan if v is None else v for v in fr["ci_high"]], dtype=float)
            if np.isfinite(lo).any():
                ax.fill_between(C, lo, hi, color=line.get_color(), alpha=0.2)
            ax.scatter(_run_compute(sub), sub["loss"].to_numpy(), color=line.get_color(), s=10, alpha=0.6,
                       label=f"{name} runs")
        called = [f"{c:.2g}: {b}" for c, b, ins in zip(cmp["compute"], cmp["better"], cmp["inside_measured_range"])
                  if ins and b]
        ax.set(xscale="log", xlabel="compute C (FLOPs)", ylabel="loss",
               title=f"{cmp['x']} vs {cmp['y']} ({cmp['pairing']})"
                     + (f"\nHolm-significant: {', '.join(called)}" if called else "\nno Holm-significant difference"))
        ax.legend(fontsize=7)
        written.append(_save(fig, out / f"compare_{file_safe(cmp['x'])}__{file_safe(cmp['y'])}.png"))
        plt.close(fig)
    return written


def _run_compute(sub: pl.DataFrame) -> np.ndarray:
    """Each run's compute as its law used it: measured C when every run has one, else 6ND."""
    if "C" in sub.columns and np.isfinite(sub["C"].to_numpy()).all():
        return sub["C"].to_numpy()
    return 6.0 * sub["N"].to_numpy() * sub["D"].to_numpy()


def write_decision_plots(rows: Sequence[dict], plots_dir: str | Path) -> list[Path]:
    """``decisions_<series>.png`` per compared series: Delta against its reference on the whole
    validation split, observed (each budget's best runs, document-bootstrap interval) and projected
    (joint fit, run-bootstrap interval), against compute; below zero the series is better."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(plots_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    whole = [r for r in rows if r.get("target") == "val" and r.get("comparison") in ("best", "compute_optimal")]
    for name in sorted({r["variant"] for r in whole}):
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for kind, marker, color in (("observed", "o", "tab:blue"), ("projected", "s", "tab:orange")):
            sub = sorted((r for r in whole if r["variant"] == name and r["kind"] == kind), key=lambda r: r["budget"])
            if not sub:
                continue
            x = np.array([r["budget"] for r in sub], dtype=float)
            y = np.array([r["delta"] for r in sub], dtype=float)
            lo = np.array([r["ci_low"] for r in sub], dtype=float)
            hi = np.array([r["ci_high"] for r in sub], dtype=float)
            unit = sub[0].get("budget_kind", "flops")
            ax.plot(x, y, marker=marker, color=color, label=f"{kind} ({'tokens' if unit == 'tokens' else 'FLOPs'})")
            ax.fill_between(x, lo, hi, color=color, alpha=0.2)
        ax.axhline(0.0, color="k", lw=0.8)
        ref = whole[0]["reference"]
        ax.set(xscale="log", xlabel="budget", ylabel=f"Delta loss vs {ref} (nats; < 0: better)",
               title=f"{name} vs {ref}: paired difference on the validation split, 95% bands")
        ax.legend(fontsize=7)
        written.append(_save(fig, out / f"decisions_{file_safe(name)}.png"))
        plt.close(fig)
    return written
