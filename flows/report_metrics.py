"""DVC's headline metrics: each stage's numbers, one small JSON per variant or setting under
``reports/metrics/<stage>/``. ``dvc metrics show`` prints one row per file and one column per key, so
rows sharing keys keep its lines short however many variants a preset trains."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import polars as pl

from flows.report_data import LAW_PARAMS, Reports, best_runs, load_reports, trained_series
from flows.report_sections import compression_table
from tasks.common.io import atomic_dir, write_json


def _num(x: Any) -> float | int | bool | None:
    if isinstance(x, bool) or x is None:
        return x
    if isinstance(x, int):
        return x
    x = float(x)
    return x if math.isfinite(x) else None


def _drop_none(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


# Stages with a headline folder reports/metrics/<stage>/ (prepare's prepare.json is already small).
HEADLINE_STAGES = ("curate", "train", "compress", "sparse_eval", "evaluate", "fit")


def stage_metrics(stage: str, reports: Reports) -> dict[str, dict[str, Any]]:
    """``{row name: {key: number}}``: the stage's headline numbers, one row per variant, setting or task.

    Rows of a stage share their keys (and keys recur across stages: ``models``, ``delta_val_loss``,
    ``best_val_loss``), so ``dvc metrics show`` stays as wide as the union of keys. Missing values
    are left out, never 0; a stage whose report is missing or empty gives ``{}``. Raises
    ``ValueError`` for a stage not in :data:`HEADLINE_STAGES`.
    """
    if stage not in HEADLINE_STAGES:
        raise ValueError(f"stage {stage!r}: no headline metrics (stages with them: {', '.join(HEADLINE_STAGES)})")
    if stage == "curate" and "curation.csv" in reports.tables:
        return {r["variant"]: _drop_none({"docs_kept": _num(r["docs_kept"]), "docs_in": _num(r["docs_in"]),
                                          "tokens_kept": _num(r["tokens_kept"]),
                                          "val_decontaminated": _num(r.get("val_decontaminated"))})
                for r in reports.tables["curation.csv"].iter_rows(named=True)}
    if stage == "train" and "train.csv" in reports.tables:
        train = reports.tables["train.csv"]
        best = best_runs(train) if train.height else {}
        out = {}
        for (v,), g in (train.group_by("variant", maintain_order=True) if train.height else []):
            diverged = (g["diverged"].cast(pl.String).str.to_lowercase().is_in(["true", "1"]).sum()
                        if "diverged" in g.columns else None)
            out[v] = _drop_none({"runs": g.height, "diverged": None if diverged is None else int(diverged),
                                 "best_val_loss": _num(best.get(v, {}).get("val_loss")),
                                 "flops": _num(g["flops_total"].cast(pl.Float64).sum()) if "flops_total" in g.columns else None})
        return out
    if stage == "compress" and "compress.csv" in reports.tables and reports.tables["compress.csv"].height:
        t = compression_table(reports.tables["compress.csv"])
        return {(r["setting"] if r["group"] == "ladder" else f"{r['group']}_{r['setting']}"):
                _drop_none({"models": r["models"], "bits_per_weight": _num(r["bits_per_weight"]),
                            "delta_val_loss": _num(r["delta_median"])}) for r in t.iter_rows(named=True)}
    if stage == "sparse_eval" and "sparse_eval.csv" in reports.tables and reports.tables["sparse_eval.csv"].height:
        f = reports.tables["sparse_eval.csv"]
        t = (f.group_by("setting", maintain_order=True)
             .agg(pl.len().alias("models"), pl.col("achieved_sparsity").cast(pl.Float64).median().alias("a"),
                  pl.col("delta_val_loss").cast(pl.Float64).median().alias("d")))
        return {r["setting"]: _drop_none({"models": r["models"], "achieved_sparsity": _num(r["a"]),
                                          "delta_val_loss": _num(r["d"])}) for r in t.iter_rows(named=True)}
    if stage == "evaluate" and "downstream.csv" in reports.tables and reports.tables["downstream.csv"].height:
        d = reports.tables["downstream.csv"]
        base = d.filter(pl.col("method").cast(pl.String) == "none")
        if "family" in base.columns:
            base = base.filter(pl.col("family") == "ladder")
        out = {}
        for (task,), g in d.group_by("task", maintain_order=True):
            b = base.filter(pl.col("task") == task)
            out[task] = _drop_none({"models": g["model"].n_unique(),
                                    "best_acc": _num(b["acc"].cast(pl.Float64).max()) if b.height else None,
                                    "chance": _num(g["chance"][0]) if "chance" in g.columns else None})
        return out
    if stage == "fit" and "fits.json" in reports.json:
        fits = reports.json["fits.json"]["variants"]
        best = best_runs(reports.tables["train.csv"]) if reports.tables.get("train.csv") is not None and \
            reports.tables["train.csv"].height else {}
        out = {}
        for name in trained_series(reports):
            e = fits.get(name)
            if e is None:
                continue
            row: dict[str, Any] = {"identified": bool(e["identified"]), "points": _num(e.get("n_points"))}
            for p in LAW_PARAMS:
                if p in e:
                    row[p] = _num(e[p]["value"])
                    row[f"{p}_lo"], row[f"{p}_hi"] = _num(e[p].get("ci_low")), _num(e[p].get("ci_high"))
            row["best_val_loss"] = _num(best.get(name, {}).get("val_loss"))
            out[name] = _drop_none(row | decision_metrics(reports, name))
        return out
    return {}


def decision_metrics(reports: Reports, name: str) -> dict[str, Any]:
    """A series' paired Delta against the reference on the whole split, for ``dvc metrics show``:
    observed at the largest budget (``delta``, ``delta_lo``, ``delta_hi``, ``decision``) and at each
    projected budget (``delta_<C>``...)."""
    table = reports.table("decisions.csv")
    if table is None or not table.height:
        return {}
    mine = table.filter((pl.col("variant") == name) & (pl.col("target") == "val")
                        & pl.col("comparison").is_in(["best", "compute_optimal"]))
    out: dict[str, Any] = {}
    observed = mine.filter(pl.col("kind") == "observed").sort("budget")
    if observed.height:
        r = observed.row(-1, named=True)
        out |= {"delta": _num(r["delta"]), "delta_lo": _num(r["ci_low"]), "delta_hi": _num(r["ci_high"]),
                "decision": r["decision"]}
    for r in mine.filter(pl.col("kind") == "projected").iter_rows(named=True):
        tag = f"{float(r['budget']):.0e}".replace("+", "")
        out |= {f"delta_{tag}": _num(r["delta"]), f"delta_{tag}_lo": _num(r["ci_low"]),
                f"delta_{tag}_hi": _num(r["ci_high"]), f"decision_{tag}": r["decision"]}
    return out


def _metric_file(name: str) -> str:
    """A row name as a file name, kept readable (``raw+repb``, ``teal@0.5``)."""
    return "".join(ch if ch.isalnum() or ch in "-_.+@" else "_" for ch in name) + ".json"


def write_stage_metrics(stage: str, reports_dir: str | Path) -> Path:
    """Write ``reports/metrics/<stage>/<row>.json`` (:func:`stage_metrics`), replacing the folder whole."""
    reports_dir = Path(reports_dir)
    rows = stage_metrics(stage, load_reports(reports_dir))
    folder = reports_dir / "metrics" / stage
    with atomic_dir(folder) as out:
        for name, row in rows.items():
            write_json(out / _metric_file(name), row)
    return folder
