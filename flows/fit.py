"""Stage 5, fit: Chinchilla L(N, D) per variant (and per compression/sparsity setting).

Run: ``scalelab run fit [--preset ci]`` (reads reports/{train,compress,sparse_eval}.csv).
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
from prefect import flow

from flows.stage import stage_context, stage_run
from tasks.scaling.config import FitConfig
from tasks.scaling.report import fit_points, write_fit_report


def gather_points(reports: Path) -> pl.DataFrame:
    """Every measured (N, D, loss) as one frame with a ``variant`` label per law to fit.

    Trained models are labelled by their data variant; compressed and sparse evaluations by
    ``<variant>+<setting>`` (e.g. ``raw+rtn_w4_g32``, ``raw+teal@0.5``) so each gets its own law.
    """
    frames = []
    train = reports / "train.csv"
    if not train.exists():
        raise FileNotFoundError(f"{train}: no training results to fit; run `scalelab run train` first")
    t = pl.read_csv(train)
    frames.append(t.select(pl.col("variant"), pl.col("n_params").alias("N"), pl.col("tokens").alias("D"), pl.col("val_loss").alias("loss")))
    for name in ("compress", "sparse_eval"):
        path = reports / f"{name}.csv"
        if path.exists() and path.stat().st_size > 0:
            c = pl.read_csv(path)
            if c.height:
                frames.append(
                    c.select(
                        (pl.col("variant") + "+" + pl.col("setting")).alias("variant"),
                        pl.col("n_params").alias("N"),
                        pl.col("tokens").alias("D"),
                        pl.col("val_loss").alias("loss"),
                    )
                )
    return pl.concat(frames, how="vertical_relaxed").with_columns(
        pl.col("N").cast(pl.Float64), pl.col("D").cast(pl.Float64), pl.col("loss").cast(pl.Float64)
    )


@flow(name="fit", log_prints=True)
def fit_flow(
    root: str = ".",
    preset: str | None = None,
    workdir: str | None = None,
    runner: str | None = None,
    parent_run_id: str | None = None,
) -> dict:
    ctx = stage_context(root, preset, workdir, runner, parent_run_id)
    cfg = ctx.config(FitConfig, "fit")
    with stage_run(ctx, "fit", cfg) as run:
        points = gather_points(ctx.layout.reports)
        report = fit_points(points, cfg)
        paths = write_fit_report(report, points, ctx.layout.reports, plots_dir=ctx.layout.plots)
        for p in paths:
            run.log_artifact(p, "plots" if p.suffix == ".png" else "reports")
        for variant, fit in report.get("variants", {}).items():
            if not isinstance(fit, dict) or "alpha" not in fit:
                continue
            with stage_run(ctx.with_parent(run.ref()), "fit", run_name=f"fit:{variant}", variant=variant,
                           method="chinchilla_approach3") as child:
                child.log_metrics(
                    {k: fit[k]["value"] for k in ("E", "A", "B", "alpha", "beta") if isinstance(fit.get(k), dict)}
                    | {f"{k}_ci_low": fit[k]["ci_low"] for k in ("alpha", "beta") if isinstance(fit.get(k), dict)}
                    | {f"{k}_ci_high": fit[k]["ci_high"] for k in ("alpha", "beta") if isinstance(fit.get(k), dict)}
                    | {"n_points": fit.get("n_points")}
                )
        print(f"fit: {len(report.get('variants', {}))} laws -> {ctx.layout.reports / 'fits.json'}")
        return report
