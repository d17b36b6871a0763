"""Stage 5, fit: Chinchilla L(N, D) per variant (and per compression/sparsity setting).

Run: ``scalelab run fit [--preset ci]`` (reads reports/{train,compress,sparse_eval}.csv).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
from prefect import flow

from flows.artifacts import law_table, publish_table
from flows.feasibility import left_out
from flows.report_data import PRETRAINED
from flows.stage import finished, stage_context, stage_run, write_table
from tasks.common.io import write_csv
from tasks.common.lineage import data_ref, log_datasets
from tasks.scaling.compute_optimal import fit_flops_per_token
from tasks.scaling.config import FitConfig
from tasks.scaling.decisions import DOC_COLUMNS, decision_report
from tasks.scaling.report import exclude_runs, fit_points, write_decision_plots, write_fit_report

# N by params' n_definition, from train.csv; reports written before these columns existed have
# only n_params (non-embedding), which is used instead and named in fits.json.
N_COLUMNS = {"total": "n_params_total", "non_embedding": "n_params_nonembed"}
# train.csv columns carried to every law's points (when present)
RUN_COLUMNS = ("run", "C", "epochs", "diverged", "compute_budget")


@dataclass
class GatheredPoints:
    """The runs to fit (columns variant, N, D, loss[, run, C, compute_budget]), the runs left out
    with their reason, and the train.csv column N was read from."""

    points: pl.DataFrame
    excluded_runs: list[dict] = field(default_factory=list)
    n_column: str = "n_params"


def _train_runs(t: pl.DataFrame, n_definition: str) -> tuple[pl.DataFrame, str]:
    n_column = N_COLUMNS[n_definition] if N_COLUMNS[n_definition] in t.columns else "n_params"
    cols = [pl.col("variant").cast(pl.String), pl.col(n_column).cast(pl.Float64).alias("N"),
            pl.col("tokens").cast(pl.Float64).alias("D"), pl.col("val_loss").cast(pl.Float64).alias("loss")]
    if "run" in t.columns:
        cols.append(pl.col("run").cast(pl.String))
    if "flops_total" in t.columns:
        cols.append(pl.col("flops_total").cast(pl.Float64).alias("C"))
    if "epochs" in t.columns:
        cols.append(pl.col("epochs").cast(pl.Float64))
    if "diverged" in t.columns:
        d = pl.col("diverged")
        cols.append((d.cast(pl.String).str.to_lowercase().is_in(["true", "1"]) if t.schema["diverged"] != pl.Boolean
                     else d).alias("diverged"))
    if "compute_budget" in t.columns:
        cols.append(pl.col("compute_budget").cast(pl.Float64))
    if "point" in t.columns:
        cols.append(pl.col("point").cast(pl.String))
    return t.select(cols), n_column


def gather_points(reports: Path, cfg: FitConfig = FitConfig()) -> GatheredPoints:
    """Every measured (N, D, loss) as one frame with a ``variant`` label per law to fit.

    Trained models are labelled by their data variant; compressed and sparse evaluations by
    ``<variant>+<setting>`` (e.g. ``raw+rtn_w4_g32``, ``raw+teal@0.5``) so each gets its own law.
    Those evaluations are joined to train.csv on (variant, run) for the trained model's N, C,
    epochs, divergence and compute budget (their own n_params / tokens where no run matches).
    A ``series`` column says where each row came from (``trained``, ``compress``, ``sparse_eval``):
    the derived ones are fitted with ``fit.derived_n_bootstrap`` replicates.
    Rows of pretrained models (variant ``pretrained``: SmolLM2) have no training budget and are left out.
    Runs that diverged, ran over ``cfg.max_epochs`` epochs or have no loss are left out and
    listed with their reason (:func:`tasks.scaling.report.exclude_runs`).
    """
    train = reports / "train.csv"
    if not train.exists():
        raise FileNotFoundError(f"{train}: no training results to fit; run `scalelab run train` first")
    runs, n_column = _train_runs(finished(pl.read_csv(train)), cfg.n_definition)
    frames = [runs.with_columns(pl.lit("trained").alias("series"))]
    for name in ("compress", "sparse_eval"):
        path = reports / f"{name}.csv"
        if not (path.exists() and path.stat().st_size > 0):
            continue
        # a pretrained model's rows (SmolLM2, variant "pretrained") are no point of a ladder's law
        c = finished(pl.read_csv(path)).filter(pl.col("variant").cast(pl.String) != PRETRAINED)
        if not c.height:
            continue
        own = c.select(pl.col("variant").cast(pl.String), pl.col("setting").cast(pl.String),
                       *([pl.col("run").cast(pl.String)] if "run" in c.columns else []),
                       pl.col("n_params").cast(pl.Float64).alias("N_own"),
                       pl.col("tokens").cast(pl.Float64).alias("D_own"),
                       pl.col("val_loss").cast(pl.Float64).alias("loss"))
        if "run" in own.columns and "run" in runs.columns:
            own = own.join(runs.drop("loss"), on=["variant", "run"], how="left")
        else:
            own = own.with_columns(pl.lit(None, pl.Float64).alias("N"), pl.lit(None, pl.Float64).alias("D"))
        frames.append(own.with_columns(
            (pl.col("variant") + "+" + pl.col("setting")).alias("variant"),
            pl.coalesce("N", "N_own").alias("N"), pl.coalesce("D", "D_own").alias("D"),
            pl.lit(name).alias("series"),
        ).drop("setting", "N_own", "D_own"))
    points = pl.concat(frames, how="diagonal_relaxed")
    kept, excluded = exclude_runs(points, cfg.max_epochs)
    keep_cols = ["variant", "N", "D", "loss",
                 *(c for c in ("run", "C", "compute_budget", "point", "series") if c in kept.columns)]
    return GatheredPoints(points=kept.select(keep_cols), excluded_runs=excluded, n_column=n_column)


# The columns of reports/decisions.csv, in order (docs/decisions.md, "Reading the output").
DECISION_COLUMNS = ("variant", "reference", "target", "kind", "comparison", "budget", "budget_kind", "run",
                    "reference_run", "delta", "ci_low", "ci_high", "p_value", "p_holm", "decision", "n_docs",
                    "n_seeds", "sigma_doc", "sigma_seed", "repeats_data", "D_opt_variant", "D_opt_reference",
                    "n_replicates")


def downstream_items(reports: Path) -> pl.DataFrame | None:
    """Per-item gold-answer bits per byte of the trained (uncompressed, unpruned) ladder models, from
    the evaluate stage's ``downstream/items.parquet``: columns variant, run, item, bpb (None when
    absent)."""
    path = reports / "downstream" / "items.parquet"
    if not path.exists():
        return None
    items = pl.read_parquet(path, columns=["model", "family", "method", "task", "doc_id", "bpb"])
    items = items.filter((pl.col("family") == "ladder") & (pl.col("method") == "none")
                         & ~pl.col("model").str.contains(":", literal=True))
    return items.select(pl.col("model").str.split("/").list.get(0).alias("variant"),
                        pl.col("model").str.split("/").list.get(1).alias("run"),
                        pl.concat_str([pl.col("task"), pl.col("doc_id").cast(pl.String)], separator=":").alias("item"),
                        pl.col("bpb").cast(pl.Float64))


def decision_metrics(rows: list[dict], decisions: dict) -> dict[str, float]:
    """MLflow metrics of the fit run: per compared series, Delta on the whole split at the largest
    budget (observed, best run per budget) and at each projected budget, with interval ends."""
    out: dict[str, float] = {}
    observed = [r for r in rows if r["kind"] == "observed" and r["comparison"] == "best" and r["target"] == "val"]
    top = max((r["budget"] for r in observed), default=None)
    for r in rows:
        name = r["variant"].replace("+", "_")  # MLflow metric names allow no '+' (raw+repb)
        if r["kind"] == "observed" and r in observed and r["budget"] == top:
            key = f"delta.{name}.observed"
        elif r["kind"] == "projected":
            key = f"delta.{name}.projected_{r['budget']:.0e}".replace("+", "")
        else:
            continue
        out |= {key: r["delta"], f"{key}.ci_low": r["ci_low"], f"{key}.ci_high": r["ci_high"]}
    sigma = (decisions.get("sigma_seed") or {}).get("value")
    if sigma is not None:
        out["sigma_seed"] = sigma
    return {k: float(v) for k, v in out.items() if v is not None}


def run_decisions(reports: Path, points: pl.DataFrame, cfg: FitConfig) -> dict:
    """The decisions of :func:`tasks.scaling.decisions.decision_report` on this workdir's reports:
    per-document losses from ``val_docs.parquet`` (every seed), unique tokens per series from
    train.csv, downstream bits per byte from the evaluate stage's items. A reference or compared
    series the train stage's feasibility check left untrained is absent: said in ``skipped``."""
    dcfg, absent = cfg.decisions, left_out(reports, "fit")
    if dcfg.reference in absent or (dcfg.compared and all(v in absent for v in dcfg.compared)):
        # what the decisions compare was left untrained by the feasibility check: absent, not an error
        gone = [v for v in (dcfg.reference, *dcfg.compared) if v in absent]
        return {"reference": dcfg.reference, "compared": [], "confidence": dcfg.confidence, "rows": [],
                "skipped": [f"{v} was not trained ({absent[v]}): no comparison" for v in gone]}
    dcfg = dataclasses.replace(dcfg, compared=tuple(v for v in dcfg.compared if v not in absent))
    docs_path = reports / "val_docs.parquet"
    docs = None
    if docs_path.exists():
        docs = pl.read_parquet(docs_path)
        missing = [c for c in DOC_COLUMNS if c not in docs.columns]
        if missing:
            raise ValueError(f"{docs_path}: missing column {missing[0]!r} (need {', '.join(DOC_COLUMNS)})")
        docs = docs.select(DOC_COLUMNS)
    train = pl.read_csv(reports / "train.csv")
    unique = {}
    if "train_tokens_available" in train.columns:
        unique = {r["variant"]: float(r["t"]) for r in train.group_by("variant").agg(
            pl.col("train_tokens_available").max().alias("t")).iter_rows(named=True)}
    trained = points.filter(pl.col("series") == "trained") if "series" in points.columns else points
    ref = trained.filter(pl.col("variant") == cfg.decisions.reference)
    source = ref if ref.height else trained
    flops = fit_flops_per_token(source["N"].to_numpy(), source["D"].to_numpy(),
                                source["C"].to_numpy() if "C" in source.columns else 6 * source["N"] * source["D"])
    out = decision_report(points, docs, dcfg, flops=flops, unique_tokens=unique, downstream=downstream_items(reports))
    out["skipped"] += [f"{v} was not trained ({absent[v]}): no comparison" for v in cfg.decisions.compared if v in absent]
    return out


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
        gathered = gather_points(ctx.layout.reports, cfg)
        log_datasets(run, [data_ref(ctx.workdir, ctx.layout.reports / f"{n}.csv", n) for n in ("train", "compress", "sparse_eval")
                           if (ctx.layout.reports / f"{n}.csv").exists()], "training")
        report = fit_points(gathered.points, cfg, excluded_runs=gathered.excluded_runs)
        report["n_column"] = gathered.n_column
        decisions = run_decisions(ctx.layout.reports, gathered.points, cfg)
        rows = decisions.pop("rows")
        report["decisions"] = decisions
        table = [{c: r.get(c) for c in DECISION_COLUMNS} for r in rows]
        if table:
            write_table(ctx, "decisions", table, run)
        else:  # the header alone, so readers find the columns
            write_csv(ctx.layout.reports / "decisions.csv", pl.DataFrame(schema=dict.fromkeys(DECISION_COLUMNS, pl.String)))
        paths = write_fit_report(report, gathered.points, ctx.layout.reports, plots_dir=ctx.layout.plots)
        paths += write_decision_plots(rows, ctx.layout.plots)
        for p in paths:
            run.log_artifact(p, "plots" if p.suffix == ".png" else "reports")
        run.log_metrics({"n_excluded_runs": len(gathered.excluded_runs),
                         "n_identified_laws": sum(bool(v.get("identified")) for v in report["variants"].values())}
                        | decision_metrics(rows, decisions))
        for variant, fit in report.get("variants", {}).items():
            if not isinstance(fit, dict) or "alpha" not in fit:
                continue
            with stage_run(ctx.with_parent(run.ref()), "fit", run_name=f"fit:{variant}", variant=variant,
                           method="chinchilla_approach3") as child:
                child.log_metrics(
                    {k: fit[k]["value"] for k in ("E", "A", "B", "alpha", "beta") if isinstance(fit.get(k), dict)}
                    | {f"{k}_ci_low": fit[k]["ci_low"] for k in ("alpha", "beta") if isinstance(fit.get(k), dict)}
                    | {f"{k}_ci_high": fit[k]["ci_high"] for k in ("alpha", "beta") if isinstance(fit.get(k), dict)}
                    | {"n_points": fit.get("n_points"), "identified": float(bool(fit.get("identified")))}
                )
        publish_table(run, "fit", ctx.preset, law_table(report),
                      "Scaling laws L(N, D) = E + A/N^alpha + B/D^beta with bootstrap intervals",
                      "A law is *identified* only if its intervals are narrow enough, |rho(alpha, beta)| is small "
                      "and its backtest is close (docs/fit.md); every reason is in reports/fits.json.")
        decided = sum(r["decision"] != "undecided" for r in rows)
        print(f"fit: {len(report.get('variants', {}))} laws, {len(gathered.excluded_runs)} runs excluded; "
              f"{len(rows)} paired comparisons against {decisions['reference']!r}, {decided} decided "
              f"-> {ctx.layout.reports / 'fits.json'}, {ctx.layout.reports / 'decisions.csv'}")
        return report
